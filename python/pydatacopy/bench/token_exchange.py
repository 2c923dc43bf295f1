"""The token exchange (DoubleBufferManager), both ways, beside a bare copy of its bytes."""

from __future__ import annotations


import torch
import torch.distributed as dist

import pydatacopy

from ._harness import against, agree, device_clean, fill, make_row, time_op
from .baselines import bare_copy


def bench_token_exchange(n_tokens: int, token_size: int, args) -> list[dict]:
    """DoubleBufferManager exchange, both directions at once, rounds back to back; beside a bare
    copy of the same bytes on this GPU."""
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    peer = pydatacopy._C.DoubleBufferManager.default_src_pe(me, n)
    nbytes = n_tokens * token_size
    size = f"{n_tokens}x{token_size}"
    base = bare_copy(nbytes, args)
    base["size"] = size
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        for s in (0, 1):
            fill(dbm.send_buffer_of(s), 1000 * me + s)

        def run():
            dbm.wait(dbm.exchange())

        timed = time_op(run, args.iters, args.warmup, args.repeats)
        # The checked round: fresh data from a new seed, this round's receive buffer cleared
        # (free: its round two back was waited for).
        torch.cuda.synchronize()
        dist.barrier()
        round_ = dbm.round
        fill(dbm.send_buffer_of(round_), 7000 + 10 * me + round_ % 2)
        dbm.recv_buffer(round_).zero_()
        torch.cuda.synchronize()
        dist.barrier()
        got = dbm.wait(dbm.exchange())
        torch.cuda.synchronize()
        ok = device_clean()
        expected = torch.empty((n_tokens, token_size), dtype=torch.uint8, device="cuda")
        ok = ok and torch.equal(got, fill(expected, 7000 + 10 * peer + round_ % 2))
        row = make_row("token_exchange", "DoubleBufferManager", "both", nbytes, timed, agree(ok), size)
        return [base, against(row, base)]
    finally:
        dbm.cleanup()
