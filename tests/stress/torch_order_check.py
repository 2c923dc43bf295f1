"""One NVSHMEM, two users: python tests/stress/torch_order_check.py [--timeout 180] [--order O]

pydatacopy and torch's symmetric memory on its NVSHMEM backend share the one NVSHMEM of a
process. Each scenario starts a fresh pair of worker processes (not under torchrun; rank r on
GPU r // PYDATACOPY_RANKS_PER_GPU; an nccl process group on 127.0.0.1 and a free port, gloo when
the two share a GPU) and brings both up, in one order or the other:
- torch-first: symm_mem.set_backend("NVSHMEM"), symm_mem.empty(), rendezvous(), then pydatacopy.init();
- pydatacopy-first: pydatacopy.init(), then the same torch steps.
Then, on both ranks, byte-exact with data that differs per rank and per step, destinations
cleared first: put into a pydatacopy.empty() tensor on the peer; sendrecv both ways; a
DoubleBufferManager token exchange; barrier(blocking=True); torch.ops.symm_mem.nvshmem_put still
right; pydatacopy.finalize(), and torch's nvshmem_put still right after it (pydatacopy must not
end an NVSHMEM that torch uses); dist.destroy_process_group() and a clean exit.
Workers print "STEP <name> ok", "MISMATCH <step>: <count> bytes wrong", "ERROR in <step>: ..."
or "SKIP <reason>"; the parent prints one line per scenario and exits non-zero on a failure. A
torch without NVSHMEM counts as a failure (it would hide a regression) unless --allow-skip.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ORDERS = {"torch-first": ["torch symm_mem up", "pydatacopy init"],
          "pydatacopy-first": ["pydatacopy init", "torch symm_mem up"]}
CHECKED = ["put", "sendrecv", "exchange", "barrier", "torch put", "finalize", "torch put after finalize"]
SKIP_CODE = 4
GRACE_S = 15.0  # how long the other rank may take to exit once one has failed


# ---- worker ----------------------------------------------------------------------------------

def ranks_per_gpu() -> int:
    return int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1)


def device_of(rank: int) -> int:
    """pydatacopy's device rule (both workers are local): rank // PYDATACOPY_RANKS_PER_GPU."""
    return rank // ranks_per_gpu()


class Mismatch(Exception):
    pass


class Worker:
    """The steps of one rank; each method is one STEP, run in order by run_worker()."""

    def __init__(self, rank: int) -> None:
        import torch
        import torch.distributed as dist
        import pydatacopy

        self.torch, self.dist, self.pydatacopy = torch, dist, pydatacopy
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device("cuda", device_of(rank))
        self.t = self.handle = None

    def pattern(self, rank: int, step: int, nbytes: int):
        """Random bytes that differ per rank and per step; any rank can regenerate them."""
        torch = self.torch
        generator = torch.Generator(device="cuda").manual_seed(1_000_003 * rank + 7_919 * step + 1)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)

    def check(self, step: str, got, expected) -> None:
        self.torch.cuda.synchronize()
        wrong = (got.reshape(-1) != expected.reshape(-1)).nonzero()
        if wrong.numel():
            raise Mismatch(f"MISMATCH {step}: {wrong.numel()} bytes wrong (of {expected.numel()}, "
                           f"first at byte {wrong[0].item()})")

    def settle(self) -> None:
        """Local work done and both ranks here (torch's barrier, independent of pydatacopy)."""
        self.torch.cuda.synchronize()
        self.dist.barrier()
        self.torch.cuda.synchronize()

    # -- bring-up
    def torch_up(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        torch, dist = self.torch, self.dist
        symm_mem.set_backend("NVSHMEM")
        self.t = symm_mem.empty((4 << 20) + 7, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.t, dist.group.WORLD.group_name)
        if (self.handle.rank, self.handle.world_size) != (self.rank, 2):
            raise RuntimeError(f"torch symm_mem handle is rank {self.handle.rank} of "
                               f"{self.handle.world_size}, expected {self.rank} of 2")

    def pydatacopy_init(self) -> None:
        pdc = self.pydatacopy
        pe = pdc.init()
        if (pe, pdc.n_pes()) != (self.rank, 2):
            raise RuntimeError(f"pydatacopy.init() gave PE {pe} of {pdc.n_pes()}, expected {self.rank} of 2")

    # -- the checked steps
    def put(self) -> None:
        torch, pdc = self.torch, self.pydatacopy
        nbytes = (1 << 20) + 3
        dst = pdc.empty(nbytes, dtype=torch.uint8)
        dst.zero_()
        self.settle()  # cleared on both ranks before either writes
        pdc.put(dst, self.pattern(self.rank, 1, nbytes), self.peer)
        pdc.barrier()
        torch.cuda.synchronize()
        self.check("put", dst, self.pattern(self.peer, 1, nbytes))

    def sendrecv(self) -> None:
        torch, pdc = self.torch, self.pydatacopy
        nbytes = (3 << 20) + 5
        received = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        pdc.sendrecv(self.pattern(self.rank, 2, nbytes), self.peer, received, self.peer)
        torch.cuda.synchronize()
        pdc.check_errors()
        self.check("sendrecv", received, self.pattern(self.peer, 2, nbytes))

    def exchange(self) -> None:
        pdc = self.pydatacopy
        dbm = pdc.DoubleBufferManager()
        dbm.init(n_tokens=256, token_size=7168)
        nbytes = dbm.n_tokens * dbm.token_size
        dbm.recv_buffer(dbm.round).zero_()  # the set the next round receives into
        self.settle()
        dbm.send_buffer.copy_(self.pattern(self.rank, 3, nbytes).view(dbm.n_tokens, dbm.token_size))
        round_ = dbm.exchange(self.peer)
        dbm.wait(round_, blocking=True)
        self.check("exchange", dbm.recv_buffer(round_), self.pattern(self.peer, 3, nbytes))
        dbm.cleanup()

    def barrier(self) -> None:
        self.pydatacopy.barrier(blocking=True)

    def torch_put(self, name: str = "torch put", step: int = 5) -> None:
        """nvshmem_put(t, peer) writes the whole local t into the peer's t. Both directions in
        turn: a rank's t is its put's source and the peer's put's destination at once."""
        torch = self.torch
        nbytes = self.t.numel()
        for sender in (0, 1):
            if self.rank == sender:
                self.t.copy_(self.pattern(self.rank, step, nbytes))
            else:
                self.t.zero_()
            self.settle()
            if self.rank == sender:
                torch.ops.symm_mem.nvshmem_put(self.t, self.peer)
            self.settle()  # the put done on the sender's stream, then both ranks here
            if self.rank != sender:
                self.check(name, self.t, self.pattern(self.peer, step, nbytes))
            self.settle()  # checked before the next turn overwrites t

    def finalize(self) -> None:
        self.pydatacopy.finalize()
        if self.pydatacopy.is_initialized():
            raise RuntimeError("pydatacopy.is_initialized() is still True after finalize()")

    def torch_put_after_finalize(self) -> None:
        self.torch_put("torch put after finalize", 6)


def run_worker(order: str) -> int:
    rank = int(os.environ["RANK"])
    import torch
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
        available = symm_mem.is_nvshmem_available()
    except ImportError as error:
        available, why = False, f"torch.distributed._symmetric_memory does not import ({error})"
    else:
        why = "symm_mem.is_nvshmem_available() is False (torch without NVSHMEM, or no libnvshmem_host.so.3)"
    if not available:
        print(f"SKIP torch {torch.__version__}: {why}", flush=True)
        return SKIP_CODE
    current = "setup"
    try:
        import pydatacopy

        torch.cuda.set_device(device_of(rank))
        if ranks_per_gpu() > 1:  # NCCL refuses two ranks on one GPU
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=torch.device("cuda", device_of(rank)))
        if rank == 0:
            print(f"INFO torch {torch.__version__}, pydatacopy {pydatacopy.__version__}, NVSHMEM "
                  f"{pydatacopy.nvshmem_versions()}, order {order}", flush=True)
        worker = Worker(rank)
        steps = {"torch symm_mem up": worker.torch_up, "pydatacopy init": worker.pydatacopy_init,
                 "put": worker.put, "sendrecv": worker.sendrecv, "exchange": worker.exchange,
                 "barrier": worker.barrier, "torch put": worker.torch_put,
                 "finalize": worker.finalize, "torch put after finalize": worker.torch_put_after_finalize}
        for current in ORDERS[order] + CHECKED:
            steps[current]()
            print(f"STEP {current} ok", flush=True)
        current = "destroy_process_group"
        dist.destroy_process_group()
    except Mismatch as error:
        print(error, flush=True)
        os._exit(2)  # not a normal exit: the peer may be gone, teardown could wait on it
    except BaseException as error:  # noqa: BLE001 - every failure is reported, then the process ends
        traceback.print_exc()
        print(f"ERROR in {current}: {type(error).__name__}: {error}"[:1000], flush=True)
        sys.stderr.flush()
        os._exit(1)
    print("DONE", flush=True)
    return 0  # a normal interpreter exit, which must not hang


# ---- parent ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario(order: str, timeout: float, allow_skip: bool) -> tuple[str, str]:
    """(PASS / FAIL / SKIP, detail) for one fresh pair of workers."""
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    logs = [tempfile.TemporaryFile() for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", order],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(2)]
    begin = time.time()
    exited: list[int] = []  # ranks in the order they ended
    failed_at = None
    timed_out = False
    while len(exited) < 2:
        for r, p in enumerate(procs):
            if r not in exited and p.poll() is not None:
                exited.append(r)
                if p.returncode != 0 and failed_at is None:
                    failed_at = time.time()
        now = time.time()
        if len(exited) < 2 and (now - begin > timeout or (failed_at and now - failed_at > GRACE_S)):
            timed_out = failed_at is None
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            exited += [r for r in range(2) if r not in exited]
        time.sleep(0.1)
    outputs = []
    for log in logs:
        log.seek(0)
        text = log.read().decode(errors="replace")
        outputs.append([line.rstrip() for line in text.splitlines() if line.strip()])
        log.close()
    codes = [p.returncode for p in procs]
    done = [set(l[5:-3] for l in out if l.startswith("STEP ") and l.endswith(" ok")) for out in outputs]
    passed = [s for s in CHECKED if all(s in d for d in done)]

    def tail(r: int) -> str:
        key = [l for l in outputs[r] if l.startswith(("MISMATCH", "ERROR", "SKIP"))]
        return " | ".join(key or outputs[r][-3:])[:600] or "(no output)"

    if codes == [SKIP_CODE, SKIP_CODE]:
        return ("SKIP" if allow_skip else "FAIL"), f"rank 0: {tail(0)}" + (
            "" if allow_skip else " (pass --allow-skip where torch has no NVSHMEM)")
    if codes == [0, 0] and passed == CHECKED and all("DONE" in out for out in outputs):
        return "PASS", f"({', '.join(CHECKED)})"
    for r in range(2):  # the whole story of a failure, before the summary lines
        for line in outputs[r][-25:]:
            print(f"  [{order} rank {r}] {line}", flush=True)
    if timed_out:
        hung = [r for r in range(2) if "DONE" in outputs[r]]
        what = (f"timed out after {timeout:.0f} s" +
                (f" (rank {hung} printed DONE: a hang at exit)" if hung else ""))
        return "FAIL", what + "; " + "; ".join(f"rank {r}: {tail(r)}" for r in range(2))
    # A mismatch first: the peer of a rank that stopped often fails next, on the lost connection.
    failing = [r for r in exited if codes[r] != 0]
    failing.sort(key=lambda r: not any(l.startswith("MISMATCH") for l in outputs[r]))
    blamed = failing[0] if failing else exited[0]
    other = 1 - blamed
    also = f"; rank {other} (exit code {codes[other]}): {tail(other)}" if codes[other] not in (0, -9) else ""
    return "FAIL", (f"rank {blamed} (exit code {codes[blamed]}, steps passed on both ranks: "
                    f"{', '.join(passed) or 'none'}): {tail(blamed)}{also}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per scenario")
    parser.add_argument("--order", choices=sorted(ORDERS), help="run this scenario only")
    parser.add_argument("--allow-skip", action="store_true",
                        help="a torch without NVSHMEM is a SKIP, not a FAIL")
    parser.add_argument("--worker", choices=sorted(ORDERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args.worker)
    orders = [args.order] if args.order else list(ORDERS)
    results = [(order, *scenario(order, args.timeout, args.allow_skip)) for order in orders]
    for order, verdict, detail in results:
        print(f"torch-order-check {order}: {verdict}{' ' if verdict == 'PASS' else ': '}{detail}", flush=True)
    return 0 if all(verdict != "FAIL" for _, verdict, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
