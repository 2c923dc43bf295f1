"""Many small tensors in one call: put_many's list form and its prepared form against put_blocks."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import against, agree, fill, make_row, time_op


def bench_batched(args, count: int = 1024, tensor_bytes: int = 4096) -> list[dict]:
    """`count` tensors of `tensor_bytes` in one call, rank 0 -> rank 1, the same rows for all
    three (row i of the source to row order[i] of the peer's pool): put_blocks (pools + device
    index tensors), put_many (a list of tensors, read on the host at every call) and put_many
    prepared once (the table on the GPU, one launch per run). Each row's `issue_us` is the host
    time per call; each is checked after its timing with fresh data into a cleared pool."""
    me = pydatacopy.my_pe()
    pool = pydatacopy.empty((count, tensor_bytes), dtype=torch.uint8)
    source = fill(torch.empty((count, tensor_bytes), dtype=torch.uint8, device="cuda"), 77)
    order = torch.randperm(count, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    identity = torch.arange(count, device="cuda")
    dsts, srcs = [pool[i] for i in order.tolist()], list(source)
    prepared = pydatacopy.prepare_put_many(dsts, srcs, 1 - me)
    names = ("put_blocks", "put_many", "put_many prepared")
    rows: dict[str, dict] = {}
    try:
        for number, name in enumerate(names):
            pool.zero_()
            pydatacopy.barrier()

            def run():
                if me != 0:
                    return
                if name == "put_many":
                    pydatacopy.put_many(dsts, srcs, 1)
                elif name == "put_many prepared":
                    prepared.run()
                else:
                    pydatacopy.put_blocks(pool, source, order, identity, 1)
                pydatacopy.quiet()

            timed = time_op(run, args.iters, args.warmup, args.repeats)
            # Checked: fresh rows from a new seed (in place: the lists and the table view them),
            # the pool cleared, one call.
            torch.cuda.synchronize()
            dist.barrier()
            fill(source, 800 + number)
            pool.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            run()
            torch.cuda.synchronize()
            dist.barrier()
            expected = torch.empty_like(source).index_copy_(0, order, source)
            ok = agree(me == 0 or torch.equal(pool, expected))
            rows[name] = make_row(name, f"{count} x {tensor_bytes}B", "one", count * tensor_bytes, timed, ok)
        against(rows["put_many"], rows["put_blocks"])
        against(rows["put_many prepared"], rows["put_blocks"])
    finally:
        prepared.release()
        pydatacopy.barrier()
        pydatacopy.free(pool)
    return [rows[name] for name in names if name in rows]
