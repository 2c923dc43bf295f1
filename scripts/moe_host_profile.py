"""Where an eager MoE dispatch and combine spend their host time (issue 37: at most 30 us for a
dispatch at 128 tokens). Run under torchrun on the GPU machine, as bench.moe is:
    torchrun --nproc_per_node=4 scripts/moe_host_profile.py [--tokens 128]
Prints, on PE 0, the host time of each step of the eager path (perf_counter around the same
calls MoeDispatcher makes, GPU synchronised between repetitions so that the host never waits on
a full queue), then torch.profiler's CPU-side table (CUDA runtime calls included) for 20 calls."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy import _C
from pydatacopy.bench._cli import _placement
from pydatacopy.bench._harness import start
from pydatacopy.moe.dispatcher import MoeDispatcher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    device, per_gpu = _placement()
    start(device, per_gpu)
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    moe = MoeDispatcher(args.experts, args.hidden, args.topk, args.tokens, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(7 + me)
    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(args.experts, device="cuda", generator=g)[:args.topk]
                       for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, args.topk, device="cuda", generator=g)

    def timed(label, fn, results):
        t0 = time.perf_counter()
        out = fn()
        results.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)
        return out

    for _ in range(10):
        recv_x, handle = moe.dispatch(x, ids)
        moe.combine(recv_x, handle, weights)
    torch.cuda.synchronize()
    dist.barrier()
    whole: dict[str, list[float]] = {}
    for _ in range(args.calls):
        recv_x, handle = timed("dispatch (whole call)", lambda: moe.dispatch(x, ids), whole)
        timed("combine (whole call)", lambda: moe.combine(recv_x, handle, weights), whole)
        torch.cuda.synchronize()
    # The steps of the native dispatch, as _dispatch_native makes them.
    steps: dict[str, list[float]] = {}
    buffer = moe._dispatch
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(args.calls):
        timed("check (Python argument checks)", lambda: moe._refused(buffer, lambda: moe._check_tokens(x, ids, "dispatch"), None), steps)
        layout = timed("_C.moe_dispatch_workspace", lambda: _C.moe_dispatch_workspace(
            args.tokens, args.topk, n, moe.experts_per_pe, n * moe.max_tokens, args.hidden * 2), steps)
        totals, parts = layout
        pairs = n * moe.max_tokens * args.topk
        recv = timed("torch.empty x3", lambda: (torch.empty((pairs, args.hidden), dtype=x.dtype, device="cuda"),
                                                torch.empty(totals["handle"], dtype=torch.uint8, device="cuda"),
                                                torch.empty(totals["scratch"], dtype=torch.uint8, device="cuda")), steps)
        recv_x, kept, scratch = recv
        timed("_C.moe_dispatch_region (native: launches)", lambda: _C.moe_dispatch_region(
            buffer._core, x.data_ptr(), args.hidden * 2, ids.data_ptr(), ids.element_size(), args.tokens, args.topk,
            args.experts, recv_x.data_ptr(), recv_x.numel() * 2, kept.data_ptr(), totals["handle"],
            scratch.data_ptr(), totals["scratch"], stream, 60.0), steps)
        timed("11 handle views", lambda: [kept[o:o + s].view(torch.int64) for (_, o, s) in list(parts.values())[:11]], steps)
        torch.cuda.synchronize()
    if me == 0:
        print(f"{n} PEs, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}: "
              f"host us per call, median / p90 over {args.calls}")
        for table in (whole, steps):
            for label, values in table.items():
                values = sorted(values)
                print(f"  {label:<44} {statistics.median(values):8.1f} {values[int(0.9 * len(values))]:8.1f}")
    dist.barrier()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            recv_x, handle = moe.dispatch(x, ids)
            moe.combine(recv_x, handle, weights)
            torch.cuda.synchronize()
    if me == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    dist.barrier()
    moe.close()
    pydatacopy.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
