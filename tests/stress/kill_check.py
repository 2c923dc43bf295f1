"""Dead- and absent-peer checks: python tests/stress/kill_check.py [--timeout 5]

Starts worker processes (not under torchrun, whose agent would end the survivor too):
- kill: both stream send/recv both ways, PE 1 is SIGKILLed mid-transfer; PE 0 must raise
  pydatacopy.TimeoutError within the timeout plus a few seconds and exit without blocking on
  the dead peer; kill-small the same with 4 KiB messages (the low-latency protocol);
- no-finalize: both exit without finalize(); interpreter exit must not hang;
- absent-barrier / absent-alloc: PE 1 is alive but never calls barrier() / empty(); PE 0 must
  raise TimeoutError naming the operation and PE 1, then finalize() without waiting for it;
- absent-init: only rank 0 of 2 starts; init_nvshmem must raise TimeoutError and the
  interpreter must then exit normally (NVSHMEM's bootstrap thread is left waiting);
- init-after-finalize: one PE inits, finalizes twice, inits again: a clear pydatacopy.Error;
- late-exit / late-finalize: PE 0 calls barrier(blocking=True) and exits at once (or after
  finalize()) while PE 1 arrives 2 s late: both must exit 0, PE 1 without an error.
Prints one line per scenario; exits non-zero on failure. `--only NAME` runs one scenario (its
mode name: kill, kill-small, no-finalize, late-exit, late-finalize, absent-barrier, absent-alloc, absent-init, init-after-finalize):
on one GPU under CUDA MPS, scripts/gpu-check.sh restarts MPS between them, as a killed client
can leave MPS refusing the next one.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import os, sys, time, torch, torch.distributed as dist, pydatacopy
rank = int(os.environ["RANK"]); mode = os.environ["KILL_MODE"]; timeout = float(os.environ["KILL_TIMEOUT"])
# pydatacopy's device rule: rank r on device r // PYDATACOPY_RANKS_PER_GPU (both on cuda:0 when
# they share one GPU; torch.distributed is on gloo either way).
torch.cuda.set_device(rank // int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1))
if mode == "init-after-finalize":  # one PE, no peer needed
    pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), 0, 1)
    pydatacopy.finalize()
    pydatacopy.finalize()  # harmless twice
    try:
        pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), 0, 1)
    except pydatacopy.Error as error:
        print(f"RAISED {type(error).__name__} after 0.0 s: {error}", flush=True)
        print("FINALIZED", flush=True)
        sys.exit(3)
    print("second init worked", flush=True)
    sys.exit(1)
if mode == "absent-init":
    begin = time.time()
    try:
        pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), 0, 2, timeout=timeout)
    except pydatacopy.TimeoutError as error:
        print(f"RAISED {type(error).__name__} after {time.time() - begin:.1f} s: {error}", flush=True)
        try:
            pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), 0, 1, timeout=timeout)
        except pydatacopy.Error as again:
            print(f"AGAIN {type(again).__name__}: {again}"[:200], flush=True)
        print("FINALIZED", flush=True)
        sys.exit(3)  # a normal interpreter exit, with NVSHMEM's bootstrap still waiting
    sys.exit(1)
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=2)
pydatacopy.init()
# kill-small: 4 KiB messages, the low-latency protocol's (a receiver polling its ring's lines).
outgoing = torch.randint(0, 256, (4096 if mode == "kill-small" else 64 << 20,), dtype=torch.uint8, device="cuda")
incoming = torch.empty_like(outgoing)
if mode.startswith("absent-"):
    if rank == 1:
        print("READY", flush=True)
        time.sleep(4 * timeout)  # alive, but never makes the matching call
        os._exit(0)
    begin = time.time()
    try:
        if mode == "absent-barrier":
            pydatacopy.barrier(timeout=timeout, blocking=True)
        else:
            pydatacopy.empty(1 << 20)
    except pydatacopy.TimeoutError as error:
        print(f"RAISED {type(error).__name__} after {time.time() - begin:.1f} s: {error}", flush=True)
        pydatacopy.finalize()  # must not wait for the absent peer
        print("FINALIZED", flush=True)
        os._exit(3)
    os._exit(1)
if mode.startswith("late-"):
    # PE 1 arrives 2 s late. PE 0 leaves as soon as its blocking barrier returns: at once
    # (late-exit) or after finalize() (late-finalize). PE 1 must finish without an error (old
    # code: PE 0's barrier did not block, PE 0 exited, and PE 1's barrier signal went to the heap
    # of a process that had gone: cudaErrorIllegalAddress on PE 1).
    # A blocking barrier in step first: the old code waited on the process's first one only.
    pydatacopy.barrier(blocking=True, timeout=timeout * 4)
    if rank == 1:
        time.sleep(2.0)
    begin = time.time()
    pydatacopy.barrier(blocking=True, timeout=timeout * 4)
    print(f"BARRIER after {time.time() - begin:.1f} s", flush=True)
    if mode == "late-finalize":
        pydatacopy.finalize()
    elif rank == 0:
        sys.exit(0)  # at once, without finalize()
    if rank == 1:
        torch.cuda.synchronize()
        pydatacopy.check_errors()
        print("DONE", flush=True)
    sys.exit(0)
if mode == "no-finalize":
    pydatacopy.sendrecv(outgoing, 1 - rank, incoming, 1 - rank, timeout=timeout)
    torch.cuda.synchronize()
    print("READY", flush=True)
    sys.exit(0)  # deliberately without finalize()
try:
    for step in range(1_000_000):
        pydatacopy.sendrecv(outgoing, 1 - rank, incoming, 1 - rank, timeout=timeout)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
        if step == 3:
            print("READY", flush=True)
except pydatacopy.TimeoutError as error:
    print(f"RAISED {type(error).__name__}: {error}", flush=True)
    pydatacopy.finalize()  # must not wait on the dead peer
    print("FINALIZED", flush=True)
    os._exit(3)
"""


EXPECTED_WORDS = {"absent-barrier": "barrier", "absent-alloc": "symmetric_malloc",
                  "absent-init": "not every rank joined", "init-after-finalize": "cannot be started twice"}


def run(mode: str, timeout: float) -> tuple[bool, str]:
    store = tempfile.mktemp(prefix="pydatacopy-kill-")
    # PYDATACOPY_TIMEOUT_S bounds the collective allocation (absent-alloc) as well.
    env = dict(os.environ, KILL_MODE=mode, KILL_TIMEOUT=str(timeout), STORE=store,
               WORLD_SIZE="2", PYTHONUNBUFFERED="1", PYDATACOPY_TIMEOUT_S=str(timeout))
    ranks = [0] if mode in ("absent-init", "init-after-finalize") else [0, 1]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in ranks]
    try:
        if mode in EXPECTED_WORDS:
            begin = time.time()
            output, _ = procs[0].communicate(timeout=timeout + 120)
            elapsed = time.time() - begin
            lines = [l for l in output.splitlines() if l.startswith(("RAISED", "AGAIN", "FINALIZED"))]
            wanted = "RAISED Error" if mode == "init-after-finalize" else "RAISED TimeoutError"
            raised = next((l for l in lines if l.startswith(wanted)), "")
            waited = float(raised.split(" after ")[1].split(" s")[0]) if raised else float("inf")
            ok = (EXPECTED_WORDS[mode] in raised and "FINALIZED" in output and
                  procs[0].returncode == 3 and waited <= timeout + 10)
            if mode.startswith("absent-") and mode != "absent-init":
                ok = ok and "PE 1" in raised
            return ok, (f"PE 0 raised after {waited:.1f} s (timeout {timeout:.0f} s), exit code "
                        f"{procs[0].returncode}, process done {elapsed:.1f} s after start; "
                        + " | ".join(lines)[:500])
        if mode.startswith("late-"):
            outputs = [p.communicate(timeout=timeout * 4 + 60)[0] for p in procs]
            codes = [p.returncode for p in procs]
            ok = codes == [0, 0] and "DONE" in outputs[1]
            said = [" | ".join(l for l in out.splitlines() if l.startswith(("BARRIER", "DONE")) or "Error" in l)[:300]
                    for out in outputs]
            return ok, f"exit codes {codes}; PE 0: {said[0]}; PE 1: {said[1]}"
        # Wait for PE 1 to be mid-transfer.
        line = ""
        deadline = time.time() + 120
        while "READY" not in line and time.time() < deadline:
            line = procs[1].stdout.readline()
            if not line and procs[1].poll() is not None:
                break
        if mode == "no-finalize":
            begin = time.time()
            codes = [p.wait(timeout=60) for p in procs]
            return codes == [0, 0], f"both workers exited (codes {codes}) {time.time() - begin:.1f} s after the transfer, without finalize()"
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        output, _ = procs[0].communicate(timeout=timeout + 60)
        elapsed = time.time() - killed_at
        raised = "RAISED TimeoutError" in output
        finalized = "FINALIZED" in output
        ok = raised and finalized and procs[0].returncode == 3 and elapsed <= timeout + 10
        tail = [l for l in output.splitlines() if l.startswith(("RAISED", "FINALIZED"))]
        if not ok:  # what the survivor said last (a traceback, say)
            tail += output.splitlines()[-6:]
        return ok, (f"survivor exit code {procs[0].returncode} {elapsed:.1f} s after SIGKILL "
                    f"(timeout {timeout:.0f} s); " + " | ".join(tail)[:400])
    except subprocess.TimeoutExpired:
        procs[0].kill()
        output = procs[0].communicate()[0] or ""
        return False, "the survivor did not exit in time (hang); its last lines: " + \
            " | ".join(output.splitlines()[-4:])[:600]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if os.path.exists(store):
            os.unlink(store)


SCENARIOS = [("kill", "kill PE 1 mid-transfer"), ("kill-small", "kill PE 1 mid-transfer of 4 KiB messages"), ("no-finalize", "exit without finalize()"),
             ("late-exit", "exit after a barrier, peer late"),
             ("late-finalize", "finalize after a barrier, peer late"),
             ("absent-barrier", "PE 1 skips barrier()"), ("absent-alloc", "PE 1 skips empty()"),
             ("absent-init", "rank 1 never starts"), ("init-after-finalize", "init after finalize()")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--only", choices=[mode for mode, _ in SCENARIOS], help="run this scenario only")
    args = parser.parse_args()
    results = [(name, *run(mode, args.timeout)) for mode, name in SCENARIOS
               if args.only in (None, mode)]
    for name, ok, detail in results:
        print(f"kill-check: {name:<26} {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
