"""The bench's harness, as nccl-tests' common.cu: timing (CUDA events, host clock, issue time),
seeded data, the checked run, the row and its ratio to a baseline of the same run."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import astuple, dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy._torch_utils import allocator_setting


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=tensor.device).manual_seed(seed)
    flat = tensor.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(1, 256, flat.shape, dtype=torch.uint8, device=tensor.device,
                             generator=generator))
    return tensor


def reduce_device() -> str:
    """Where torch.distributed reduces: NCCL takes CUDA tensors, gloo (ranks sharing a GPU) CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0 to 100) of `samples`, linear between the two nearest ranks (numpy's
    default): the 99th of 100 samples lies between the two slowest, not on the slowest alone."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not between 0 and 100")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def gaps(stamps: Sequence[float], scale: float = 1.0) -> list[float]:
    """The time between consecutive timestamps (each call's, from its start to the next's), times
    `scale`."""
    return [(later - earlier) * scale for earlier, later in zip(stamps, stamps[1:])]


@dataclass(frozen=True)
class Timing:
    """Seconds per operation, each the slower PE's: `seconds` the median over repeats of a loop's
    time per call and `p99_seconds` the 99th percentile of one call's time, by CUDA events (see
    time_op); `host_seconds` by the host's clock until the
    last operation is complete (median over repeats: what NIXL, whose completion is polled on the
    host, can only be timed by), `host_p99_seconds` the 99th percentile of one call's time by the
    host's clock (from its start to the next call's); `issue_seconds` the host's time to issue one
    call (the loop alone, before waiting for the GPU; median over repeats)."""

    seconds: float
    p99_seconds: float
    host_seconds: float
    host_p99_seconds: float
    issue_seconds: float

    def per(self, count: int) -> "Timing":
        """Per one of `count` operations that each timed call made (a graph of `count` puts)."""
        return Timing(*(value / count for value in astuple(self)))

    def by_host_clock(self) -> "Timing":
        """The host's clock as the row's time: for an operation the GPU's events do not see."""
        return replace(self, seconds=self.host_seconds, p99_seconds=self.host_p99_seconds)


def time_op(run: Callable[[], None], iterations: int, warmup: int, repeats: int,
            after_warmup: Callable[[], None] | None = None) -> Timing:
    """Times `iterations` calls of `run`, `repeats` times, after `warmup` untimed calls. Each
    repeat is two passes. The first has an event before the first call and after the last only,
    so that nothing stands between two calls on the stream (an event recorded between two kernels
    keeps the second from starting while the first ends: programmatic launch, launch.cuh); its
    time per call, median over repeats, is the row's `us`. The second marks the start of every
    call with a CUDA event (and a host timestamp), so that each call has its own time: the 99th
    percentile over every call of every repeat is the row's `p99_us`, a slow call that a loop's
    average hides. `after_warmup` is called once the warm-up calls are done (the GPU idle), before
    the first timed call."""
    for _ in range(warmup):
        run()
    if after_warmup is not None:
        torch.cuda.synchronize()
        after_warmup()
    # Made once per row and recorded again every repeat: no event is created inside the loop.
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(iterations + 1)]
    stamps = [0.0] * (iterations + 1)
    per_call, host_per_call, loop_samples, host_samples, issue_samples = [], [], [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        marks[0].record()
        for _ in range(iterations):
            run()
        issued = time.perf_counter()
        marks[iterations].record()
        marks[iterations].synchronize()
        ended = time.perf_counter()
        pydatacopy.check_errors()
        loop_samples.append(marks[0].elapsed_time(marks[iterations]) / 1e3 / iterations)
        host_samples.append((ended - began) / iterations)
        issue_samples.append((issued - began) / iterations)
        torch.cuda.synchronize()
        dist.barrier()
        for index in range(iterations):
            stamps[index] = time.perf_counter()
            marks[index].record()
            run()
        stamps[iterations] = time.perf_counter()
        marks[iterations].record()
        marks[iterations].synchronize()
        pydatacopy.check_errors()
        per_call.extend(marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(iterations))
        host_per_call.extend(gaps(stamps))
    seconds = torch.tensor([statistics.median(loop_samples), percentile(per_call, 99),
                            statistics.median(host_samples), percentile(host_per_call, 99),
                            statistics.median(issue_samples)], dtype=torch.float64,
                           device=reduce_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return Timing(*seconds.tolist())


def device_clean() -> bool:
    """check_errors() as a data check: False (said on stderr) when a device-side wait timed out
    or a transfer was refused in the checked run. Agree on it afterwards: the peer must not be
    left waiting alone in a collective."""
    try:
        pydatacopy.check_errors()
    except pydatacopy.Error as error:
        print(f"  rank {pydatacopy.my_pe()}: {error}", file=sys.stderr, flush=True)
        return False
    return True


def agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], device=reduce_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def capture_after_warmup(run: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run`` warmed up eagerly on a side stream, then captured there (as torch's docs warm up
    before a capture): (graph, what the captured run returned). The bench's MoE graph rows and
    the GPU MoE tests capture this way."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        result = run()
    return graph, result


def capture_graphs(captures: dict, what: str) -> dict | None:
    """One CUDA graph per entry of `captures` (name: a callable that issues the graph's calls, or
    None where this PE captures nothing for it), or None on every PE, with a line saying why, when
    a capture failed on any PE (agreed, so that every PE goes on alike)."""
    graphs, failure = {}, ""
    try:
        for name, issue in captures.items():
            graphs[name] = None
            if issue is not None:
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    issue()
    except RuntimeError as error:  # pydatacopy.Error too
        failure = f"{type(error).__name__}: {error}"
    if not agree(not failure):
        print(f"  {what} rows skipped: {failure or 'the capture failed on the peer'}", file=sys.stderr, flush=True)
        return None
    return graphs


def copies_to_capture(dst: torch.Tensor, src: torch.Tensor, calls: int) -> Callable[[], None]:
    """What a graph baseline captures: `calls` bare cudaMemcpyAsync calls of src into dst (this
    GPU, no pydatacopy code) on the current stream."""
    def issue():
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(calls):
            pydatacopy._C.bench_memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes, stream)
    return issue


def refill(src: torch.Tensor, seed: int, destination: torch.Tensor) -> Callable[[], None]:
    """time_graph's `prepare`: fresh data into src from `seed`, the destination cleared."""
    def prepare():
        fill(src, seed)
        destination.zero_()
    return prepare


def time_graph(run: Callable[[], None], calls: int, args, prepare: Callable[[], None],
               check: Callable[[], bool]) -> tuple[Timing, bool]:
    """A graph's replay `run` of `calls` calls timed (per call), then checked: `prepare` (fresh data,
    the destination cleared) on every PE, one replay, and `check` on every PE (agreed)."""
    timed = time_op(run, args.iters, args.warmup, args.repeats).per(calls)
    torch.cuda.synchronize()
    dist.barrier()
    prepare()
    torch.cuda.synchronize()
    dist.barrier()
    run()
    torch.cuda.synchronize()
    dist.barrier()  # every PE's replay is over (a one-way put graph: the peer's puts landed)
    ok = device_clean()  # a device-side wait that timed out in the checked replay
    return timed, agree(ok and check())


def make_row(op: str, path: str, direction: str, nbytes: int, timed: Timing, ok: bool,
             size: str | None = None) -> dict:
    return {"op": op, "path": path, "direction": direction, "bytes": nbytes,
            "size": size or human(nbytes), "us": timed.seconds * 1e6, "p99_us": timed.p99_seconds * 1e6,
            "host_us": timed.host_seconds * 1e6, "issue_us": timed.issue_seconds * 1e6,
            "gbps": nbytes / timed.seconds / 1e9, "ok": ok, "alloc": allocator_setting()}


def against(row: dict, base: dict) -> dict:
    """Set row's ratios to `base`, a baseline measured in the same run: time over time."""
    row["base"] = f"{base['op']} ({base['path']})"
    row["xbase"] = row["us"] / base["us"]
    if row.get("issue_us") and base.get("issue_us"):
        row["xbase_host"] = row["issue_us"] / base["issue_us"]
    return row


#: Above this size a row times fewer calls (counts_for_size): a 1 GiB staged sendrecv both ways
#: takes about 6 ms a call on one H200, and the sweep must fit gpu-check's bench step.
LARGE_MESSAGE_BYTES = 64 << 20
#: The fewest timed calls (and warm-up calls) per repeat a large message keeps.
LARGE_MESSAGE_MIN_ITERATIONS, LARGE_MESSAGE_MIN_WARMUP = 5, 2


def counts_for_size(nbytes: int, iterations: int, warmup: int) -> tuple[int, int]:
    """(timed calls per repeat, warm-up calls) for one message of `nbytes`: -n and -w up to
    LARGE_MESSAGE_BYTES, above it divided by how many times larger the message is, down to at
    least 5 and 2 (or -n and -w where those are fewer), so that every row still has calls enough
    for its percentile and the warm-up still makes a zero-copy handshake."""
    if nbytes <= LARGE_MESSAGE_BYTES:
        return iterations, warmup
    times_larger = nbytes // LARGE_MESSAGE_BYTES
    return (max(min(iterations, LARGE_MESSAGE_MIN_ITERATIONS), iterations // times_larger),
            max(min(warmup, LARGE_MESSAGE_MIN_WARMUP), warmup // times_larger))


class Sweep:
    """The one-directional (rank 0 -> rank 1) and bidirectional cases of one message size."""

    def __init__(self, nbytes: int, both: bool, args):
        self.nbytes, self.both, self.args = nbytes, both, args
        self.iterations, self.warmup = counts_for_size(nbytes, args.iters, args.warmup)
        self.me = pydatacopy.my_pe()
        self.peer = 1 - self.me
        self.sends = both or self.me == 0
        self.receives = both or self.me == 1
        self.src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 11 + self.me)
        self.out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.checked_runs = 0
        self.extra: dict = {}  # fields a row function adds to its row (the sweep's loop takes them)

    def measure(self, run, dst: torch.Tensor, src: torch.Tensor | None = None,
                local: bool = False, around_timed: Callable[[], None] | None = None) -> tuple[Timing, bool]:
        """Times `run`, then checks one more run of it that must deliver fresh data: the sender
        refills `src` (default self.src) from a new seed, the receiver clears `dst`, and after
        that one run `dst` must hold exactly the sender's new data (a stale, lost or replayed
        delivery fails). `local`: a copy on the sender's own GPU, checked by the sender.
        `around_timed`: called after the warm-up and again after the last timed call (the GPU
        idle both times), so that a row can count over its timed calls alone. Returns (the
        timing, the check on all PEs)."""
        timed = time_op(run, self.iterations, self.warmup, self.args.repeats, after_warmup=around_timed)
        if around_timed is not None:
            torch.cuda.synchronize()
            around_timed()
        src = self.src if src is None else src
        self.checked_runs += 1
        seed = 1000 * self.checked_runs
        torch.cuda.synchronize()
        dist.barrier()  # the timed operations are over on both ranks
        checks = self.sends if local else self.receives
        if self.sends:
            fill(src, seed + self.me)
        if checks:
            dst.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        run()
        torch.cuda.synchronize()
        dist.barrier()
        ok = device_clean()  # a device-side wait that timed out in the checked run
        if checks:
            ok = ok and torch.equal(dst, fill(torch.empty_like(dst), seed + (self.me if local else self.peer)))
        return timed, agree(ok)

    def _into_symmetric(self, make_run) -> tuple[Timing, bool]:
        """Time and check make_run(symmetric)'s operation into a fresh symmetric tensor."""
        symmetric = pydatacopy.empty(self.nbytes, dtype=torch.uint8)
        symmetric.zero_()
        pydatacopy.barrier()
        try:
            return self.measure(make_run(symmetric), symmetric)
        finally:
            pydatacopy.barrier()
            pydatacopy.free(symmetric)


def start(device: int, per_gpu: int) -> None:
    """This rank on `device`: torch.distributed (on gloo when ranks share a GPU: NCCL refuses
    two ranks on one GPU), then pydatacopy."""
    torch.cuda.set_device(device)
    if per_gpu > 1:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    pydatacopy.init(device=device)


def finish(rows: list[dict], json_path: str | None) -> int:
    """PE 0 writes the rows as JSON; every PE leaves. The exit code: 0 when every row's data
    check passed."""
    if json_path and pydatacopy.my_pe() == 0:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["ok"] for r in rows)
    pydatacopy.finalize()
    dist.destroy_process_group()
    return 0 if ok else 1
