"""A step that computes, exchanges (sendrecv) and computes again, eager beside the same step under
torch.compile (inductor, fullgraph) and under mode="reduce-overhead" (CUDA graphs), same run."""

from __future__ import annotations

import sys

import torch

import pydatacopy

from ._harness import against, agree, fill, make_row, time_op


def bench_compiled(args, nbytes: int = 64 << 10) -> list[dict]:
    """Per step: the eager step is the baseline of the compiled ones (`xbase`, and `xbaseH` for
    the host's time to issue a step). Each row is checked by one more step on fresh data."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    n = nbytes // 4

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 3 + 1
        got = torch.empty_like(y)
        pydatacopy.sendrecv(y, peer, got, peer)
        return got * 2 + x  # integers: exact in eager and in Triton alike

    x = torch.empty(n, dtype=torch.int32, device="cuda")
    rows: list[dict] = []
    variants = (("eager", step), ("inductor", torch.compile(step, fullgraph=True)),
                ("reduce-overhead", torch.compile(step, mode="reduce-overhead", fullgraph=True)))
    for number, (name, function) in enumerate(variants):
        graphs = name == "reduce-overhead"

        def run():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            function(x)

        fill(x, 40 + me).bitwise_and_(0xFFFFF)  # small values: no overflow in x * 3 + 1
        print(f"  step {name}: compiling and warming up" if name != "eager" else "  step eager",
              file=sys.stderr, flush=True)
        timed = time_op(run, args.iters, args.warmup + 3, args.repeats)  # +3: compile, record
        seed = 4000 + 100 * number
        fill(x, seed + me).bitwise_and_(0xFFFFF)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = function(x)
        theirs = fill(torch.empty_like(x), seed + peer).bitwise_and_(0xFFFFF)
        ok = agree(torch.equal(out, (theirs * 3 + 1) * 2 + x))
        row = make_row("step", f"{name} (sendrecv)", "both", nbytes, timed, ok)
        rows.append(row if not rows else against(row, rows[0]))
    return rows
