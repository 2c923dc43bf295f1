"""Preflight report: python -m pydatacopy.doctor [--world-size N] [--tokens N_TOKENSxTOKEN_BYTES]

Run it on every kind of node before a job, and attach its output to a bug report. It starts no
NVSHMEM job and needs no GPU: on a machine without one it says so and what that means. Each line
is OK, WARN, FAIL or INFO; the exit code is 1 if any line is FAIL (with --strict, also WARN).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

import torch

import pydatacopy
from pydatacopy import _C, _network

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WATCHED = ["CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_DISABLE_P2P", "NVSHMEM_REMOTE_TRANSPORT",
           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY", "NVSHMEM_HCA_LIST",
           "NVSHMEM_IB_ENABLE_IBGDA", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "PYDATACOPY_TIMEOUT_S",
           "PYDATACOPY_INIT_TIMEOUT_S", "PYDATACOPY_FORCE_RMA", "PYDATACOPY_CHUNK_BYTES",
           "PYDATACOPY_NUM_CHUNKS", "PYDATACOPY_SEND_BLOCKS", "PYDATACOPY_IBGDA"]


class Report:
    def __init__(self) -> None:
        self.counts = {"OK": 0, "WARN": 0, "FAIL": 0, "INFO": 0}

    def section(self, title: str) -> None:
        print(f"\n== {title}")

    def line(self, verdict: str, text: str) -> None:
        self.counts[verdict] += 1
        print(f"  [{verdict:<4}] {text}")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def symmetric_bytes_needed(world_size: int, tokens: tuple[int, int] | None) -> int:
    """What init() and one DoubleBufferManager of `tokens` take from the symmetric heap (the
    core's own layout arithmetic; NVSHMEM's per-allocation alignment is not counted)."""
    from ._transfer import send_recv_settings

    need = _C.SendRecvEngine.symmetric_bytes_needed(world_size, *send_recv_settings())
    need += 8 * world_size  # the barrier's signals
    if tokens:
        need += _C.DoubleBufferManager.symmetric_bytes_needed(*tokens, world_size)
    return need


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    parser.add_argument("--tokens", help="a DoubleBufferManager you plan, N_TOKENSxTOKEN_BYTES")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    args = parser.parse_args(argv)
    r = Report()

    r.section("software")
    r.line("INFO", f"python {platform.python_version()} on {platform.machine()}, pydatacopy {pydatacopy.__version__}")
    cuda_build = torch.version.cuda
    r.line("OK" if cuda_build else "WARN",
           f"torch {torch.__version__}" + (f" (CUDA {cuda_build})" if cuda_build else " (CPU build: it cannot move GPU data)"))
    versions = pydatacopy.nvshmem_versions()
    same = versions["built"].split(".")[:2] == versions["loaded"].split(".")[:2]
    r.line("OK" if same else "FAIL",
           f"NVSHMEM built {versions['built']}, loaded {versions['loaded']}"
           + ("" if same else ": rebuild pydatacopy against the NVSHMEM torch loads"))
    try:
        import nvidia.nvshmem as wheel

        lib = os.path.join(list(wheel.__path__)[0], "lib")
        plugins = sorted(f for f in os.listdir(lib) if f.startswith("nvshmem_"))
        boot = [p.split(".so")[0].replace("nvshmem_bootstrap_", "") for p in plugins if "bootstrap" in p]
        trans = [p.split(".so")[0].replace("nvshmem_transport_", "") for p in plugins if "transport" in p]
        r.line("OK" if "uid" in boot else "FAIL", f"NVSHMEM bootstrap plugins: {', '.join(boot)} (pydatacopy uses uid)")
        r.line("INFO", f"NVSHMEM remote transport plugins: {', '.join(trans) or 'none'} (in {lib})")
    except ImportError:
        r.line("WARN", "the nvidia-nvshmem-cu13 wheel is not importable; NVSHMEM comes from NVSHMEM_HOME")
    r.line("OK", f"unique ID creation works without a GPU ({len(pydatacopy.get_unique_id())} bytes)")

    r.section("GPUs")
    count = torch.cuda.device_count() if cuda_build else 0
    if count == 0:
        r.line("WARN", "no CUDA device visible: this machine can build pydatacopy, create IDs and run the "
                       "CPU tests, but cannot move data (check nvidia-smi, CUDA_VISIBLE_DEVICES)")
    else:
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            r.line("OK", f"cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                         f"{props.multi_processor_count} SMs")
        for i in range(count):
            row = ["  -" if i == j else (" yes" if torch.cuda.can_device_access_peer(i, j) else "  NO")
                   for j in range(count)]
            r.line("OK" if "  NO" not in row else "WARN", f"peer access from cuda:{i}: {' '.join(row)}")
    smi = shutil.which("nvidia-smi")
    if smi and count:
        try:
            topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
            links = sorted({w for line in topo.splitlines() for w in line.split() if w.startswith("NV")
                            and w[2:].isdigit()})
            r.line("OK" if links else "WARN", f"NVLink between GPUs: {', '.join(links) or 'none (PCIe or remote only)'}")
        except (OSError, subprocess.TimeoutExpired) as error:
            r.line("WARN", f"nvidia-smi topo -m failed: {error}")

    r.section("network")
    ib = _network.infiniband_devices()
    r.line("OK" if ib else "INFO", f"InfiniBand/RoCE devices: {', '.join(ib)}" if ib else
           "no InfiniBand/RoCE device: PEs on other nodes cannot be reached through NVSHMEM from here")
    mapped = {n: os.environ[c] for c, n in _network.NCCL_TO_NVSHMEM.items()
              if c in os.environ and n not in os.environ}
    for name, value in mapped.items():
        r.line("INFO", f"init() will set {name}={value} (from NCCL's setting)")
    try:
        _network.check_transport_preconditions(args.world_size)
        r.line("OK", f"transport settings can start {args.world_size} PEs")
    except pydatacopy.Error as error:
        r.line("FAIL", str(error))

    r.section("symmetric heap")
    tokens = None
    if args.tokens:
        n_tokens, token_size = (int(v) for v in args.tokens.lower().split("x"))
        tokens = (n_tokens, token_size)
    need = symmetric_bytes_needed(args.world_size, tokens)
    configured = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    heap = parse_size(configured) if configured else 1 << 30
    r.line("OK" if need <= heap else "FAIL",
           f"NVSHMEM_SYMMETRIC_SIZE {configured or 'unset (1G)'} = {heap / 2**20:.0f} MiB; send/recv staging for "
           f"{args.world_size} PEs" + (f" + DoubleBufferManager {args.tokens}" if tokens else "")
           + f" need {need / 2**20:.0f} MiB, before your own pydatacopy.empty() tensors"
           + ("" if need <= heap else f": set NVSHMEM_SYMMETRIC_SIZE={(need >> 20) + 64}M or more on every rank"))

    r.section("environment")
    for name, value in MULTICAST_OFF.items():
        current = os.environ.get(name)
        r.line("OK" if current == value else "WARN",
               f"{name}={current}" + ("" if current == value else
                                      f" (pydatacopy sets {value} at import; NVLink multicast stays off)"))
    for name in WATCHED:
        if name in os.environ:
            r.line("INFO", f"{name}={os.environ[name]}")
    if os.environ.get("PYDATACOPY_FORCE_RMA") not in (None, "", "0"):
        r.line("WARN", "PYDATACOPY_FORCE_RMA is set: every transfer takes the NVSHMEM RMA path (a test switch)")

    print(f"\nsummary: {r.counts['OK']} ok, {r.counts['WARN']} warnings, {r.counts['FAIL']} failures")
    return 1 if r.counts["FAIL"] or (args.strict and r.counts["WARN"]) else 0


if __name__ == "__main__":
    sys.exit(run())
