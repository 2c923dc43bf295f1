"""The MoE bench's ``deep_ep`` rows: pydatacopy.compat.deep_ep (DeepEP v1's API) as DeepEP's users
call it, per shape of bench/moe.py, beside a bare copy of the bytes it moves, same run.

Rows: dispatch (``num_worst_tokens=0``: the received count read on the host, DeepEP's default),
combine, and get_dispatch_layout + dispatch + combine eagerly; the same layer with
``num_worst_tokens`` replayed from a CUDA graph; and, for decode-sized shapes, the low-latency
calls (``deep_ep ll``: bf16, eagerly and in a graph). Bytes: each token once per receiving PE, its row
plus the routing and its top-k ids and weights (dispatch), its row back (combine). Check (can
fail): one more layer with fresh tokens and an identity expert, whose output must equal x[t]
added once per PE t went to, in PE order, float32, rounded once, and whose received rows summed
over PEs must be the (token, PE) pairs routed."""

from __future__ import annotations

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy.compat import deep_ep

from ._harness import agree, device_clean, reduce_device, time_op


def bench_shape_deep_ep(name: str, args, shape_of, helpers) -> list[dict]:
    """``shape_of``, ``helpers``: bench/moe.py's _shape_of and (_tokens, _routing, _copy_baselines,
    _max_over_pes, _adder, _capture)."""
    _tokens, _routing, _copy_baselines, _max_over_pes, _adder, _capture = helpers
    shape = shape_of(name)
    if shape is None:
        return []
    me, n, tokens, hidden, topk, experts, size = shape
    buffer = deep_ep.Buffer(dist.group.WORLD, deep_ep.utils.normal_symmetric_bytes(tokens, hidden, n),
                            explicitly_destroy=True)
    try:
        x = _tokens(tokens, hidden, 11 + me)
        ids, weights = _routing(tokens, experts, topk, 100 + me)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, experts)
        args_d = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=ids, topk_weights=weights)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **args_d)
        y = recv_x.clone()
        sent_tokens = int(in_rank.sum())
        dispatch_bytes = _max_over_pes(sent_tokens * (hidden * 2 + (n + 1) * 4 + topk * 8))
        combine_bytes = _max_over_pes(sent_tokens * hidden * 2)
        rows = []
        add = _adder(rows, size, 20)
        base_d, base_c, base_dc = _copy_baselines(add, "deep_ep copy", dispatch_bytes, combine_bytes, args)
        checked = _check(buffer, tokens, hidden, experts, topk, 9500 + me, _tokens, _routing, 0)
        add("moe dispatch", "deep_ep eager", dispatch_bytes,
            time_op(lambda: buffer.dispatch(x, **args_d), args.iters, args.warmup, args.repeats), checked, base_d)
        add("moe combine", "deep_ep eager", combine_bytes,
            time_op(lambda: buffer.combine(y, handle), args.iters, args.warmup, args.repeats), checked, base_c)

        def layer(worst):
            layout = buffer.get_dispatch_layout(ids, experts)
            got, _, _, _, h, _ = buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                 num_tokens_per_expert=layout[2], topk_idx=ids,
                                                 topk_weights=weights, num_worst_tokens=worst)
            buffer.combine(got, h)

        add("moe dispatch+comb", "deep_ep eager", dispatch_bytes + combine_bytes,
            time_op(lambda: layer(0), args.iters, args.warmup, args.repeats), checked, base_dc)
        worst = tokens * n
        graph = _capture(lambda: layer(worst))
        add("moe dispatch+comb", "deep_ep graph", dispatch_bytes + combine_bytes,
            time_op(graph.replay, args.iters, args.warmup, args.repeats),
            checked and _check(buffer, tokens, hidden, experts, topk, 10500 + me, _tokens, _routing, worst), base_dc)
        del graph
        if tokens <= LOW_LATENCY_MAX_TOKENS:
            rows += _low_latency_rows(args, tokens, hidden, topk, experts, size, helpers)
        return rows
    finally:
        torch.cuda.synchronize()
        buffer.destroy()


#: Low-latency rows for shapes of at most this many tokens per PE (DeepEP's layout holds local
#: experts x PEs x tokens rows: the prefill shape would need gigabytes).
LOW_LATENCY_MAX_TOKENS = 512


def _low_latency_rows(args, tokens, hidden, topk, experts, size, helpers) -> list[dict]:
    """low_latency_dispatch + low_latency_combine (bf16), eagerly and replayed from a CUDA graph,
    beside a bare copy of their bytes (the default layout's: each token once per PE with its ids and
    index, one row per (token, expert) back). Check: an identity expert, out[t] = sum_k w[t, k] x[t]
    in float32, k in order, eagerly and in a replay with fresh tokens."""
    _tokens, _routing, _copy_baselines, _max_over_pes, _adder, _capture = helpers
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, n, experts),
                            low_latency_mode=True, explicitly_destroy=True)
    try:
        x = _tokens(tokens, hidden, 31 + me)
        ids, weights = _routing(tokens, experts, topk, 300 + me)
        # The expanded dispatcher's bytes (as the default layout's rows count them): each token once
        # per PE with its ids and index, one output row per (token, expert) back.
        sent_tokens = int(pydatacopy.moe.dispatch_plan(ids, experts, n).send_counts.sum())
        dispatch_bytes = _max_over_pes(sent_tokens * (hidden * 2 + (topk + 1) * 4))
        combine_bytes = _max_over_pes(int((ids >= 0).sum()) * hidden * 2)
        rows = []
        add = _adder(rows, size, 20)
        _, _, base_dc = _copy_baselines(add, "deep_ep ll copy", dispatch_bytes, combine_bytes, args)

        def layer():
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, ids, tokens, experts, use_fp8=False)
            return buffer.low_latency_combine(recv_x, ids, weights, handle)[0]

        out = layer()
        want = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
        for k in range(topk):
            want = want + weights[:, k:k + 1] * x.float()
        checked = agree(device_clean() and torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)))
        add("moe dispatch+comb", "deep_ep ll eager", dispatch_bytes + combine_bytes,
            time_op(layer, args.iters, args.warmup, args.repeats), checked, base_dc)
        graph_out = []
        graph = _capture(lambda: graph_out.append(layer()))
        timed = time_op(graph.replay, args.iters, args.warmup, args.repeats)
        x.copy_(_tokens(tokens, hidden, 41 + me))  # fresh tokens: the replay's output must follow them
        graph.replay()
        want = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
        for k in range(topk):
            want = want + weights[:, k:k + 1] * x.float()
        replayed = torch.equal(graph_out[-1].view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
        add("moe dispatch+comb", "deep_ep ll graph", dispatch_bytes + combine_bytes, timed,
            agree(device_clean() and checked and replayed), base_dc)
        del graph
        return rows
    finally:
        torch.cuda.synchronize()
        buffer.destroy()


def _check(buffer, tokens, hidden, experts, topk, seed, _tokens, _routing, worst) -> bool:
    n = pydatacopy.n_pes()
    x = _tokens(tokens, hidden, seed)
    ids, weights = _routing(tokens, experts, topk, seed + 1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=ids,
                                                 topk_weights=weights, num_worst_tokens=worst)
    out = buffer.combine(recv_x.clone(), handle)[0]
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device="cuda")
    for p in range(n):
        want = torch.where(in_rank[:, p:p + 1], want + x.float(), want)
    ok = torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    received = int((handle[3] >= 0).sum())
    counts = torch.tensor([int(in_rank.sum()), received], dtype=torch.int64, device=reduce_device())
    dist.all_reduce(counts)
    ok = device_clean() and ok
    return agree(ok and int(counts[0]) == int(counts[1]))
