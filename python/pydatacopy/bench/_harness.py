"""The bench's harness, as nccl-tests' common.cu: timing (CUDA events, host clock, issue time),
seeded data, the checked run, the row and its ratio to a baseline of the same run."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import pydatacopy


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


def time_op(run: Callable[[], None], iterations: int, warmup: int,
          repeats: int) -> tuple[float, float, float]:
    """Seconds per operation, median over repeats, the slower PE: by CUDA events; by the host's
    clock until the last operation is complete (what NIXL, whose completion is polled on the
    host, can only be timed by; its ratios use these); and the host's time to issue one call
    (the loop alone, before waiting for the GPU)."""
    for _ in range(warmup):
        run()
    samples, host_samples, issue_samples = [], [], []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        start.record()
        for _ in range(iterations):
            run()
        issued = time.perf_counter()
        stop.record()
        stop.synchronize()
        ended = time.perf_counter()
        pydatacopy.check_errors()
        samples.append(start.elapsed_time(stop) / 1e3 / iterations)
        host_samples.append((ended - began) / iterations)
        issue_samples.append((issued - began) / iterations)
    seconds = torch.tensor([statistics.median(samples), statistics.median(host_samples),
                            statistics.median(issue_samples)], dtype=torch.float64,
                           device=reduce_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0].item()), float(seconds[1].item()), float(seconds[2].item())


def agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], device=reduce_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def make_row(op: str, path: str, direction: str, nbytes: int, timed: tuple[float, float, float],
         ok: bool, size: str | None = None) -> dict:
    seconds, host_seconds, issue_seconds = timed
    return {"op": op, "path": path, "direction": direction, "bytes": nbytes,
            "size": size or human(nbytes), "us": seconds * 1e6, "host_us": host_seconds * 1e6,
            "issue_us": issue_seconds * 1e6, "gbps": nbytes / seconds / 1e9, "ok": ok}


def against(row: dict, base: dict) -> dict:
    """Set row's ratios to `base`, a baseline measured in the same run: time over time."""
    row["base"] = f"{base['op']} ({base['path']})"
    row["xbase"] = row["us"] / base["us"]
    if row.get("issue_us") and base.get("issue_us"):
        row["xbase_host"] = row["issue_us"] / base["issue_us"]
    return row


class Sweep:
    """The one-directional (rank 0 -> rank 1) and bidirectional cases of one message size."""

    def __init__(self, nbytes: int, both: bool, args):
        self.nbytes, self.both, self.args = nbytes, both, args
        self.me = pydatacopy.my_pe()
        self.peer = 1 - self.me
        self.sends = both or self.me == 0
        self.receives = both or self.me == 1
        self.src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 11 + self.me)
        self.out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.checked_runs = 0

    def measure(self, run, dst: torch.Tensor, src: torch.Tensor | None = None,
                local: bool = False) -> tuple[tuple[float, float, float], bool]:
        """Times `run`, then checks one more run of it that must deliver fresh data: the sender
        refills `src` (default self.src) from a new seed, the receiver clears `dst`, and after
        that one run `dst` must hold exactly the sender's new data (a stale, lost or replayed
        delivery fails). `local`: a copy on the sender's own GPU, checked by the sender.
        Returns ((seconds by CUDA events, by the host's clock, to issue), check on all)."""
        timed = time_op(run, self.args.iters, self.args.warmup, self.args.repeats)
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
        ok = True
        try:
            pydatacopy.check_errors()  # a device-side wait that timed out in the checked run
        except pydatacopy.Error as error:
            print(f"  rank {self.me}: {error}", file=sys.stderr, flush=True)
            ok = False
        if checks:
            ok = ok and torch.equal(dst, fill(torch.empty_like(dst), seed + (self.me if local else self.peer)))
        return timed, agree(ok)

    def _into_symmetric(self, make_run) -> tuple[tuple[float, float, float], bool]:
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
