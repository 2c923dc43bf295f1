"""A peer killed among four: python tests/stress/kill_ring.py [--timeout 5] [--scenario all]

Starts four worker processes itself (not torchrun, whose agent would end the survivors when one
dies): torch.distributed over gloo through a file:// store, then pydatacopy.init(). Devices follow
the shared rule, never a modulo: PYDATACOPY_RANKS_PER_GPU=K with K = ceil(4 / GPUs) (one GPU: all
four on cuda:0, K=4), rank r on cuda:(r // K), also passed as init(device=). CUDA_MPS_* and the
rest of the environment are inherited (scripts/gpu-check.sh runs this under MPS, 25% each).

Every PE first runs one ring round, all four alive: send to the next PE, receive from the previous
one, byte-exact. Then PE 3 dies:
- exit:    PE 3 leaves with os._exit(0) before the survivors start;
- sigkill: PE 3 starts its part of the next ring round (send to PE 0, receive from PE 2) with a
           message larger than the staging, so its kernel has delivered part of it and is
           waiting for credits, and is SIGKILLed there (mid-transfer); then the survivors start.
The survivors (PE 0, 1, 2), at once, each run
    with pydatacopy.group(): send(s, next, timeout=T); recv(r, prev, timeout=T)
then synchronise and check_errors(). Expected (issue 18):
- PE 1 (no operation with PE 3) completes without error; it received PE 0's data byte-exact;
- PE 0 (receives from PE 3) and PE 2 (sends to PE 3) raise pydatacopy.TimeoutError naming PE 3,
  within T + margin of starting the group, after their parts with live PEs were delivered:
  PE 1 has PE 0's data (above) and PE 2 received PE 1's data byte-exact. A timeout while waiting
  on a live PE, or any other error, is a failure;
- live pairs still transfer, byte-exact, within T: PE 1 <-> PE 2, then PE 0 <-> PE 1 (sendrecv);
- finalize() returns or raises TimeoutError within T + margin (it must not block on the dead
  peer; PYDATACOPY_TIMEOUT_S=T bounds its barriers), and every survivor process then exits by
  itself with code 0 within a hard bound; a worker still running is killed and reported.
MPS error containment: on ONE GPU under CUDA MPS, a client SIGKILLed while its kernel runs can
be fatal to every client with work on that GPU (the MPS server tears them down; seen: "illegal
memory access" on every survivor). When, in the sigkill scenario with all four PEs on one GPU,
every survivor fails with an illegal-address or MPS client/server error within T + margin of the
others, the scenario is reported as MPS-CONTAINMENT with that evidence: a known limitation of MPS,
neither a pass nor a failure of pydatacopy (exit code 0 if nothing else failed). With the PEs on
several GPUs the same outcome stays a FAIL. The exit scenario (no kernel running when PE 3 leaves)
must pass in full.
Prints one line per scenario (PASS/FAIL/MPS-CONTAINMENT, with times) and the reasons of a failure
(or the containment's evidence); exits non-zero on any failure. Everything runs under --total-timeout; every worker still running at
the end is killed. --dry-run starts the same workers without CUDA (simulated events), to check
the process handling on a machine without a GPU: `pass` must pass, `hang`, `late` and `crash`
must fail, `contained` (every survivor fails with an illegal address after the sigkill) must give
MPS-CONTAINMENT with --gpus 1 (exit scenario PASS, exit code 0) and FAIL with --gpus 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

WORLD = 4
DEAD = 3
SURVIVORS = (0, 1, 2)
TAG = "KILLRING "  # prefix of the workers' event lines (JSON after it)
SCENARIOS = ("exit", "sigkill")
# What a client sees when MPS tears down every client of the GPU after one of them faulted.
MPS_CONTAINMENT_ERROR = re.compile(r"illegal (memory access|address)|cudaErrorIllegalAddress|"
                                   r"cudaErrorMps\w*|MPS (client|server)", re.IGNORECASE)
MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # as pydatacopy.runtime.probes (not imported by the parent)


def mps_view(environ) -> dict:
    """What decides whether a process with `environ` is an MPS client, with the rule of
    pydatacopy.runtime.probes.mps_control_pipe: its CUDA_MPS_* variables and whether the control pipe
    exists. A 'without CUDA MPS' warning with pipe=False means no daemon at that pipe, not a
    variable lost on the way (the workers inherit the parent's environment whole)."""
    directory = environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY
    path = os.path.join(directory, "control")
    try:
        import stat

        pipe = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        pipe = False
    return {"control_pipe": path, "pipe": pipe,
            "variables": {k: v for k, v in sorted(environ.items()) if k.startswith("CUDA_MPS_")}}


# ---- worker --------------------------------------------------------------------------------

def _emit(event: str, **fields) -> None:
    print(TAG + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def _wait_for_file(path: str, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.01)
    return False


def _outcome(call) -> dict:
    """Run call(); what it raised (type and message) and how long it took."""
    begin = time.monotonic()
    raised = message = None
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported, the parent judges it
        raised, message = type(error).__name__, str(error)
    return {"raised": raised, "message": message, "elapsed": time.monotonic() - begin}


def _worker_dry(rank: int, scenario: str, timeout: float, go_file: str, mode: str) -> int:
    """The worker's events without CUDA: checks the parent's process handling."""
    _emit("start", device=None, nbytes=0, mps=mps_view(os.environ))
    if mode == "crash" and rank == 2:
        raise RuntimeError("(dry run) PE 2 failed in init")
    time.sleep(0.1)
    _emit("round1", ok=True, detail="dry run")
    if rank == DEAD:
        if scenario == "exit":
            _emit("dying")
            os._exit(0)
        _emit("launched", nbytes=0)
        time.sleep(3600)  # the parent kills it
        os._exit(1)
    if not _wait_for_file(go_file, 120):
        _emit("no_go")
        return 1
    if mode == "contained" and scenario == "sigkill":  # what MPS did to every survivor on one GPU
        time.sleep(0.2)
        raise RuntimeError("(dry run) CUDA error: an illegal memory access was encountered")
    wait = timeout * 0.3
    if mode == "late" and rank == 0:
        wait = 2 * timeout + 5  # later than the timeout plus any margin up to T + 5
    group = {"raised": None, "message": None, "elapsed": 0.01, "recv_ok": True}
    if rank in (0, 2):
        time.sleep(wait)
        group = {"raised": "TimeoutError", "message": f"(dry run) PE {rank} waited on PE 3",
                 "elapsed": wait, "recv_ok": True if rank == 2 else None, "arrived": 0}
    _emit("group", **group)
    for pair in ((1, 2), (0, 1)):
        if rank in pair:
            _emit("live_pair", pair=list(pair), raised=None, message=None, elapsed=0.01, ok=True)
    _emit("finalize", raised=None, message=None, elapsed=0.01)
    _emit("exiting")
    if mode == "hang" and rank == 1:
        time.sleep(3600)
    return 0


def _worker(rank: int, scenario: str, timeout: float, go_file: str, store: str) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    import pydatacopy
    from pydatacopy.runtime import settings as _settings

    ranks_per_gpu = int(os.environ["PYDATACOPY_RANKS_PER_GPU"])
    device = rank // ranks_per_gpu
    next_pe, prev_pe = (rank + 1) % WORLD, (rank - 1) % WORLD
    # Larger than the staging a sender may fill without credits, so that PE 3 in the sigkill
    # scenario is mid-message (waiting for PE 0's credits) when it is killed.
    chunk_bytes, num_chunks, _ = _settings.send_recv_settings()
    nbytes = max((64 << 20) + 5, 2 * chunk_bytes * num_chunks + 5)

    def data(src: int, dst: int, tag: int) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed((src * 16 + dst) * 1_000_003 + tag)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)

    _emit("start", device=device, nbytes=nbytes, mps=mps_view(os.environ))
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=180))
    pydatacopy.init(device=device)
    torch.cuda.synchronize()

    # Round 1, all four alive.
    outgoing, received = data(rank, next_pe, 1), torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    with pydatacopy.group():
        pydatacopy.send(outgoing, next_pe, timeout=timeout)
        pydatacopy.recv(received, prev_pe, timeout=timeout)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    _emit("round1", ok=bool(torch.equal(received, data(prev_pe, rank, 1))),
          detail=f"PE {rank} from PE {prev_pe}, {nbytes} bytes")
    dist.barrier()  # every PE has its round 1; gloo is not used after this (PE 3 dies)

    if rank == DEAD:
        if scenario == "exit":
            _emit("dying")
            os._exit(0)
        # Its own timeout is long: it must still be mid-transfer when the parent kills it.
        doomed = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
        sink = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        with pydatacopy.group():
            pydatacopy.send(doomed, next_pe, timeout=20 * timeout)
            pydatacopy.recv(sink, prev_pe, timeout=20 * timeout)
        _emit("launched", nbytes=nbytes)
        time.sleep(3600)  # the kernel runs; the parent SIGKILLs this process
        os._exit(1)

    outgoing = data(rank, next_pe, 2)
    received = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    if not _wait_for_file(go_file, 180):
        _emit("no_go")
        return 1

    def ring_group() -> None:
        with pydatacopy.group():
            pydatacopy.send(outgoing, next_pe, timeout=timeout)
            pydatacopy.recv(received, prev_pe, timeout=timeout)
        torch.cuda.synchronize()
        pydatacopy.check_errors()

    group = _outcome(ring_group)
    torch.cuda.synchronize()
    if prev_pe == DEAD:  # what had arrived from PE 3 (its data is 0xA5 in the sigkill scenario)
        group["recv_ok"] = None
        group["arrived"] = int(received.count_nonzero())
    else:
        group["recv_ok"] = bool(torch.equal(received, data(prev_pe, rank, 2)))
    _emit("group", **group)

    for step, pair in enumerate(((1, 2), (0, 1))):
        if rank not in pair:
            continue
        peer = pair[1] if rank == pair[0] else pair[0]
        tag = 3 + step
        outgoing, received = data(rank, peer, tag), torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

        def live_pair() -> None:
            pydatacopy.sendrecv(outgoing, peer, received, peer, timeout=timeout)
            torch.cuda.synchronize()
            pydatacopy.check_errors()

        result = _outcome(live_pair)
        result["ok"] = bool(torch.equal(received, data(peer, rank, tag)))
        _emit("live_pair", pair=list(pair), **result)

    _emit("finalize", **_outcome(pydatacopy.finalize))
    _emit("gloo_destroyed", **_outcome(dist.destroy_process_group))  # local; a hang shows here
    _emit("exiting")
    return 0  # a normal interpreter exit: it must not hang either


def worker_main() -> int:
    rank = int(os.environ["RANK"])
    scenario, timeout = os.environ["KILL_RING_SCENARIO"], float(os.environ["KILL_RING_TIMEOUT"])
    go_file, dry = os.environ["KILL_RING_GO"], os.environ.get("KILL_RING_DRY", "")
    try:
        if dry:
            return _worker_dry(rank, scenario, timeout, go_file, dry)
        return _worker(rank, scenario, timeout, go_file, os.environ["KILL_RING_STORE"])
    except BaseException as error:  # noqa: BLE001 - reported to the parent, then a failing exit
        _emit("crash", error=f"{type(error).__name__}: {error}",
              traceback=traceback.format_exc()[-1500:])
        return 2


# ---- parent --------------------------------------------------------------------------------

def count_gpus() -> int:
    """Visible GPUs without creating a CUDA context here (the parent is no MPS client)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            count = sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))
            if count:
                return count
        except (OSError, subprocess.SubprocessError):
            pass
    return 1


def ranks_per_gpu(gpus: int) -> int:
    """K of PYDATACOPY_RANKS_PER_GPU: the environment's if set (checked), else ceil(4 / gpus)."""
    given = os.environ.get("PYDATACOPY_RANKS_PER_GPU")
    if given:
        k = int(given)
        if k < 1 or math.ceil(WORLD / k) > gpus:
            raise SystemExit(f"kill_ring: PYDATACOPY_RANKS_PER_GPU={given} puts {WORLD} ranks on "
                             f"{math.ceil(WORLD / max(k, 1))} GPUs, but {gpus} are visible; unset it "
                             f"or use {math.ceil(WORLD / gpus)}")
        return k
    return math.ceil(WORLD / gpus)


class Worker:
    def __init__(self, rank: int, env: dict) -> None:
        self.rank = rank
        self.events: dict[str, list[dict]] = {}
        self.lines: list[str] = []
        self.exited_at: float | None = None
        self.killed = False
        self.closed = False
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

    def last(self, event: str) -> dict | None:
        return self.events.get(event, [None])[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: it and its children
            except ProcessLookupError:
                pass
            self.killed = True

    def tail(self, n: int = 6) -> str:
        return " | ".join(line[:300] for line in self.lines[-n:])


def _reader(worker: Worker, inbox: queue.Queue) -> None:
    for line in worker.proc.stdout:
        inbox.put((worker.rank, line.rstrip("\n")))
    inbox.put((worker.rank, None))


def run_scenario(scenario: str, args, k: int, total_deadline: float) -> tuple[str, str, list[str]]:
    """One scenario: (verdict PASS/FAIL/MPS-CONTAINMENT, summary with times, reasons of failure
    or the containment's evidence)."""
    workdir = tempfile.mkdtemp(prefix="pydatacopy-kill-ring-")
    go_file, store = os.path.join(workdir, "go"), os.path.join(workdir, "store")
    base = dict(os.environ, WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), PYTHONUNBUFFERED="1",
                PYDATACOPY_RANKS_PER_GPU=str(k), PYDATACOPY_TIMEOUT_S=str(args.timeout),
                KILL_RING_SCENARIO=scenario, KILL_RING_TIMEOUT=str(args.timeout),
                KILL_RING_GO=go_file, KILL_RING_STORE=store, KILL_RING_DRY=args.dry_run or "")
    # dict(os.environ, ...) above: every CUDA_MPS_* variable reaches the workers as it is here
    # (none is among the names set); checked, so that a 'without CUDA MPS' warning can never
    # come from this script.
    lost = [k for k in os.environ if k.startswith("CUDA_MPS_") and base.get(k) != os.environ[k]]
    assert not lost, f"kill_ring dropped {lost} from the workers' environment"
    base.setdefault("PYDATACOPY_INIT_TIMEOUT_S", "120")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        base.setdefault(name, value)
    begin = time.monotonic()
    workers = [Worker(r, dict(base, RANK=str(r), LOCAL_RANK=str(r))) for r in range(WORLD)]
    inbox: queue.Queue = queue.Queue()
    for w in workers:
        threading.Thread(target=_reader, args=(w, inbox), daemon=True).start()
    reasons: list[str] = []
    open_streams = WORLD
    go_at = killed_at = None
    launched_at = None
    # Survivors must be done (exited) this long after the go: the group, two live pairs and
    # finalize, each T + margin, and the interpreter's exit.
    survivor_bound = 4 * (args.timeout + args.margin) + args.exit_bound
    start_deadline = begin + args.start_timeout
    try:
        while open_streams or any(w.proc.poll() is None for w in workers):
            now = time.monotonic()
            if now > total_deadline:
                reasons.append(f"the total bound (--total-timeout {args.total_timeout:.0f} s) ran out")
                break
            if go_at is None and now > start_deadline:
                reasons.append(f"PE 3 was not dead and the survivors not ready within "
                               f"--start-timeout {args.start_timeout:.0f} s (init or round 1 hung?)")
                break
            if go_at is not None and now > go_at + survivor_bound:
                for w in workers:
                    if w.proc.poll() is None:
                        last = max(w.events, key=lambda e: w.events[e][-1]["t"]) if w.events else "nothing"
                        reasons.append(f"PE {w.rank} still running {survivor_bound:.0f} s after the "
                                       f"survivors started (hang; its last event: {last}); killed")
                break
            try:
                rank, line = inbox.get(timeout=0.05)
            except queue.Empty:
                rank = line = None
            if rank is not None:
                w = workers[rank]
                if line is None:
                    open_streams -= 1
                    w.closed = True  # every line it wrote has been read
                elif line.startswith(TAG):
                    event = json.loads(line[len(TAG):])
                    w.events.setdefault(event["event"], []).append(event)
                    if event["event"] == "launched":
                        launched_at = time.monotonic()
                else:
                    w.lines.append(line)
            for w in workers:
                if w.exited_at is None and w.proc.poll() is not None:
                    w.exited_at = time.monotonic()
            dead = workers[DEAD]
            if any(w.last("crash") or (w.exited_at and not w.last("exiting") and w.rank != DEAD)
                   for w in workers) and go_at is None:
                reasons.append("a worker failed before PE 3 died: PE " + ", PE ".join(
                    str(w.rank) for w in workers
                    if w.last("crash") or (w.exited_at and w.rank != DEAD)))
                break
            if scenario == "sigkill" and launched_at and killed_at is None and \
                    time.monotonic() >= launched_at + args.kill_after:
                if dead.proc.poll() is not None:
                    reasons.append(f"PE 3 had already exited (code {dead.proc.returncode}) when it "
                                   "was to be killed mid-transfer")
                    break
                dead.kill()
                killed_at = time.monotonic()
            if go_at is None and dead.exited_at is not None and dead.closed:
                planned = dead.last("dying") if scenario == "exit" else killed_at is not None
                if not planned:
                    reasons.append(f"PE 3 ended (code {dead.proc.returncode}) before its planned "
                                   f"death: {(dead.last('crash') or {}).get('error') or dead.tail(3)}")
                    break
                open(go_file, "w").close()  # PE 3 is dead: the survivors start together
                go_at = time.monotonic()
    finally:
        for w in workers:
            w.kill()
        for w in workers:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                reasons.append(f"PE {w.rank} (pid {w.proc.pid}) did not die after SIGKILL")
        shutil.rmtree(workdir, ignore_errors=True)
    passed, summary, reasons = judge(scenario, args, workers, go_at, killed_at, launched_at, begin,
                                     reasons)
    if passed:
        return "PASS", summary, reasons
    one_gpu = k >= WORLD  # every PE, the killed one too, on cuda:0
    evidence = mps_containment(scenario, args, workers, killed_at, go_at, one_gpu)
    if evidence is not None:
        return "MPS-CONTAINMENT", summary, evidence + ["what failed with it: " + r for r in reasons]
    if not one_gpu and mps_containment(scenario, args, workers, killed_at, go_at, True):
        reasons.append("every survivor failed with an illegal-address / MPS error, but the PEs "
                       "are on several GPUs: not MPS containment of one shared GPU, a failure")
    return "FAIL", summary, reasons


def _containment_error(w: Worker) -> tuple[float | None, str] | None:
    """The first illegal-address / MPS error a survivor reported: (time.time() of its event, or
    None when only its output shows it; the text), or None."""
    for event in sorted((e for events in w.events.values() for e in events), key=lambda e: e["t"]):
        for text in (event.get("message"), event.get("error")):
            if text and MPS_CONTAINMENT_ERROR.search(text):
                return event["t"], f"{event['event']}: {text[:300]}"
    for line in w.lines:
        if MPS_CONTAINMENT_ERROR.search(line):
            return None, f"output: {line[:300]}"
    return None


def mps_containment(scenario, args, workers, killed_at, go_at, one_gpu) -> list[str] | None:
    """Evidence that the sigkill took every client of the one shared GPU down with it (MPS error
    containment), or None: PE 3 was SIGKILLed mid-transfer as planned, round 1 was byte-exact
    everywhere, and every survivor failed with an illegal-address / MPS error, the reported ones
    within T + margin of each other."""
    dead = workers[DEAD]
    if not one_gpu or scenario != "sigkill" or killed_at is None or go_at is None \
            or dead.proc.returncode != -signal.SIGKILL:
        return None
    if not all((w.last("round1") or {}).get("ok") for w in workers):
        return None
    found = {rank: _containment_error(workers[rank]) for rank in SURVIVORS}
    if not all(found.values()):
        return None
    times = [t for t, _ in found.values() if t is not None]
    if times and max(times) - min(times) > args.timeout + args.margin:
        return None
    views = {json.dumps(((w.last("start") or {}).get("mps") or {}), sort_keys=True) for w in workers}
    return ["a known limitation of CUDA MPS on one shared GPU, neither a pass nor a pydatacopy "
            "failure: PE 3 was SIGKILLed while its kernel ran, and every survivor then failed "
            "with an illegal-address / MPS error"
            + (f" within {max(times) - min(times):.1f} s of each other" if len(times) > 1 else "")]\
        + [f"PE {rank}: {text}" for rank, (_, text) in found.items()] \
        + [f"MPS as the workers saw it: {view}" for view in sorted(views)]


def judge(scenario, args, workers, go_at, killed_at, launched_at, begin, reasons):
    limit = args.timeout + args.margin
    times: list[str] = []
    output = "\n".join(line for w in workers for line in w.lines)
    if "without CUDA MPS" in output:
        views = {json.dumps(((w.last("start") or {}).get("mps") or {}), sort_keys=True) for w in workers}
        # A note, not a reason: the warning alone fails nothing.
        print("kill-ring:   note: pydatacopy warned of a GPU shared 'without CUDA MPS'; the workers "
              "got the parent's CUDA_MPS_* whole, and saw: " + "; ".join(sorted(views)), flush=True)
    if "busy or unavailable" in output:
        reasons.append("CUDA refused a process ('busy or unavailable'): after a failed client, MPS "
                       "needs a restart (run the scenarios separately with --scenario)")
    for w in workers:
        if w.last("crash"):
            reasons.append(f"PE {w.rank} crashed: {w.last('crash')['error']}")
        elif w.exited_at and w.rank != DEAD and not w.last("exiting"):
            reasons.append(f"PE {w.rank} ended (code {w.proc.returncode}) without reporting: {w.tail(4)}")
    for w in workers:
        r1 = w.last("round1")
        if r1 is None:
            if go_at is not None:
                reasons.append(f"PE {w.rank}: no round 1 reported ({w.tail(3)})")
        elif not r1["ok"]:
            reasons.append(f"PE {w.rank}: round 1 with all four alive was not byte-exact ({r1['detail']})")
    dead = workers[DEAD]
    if scenario == "exit" and dead.last("dying") and dead.proc.returncode != 0:
        reasons.append(f"PE 3's os._exit(0) ended with code {dead.proc.returncode}")
    if scenario == "sigkill":
        if not dead.last("launched"):
            reasons.append("PE 3 never reported its mid-transfer launch")
        elif killed_at is None or dead.proc.returncode != -signal.SIGKILL:
            reasons.append(f"PE 3 was not SIGKILLed mid-transfer (exit code {dead.proc.returncode})")
    if go_at is None:
        reasons.append("the survivors never started (see above)")
        return False, "not run", with_output(reasons, workers)

    group = {w.rank: w.last("group") for w in workers[:DEAD]}
    for rank in SURVIVORS:
        g = group[rank]
        if g is None:
            reasons.append(f"PE {rank}: no result of the survivors' group ({workers[rank].tail(3)})")
            continue
        if rank == 1:
            times.append(f"PE 1 done {g['elapsed']:.1f} s" if not g["raised"] else
                         f"PE 1 {g['raised']} {g['elapsed']:.1f} s")
            if g["raised"]:
                reasons.append(f"PE 1 (no operation with the dead PE) raised {g['raised']} after "
                               f"{g['elapsed']:.1f} s: {g['message']}")
            if g["recv_ok"] is not True:
                reasons.append("PE 1 did not receive PE 0's data byte-exact (PE 0's part with a "
                               "live PE was not delivered)")
            continue
        what = "receives from" if rank == 0 else "sends to"
        nbytes = (workers[rank].last("start") or {}).get("nbytes")
        arrived = (f", {g.get('arrived')} of {nbytes} bytes from PE 3 had arrived"
                   if rank == 0 and scenario == "sigkill" else "")
        times.append(f"PE {rank} {g['raised'] or 'no error'} {g['elapsed']:.1f} s{arrived}")
        if g["raised"] != "TimeoutError":
            reasons.append(f"PE {rank} ({what} the dead PE 3) raised {g['raised'] or 'nothing'} "
                           f"after {g['elapsed']:.1f} s, expected pydatacopy.TimeoutError"
                           + (f": {g['message']}" if g["message"] else ""))
        else:
            if g["elapsed"] > limit:
                reasons.append(f"PE {rank} raised TimeoutError after {g['elapsed']:.1f} s, later than "
                               f"its timeout {args.timeout:g} s + {args.margin:g} s")
            if not re.search(r"\bPE 3\b", g["message"] or ""):
                reasons.append(f"PE {rank}'s TimeoutError does not name the dead PE 3 (waited on a "
                               f"live PE?): {g['message']}")
        if rank == 2 and g["recv_ok"] is not True:
            reasons.append("PE 2 did not receive PE 1's data byte-exact (its part with a live PE "
                           "was not delivered before the error)")

    for pair in ((1, 2), (0, 1)):
        for rank in pair:
            results = [e for e in workers[rank].events.get("live_pair", []) if e["pair"] == list(pair)]
            label = f"{pair[0]}<->{pair[1]}"
            if not results:
                reasons.append(f"live pair {label}: PE {rank} reported no result")
                continue
            result = results[-1]
            if result["raised"] or not result["ok"]:
                reasons.append(f"live pair {label}: PE {rank} "
                               + (f"raised {result['raised']} after {result['elapsed']:.1f} s: "
                                  f"{result['message']}" if result["raised"] else "data not byte-exact"))
        done = [e for r in pair for e in workers[r].events.get("live_pair", []) if e["pair"] == list(pair)]
        if done:
            times.append(f"{pair[0]}<->{pair[1]} {max(e['elapsed'] for e in done):.1f} s")

    finalize_times = []
    for rank in SURVIVORS:
        w = workers[rank]
        f = w.last("finalize")
        if f is None:
            reasons.append(f"PE {rank}: finalize() did not return ({w.tail(3)})")
            continue
        finalize_times.append(f"{f['elapsed']:.1f}")
        if f["elapsed"] > limit:
            reasons.append(f"PE {rank}: finalize() took {f['elapsed']:.1f} s, more than the timeout "
                           f"{args.timeout:g} s + {args.margin:g} s (blocked on the dead peer?)")
        if f["raised"] not in (None, "TimeoutError"):
            reasons.append(f"PE {rank}: finalize() raised {f['raised']}: {f['message']}")
        if w.killed:
            if not any(reason.startswith(f"PE {rank} still running") for reason in reasons):
                reasons.append(f"PE {rank} did not exit by itself after finalize(); killed")
        elif w.proc.returncode != 0:
            reasons.append(f"PE {rank} exited with code {w.proc.returncode} ({w.tail(3)})")
    times.append("finalize " + "/".join(finalize_times) + " s")
    exits = [w.exited_at - go_at for w in workers[:DEAD] if w.exited_at and not w.killed]
    if exits:
        times.append(f"last survivor exited {max(exits):.1f} s after the start")
    if scenario == "sigkill" and killed_at and launched_at:
        times.insert(0, f"killed {killed_at - launched_at:.1f} s into PE 3's transfer")
    times.append(f"scenario {time.monotonic() - begin:.0f} s")
    return not reasons, ", ".join(times), with_output(reasons, workers)


def with_output(reasons: list[str], workers) -> list[str]:
    """After a failure: what each worker printed besides its events (NVSHMEM, CUDA, tracebacks)."""
    if reasons:
        for w in workers:
            crash = w.last("crash")
            if crash:
                reasons.append(f"PE {w.rank} traceback: " + crash["traceback"].replace("\n", " | ")[-800:])
            if w.lines:
                reasons.append(f"PE {w.rank} output: {w.tail(4)}")
    return reasons


def main() -> int:
    if "--worker" in sys.argv[1:]:
        return worker_main()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="T: each survivor op's timeout= (s)")
    parser.add_argument("--margin", type=float, default=3.0,
                        help="how much later than T a TimeoutError or finalize() may come (s)")
    parser.add_argument("--scenario", choices=SCENARIOS + ("all",), default="all")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to spread the four PEs over (default: the visible ones)")
    parser.add_argument("--kill-after", type=float, default=1.0,
                        help="sigkill: seconds between PE 3's launch and the SIGKILL (< 20 T)")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="bound for start, init and round 1 (s)")
    parser.add_argument("--exit-bound", type=float, default=15.0,
                        help="time a survivor may take to exit after finalize() (s)")
    parser.add_argument("--total-timeout", type=float, default=420.0,
                        help="bound for the whole run; every worker still running is killed (s)")
    parser.add_argument("--dry-run", choices=("pass", "hang", "late", "crash", "contained"), default=None,
                        help="workers without CUDA, simulated events: check the process handling")
    args = parser.parse_args()
    if args.timeout <= 0 or args.margin < 0 or not 0 < args.kill_after < 20 * args.timeout:
        parser.error("--timeout must be > 0, --margin >= 0, 0 < --kill-after < 20 x --timeout")
    gpus = args.gpus if args.gpus is not None else (1 if args.dry_run else count_gpus())
    if gpus < 1:
        parser.error("--gpus must be at least 1 (no GPU visible?)")
    k = ranks_per_gpu(gpus)
    devices = sorted({r // k for r in range(WORLD)})
    mps = mps_view(os.environ)
    print(f"kill-ring: {WORLD} PEs, PYDATACOPY_RANKS_PER_GPU={k} (cuda:{', cuda:'.join(map(str, devices))}), "
          f"timeout {args.timeout:g} s + margin {args.margin:g} s"
          + (f", MPS ({mps['control_pipe']}) with "
             f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'no SM limit')}"
             f"{'%' if os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') else ''} per client"
             if mps["pipe"] else f", no MPS control pipe at {mps['control_pipe']}")
          + (f", dry run ({args.dry_run})" if args.dry_run else ""), flush=True)
    total_deadline = time.monotonic() + args.total_timeout
    failed = contained = False
    for scenario in (SCENARIOS if args.scenario == "all" else (args.scenario,)):
        if time.monotonic() > total_deadline:
            print(f"kill-ring: {scenario:<8} FAIL  not run: --total-timeout ran out", flush=True)
            failed = True
            continue
        verdict, summary, reasons = run_scenario(scenario, args, k, total_deadline)
        print(f"kill-ring: {scenario:<8} {verdict}  {summary}", flush=True)
        for reason in reasons:
            print(f"kill-ring:   {reason}", flush=True)
        failed = failed or verdict == "FAIL"
        contained = contained or verdict == "MPS-CONTAINMENT"
    if contained:
        print("kill-ring: MPS-CONTAINMENT is a known limitation of CUDA MPS (a client killed "
              "mid-kernel takes the GPU's other clients down), counted as neither pass nor "
              "failure", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
