"""Preflight report: python -m pydatacopy.doctor [--world-size N] [--tokens N_TOKENSxTOKEN_BYTES]

Run it on every kind of node before a job, and attach its output to a bug report. It starts no
NVSHMEM job and needs no GPU: on a machine without one it says so and what that means. Each line
is OK, WARN, FAIL or INFO; the exit code is 1 if any line is FAIL (with --strict, also WARN), 2
for a bad option. Every environment variable pydatacopy or NVSHMEM reads is checked the way
init() checks it, so a FAIL here is an error init() would raise.
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
from pydatacopy import _C
from pydatacopy.runtime import network as _network, probes as _probes, settings as _settings
from pydatacopy.runtime import startup as _startup
from pydatacopy.token_exchange.double_buffer import check_tokens

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WATCHED = ["CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_DISABLE_P2P", "NVSHMEM_REMOTE_TRANSPORT",
           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY", "NVSHMEM_HCA_LIST",
           "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_DISABLE_GDRCOPY", "LOCAL_WORLD_SIZE", "NCCL_SOCKET_IFNAME",
           "NCCL_IB_HCA", "PYDATACOPY_TIMEOUT_S",
           "PYDATACOPY_INIT_TIMEOUT_S", "PYDATACOPY_FORCE_RMA", "PYDATACOPY_CHUNK_BYTES",
           "PYDATACOPY_NUM_CHUNKS", "PYDATACOPY_SEND_BLOCKS",
           "PYDATACOPY_NARROW_SEND_BLOCKS", "PYDATACOPY_ZERO_COPY_MIN_BYTES", "PYDATACOPY_COPY_ENGINE_MIN_BYTES",
           "PYDATACOPY_LOW_LATENCY_MAX_BYTES", "PYDATACOPY_IBGDA",
           "PYDATACOPY_RANKS_PER_GPU", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY",
           "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]


class Report:
    def __init__(self) -> None:
        self.counts = {"OK": 0, "WARN": 0, "FAIL": 0, "INFO": 0}

    def section(self, title: str) -> None:
        print(f"\n== {title}")

    def line(self, verdict: str, text: str) -> None:
        self.counts[verdict] += 1
        print(f"  [{verdict:<4}] {text}")


def parse_size(text: str) -> int:
    """NVSHMEM_SYMMETRIC_SIZE's value in bytes, read as NVSHMEM reads it (see pydatacopy.runtime.settings);
    raises _settings.SettingError, saying what to write, for a value NVSHMEM cannot use."""
    return _settings.parse_nvshmem_size(text)


def symmetric_bytes_needed(world_size: int, tokens: tuple[int, int] | None,
                           settings: tuple[int, int, int] | None = None) -> int:
    """What init() and one DoubleBufferManager of `tokens` take from the symmetric heap (the
    core's own layout arithmetic; NVSHMEM's per-allocation alignment is not counted).
    `settings`: send/recv's (chunk_bytes, num_chunks, blocks), by default from PYDATACOPY_*."""
    if settings is None:
        settings = _settings.send_recv_settings()
    need = _C.SendRecvEngine.symmetric_bytes_needed(world_size, *settings)
    need += _C.barrier_symmetric_bytes(world_size)  # the barriers' signals
    if tokens:
        need += _C.DoubleBufferManager.symmetric_bytes_needed(*tokens, world_size)
    return need


def check_nvshmem_version(versions: dict[str, str]) -> tuple[str, str]:
    """(verdict, line) for pydatacopy.nvshmem_versions(): FAIL when the NVSHMEM loaded in this
    process is another major.minor than the one pydatacopy was built against."""
    same = versions["built"].split(".")[:2] == versions["loaded"].split(".")[:2]
    return ("OK" if same else "FAIL",
            f"NVSHMEM built {versions['built']}, loaded {versions['loaded']}"
            + ("" if same else ": rebuild pydatacopy (pip install .) against the NVSHMEM that "
                               "torch loads, or install the nvidia-nvshmem-cu13 it was built with"))


def multicast_line(name: str, safe: str, environ=os.environ,
                   set_at_import: dict[str, str] | None = None) -> tuple[str, str]:
    """(verdict, line) for one of the variables that keep NVLink multicast off, telling a value
    the user set from one pydatacopy set at import."""
    set_at_import = _startup.SET_AT_IMPORT if set_at_import is None else set_at_import
    current = environ.get(name)
    if current is None:
        return "WARN", (f"{name} is unset: NVLink multicast may be on, which can take shared GPUs "
                        f"down; export {name}={safe} in the job script")
    if name in set_at_import and current == set_at_import[name]:
        return "INFO", (f"{name}={current}: set by pydatacopy at import, not by you; processes "
                        f"that do not import pydatacopy first do not get it: export {name}={safe} "
                        "in the job script")
    if current == safe:
        return "OK", f"{name}={current} (set by you: NVLink multicast off)"
    return "WARN", (f"{name}={current} (set by you): NVLink multicast may be on, which can take "
                    f"shared GPUs down; set {name}={safe} unless you need it")


MPS_START = ("export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; "
             "nvidia-cuda-mps-control -d")


def shared_gpu_lines(count: int, sms: int | None, environ=os.environ,
                     control_pipe: str | None | bool = False) -> list[tuple[str, str]]:
    """(verdict, line)s on ranks sharing a GPU: PYDATACOPY_RANKS_PER_GPU and what LOCAL_WORLD_SIZE
    and the `count` visible GPUs imply, the torch.distributed backend, whether CUDA MPS is there
    (`control_pipe`: its control pipe, None when absent; by default looked up) and this
    process's share of the `sms` SMs of its GPU (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."""
    if control_pipe is False:
        control_pipe = _probes.mps_control_pipe(environ)
    lines: list[tuple[str, str]] = []
    try:
        per_gpu = _settings.ranks_per_gpu(environ)
    except _settings.SettingError as error:
        lines.append(("FAIL", str(error)))
        per_gpu = 1
    on_node = _settings.local_world_size(environ)
    setting = (f"PYDATACOPY_RANKS_PER_GPU={per_gpu}" if "PYDATACOPY_RANKS_PER_GPU" in environ
               else "PYDATACOPY_RANKS_PER_GPU unset (1)")
    rule = f"local rank r uses cuda:r // {per_gpu}" if per_gpu > 1 else "local rank r uses cuda:r"
    if count and on_node and on_node > count * per_gpu:
        share = -(-on_node // count)
        lines.append(("FAIL", f"{setting}: LOCAL_WORLD_SIZE={on_node} ranks on {count} GPU(s) need "
                              f"{share} ranks per GPU, and init() refuses ({rule}): set "
                              f"PYDATACOPY_RANKS_PER_GPU={share} on every rank (torch.distributed "
                              "on gloo), or start fewer ranks per node"))
    elif count and on_node:
        used = -(-on_node // per_gpu)
        lines.append(("OK", f"{setting}: {rule}; LOCAL_WORLD_SIZE={on_node} ranks: "
                            f"{min(per_gpu, on_node)} per GPU on {used} of this node's {count} GPU(s)"))
    else:
        lines.append(("INFO", f"{setting}: {rule}"
                              + ("" if on_node else " (LOCAL_WORLD_SIZE unset: torchrun sets it)")))
    # Ranks of this node that share one GPU (as init() will map them; the setting alone when
    # LOCAL_WORLD_SIZE is not known).
    ranks_here = min(per_gpu, on_node) if on_node else per_gpu
    sharing = ranks_here > 1 or bool(count and on_node and on_node > count)
    if sharing:
        lines.append(("INFO", "ranks share a GPU: create the torch.distributed group with the gloo "
                              "backend. NCCL refuses two ranks on one GPU ('Duplicate GPU "
                              "detected'), and pydatacopy.init() refuses an nccl group then; "
                              "pydatacopy sends only its 128-byte ID through torch.distributed, "
                              "its data moves through NVSHMEM"))
    if control_pipe:
        lines.append(("OK", f"CUDA MPS: a control daemon listens at {control_pipe}: CUDA "
                            "processes started here become MPS clients and run side by side"))
    elif sharing:
        where = os.path.join(environ.get("CUDA_MPS_PIPE_DIRECTORY") or _probes.MPS_DEFAULT_PIPE_DIRECTORY,
                             "control")
        state = ("a file left by a daemon that ended" if os.path.lexists(where)
                 else "nothing")
        lines.append(("WARN", f"CUDA MPS is not running (no daemon listens at {where}: {state} "
                              "there): ranks sharing "
                              "a GPU are time-sliced, right but slow (a 64 MiB sendrecv about 7 GB/s "
                              "per direction on an H200, 135 GB/s under MPS). Start it (as the "
                              f"GPU's owner or root): {MPS_START}; stop it with "
                              "'echo quit | nvidia-cuda-mps-control'"))
    else:
        lines.append(("INFO", "CUDA MPS is not running (not needed with one rank per GPU)"))
    try:
        percentage = _settings.mps_thread_percentage(environ)
    except _settings.SettingError as error:
        lines.append(("FAIL", str(error)))
        return lines
    ranks_here = max(ranks_here, -(-on_node // count) if count and on_node else 1)
    of_sms = f" of its {sms} SMs" if sms else ""
    if percentage is not None:
        about = f"about {int(sms * percentage // 100)}{of_sms}" if sms else "that share of its SMs"
        text = (f"SM share: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage:g}: this process may use "
                f"{percentage:g}% of its GPU's threads, {about}"
                + ("" if control_pipe else " (it takes effect only under MPS)"))
        if sharing and control_pipe and percentage * ranks_here > 100:
            lines.append(("WARN", f"{text}; {ranks_here} ranks x {percentage:g}% is more than 100: "
                                  "NVSHMEM supports several PEs per GPU fully only when their "
                                  "shares sum to at most 100 (a kernel waiting for a peer on the "
                                  "same GPU can hold the SMs the peer needs), and init() refuses "
                                  f"it: set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // ranks_here}"))
        else:
            lines.append(("OK", text))
    elif sharing and control_pipe:
        lines.append(("WARN", "SM share: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is unset, so each MPS "
                              "client gets the daemon's default (100% unless changed) and the "
                              "shares of one GPU can sum past 100, where NVSHMEM gives only "
                              "limited support and a transfer can wait on a starved peer until "
                              f"its timeout: set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // ranks_here} "
                              "on every rank"))
    else:
        lines.append(("INFO", f"SM share: the whole GPU{(' (' + str(sms) + ' SMs)') if sms else ''}"
                              + (", time-sliced with the other ranks on it" if sharing else "")))
    return lines


def allocator_line(environ=os.environ) -> tuple[str, str]:
    """What torch's allocator setting (PYTORCH_CUDA_ALLOC_CONF) means for send/recv: WARN where
    receive buffers stay staged on purpose (cudaMallocAsync)."""
    from pydatacopy._torch_utils import ALLOCATOR_ZERO_COPY, allocator_conf, allocator_setting

    conf = allocator_conf(environ)
    setting = allocator_setting(conf)
    return ("WARN" if setting == "cudaMallocAsync" else "OK",
            f"{setting} ({conf or 'PYTORCH_CUDA_ALLOC_CONF unset'}): {ALLOCATOR_ZERO_COPY[setting]}")


def _positive_int(text: str) -> int:
    try:
        return _settings.parse_int(text, "--world-size", 1, _settings.INT32_MAX, 2, "the number of PEs")
    except _settings.SettingError as error:
        raise argparse.ArgumentTypeError(str(error).replace("or unset it", "or leave it out")) from None


def parse_tokens(text: str) -> tuple[int, int]:
    """N_TOKENSxTOKEN_BYTES (``4096x7168``) as (n_tokens, token_size), with the limits of
    DoubleBufferManager.init; argparse.ArgumentTypeError saying what to write otherwise."""
    howto = "write N_TOKENSxTOKEN_BYTES, e.g. 4096x7168"
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and p.strip().isascii() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not two whole numbers joined by 'x': {howto}")
    try:
        return check_tokens(int(parts[0]), int(parts[1]), "")
    except pydatacopy.Error as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(error).lstrip(': ')}; {howto}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=_positive_int, default=None,
                        help="the number of PEs the job will start (default: WORLD_SIZE, else 2)")
    parser.add_argument("--tokens", type=parse_tokens, default=None,
                        help="a DoubleBufferManager you plan, N_TOKENSxTOKEN_BYTES (e.g. 4096x7168)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    return parser


def parse_args(argv: list[str] | None = None, environ=os.environ) -> argparse.Namespace:
    """The doctor's options, checked; a bad one ends the process with argparse's one-line error
    and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size is None:
        try:
            args.world_size = _settings.world_size(environ) or 2
        except _settings.SettingError as error:
            parser.error(f"{error}; or pass --world-size N")
    return args


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = Report()
    reported: set[str] = set()  # variables whose problem a line has shown already

    r.section("software")
    r.line("INFO", f"python {platform.python_version()} on {platform.machine()}, pydatacopy {pydatacopy.__version__}")
    cuda_build = torch.version.cuda
    r.line("OK" if cuda_build else "WARN",
           f"torch {torch.__version__}" + (f" (CUDA {cuda_build})" if cuda_build else " (CPU build: it cannot move GPU data)"))
    r.line(*check_nvshmem_version(pydatacopy.nvshmem_versions()))
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
    blockers = [name for name, _ in _settings.nvshmem_problems()]
    if blockers:  # NVSHMEM would crash or fail on them: each gets its own line below
        r.line("FAIL", f"unique ID: not tried, NVSHMEM would fail on {', '.join(blockers)} (below)")
    else:
        try:
            r.line("OK", f"unique ID creation works without a GPU ({len(pydatacopy.get_unique_id())} bytes)")
        except pydatacopy.Error as error:
            r.line("FAIL", str(error))

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
    r.section("ranks per GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if count else None
    for verdict, text in shared_gpu_lines(count, sms):
        r.line(verdict, text)
    for name in ("PYDATACOPY_RANKS_PER_GPU", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        reported.add(name)  # a bad value has had its FAIL line above

    smi = shutil.which("nvidia-smi")
    if smi and count:
        try:
            topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
            links = sorted({w for line in topo.splitlines() for w in line.split() if w.startswith("NV")
                            and w[2:].isdigit()})
            r.line("OK" if links else "WARN", f"NVLink between GPUs: {', '.join(links) or 'none (PCIe or remote only)'}")
        except (OSError, subprocess.TimeoutExpired) as error:
            r.line("WARN", f"nvidia-smi topo -m failed: {error}")

    try:
        per_gpu = _settings.ranks_per_gpu()
    except _settings.SettingError:
        per_gpu = 1  # its FAIL line is in "ranks per GPU"

    r.section("torch's allocator (zero-copy send/recv)")
    verdict, text = allocator_line()
    r.line(verdict, text)

    r.section("network")
    for verdict, text in _network.remote_transport_report():
        r.line(verdict, text)
    ib = sorted({p.device for p in _network.rdma_ports() if p.active})
    mapped = {n: os.environ[c] for c, n in _network.NCCL_TO_NVSHMEM.items()
              if c in os.environ and n not in os.environ}
    for name, value in mapped.items():
        r.line("INFO", f"init() will set {name}={value} (from NCCL's setting)")
    try:
        chosen = _settings.check_interfaces()
        settings = _settings.network_settings()
        if chosen:
            value, source = settings["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"]
            r.line("OK", f"bootstrap interface: {source}={value} selects {', '.join(chosen)}")
        else:
            r.line("INFO", "bootstrap interface: NVSHMEM chooses (set NCCL_SOCKET_IFNAME or "
                           "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME to pick one)")
    except _settings.SettingError as error:
        if "the bootstrap settings" not in reported:
            r.line("FAIL", str(error))
        reported.add("the bootstrap settings")
    try:
        _network.check_transport_preconditions(args.world_size, call="python -m pydatacopy.doctor")
        if count == 0:
            r.line("INFO", f"transport: no GPU here, so no PE can start on this machine; nothing "
                           f"in the transport settings stops {args.world_size} PEs on GPU nodes")
        elif args.world_size <= count * per_gpu:
            r.line("OK", f"transport: {args.world_size} PEs fit this node's {count} GPUs"
                         + (f" at {per_gpu} per GPU" if per_gpu > 1 else ""))
        elif ib:
            r.line("OK", f"transport: {args.world_size} PEs, more than this node's {count} GPUs: "
                         f"the others are reached over InfiniBand/RoCE ({', '.join(ib)})")
        else:
            r.line("WARN", f"transport: {args.world_size} PEs is more than this node's {count} "
                           "GPUs, and no InfiniBand/RoCE port here is ACTIVE to reach other nodes")
    except pydatacopy.Error as error:
        r.line("FAIL", str(error))

    r.section("symmetric heap")
    tokens = args.tokens
    configured = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    heap = settings = None
    try:
        heap = _settings.symmetric_size()
    except _settings.SettingError as error:
        if "NVSHMEM_SYMMETRIC_SIZE" not in reported:
            r.line("FAIL", str(error))
        reported.add("NVSHMEM_SYMMETRIC_SIZE")
    try:
        settings = _settings.send_recv_settings()
    except _settings.SettingError as error:
        r.line("FAIL", str(error))
        reported.update(_settings.SEND_RECV_DEFAULTS)
    if heap is not None and settings is not None:
        need = symmetric_bytes_needed(args.world_size, tokens, settings)
        shape = f" + DoubleBufferManager {tokens[0]}x{tokens[1]}" if tokens else ""
        r.line("OK" if need <= heap else "FAIL",
               f"NVSHMEM_SYMMETRIC_SIZE {configured or 'unset (1G)'} = {heap / 2**20:.0f} MiB; send/recv "
               f"staging for {args.world_size} PEs{shape} need {need / 2**20:.0f} MiB, before your own "
               "pydatacopy.empty() tensors"
               + ("" if need <= heap else
                  f": set NVSHMEM_SYMMETRIC_SIZE={(need >> 20) + 64}M or more on every rank"))

    r.section("environment")
    for name, value in MULTICAST_OFF.items():
        r.line(*multicast_line(name, value))
    for name, problem in _settings.nvshmem_problems() + _settings.pydatacopy_problems():
        if name not in reported:
            r.line("FAIL", problem)
            reported.add(name)
    for read in (_settings.world_size, _settings.local_rank):
        try:
            read()
        except _settings.SettingError as error:
            r.line("FAIL", str(error))
    for name in WATCHED:
        if name in os.environ:
            r.line("INFO", f"{name}={os.environ[name]}")
    if os.environ.get("PYDATACOPY_FORCE_RMA") == "1":
        r.line("WARN", "PYDATACOPY_FORCE_RMA is set: every transfer takes the NVSHMEM RMA path (a test switch)")

    print(f"\nsummary: {r.counts['OK']} ok, {r.counts['WARN']} warnings, {r.counts['FAIL']} failures")
    return 1 if r.counts["FAIL"] or (args.strict and r.counts["WARN"]) else 0


if __name__ == "__main__":
    sys.exit(run())
