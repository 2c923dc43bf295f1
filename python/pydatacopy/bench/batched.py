"""Many small tensors in one call: put_many against put_blocks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import against, agree, fill, make_row, time_op


def bench_batched(args, count: int = 1024, tensor_bytes: int = 4096) -> list[dict]:
    """`count` tensors of `tensor_bytes` in one call, rank 0 -> rank 1: put_many (a list of
    tensors, checked one by one on the host) against put_blocks (pools + device index tensors)."""
    me = pydatacopy.my_pe()
    pool = pydatacopy.empty((count, tensor_bytes), dtype=torch.uint8)
    source = fill(torch.empty((count, tensor_bytes), dtype=torch.uint8, device="cuda"), 77)
    order = torch.randperm(count, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    identity = torch.arange(count, device="cuda")
    dsts, srcs = list(pool), list(source)
    rows: dict[str, dict] = {}
    try:
        for number, name in enumerate(("put_blocks", "put_many")):
            pool.zero_()
            pydatacopy.barrier()

            def run():
                if me != 0:
                    return
                if name == "put_many":
                    pydatacopy.put_many(dsts, srcs, 1)
                else:
                    pydatacopy.put_blocks(pool, source, order, identity, 1)
                pydatacopy.quiet()

            timed = time_op(run, args.iters, args.warmup, args.repeats)
            # Checked: fresh rows from a new seed (in place: dsts/srcs view them), the pool
            # cleared, one call.
            torch.cuda.synchronize()
            dist.barrier()
            fill(source, 800 + number)
            pool.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            run()
            torch.cuda.synchronize()
            dist.barrier()
            expected = source if name == "put_many" else torch.empty_like(source).index_copy_(0, order, source)
            ok = agree(me == 0 or torch.equal(pool, expected))
            rows[name] = make_row(name, f"{count} x {tensor_bytes}B", "one", count * tensor_bytes, timed, ok)
        against(rows["put_many"], rows["put_blocks"])
    finally:
        pydatacopy.barrier()
        pydatacopy.free(pool)
    return [rows[name] for name in ("put_blocks", "put_many") if name in rows]
