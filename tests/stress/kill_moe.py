"""A PE killed during MoE dispatch/combine: python tests/stress/kill_moe.py [--timeout 5] [--scenario all]
[--workload moe]

--workload distributed (or distributed-native: PYDATACOPY_DISTRIBUTED_NATIVE=1): the same with
torch.distributed's all_to_all_single on a default group on "cpu:gloo,cuda:pydatacopy" (issue 38:
a dead peer gives an error from the calls within the group's timeout, never a hang), started by
init_process_group(timeout=T) instead of pydatacopy.init(); the exit scenario only (a group's
calls all take the group's timeout, so the dying PE cannot be given a longer one).

Starts WORLD=4 worker processes itself (torch.distributed over gloo through a file:// store,
then pydatacopy.init()); devices as tests/stress/kill_ring.py places them
(PYDATACOPY_RANKS_PER_GPU=K, rank r on cuda:(r // K); CUDA_MPS_* inherited).

Every PE first runs one dispatch + combine, all alive, and checks it bit for bit (identity
expert: out[t] = sum_k w[t, k] * x[t] in float32, k in order). Then PE 3 dies:
- exit:    it leaves with os._exit(0) before the survivors' next dispatch;
- sigkill: it launches its next dispatch (its send kernel delivers, its receive kernel waits for
           the others, who have not started) and is SIGKILLed there, mid-exchange.
The survivors then run dispatch + combine with timeout=T, synchronise and call check_errors().
Expected: each raises pydatacopy.TimeoutError naming PE 3 within 2 T + margin (dispatch's and
combine's waits each time out once), never hangs; a further dispatch raises TimeoutError at once
(on the host: the collective is refused after a peer timed out); finalize() returns or raises
TimeoutError within T + margin, and the process exits by itself with code 0.
On ONE GPU under MPS, a client SIGKILLed while its kernel runs can take every client on that GPU
down (kill_ring.py's MPS-CONTAINMENT): when every survivor fails with an illegal-address or MPS
error in the sigkill scenario on one GPU, the verdict is MPS-CONTAINMENT (not a failure); the
exit scenario must pass. Prints one line per scenario: `kill-moe <scenario>: PASS|FAIL|...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

WORLD = 4
DEAD = WORLD - 1
TOKENS, HIDDEN, TOPK, EXPERTS_PER_PE = 64, 256, 4, 2


def _emit(event: str, **fields) -> None:
    print("EVENT " + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def _worker() -> int:
    import datetime

    import torch
    import torch.distributed as dist

    import pydatacopy

    rank = int(os.environ["RANK"])
    scenario, timeout = os.environ["KILL_MOE_SCENARIO"], float(os.environ["KILL_MOE_TIMEOUT"])
    go_file, workload = os.environ["KILL_MOE_GO"], os.environ["KILL_MOE_WORKLOAD"]
    device = rank // int(os.environ["PYDATACOPY_RANKS_PER_GPU"])
    store = "file://" + os.environ["KILL_MOE_STORE"]
    if workload == "moe":
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=180))
        pydatacopy.init(device=device)
        layer, ok = _moe_layer(rank)
    else:
        import pydatacopy.distributed  # noqa: F401 - registers the backend

        torch.cuda.set_device(device)
        # The group's timeout is its calls' (and gloo's, unused after round 1).
        dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=store, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=timeout))
        layer, ok = _all_to_all_layer(rank)

    out = layer(timeout)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    _emit("round1", ok=ok(out))
    dist.barrier()  # gloo is not used after this

    if rank == DEAD:
        if scenario == "exit":
            _emit("dying")
            os._exit(0)
        layer(20 * timeout)  # launched; its receive waits for the survivors, who wait for the go
        _emit("launched")
        time.sleep(3600)  # the parent SIGKILLs this process
        os._exit(1)

    deadline = time.time() + 180
    while not os.path.exists(go_file) and time.time() < deadline:
        time.sleep(0.05)
    began = time.time()
    outcome = {"error": None, "kind": None}
    try:
        layer(timeout)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        outcome = {"error": str(error)[:400], "kind": type(error).__name__}
    _emit("timed_out", seconds=time.time() - began, **outcome)
    began = time.time()
    try:
        layer(timeout)
        again = {"error": None, "kind": None}
    except BaseException as error:  # noqa: BLE001
        again = {"error": str(error)[:400], "kind": type(error).__name__}
    _emit("again", seconds=time.time() - began, **again)
    began = time.time()
    try:
        if workload != "moe":
            dist.destroy_process_group()  # what a user's code does first
        pydatacopy.finalize()
        fin = {"error": None, "kind": None}
    except BaseException as error:  # noqa: BLE001
        fin = {"error": str(error)[:400], "kind": type(error).__name__}
    _emit("finalize", seconds=time.time() - began, **fin)
    return 0


def _moe_layer(rank: int):
    """Dispatch + combine through an identity expert, and its check bit for bit: out[t] = sum_k
    w[t, k] * x[t] in float32, k in order."""
    import torch

    import pydatacopy

    moe = pydatacopy.MoeDispatcher(EXPERTS_PER_PE * WORLD, HIDDEN, TOPK, TOKENS, torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=generator).to(torch.bfloat16)
    ids = torch.rand(TOKENS, EXPERTS_PER_PE * WORLD, device="cuda", generator=generator).topk(TOPK, 1).indices
    weights = torch.rand(TOKENS, TOPK, device="cuda", generator=generator)

    def layer(t):
        recv_x, handle = moe.dispatch(x, ids, timeout=t)
        return moe.combine(recv_x.clone(), handle, weights, timeout=t)

    def ok(out) -> bool:
        want = torch.zeros(TOKENS, HIDDEN, device="cuda")
        for k in range(TOPK):
            want = want + weights[:, k:k + 1] * x.float()
        return bool(torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)))

    return layer, ok


def _all_to_all_layer(rank: int):
    """torch.distributed's all_to_all_single of TOKENS rows to every rank (every rank exchanges with
    every other, so every survivor meets the dead PE), waited with a bound on the host; its check:
    the rows from rank s are s's, bit for bit. The group's timeout is the calls' (the argument is
    moe's per-call one)."""
    import datetime

    import torch
    import torch.distributed as dist

    def rows(source: int, dest: int):
        return torch.arange(TOKENS * HIDDEN, device="cuda", dtype=torch.float32).view(TOKENS, HIDDEN) + \
            1000.0 * source + 10.0 * dest

    send = torch.cat([rows(rank, d) for d in range(WORLD)])

    def layer(t):
        out = torch.zeros_like(send)
        work = dist.all_to_all_single(out, send, async_op=True)
        work.wait(datetime.timedelta(seconds=3 * t + 30))  # the GPU done (or given up), then its errors
        return out

    def ok(out) -> bool:
        return bool(torch.equal(out, torch.cat([rows(s, rank) for s in range(WORLD)])))

    return layer, ok


def _ranks_per_gpu() -> int:
    given = os.environ.get("PYDATACOPY_RANKS_PER_GPU")
    if given:
        return int(given)
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = max(1, sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU ")))
    except (OSError, subprocess.SubprocessError):
        gpus = 1
    return math.ceil(WORLD / gpus)


def run_scenario(scenario: str, timeout: float, workload: str = "moe") -> tuple[str, list[str]]:
    k = _ranks_per_gpu()
    one_gpu = k >= WORLD
    work = tempfile.mkdtemp(prefix="kill-moe-")
    go_file = os.path.join(work, "go")
    events: dict[int, dict[str, dict]] = {r: {} for r in range(WORLD)}
    lines: dict[int, list[str]] = {r: [] for r in range(WORLD)}
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(WORLD), PYDATACOPY_RANKS_PER_GPU=str(k),
                   PYDATACOPY_TIMEOUT_S=str(timeout), KILL_MOE_SCENARIO=scenario,
                   KILL_MOE_TIMEOUT=str(timeout), KILL_MOE_GO=go_file, KILL_MOE_WORKLOAD=workload,
                   PYDATACOPY_DISTRIBUTED_NATIVE="1" if workload == "distributed-native" else "0",
                   KILL_MOE_STORE=os.path.join(work, "store"))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))

    def read(rank):
        for line in procs[rank].stdout:
            lines[rank].append(line.rstrip())
            if line.startswith("EVENT "):
                event = json.loads(line[6:])
                events[rank][event["event"]] = event

    readers = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(WORLD)]
    for thread in readers:
        thread.start()
    reasons: list[str] = []

    def wait_for(condition, bound):
        end = time.time() + bound
        while time.time() < end and not condition():
            time.sleep(0.05)
        return condition()

    if not wait_for(lambda: all("round1" in events[r] for r in range(WORLD)), 240):
        reasons.append("round 1 did not complete on every PE")
    elif not all(events[r]["round1"]["ok"] for r in range(WORLD)):
        reasons.append("round 1 (all alive) was not exact")
    if not reasons:
        if scenario == "exit":
            wait_for(lambda: procs[DEAD].poll() is not None, 60)
        else:
            if wait_for(lambda: "launched" in events[DEAD], 60):
                time.sleep(0.5)  # its kernels are running
            os.killpg(procs[DEAD].pid, signal.SIGKILL)
            procs[DEAD].wait(30)
        open(go_file, "w").close()
        survivors = [r for r in range(WORLD) if r != DEAD]
        bound = 2 * timeout + 30 + 3 * timeout + 30
        wait_for(lambda: all(p.poll() is not None for r, p in enumerate(procs) if r != DEAD), bound)
        illegal = 0
        for r in survivors:
            got = events[r].get("timed_out")
            if got is None:
                reasons.append(f"PE {r}: no outcome (hung or crashed): {' | '.join(lines[r][-4:])}")
                continue
            error = got.get("error") or ""
            if "illegal" in error.lower() or "mps" in error.lower():
                illegal += 1
            if got["kind"] != "TimeoutError" or f"PE {DEAD}" not in error:
                reasons.append(f"PE {r}: expected TimeoutError naming PE {DEAD}, got {got['kind']}: {error}")
            elif got["seconds"] > 2 * timeout + 30:
                reasons.append(f"PE {r}: the timeout took {got['seconds']:.1f} s (T = {timeout})")
            again = events[r].get("again")
            if again is None or again["kind"] != "TimeoutError" or again["seconds"] > timeout:
                reasons.append(f"PE {r}: the call after the timeout did not raise TimeoutError at once: {again}")
            fin = events[r].get("finalize")
            if fin is None or fin["seconds"] > timeout + 30 or fin["kind"] not in (None, "TimeoutError"):
                reasons.append(f"PE {r}: finalize: {fin}")
            if procs[r].poll() != 0:
                reasons.append(f"PE {r}: exit code {procs[r].poll()}")
        if reasons and scenario == "sigkill" and one_gpu and illegal == len(survivors):
            for p in procs:
                _kill(p)
            return "MPS-CONTAINMENT", reasons
    for p in procs:
        _kill(p)
    return ("FAIL" if reasons else "PASS"), reasons


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> int:
    if "--worker" in sys.argv:
        try:
            return _worker()
        except BaseException as error:  # noqa: BLE001
            _emit("crash", error=f"{type(error).__name__}: {error}")
            return 2
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--scenario", choices=["exit", "sigkill", "all"], default="all")
    parser.add_argument("--workload", choices=["moe", "distributed", "distributed-native"], default="moe")
    args = parser.parse_args()
    if args.workload != "moe" and args.scenario == "sigkill":
        parser.error("the distributed workloads have the exit scenario only")
    scenarios = ["exit", "sigkill"] if args.scenario == "all" else [args.scenario]
    if args.workload != "moe":
        scenarios = ["exit"]
    failed = False
    for scenario in scenarios:
        began = time.time()
        verdict, reasons = run_scenario(scenario, args.timeout, args.workload)
        name = "kill-moe" if args.workload == "moe" else f"kill-{args.workload}"
        print(f"{name} {scenario}: {verdict} ({time.time() - began:.0f} s)", flush=True)
        for reason in reasons:
            print(f"  {reason}", flush=True)
        failed = failed or verdict == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
