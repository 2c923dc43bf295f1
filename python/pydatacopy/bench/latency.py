"""8-byte signal ping-pong: one-way latency, device side."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import agree


def bench_latency(args, iterations: int = 20000) -> dict:
    """8-byte ping-pong between the two GPUs, device side: one-way latency."""
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    try:
        signal.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier()
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pydatacopy._C.bench_pingpong(signal.data_ptr(), 1 - pydatacopy.my_pe(), iterations,
                                     pydatacopy.my_pe() == 0,
                                     torch.cuda.current_stream().cuda_stream, 60.0)
        stop.record()
        stop.synchronize()
        pydatacopy.check_errors()
        ok = agree(int(signal.item()) == iterations)
        us = start.elapsed_time(stop) * 1e3 / iterations / 2
        return {"op": "latency", "path": "8B signal ping-pong", "direction": "one-way",
                "bytes": 8, "size": "8", "us": us, "gbps": 8 / us / 1e3, "ok": ok}
    finally:
        pydatacopy.barrier()
        pydatacopy.free(signal)
