"""send/recv: one way (send on rank 0, recv on rank 1) or both ways (sendrecv), one row per path
the engine can take. `default`: no setting touched, the engine's cuts as init() left them (what a
user gets). The forced rows set the engine's two cuts for the row and put back the ones before:
`staged` (zero-copy and low-latency off: every message through the staging, two copies),
`zero-copy` (PYDATACOPY_ZERO_COPY_MIN_BYTES at 1 byte, low-latency off: messages between
load/store peers move once) and `low-latency` (PYDATACOPY_LOW_LATENCY_MAX_BYTES at the engine's
capacity, zero-copy off: data and flags in the same stores; only sizes up to the capacity).
Where the forced rows cross is where the defaults belong."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv

from ._harness import agree, allocator_setting, device_clean, fill, human, percentile, reduce_device


@contextlib.contextmanager
def engine_cuts(zero_copy_min_bytes: int, low_latency_max_bytes: int, copy_engine_min_bytes: int = 0):
    """The engine's cuts for one row, on both PEs (the first two collective), then the ones
    before. The copy engine is off unless the row asks for it."""
    before = (_send_recv.zero_copy_min_bytes(), _send_recv.low_latency_max_bytes(),
              _send_recv.copy_engine_min_bytes())
    _send_recv.set_zero_copy_min_bytes(zero_copy_min_bytes)
    _send_recv.set_low_latency_max_bytes(low_latency_max_bytes)
    _send_recv.set_copy_engine_min_bytes(copy_engine_min_bytes)
    try:
        yield
    finally:
        _send_recv.set_zero_copy_min_bytes(before[0])
        _send_recv.set_low_latency_max_bytes(before[1])
        _send_recv.set_copy_engine_min_bytes(before[2])


def _run(sweep):
    def run():
        if sweep.both:
            pydatacopy.sendrecv(sweep.src, sweep.peer, sweep.out, sweep.peer)
        elif sweep.sends:
            pydatacopy.send(sweep.src, sweep.peer)
        else:
            pydatacopy.recv(sweep.out, sweep.peer)

    return run


def recv_counts() -> dict[str, int]:
    """This PE's receives finished so far, by path (the engine's counters, on the device: read
    after the stream's work is done)."""
    counters = _send_recv._require_engine("bench").zero_copy_counters()
    return {path: counters[f"recv_{path}"] for path in ("zero_copy", "staged", "low_latency")}


def one_copy_fraction(before: dict[str, int], after: dict[str, int]) -> float | None:
    """Receives that moved once (zero-copy) over all receives between two recv_counts(); None
    when none finished in between (a PE that only sent)."""
    total = sum(after[path] - before[path] for path in after)
    return (after["zero_copy"] - before["zero_copy"]) / total if total else None


def agreed_fraction(fraction: float | None) -> float | None:
    """The lowest one-copy fraction of the PEs that received (None if none did), the same on every PE."""
    value = torch.tensor([2.0 if fraction is None else fraction], dtype=torch.float64, device=reduce_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return None if value.item() > 1.0 else value.item()


def _measure(sweep):
    """Time and check the row; the row's `one_copy_fraction`: the receives of its timed calls that
    moved once, over all of them (the lowest of the PEs that received), in sweep.extra."""
    counts: list[dict[str, int]] = []
    result = sweep.measure(_run(sweep), sweep.out, around_timed=lambda: counts.append(recv_counts()))
    sweep.extra["one_copy_fraction"] = agreed_fraction(one_copy_fraction(counts[0], counts[1]))
    return result


def _measure_counted(sweep, counter: str, path: str, why: str):
    """_measure, then say so on a receiving PE when the engine's `counter` did not move: the row's
    figures are then another path's (`why` names the likely causes)."""
    before = recv_counts()[counter]
    result = _measure(sweep)
    moved = recv_counts()[counter] - before  # after measure's synchronize
    if sweep.receives and moved == 0:
        print(f"  rank {sweep.me}: the {path} row of {sweep.nbytes} bytes moved nothing {path} ({why}): "
              "its figures are the staged path's", file=sys.stderr, flush=True)
    return result


def sendrecv_default(sweep):
    """No setting touched: the path each size takes as a user's call does."""
    return _measure(sweep)


def sendrecv(sweep):
    """Zero-copy by the SM kernel at every size (the threshold at 1 byte, low-latency and the copy
    engine off; the warm-up makes the handshake, as a user's repeated calls into one buffer do)."""
    with engine_cuts(zero_copy_min_bytes=1, low_latency_max_bytes=0):
        return _measure_counted(sweep, "zero_copy", "zero-copy", "peer not load/store reachable, "
                                "PYDATACOPY_FORCE_RMA, or memory CUDA IPC cannot export")


def copy_engine_fits(nbytes: int) -> bool:
    """Whether a message of `nbytes` can take the copy engine at all: larger than the staging
    (a message that fits it keeps the bounded fallback, which the copy engine's launch does not)."""
    engine = _send_recv._require_engine("bench")
    return nbytes > engine.chunk_bytes * engine.num_chunks


def sendrecv_ce(sweep):
    """Zero-copy with the copy engine from 1 byte (only sizes copy_engine_fits): each message the
    copy engine moves when the device finds the guess right, the SM kernel otherwise."""
    counters = _send_recv._require_engine("bench").zero_copy_counters
    before = counters()["send_copy_engine"]
    with engine_cuts(zero_copy_min_bytes=1, low_latency_max_bytes=0, copy_engine_min_bytes=1):
        result = _measure_counted(sweep, "zero_copy", "copy-engine", "peer not load/store reachable, "
                                  "PYDATACOPY_FORCE_RMA, or memory CUDA IPC cannot export")
    if sweep.sends and counters()["send_copy_engine"] == before:
        print(f"  rank {sweep.me}: the copy-engine row of {sweep.nbytes} bytes never took the copy engine "
              f"({_send_recv.copy_engine_status()}): its figures are the SM kernel's", file=sys.stderr, flush=True)
    return result


def sendrecv_staged(sweep):
    """Every message staged (zero-copy and low-latency off): two copies."""
    with engine_cuts(zero_copy_min_bytes=0, low_latency_max_bytes=0):
        return _measure(sweep)


def low_latency_fits(nbytes: int) -> bool:
    """Whether a message of `nbytes` can take the low-latency path at all."""
    return nbytes <= pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES


def sendrecv_ll(sweep):
    """Every message by the low-latency protocol (its cut at the engine's capacity, zero-copy off);
    only for sizes low_latency_fits."""
    with engine_cuts(zero_copy_min_bytes=0, low_latency_max_bytes=pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES):
        return _measure_counted(sweep, "low_latency", "low-latency",
                                "peer not load/store reachable, or PYDATACOPY_FORCE_RMA")


def bench_host_queued(args, calls: int = 64, rounds: int = 15) -> list[dict]:
    """Host time per call of send, recv and sendrecv (4 KiB: the low-latency protocol; 1 MiB:
    staged, as the defaults leave them), beside a bare cudaMemcpyAsync and a bare kernel launch
    of the same bytes, each issued while the stream is held by a sleeping kernel: `calls` calls
    queue behind it, none runs, so the figure is the host's cost alone (a loop that runs as it
    goes may be slowed by the GPU instead: a full launch queue blocks the host). One way, rank
    0 sends while rank 1 receives: the send row is rank 0's time, the recv row rank 1's. The
    median round; `gpu_us`: the GPU's time per call for the queue once the sleep ended (the
    calls back to back, the host out of the way). Checked afterwards with fresh data into a
    cleared destination."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    backend, python_backend = _distributed_group(), _distributed_group(native=False)
    null, cpp_null = _null_group(), _cpp_null_group()
    stream = torch.cuda.current_stream().cuda_stream
    sleep_cycles = 4_000_000  # about 2 ms: longer than any queue of `calls` takes to issue
    rows = []
    for nbytes in (4096, 1 << 20):
        src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 70 + me)
        dst = torch.zeros_like(src)
        calls_by_name = {
            "cudaMemcpyAsync": lambda: pydatacopy._C.bench_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream),
            "bare kernel copy": lambda: pydatacopy._C.bench_kernel_copy(dst.data_ptr(), src.data_ptr(), nbytes,
                                                                        stream),
            "send | recv": (lambda: pydatacopy.send(src, peer)) if me == 0 else (lambda: pydatacopy.recv(dst, peer)),
            "sendrecv": lambda: pydatacopy.sendrecv(src, peer, dst, peer),
            # The same through torch.distributed on the pydatacopy backend (issue 38): as users get
            # it (the native backend), and its Python group (PYDATACOPY_DISTRIBUTED_NATIVE=0); then
            # the floor of any Python backend: torch's dist.send/dist.recv and a Work, into a group
            # that moves nothing (its check: the destination stays as cleared).
            f"default ({implementation(backend)}): dist.send | dist.recv": (
                (lambda: dist.send(src, peer, group=backend)) if me == 0
                else (lambda: dist.recv(dst, peer, group=backend))),
            "Python group: dist.send | dist.recv": (
                (lambda: dist.send(src, peer, group=python_backend)) if me == 0
                else (lambda: dist.recv(dst, peer, group=python_backend))),
            "torch.distributed alone: dist.send | dist.recv": (
                (lambda: dist.send(src, peer, group=null)) if me == 0 else (lambda: dist.recv(dst, peer, group=null))),
        }
        if cpp_null is not None:
            # The floor of a C++ backend (issue 38's other route): torch's FakeProcessGroup, whose
            # send and recv move nothing and return a finished Work, with no Python in between.
            calls_by_name["torch.distributed, C++ backend that moves nothing: dist.send | dist.recv"] = (
                (lambda: dist.send(src, peer, group=cpp_null)) if me == 0
                else (lambda: dist.recv(dst, peer, group=cpp_null)))
        figures, gpu_figures = [], []
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for call in calls_by_name.values():
            samples, gpu_samples = [], []
            for _ in range(rounds):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(sleep_cycles)
                first.record()  # runs when the sleep ends: the queued calls' GPU time follows
                began = time.perf_counter()
                for _ in range(calls):
                    call()
                samples.append((time.perf_counter() - began) / calls * 1e6)
                last.record()
                last.synchronize()
                gpu_samples.append(first.elapsed_time(last) * 1e3 / calls)
            pydatacopy.check_errors()
            figures.append(statistics.median(samples))
            gpu_figures.append(statistics.median(gpu_samples))
        # [rank 0's host figures..., rank 1's...], then the same of the GPU's: each rank fills its own.
        count = len(figures)
        both = torch.zeros(4 * count, dtype=torch.float64, device=reduce_device())
        both[me * count:(me + 1) * count] = torch.tensor(figures, dtype=torch.float64)
        both[(2 + me) * count:(3 + me) * count] = torch.tensor(gpu_figures, dtype=torch.float64)
        dist.all_reduce(both)
        checks = []
        for number, (name, call) in enumerate(calls_by_name.items()):
            seed = 200 + 10 * number
            fill(src, seed + me)
            dst.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            call()
            torch.cuda.synchronize()
            dist.barrier()
            local = name in ("cudaMemcpyAsync", "bare kernel copy")
            if local:
                checks.append(torch.equal(dst, fill(torch.empty_like(src), seed + me)))
            elif name.startswith("torch.distributed"):  # the null groups, Python and C++
                checks.append(int(torch.count_nonzero(dst)) == 0)  # nothing moves through them
            elif name == "sendrecv" or me == 1:
                checks.append(torch.equal(dst, fill(torch.empty_like(src), seed + peer)))
            else:
                checks.append(True)  # rank 0 only sent: rank 1 checks what arrived
        oks = [agree(ok) for ok in checks]
        names = list(calls_by_name)
        start = len(rows)  # this size's rows begin with cudaMemcpyAsync's
        for index, name in enumerate(names):
            for rank in (0, 1):
                if " | " in name:  # rank 0's call | rank 1's: a row each
                    head, _, tail = name.rpartition(": ")
                    label = (head + ": " if head else "") + tail.split(" | ")[rank]
                else:
                    label = name
                    if rank == 1:
                        continue  # one row: the slower rank's figure
                us = both[rank * count + index].item()
                gpu_us = both[(2 + rank) * count + index].item()
                if " | " not in name:
                    us = max(us, both[count + index].item())
                    gpu_us = max(gpu_us, both[3 * count + index].item())
                rows.append({"op": "host_queued", "path": f"{label} {human(nbytes)}", "direction": "one",
                             "bytes": nbytes, "size": human(nbytes), "us": us, "issue_us": us,
                             "gpu_us": gpu_us, "gbps": 0.0, "ok": oks[index]})
        base = rows[start]  # this size's cudaMemcpyAsync row
        for r in rows[start:]:
            r["over_base_us"] = r["us"] - base["us"]
            if me == 0:
                print(f"  host per call, queued: {r['path']} {r['us']:.2f} us ({r['over_base_us']:+.2f} over "
                      f"{base['path']}); the queue ran at {r['gpu_us']:.2f} us a call on the GPU",
                      file=sys.stderr, flush=True)
    return rows


#: Issue 36's stability target: runs of sendrecvs at this size, each into buffers allocated afresh.
ENGAGEMENT_BYTES, ENGAGEMENT_RUNS, ENGAGEMENT_CALLS = 256 << 20, 10, 200


def bench_engagement(args, nbytes: int = ENGAGEMENT_BYTES, runs: int = ENGAGEMENT_RUNS,
                     calls: int = ENGAGEMENT_CALLS) -> list[dict]:
    """Whether one copy engages by itself, run after run (issue 36): `runs` runs of `calls`
    sendrecvs of `nbytes` both ways on the default path (no setting touched), each run into send
    and receive buffers allocated afresh (the last run's freed and torch's cache emptied, so that
    the memory goes back to the driver and the first call must map it again, as a new buffer's
    does). A row per run: the median and 99th percentile of one call's time (a CUDA event before
    every call), over a bare copy of the same bytes timed the same way in the same run, the first
    call's time, and `one_copy_fraction` (receives that moved once over all the run's receives,
    the first call included). Then each run's data is checked: fresh data, the destination
    cleared, one more call. The spread of the runs' medians (the slowest over the fastest) is
    printed and carried by every row as `spread`."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    stream = torch.cuda.current_stream().cuda_stream
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]

    def timed_calls(call) -> list[float]:
        torch.cuda.synchronize()
        dist.barrier()
        for index in range(calls):
            marks[index].record()
            call()
        marks[calls].record()
        marks[calls].synchronize()
        pydatacopy.check_errors()
        return [marks[i].elapsed_time(marks[i + 1]) * 1e3 for i in range(calls)]

    def slowest(values: list[float]) -> list[float]:
        both = torch.tensor(values, dtype=torch.float64, device=reduce_device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return both.tolist()

    src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 21 + me)
    copy_dst = torch.empty_like(src)
    copy_samples = timed_calls(lambda: pydatacopy._C.bench_memcpy(copy_dst.data_ptr(), src.data_ptr(), nbytes, stream))
    copy_median, copy_p99 = slowest([statistics.median(copy_samples), percentile(copy_samples, 99)])
    del src, copy_dst
    rows = []
    for run in range(runs):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the last run's buffers go back to the driver
        src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 31 + run * 2 + me)
        out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        before = recv_counts()
        samples = timed_calls(lambda: pydatacopy.sendrecv(src, peer, out, peer))
        fraction = agreed_fraction(one_copy_fraction(before, recv_counts()))
        median, p99, first = slowest([statistics.median(samples), percentile(samples, 99), samples[0]])
        seed = 5000 + 10 * run
        fill(src, seed + me)
        out.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        pydatacopy.sendrecv(src, peer, out, peer)
        torch.cuda.synchronize()
        ok = agree(device_clean() and torch.equal(out, fill(torch.empty_like(out), seed + peer)))
        rows.append({"op": "send/recv", "path": f"default, fresh buffers, run {run + 1} of {runs}",
                     "direction": "both", "bytes": nbytes, "size": human(nbytes), "us": median, "p99_us": p99,
                     "first_call_us": first, "calls": calls, "gbps": nbytes / median / 1e3, "ok": ok,
                     "alloc": allocator_setting(), "one_copy_fraction": fraction,
                     "base": "baseline (cudaMemcpyAsync, per call)", "base_us": copy_median,
                     "base_p99_us": copy_p99, "xbase": median / copy_median})
        del src, out
    medians = [row["us"] for row in rows]
    spread = max(medians) / min(medians)
    for row in rows:
        row["spread"] = spread
    if me == 0:
        for row in rows:
            print(f"  engagement {row['path']}: {row['us']:.1f} us median ({row['xbase']:.2f}x the copy's "
                  f"{copy_median:.1f}), p99 {row['p99_us']:.1f}, first call {row['first_call_us']:.1f} us, "
                  f"one copy {row['one_copy_fraction']}", file=sys.stderr, flush=True)
        print(f"  engagement: the slowest run's median over the fastest's: {spread:.2f}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    pydatacopy.barrier()
    return rows


_backend_groups: dict[bool | None, object] = {}
_null_backend_group = None


def _null_group():
    """A torch.distributed group whose send and recv move nothing and return a finished Work
    (backend "pydatacopy_bench_null", registered here, for the bench only): what torch's own
    dist.send/dist.recv and one Python Work cost, the floor of any Python backend's host time."""
    global _null_backend_group
    if _null_backend_group is None:
        from pydatacopy.distributed import work as _work

        class _NullGroup(dist.ProcessGroup):
            def getBackendName(self) -> str:
                return "pydatacopy_bench_null"

            def _get_backend(self, device):
                return self

            supports_coalescing = False
            supports_splitting = False  # new_group on a default group bound to a device asks

            def send(self, tensors, dst, tag=0):
                return _work.done_work(tensors)

            def recv(self, tensors, src, tag=0):
                return _work.done_work(tensors)

        if "PYDATACOPY_BENCH_NULL" not in dist.Backend._plugins:
            dist.Backend.register_backend("pydatacopy_bench_null",
                                          lambda store, rank, size, timeout: _NullGroup(rank, size),
                                          devices=["cuda"])
        _null_backend_group = dist.new_group(backend="pydatacopy_bench_null")
    return _null_backend_group


_cpp_null_backend_group = None


def _cpp_null_group():
    """A group on torch's own FakeProcessGroup (backend "fake", C++, moves nothing), made once,
    collectively; None where this torch has none (the row is then left out on every PE alike)."""
    global _cpp_null_backend_group
    if _cpp_null_backend_group is None:
        try:
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
        except Exception:  # noqa: BLE001 - a private module: absent or changed in some torch
            return None
        _cpp_null_backend_group = dist.new_group(backend="fake")
    return _cpp_null_backend_group


def _distributed_group(native: bool | None = None):
    """A group of every rank on the pydatacopy torch.distributed backend (issue 38), made once,
    collectively, the first time the row runs; it shares this process's runtime. None: the
    implementation users get (the native backend, unless PYDATACOPY_DISTRIBUTED_NATIVE=0 or it
    cannot be built); False: the Python group; True: the native backend."""
    if native not in _backend_groups:
        import pydatacopy.distributed  # noqa: F401 - registers the backend
        from pydatacopy.distributed import native as _native

        with contextlib.nullcontext() if native is None else _native.requested_as(native):
            _backend_groups[native] = dist.new_group(backend="pydatacopy")
    return _backend_groups[native]


def sendrecv_distributed(sweep, native: bool | None = None):
    """The default path through torch.distributed's API on the pydatacopy backend: dist.send /
    dist.recv one way, batch_isend_irecv with both waits both ways; what a user's unchanged
    torch.distributed code costs beside the direct calls (the `default` row) of the same run.
    native=False: the same on the Python group (PYDATACOPY_DISTRIBUTED_NATIVE=0)."""
    group = _distributed_group(native)

    def run():
        if sweep.both:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sweep.src, sweep.peer, group),
                                            dist.P2POp(dist.irecv, sweep.out, sweep.peer, group)])
            for work in works:
                work.wait()
        elif sweep.sends:
            dist.send(sweep.src, sweep.peer, group=group)
        else:
            dist.recv(sweep.out, sweep.peer, group=group)

    counts: list[dict[str, int]] = []
    result = sweep.measure(run, sweep.out, around_timed=lambda: counts.append(recv_counts()))
    sweep.extra["one_copy_fraction"] = agreed_fraction(one_copy_fraction(counts[0], counts[1]))
    sweep.extra["implementation"] = implementation(group)
    return result


def implementation(group) -> str:
    """Which of the backend's implementations `group` is: "native" or "python" (the default row
    is whichever users got: the Python group where the native backend could not be built)."""
    from pydatacopy.distributed import ProcessGroupPydatacopy

    return "python" if isinstance(group, ProcessGroupPydatacopy) else "native"
