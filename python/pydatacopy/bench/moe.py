"""MoE dispatch and combine, beside a bare copy of the bytes they move, any number of PEs:

    torchrun --nproc_per_node=4 -m pydatacopy.bench.moe [--shapes ds-128,ds-4096,small] [--json F] [--compact]

(on one GPU add PYDATACOPY_RANKS_PER_GPU=4 and run under CUDA MPS.) Shapes: ds-128 and ds-4096 are
DeepSeek-V3's (hidden 7168, top-8 of 256 experts, bf16) with 128 (decode) and 4096 (prefill)
tokens per PE; small is hidden 2048, top-2 of 8 x n_pes experts, 512 tokens, bf16. Routing:
uniform random top-k per token (seeded per PE), drawn on the GPU.

Rows per shape: dispatch, combine, and dispatch + combine, eagerly; dispatch + combine replayed
from a CUDA graph (the decode setting: no host work per layer); and, measured in the same run,
bare cudaMemcpyAsync copies on this GPU of the bytes each moves (the rows and meta this PE sends
in dispatch; the expert outputs it sends back in combine): `xbase` is the time over the copy's.
With one PE per GPU (torch.distributed on NCCL) also NCCL's all_to_all_single of dispatch's rows,
split sizes given on the host (which NCCL needs; not torch's all_to_all_vdev: not done).
Times: CUDA events, median of repeats, the slower PE. Check (`ok`, can fail): after the timings
one more dispatch + combine with fresh tokens, an identity expert (y = recv_x) and fresh weights,
whose output must equal, bit for bit, sum_k w[t, k] * x[t] computed here in float32 in k order
(a row delivered to the wrong place, lost or stale changes it), and the experts' row counts
summed over PEs must equal the routed (token, expert) pairs.

The same four rows for ``MoeDispatcher(expand=False)`` (DeepEP's normal-mode layout: each token
once per receiving PE, combine one row per (token, PE)), path ``expand=False ...``, each beside a
bare copy of the bytes that mode moves (dispatch: rows, ids, index and the float32 weights;
combine: one row per token and PE), same run; ``--no-expand-false`` leaves them out. Their check:
an identity expert (y = recv_x), out[t] = x[t] summed over the PEs t went to, in PE order. Then
the same rows with ``recv_in_region=True`` (path ``expand=False/region``: recv_x read where the
senders stored it, one crossing of the bytes), beside the same copies.

The same four rows for ``MoeDispatcher(pre_reduce=True)`` (path ``pre_reduce ...``: the weights go
with dispatch, combine sums each token's local experts on the expert side and sends one row per
(token, PE) back), beside the default layout's copies (issue 37's reference for the expanded
layout; its MB column is its own bytes), and its combine summing first and then sending the
rows (path ``pre_reduce 2-step``, what RMA peers take); ``--no-pre-reduce`` leaves them out. Their check: an
identity expert, out[t] = each PE's partial sum_k w[t, k] * x[t] over its experts in k order
(float32, rounded to bf16), the partials summed in PE order in float32, rounded once.

And ``deep_ep`` rows: pydatacopy.compat.deep_ep as DeepEP's users call it (bench/moe_deep_ep.py);
``--no-deep-ep`` leaves them out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import (against, agree, capture_after_warmup, device_clean, finish, make_row, reduce_device, start,
                       time_op)

SHAPES = {  # name: (tokens per PE, hidden, topk, experts (None: 8 x n_pes))
    "ds-128": (128, 7168, 8, 256),
    "ds-4096": (4096, 7168, 8, 256),
    "small": (512, 2048, 2, None),
}


def _routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, device="cuda", generator=generator)
    weights, ids = scores.topk(topk, dim=1)
    return ids, (weights / weights.sum(1, keepdim=True)).float()


def _tokens(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)


def _bare_copy(nbytes: int, args) -> tuple:
    src = torch.ones(max(nbytes, 1), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        pydatacopy._C.bench_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream)

    timed = time_op(run, args.iters, args.warmup, args.repeats)
    run()
    torch.cuda.synchronize()
    return timed, agree(torch.equal(dst[:nbytes], src[:nbytes]))


def _copy_baselines(add, path: str, dispatch_bytes: int, combine_bytes: int, args) -> tuple:
    """The three bare-copy rows a layout's rows are measured against (its dispatch, its combine,
    both), in this run: (base_d, base_c, base_dc)."""
    return tuple(add("baseline", path, nbytes, *_bare_copy(nbytes, args))
                 for nbytes in (dispatch_bytes, combine_bytes, dispatch_bytes + combine_bytes))


def _max_over_pes(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=reduce_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def bench_shape(name: str, args) -> list[dict]:
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    tokens, hidden, topk, experts = SHAPES[name]
    experts = experts or 8 * n
    if experts % n:
        if me == 0:
            print(f"  {name} skipped: {experts} experts do not split over {n} PEs", file=sys.stderr, flush=True)
        return []
    size = f"{name} {n}PE"
    moe = pydatacopy.MoeDispatcher(experts, hidden, topk, tokens, torch.bfloat16)
    try:
        x = _tokens(tokens, hidden, 11 + me)
        ids, weights = _routing(tokens, experts, topk, 100 + me)
        recv_x, handle = moe.dispatch(x, ids)
        y = recv_x.clone()
        # Bytes this PE sends (the slower PE's count, as time_op takes the slower PE's time).
        torch.cuda.synchronize()
        sent_tokens = int(pydatacopy.moe.dispatch_plan(ids, experts, n).send_counts.sum())
        sent_pairs = int((ids >= 0).sum())
        dispatch_bytes = _max_over_pes(sent_tokens * (hidden * 2 + (topk + 1) * 4))
        combine_bytes = _max_over_pes(sent_pairs * hidden * 2)
        rows = []

        add = _adder(rows, size, 16)

        base_d, base_c, base_dc = _copy_baselines(add, "local copy", dispatch_bytes, combine_bytes, args)
        if dist.get_backend() == "nccl":  # one PE per GPU: NCCL's all-to-all-v of the same rows
            add("baseline", "NCCL a2a_single", dispatch_bytes,
                *_nccl_all_to_all(x, ids, experts, n, hidden, topk, args), base_d)
        checked = _check(moe, tokens, hidden, experts, topk, 7000 + me)
        add("moe dispatch", "eager", dispatch_bytes,
            time_op(lambda: moe.dispatch(x, ids), args.iters, args.warmup, args.repeats), checked, base_d)
        add("moe combine", "eager", combine_bytes,
            time_op(lambda: moe.combine(y, handle, weights), args.iters, args.warmup, args.repeats),
            checked, base_c)

        def both():
            got, h = moe.dispatch(x, ids)
            moe.combine(got, h, weights)

        _layer_rows(add, "", both, dispatch_bytes + combine_bytes, checked,
                    lambda: _check(moe, tokens, hidden, experts, topk, 8000 + me), base_dc, args)
    finally:
        torch.cuda.synchronize()
        moe.close()
    if not args.no_pre_reduce:
        _pre_reduce_rows(add, name, args, x, ids, weights, (base_d, base_c, base_dc))
    return rows


def _pre_reduce_rows(add, name: str, args, x, ids, weights, bases) -> None:
    """pre_reduce=True's four rows (see the module docstring), against the default's copies."""
    me, n, tokens, hidden, topk, experts, _ = _shape_of(name)
    moe = pydatacopy.MoeDispatcher(experts, hidden, topk, tokens, torch.bfloat16, pre_reduce=True)
    try:
        recv_x, handle = moe.dispatch(x, ids, topk_weights=weights)
        y = recv_x.clone()
        torch.cuda.synchronize()
        sent_tokens = int(pydatacopy.moe.dispatch_plan(ids, experts, n).send_counts.sum())
        # Each token once per PE: dispatch its row, ids, index and float32 weights; combine one row back.
        dispatch_bytes = _max_over_pes(sent_tokens * (hidden * 2 + (topk + 1) * 4 + topk * 4))
        combine_bytes = _max_over_pes(sent_tokens * hidden * 2)
        base_d, base_c, base_dc = bases
        checked = _check(moe, tokens, hidden, experts, topk, 7700 + me)
        add("moe dispatch", "pre_reduce eager", dispatch_bytes,
            time_op(lambda: moe.dispatch(x, ids, topk_weights=weights), args.iters, args.warmup, args.repeats),
            checked, base_d)
        add("moe combine", "pre_reduce eager", combine_bytes,
            time_op(lambda: moe.combine(y, handle), args.iters, args.warmup, args.repeats), checked, base_c)
        # The same combine summing first, then sending the rows (what RMA peers take): the
        # summing send's gain, in this run.
        from ..moe import reduced as _reduced
        _reduced.SUM_IN_SEND = False
        try:
            two_steps_checked = _check(moe, tokens, hidden, experts, topk, 7800 + me)
            add("moe combine", "pre_reduce 2-step", combine_bytes,
                time_op(lambda: moe.combine(y, handle), args.iters, args.warmup, args.repeats), two_steps_checked,
                base_c)
        finally:
            _reduced.SUM_IN_SEND = True

        def both():
            got, h = moe.dispatch(x, ids, topk_weights=weights)
            moe.combine(got, h)

        _layer_rows(add, "pre_reduce", both, dispatch_bytes + combine_bytes, checked,
                    lambda: _check(moe, tokens, hidden, experts, topk, 8700 + me), base_dc, args)
    finally:
        torch.cuda.synchronize()
        moe.close()


def _adder(rows: list[dict], size: str, path_width: int):
    """add(op, path, bytes, timing, ok, baseline row=None): a row appended to `rows` (its xbase
    against the baseline's), printed by PE 0 as it is made; returns the row."""
    def add(op, path, nbytes, timed, ok, base=None):
        row = make_row(op, path, "all", nbytes, timed, ok, size)
        if base is not None:
            against(row, base)
        rows.append(row)
        if pydatacopy.my_pe() == 0:
            print(f"  {op:<18} {path:<{path_width}} {size:<12} {row['us']:10.1f} us", file=sys.stderr, flush=True)
        return row
    return add


def _layer_rows(add, path: str, both, nbytes: int, checked: bool, recheck, base, args) -> None:
    """The layer's two rows: dispatch + combine eagerly (path ``<path> eager``, or ``eager``) and
    replayed from a CUDA graph (``<path> graph``, or ``cuda graph``), the graph's checked again by
    ``recheck()`` after its timing."""
    add("moe dispatch+comb", f"{path} eager" if path else "eager", nbytes,
        time_op(both, args.iters, args.warmup, args.repeats), checked, base)
    graph = _capture(both)
    add("moe dispatch+comb", f"{path} graph" if path else "cuda graph", nbytes,
        time_op(graph.replay, args.iters, args.warmup, args.repeats), checked and recheck(), base)
    del graph


def _capture(run) -> torch.cuda.CUDAGraph:
    """`run` in a CUDA graph, captured on a side stream after an eager warm-up there."""
    return capture_after_warmup(run)[0]


def _shape_of(name: str):
    """(this PE, PEs, tokens, hidden, topk, experts, the rows' size label) of a shape, None where its
    experts do not split over the PEs."""
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    tokens, hidden, topk, experts = SHAPES[name]
    experts = experts or 8 * n
    return None if experts % n else (me, n, tokens, hidden, topk, experts, f"{name} {n}PE")


def bench_shape_tokens(name: str, args) -> list[dict]:
    """The expand=False rows of one shape (see the module docstring): recv_x copied out of the
    receive region (path ``expand=False``) and read there (``expand=False/region``:
    recv_in_region=True, one crossing), beside the same copies."""
    rows: list[dict] = []
    bases = None
    for in_region in (False, True):
        more, bases = _token_rows(name, args, in_region, bases)
        rows.extend(more)
    return rows


def _token_rows(name: str, args, in_region: bool, bases):
    """(rows, the copies' baseline rows): one dispatcher's expand=False rows; the copies measured
    when `bases` is None."""
    shape = _shape_of(name)
    if shape is None:
        return [], bases
    me, n, tokens, hidden, topk, experts, size = shape
    moe = pydatacopy.MoeDispatcher(experts, hidden, topk, tokens, torch.bfloat16, expand=False,
                                   recv_in_region=in_region)
    path = "expand=False/region" if in_region else "expand=False"
    try:
        x = _tokens(tokens, hidden, 11 + me)
        ids, weights = _routing(tokens, experts, topk, 100 + me)
        recv_x, _, _, handle = moe.dispatch(x, ids, topk_weights=weights)
        y = recv_x.clone()
        torch.cuda.synchronize()
        sent_tokens = int(pydatacopy.moe.dispatch_plan(ids, experts, n).send_counts.sum())
        # Each token once per PE both ways: dispatch its row, ids and index and float32 weights.
        dispatch_bytes = _max_over_pes(sent_tokens * (hidden * 2 + (topk + 1) * 4 + topk * 4))
        combine_bytes = _max_over_pes(sent_tokens * hidden * 2)
        rows = []

        add = _adder(rows, size, 26)

        if bases is None:
            bases = _copy_baselines(add, "expand=False copy", dispatch_bytes, combine_bytes, args)
        base_d, base_c, base_dc = bases
        checked = _check_tokens(moe, tokens, hidden, experts, topk, 7500 + me)
        add("moe dispatch", f"{path} eager", dispatch_bytes,
            time_op(lambda: moe.dispatch(x, ids, topk_weights=weights), args.iters, args.warmup, args.repeats),
            checked, base_d)
        add("moe combine", f"{path} eager", combine_bytes,
            time_op(lambda: moe.combine(y, handle), args.iters, args.warmup, args.repeats), checked, base_c)

        def both():
            got, _, _, h = moe.dispatch(x, ids, topk_weights=weights)
            moe.combine(got, h)

        _layer_rows(add, path, both, dispatch_bytes + combine_bytes, checked,
                    lambda: _check_tokens(moe, tokens, hidden, experts, topk, 8500 + me), base_dc, args)
        return rows, bases
    finally:
        torch.cuda.synchronize()
        moe.close()


def _check_tokens(moe, tokens, hidden, experts, topk, seed) -> bool:
    """expand=False: one dispatch + combine with fresh data and an identity expert (y = recv_x):
    out[t] = x[t] added once per PE t went to, in PE order, float32, rounded to bf16; the rows
    received, summed over PEs, are the (token, PE) pairs routed."""
    n = pydatacopy.n_pes()
    per_pe = experts // n
    x = _tokens(tokens, hidden, seed)
    ids, weights = _routing(tokens, experts, topk, seed + 1)
    recv_x, _, _, handle = moe.dispatch(x, ids, topk_weights=weights)
    out = moe.combine(recv_x.clone(), handle)
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
    pairs = 0
    for p in range(n):
        sent = ((ids >= 0) & (ids < experts) & (ids // per_pe == p)).any(1)
        want = torch.where(sent[:, None], want + x.float(), want)
        pairs += int(sent.sum())
    ok = torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    counts = torch.tensor([pairs, int(handle.num_rows)], dtype=torch.int64, device=reduce_device())
    dist.all_reduce(counts)
    ok = device_clean() and ok
    return agree(ok and int(counts[0]) == int(counts[1]))


def _nccl_all_to_all(x, ids, experts, n, hidden, topk, args) -> tuple:
    """torch.distributed.all_to_all_single (NCCL) of the rows dispatch sends (each token once per
    PE, with its ids' bytes), split sizes known on the host beforehand (NCCL needs them there; the
    copy into send order is outside the timing). Checked: every PE receives the byte counts its
    peers said they would send."""
    plan = pydatacopy.moe.dispatch_plan(ids, experts, n)
    row_bytes = hidden * 2 + (topk + 1) * 4
    counts = plan.send_counts.tolist()
    rows = int(sum(counts))
    send = torch.zeros(rows, row_bytes, dtype=torch.uint8, device="cuda")
    send[:, :hidden * 2] = x.view(torch.uint8).index_select(0, plan.send_index[:rows])
    sizes = torch.tensor(counts, dtype=torch.int64, device="cuda")
    recv_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes, sizes)
    recv_counts = recv_sizes.tolist()
    recv = torch.empty(int(sum(recv_counts)), row_bytes, dtype=torch.uint8, device="cuda")

    def run():
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=counts)

    timed = time_op(run, args.iters, args.warmup, args.repeats)
    torch.cuda.synchronize()
    return timed, agree(recv.shape[0] == int(sum(recv_counts)))


def _check(moe, tokens, hidden, experts, topk, seed) -> bool:
    """One dispatch + combine with fresh data and an identity expert; see the module docstring
    (pre_reduce=True: each PE's partial rounded to bf16, the partials summed in PE order)."""
    x = _tokens(tokens, hidden, seed)
    ids, weights = _routing(tokens, experts, topk, seed + 1)
    if moe.pre_reduce:
        recv_x, handle = moe.dispatch(x, ids, topk_weights=weights)
        out = moe.combine(recv_x.clone(), handle)
    else:
        recv_x, handle = moe.dispatch(x, ids)
        out = moe.combine(recv_x.clone(), handle, weights)
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
    per_pe = experts // pydatacopy.n_pes()
    for pe in range(pydatacopy.n_pes()) if moe.pre_reduce else [None]:
        partial = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
        here = (ids >= 0) & (ids < experts) & (ids // per_pe == pe) if moe.pre_reduce else ids >= 0
        for k in range(topk):  # separate multiply and add, each rounded to float32, k in order
            partial = torch.where(here[:, k:k + 1], partial + weights[:, k:k + 1] * x.float(), partial)
        if moe.pre_reduce:
            partial = partial.to(torch.bfloat16).float()
        want = torch.where(here.any(1, keepdim=True), want + partial, want)
    ok = torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    pairs = torch.tensor([int((ids >= 0).sum()), int(handle.num_rows)], dtype=torch.int64,
                         device=reduce_device())
    dist.all_reduce(pairs)
    ok = device_clean() and ok
    return agree(ok and int(pairs[0]) == int(pairs[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.bench.moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="ds-128,ds-4096,small",
                        help="comma-separated subset of " + ",".join(SHAPES))
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup", type=int, default=5)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    parser.add_argument("--no-expand-false", action="store_true",
                        help="leave out the expand=False rows (DeepEP's normal-mode layout)")
    parser.add_argument("--no-pre-reduce", action="store_true",
                        help="leave out the pre_reduce=True rows (the expert-side reduction)")
    parser.add_argument("--no-deep-ep", action="store_true",
                        help="leave out the deep_ep rows (pydatacopy.compat.deep_ep, bench/moe_deep_ep.py)")
    parser.add_argument("--compact", action="store_true",
                        help="the compacting path (received rows copied out of the region first, "
                             "as traced calls do) instead of reading them in the region")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        parser.error(f"unknown shapes {unknown}: choose from {','.join(SHAPES)}")
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node=4 -m pydatacopy.bench.moe", file=sys.stderr)
        return 2
    from ._cli import _placement

    device, per_gpu = _placement()
    start(device, per_gpu)
    if args.compact:
        pydatacopy.moe.dispatcher.IN_REGION = False
    rows: list[dict] = []
    for shape in shapes:
        rows.extend(bench_shape(shape, args))
        if not args.no_expand_false:
            rows.extend(bench_shape_tokens(shape, args))
        if not args.no_deep_ep:
            from .moe_deep_ep import bench_shape_deep_ep

            rows.extend(bench_shape_deep_ep(shape, args, _shape_of, (_tokens, _routing, _copy_baselines,
                                                                     _max_over_pes, _adder, _capture)))
    if pydatacopy.my_pe() == 0:
        print(f"\n{'op':<18} {'path':<26} {'shape':<14} {'MB moved':>9} {'us':>10} {'GB/s':>8} "
              f"{'xbase':>6}  ok")
        for r in rows:
            xbase = f"{r['xbase']:6.2f}" if r.get("xbase") else "     -"
            print(f"{r['op']:<18} {r['path']:<26} {r['size']:<14} {r['bytes'] / 1e6:9.2f} "
                  f"{r['us']:10.1f} {r['gbps']:8.1f} {xbase}  {'yes' if r['ok'] else 'NO'}")
        print("MB moved: the bytes the busiest PE sends (dispatch: token rows and their expert ids; "
              "combine: one output row per (token, expert); expand=False rows: one per (token, PE) both ways, "
              "dispatch with the float32 weights); xbase: time over a bare copy of those "
              "bytes on this GPU, same run")
    return finish(rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
