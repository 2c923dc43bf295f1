"""Dead-peer check: python tests/stress/kill_check.py [--timeout 5]

Starts two worker processes (not under torchrun, whose agent would end the survivor too), lets
them stream send/recv both ways, SIGKILLs PE 1 mid-transfer and checks that PE 0 raises
pydatacopy.TimeoutError within the timeout plus a few seconds and then exits without blocking
on the dead peer. A second scenario exits both workers without finalize() and checks that
interpreter exit does not hang. Prints one line per scenario; exits non-zero on failure.
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
torch.cuda.set_device(rank)
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=2)
pydatacopy.init()
outgoing = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
incoming = torch.empty_like(outgoing)
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


def run(mode: str, timeout: float) -> tuple[bool, str]:
    store = tempfile.mktemp(prefix="pydatacopy-kill-")
    env = dict(os.environ, KILL_MODE=mode, KILL_TIMEOUT=str(timeout), STORE=store,
               WORLD_SIZE="2", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    results = [("kill PE 1 mid-transfer", *run("kill", args.timeout)),
               ("exit without finalize()", *run("no-finalize", args.timeout))]
    for name, ok, detail in results:
        print(f"kill-check: {name:<26} {'PASS' if ok else 'FAIL'}  {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
