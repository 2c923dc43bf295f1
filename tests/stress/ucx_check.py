"""NVSHMEM's UCX transport on one machine: python tests/stress/ucx_check.py [--timeout 120]

Runs two PEs with P2P off (NVSHMEM_DISABLE_P2P=1) and NVSHMEM_REMOTE_TRANSPORT=ucx, UCX from the
libucx-cu13 wheel (its libucx/lib put on LD_LIBRARY_PATH), over TCP on loopback, which is as
close to two servers as one machine gets. Two outcomes pass:
- NVSHMEM starts: put, get, sendrecv and the token exchange move data byte-exact, with GB/s at
  1 MiB and 256 MiB (one way, host-timed);
- pydatacopy.init refuses with pydatacopy.Error before NVSHMEM starts, because this machine
  cannot run the transport (NVSHMEM would end the process); the message is printed.
A process that dies, hangs or moves a wrong byte fails. Prints one line and exits 0 on a pass.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

WORKER = r"""
import os, sys, time, torch, torch.distributed as dist, pydatacopy
rank = int(os.environ["RANK"]); peer = 1 - rank
torch.cuda.set_device(rank // int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1))  # the device rule
dist.init_process_group("gloo")
try:
    pydatacopy.init()
except pydatacopy.Error as error:
    print("REFUSED", str(error).replace("\n", " "), flush=True)
    sys.exit(3)
def pattern(pe, tag, n):
    g = torch.Generator(device="cuda").manual_seed(pe * 1_000_003 + tag)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
def exact(got, pe, tag):
    wrong = int((got != pattern(pe, tag, got.numel())).sum())
    if wrong:
        print(f"MISMATCH tag {tag}: {wrong} bytes wrong", flush=True); sys.exit(1)
rates = {}
for tag, n in enumerate((4096, 1 << 20, 256 << 20)):
    dst = pydatacopy.empty(n, dtype=torch.uint8); dst.zero_()
    src = pattern(rank, tag, n)
    torch.cuda.synchronize(); pydatacopy.barrier(blocking=True)
    begin = time.perf_counter()
    pydatacopy.put(dst, src, peer); pydatacopy.barrier(); torch.cuda.synchronize()
    rates[n] = n / (time.perf_counter() - begin) / 1e9
    exact(dst, peer, tag)
    got = torch.zeros(n, dtype=torch.uint8, device="cuda")
    pydatacopy.get(got, dst, peer); torch.cuda.synchronize()
    exact(got, rank, tag)
    out = torch.zeros(n, dtype=torch.uint8, device="cuda")
    pydatacopy.sendrecv(pattern(rank, 10 + tag, n), peer, out, peer); torch.cuda.synchronize()
    exact(out, peer, 10 + tag)
    pydatacopy.free(dst)
dbm = pydatacopy.DoubleBufferManager(); dbm.init(256, 7168)
dbm.send_buffer.view(-1).copy_(pattern(rank, 20, 256 * 7168))
exact(dbm.wait(dbm.exchange()).view(-1), peer, 20)
dbm.cleanup()
print("MOVED put GB/s " + ", ".join(f"{n >> 10} KiB {r:.2f}" for n, r in rates.items()), flush=True)
pydatacopy.finalize()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    try:
        import libucx
    except ImportError:
        print("ucx-check: SKIPPED: libucx-cu13 is not installed (pip install libucx-cu13)")
        return 0
    ucx_lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", NVSHMEM_DISABLE_P2P="1", NVSHMEM_REMOTE_TRANSPORT="ucx",
               UCX_TLS=os.environ.get("UCX_TLS", "tcp,cuda_copy,self"),
               UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
               LD_LIBRARY_PATH=ucx_lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
               PYDATACOPY_INIT_TIMEOUT_S="60", PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    deadline = time.time() + args.timeout
    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
        outputs.append(out)
        codes.append(proc.returncode)
    for rank, out in enumerate(outputs):
        print(f"--- rank {rank} (exit {codes[rank]}):\n" + "\n".join(out.splitlines()[-15:]))
    if all(c == 0 for c in codes) and all("MOVED" in o for o in outputs):
        line = next(l for l in outputs[0].splitlines() if l.startswith("MOVED"))
        print(f"ucx-check: PASS: NVSHMEM's UCX transport ran, byte-exact; {line}")
        return 0
    if all(c == 3 for c in codes):
        reason = next(l for l in outputs[0].splitlines() if l.startswith("REFUSED"))
        print(f"ucx-check: PASS (refused cleanly, no NVSHMEM exit): {reason[:400]}")
        return 0
    print(f"ucx-check: FAIL: exit codes {codes}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
