"""pydatacopy.compat.deep_ep on the GPU, as DeepEP v1's tests/test_intranode.py uses deep_ep (2, 4
or 8 PEs, several on one GPU under MPS): get_dispatch_layout against its own loop; dispatch of
``ones * rank`` rows checked by rank_prefix_matrix (DeepEP's check_data) and of random rows
byte-exact against a reference from every PE's inputs; with and without top-k, bf16 and an fp8
tuple with column-major scales, async events and previous events, num_worst_tokens, cached
dispatch; combine's sums (float32, ascending rank, rounded once) byte-exact; a capture of
dispatch + combine with num_worst_tokens replayed with fresh tokens; a rank over its tokens
refused on every rank. Wrong results are recorded and failed together after each test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy.compat import deep_ep
from pydatacopy.compat.deep_ep import utils as _buffer
from pe_outcome import end_step

pytestmark = pytest.mark.any_pes

TIMEOUT_S = 60.0
TOKENS, HIDDEN, TOPK, EXPERTS_PER_RANK = 192, 2048, 8, 8
_FAILURES: list[str] = []


@pytest.fixture(autouse=True)
def in_step(world):
    _FAILURES.clear()
    yield
    end_step(world[1], _FAILURES, TIMEOUT_S, "")


@pytest.fixture(scope="module")
def buffer(world):
    n = world[1]
    budget = _buffer.normal_symmetric_bytes(2 * TOKENS, HIDDEN, n)
    buf = deep_ep.Buffer(dist.group.WORLD, budget, explicitly_destroy=True)
    yield buf
    torch.cuda.synchronize()
    buf.destroy()


def _expect(condition: bool, what: str) -> None:
    if not condition:
        _FAILURES.append(what)


def _inputs(rank: int, n: int, seed: int, tokens: int = TOKENS):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    experts = n * EXPERTS_PER_RANK
    scores = torch.rand((tokens, experts), generator=g) + 1
    topk_idx = torch.topk(scores, TOPK, dim=-1, sorted=False)[1]
    topk_idx[torch.rand(topk_idx.shape, generator=g) < 0.1] = -1
    x = torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16)
    weights = torch.randn((tokens, TOPK), generator=g)
    return x, topk_idx.to(deep_ep.topk_idx_t), weights


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _reference(every, rank, n):
    """What rank receives (rows, local ids, weights, source tokens) and each rank's layout, by loops."""
    rows, ids, ws, src = [], [], [], []
    for s, (x, topk_idx, weights) in enumerate(every):
        for t in range(x.shape[0]):
            owners = {e // EXPERTS_PER_RANK for e in topk_idx[t].tolist() if e >= 0}
            if rank in owners:
                local = topk_idx[t] - rank * EXPERTS_PER_RANK
                mine = (topk_idx[t] >= 0) & (local >= 0) & (local < EXPERTS_PER_RANK)
                rows.append(x[t]), src.append(t)
                ids.append(torch.where(mine, local, -1)), ws.append(torch.where(mine, weights[t], 0.0))
    return rows, ids, ws, src


def _fp8(x: torch.Tensor):
    """DeepEP's per_token_cast_to_fp8 (per 128 channels), scales column-major as its test passes them."""
    blocks = x.float().view(x.shape[0], -1, 128)
    amax = blocks.abs().amax(dim=2).clamp(1e-4)
    fp8 = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(x.shape)
    scales = (amax / 448.0).contiguous()
    return fp8, scales.T.contiguous().T


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_dispatch_and_combine_as_deep_eps_intranode_test(world, buffer, fp8, async_mode):
    rank, n, _ = world
    x, topk_idx, weights = _inputs(rank, n, 1 + fp8 + 2 * async_mode)
    every = _gather((x, topk_idx, weights))
    rows, ids, ws, src = _reference(every, rank, n)
    dev = torch.device("cuda")
    x_dev, idx_dev, w_dev = x.to(dev), topk_idx.to(dev), weights.to(dev)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_dev, n * EXPERTS_PER_RANK)
    want_in_rank = torch.zeros((TOKENS, n), dtype=torch.bool)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                want_in_rank[t, e // EXPERTS_PER_RANK] = True
    _expect(torch.equal(in_rank.cpu(), want_in_rank), "get_dispatch_layout: is_token_in_rank")
    _expect(torch.equal(per_rank.cpu(), want_in_rank.sum(0).int()), "get_dispatch_layout: num_tokens_per_rank")
    sent = _fp8(x_dev) if fp8 else x_dev
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx_dev, topk_weights=w_dev, async_finish=async_mode, previous_event=buffer.capture())
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(sent, **args)
    if async_mode:
        event.current_stream_wait()
    got = recv_x[0] if fp8 else recv_x
    _expect(got.shape[0] == len(rows), f"dispatch: {got.shape[0]} rows, want {len(rows)}")
    held = buffer._moe.symmetric_bytes + buffer._notify.symmetric_bytes
    _expect(held <= buffer.num_nvl_bytes and buffer.tokens_per_rank == 2 * TOKENS,
            f"the buffers hold {held} symmetric bytes, num_nvl_bytes is {buffer.num_nvl_bytes}")
    if got.shape[0] == len(rows) and rows:
        want_x = torch.stack(rows)
        if fp8:
            want_fp8, want_scales = _fp8(want_x.to(dev))
            _expect(torch.equal(recv_x[0].view(torch.uint8), want_fp8.view(torch.uint8)), "dispatch: fp8 rows")
            _expect(torch.equal(recv_x[1], want_scales.contiguous()), "dispatch: fp8 scales")
        else:
            _expect(torch.equal(recv_x.cpu(), want_x), "dispatch: bf16 rows")
        _expect(torch.equal(recv_idx.cpu(), torch.stack(ids)), "dispatch: recv_topk_idx")
        _expect(torch.equal(recv_w.cpu(), torch.stack(ws)), "dispatch: recv_topk_weights")
        _expect(handle[3].cpu().tolist() == src, "dispatch: recv_src_idx")
    want_counts = [sum(int((e[1] == rank * EXPERTS_PER_RANK + i).sum()) for e in every)
                   for i in range(EXPERTS_PER_RANK)]
    _expect(counts == want_counts, f"dispatch: num_recv_tokens_per_expert_list {counts}, want {want_counts}")
    matrix = torch.stack([torch.tensor([sum(1 for r in range(e[1].shape[0])
                                            if d in {v // EXPERTS_PER_RANK for v in e[1][r].tolist() if v >= 0})
                                        for d in range(n)]) for e in every]).cumsum(0).int()
    _expect(torch.equal(handle[0].cpu(), matrix), "dispatch: rank_prefix_matrix")
    # num_worst_tokens: the same rows first, -1 / 0 after, nothing read on the host
    worst = buffer.dispatch(sent, **dict(args, num_worst_tokens=TOKENS * n))
    if async_mode:
        worst[5].current_stream_wait()
    worst_x = worst[0][0] if fp8 else worst[0]
    _expect(worst_x.shape[0] == TOKENS * n and worst[3] == [], "num_worst_tokens: rows / empty list")
    _expect(torch.equal(worst_x[:len(rows)].view(torch.uint8), got.view(torch.uint8)), "num_worst_tokens: rows")
    _expect(bool((worst[1][len(rows):] == -1).all()) and bool((worst[2][len(rows):] == 0).all()),
            "num_worst_tokens: padding rows' ids -1 and weights 0")
    # cached dispatch repeats the layout
    cached = buffer.dispatch(sent, handle=handle, async_finish=async_mode)
    if async_mode:
        cached[5].current_stream_wait()
    cached_x = cached[0][0] if fp8 else cached[0]
    _expect(torch.equal(cached_x.view(torch.uint8), got.view(torch.uint8)), "cached dispatch: rows")
    # combine: y = the bf16 rows x (rank + 1); sums over the ranks each token went to, ascending
    plain = (recv_x[0].float() * recv_x[1].repeat_interleave(128, 1)) if fp8 else recv_x.float()
    y = (plain * (rank + 1)).to(torch.bfloat16)
    every_y = _gather((y.cpu(), handle[3].cpu(), recv_w.cpu()))
    combined, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w, async_finish=async_mode,
                                                 previous_event=buffer.capture())
    if async_mode:
        event.current_stream_wait()
    want_out = torch.zeros((TOKENS, HIDDEN), dtype=torch.float32)
    want_w = torch.zeros((TOKENS, TOPK), dtype=torch.float32)
    for r in range(n):  # ascending: rank r's rows from this rank sit after the lower sources'
        r_y, r_src, r_w = every_y[r]
        start = int(matrix[rank - 1][r]) if rank else 0
        for i in range(start, int(matrix[rank][r])):
            want_out[r_src[i]] += r_y[i].float()
            want_w[r_src[i]] += r_w[i]
    _expect(torch.equal(combined.cpu(), want_out.to(torch.bfloat16)), "combine: rows")
    _expect(torch.equal(combined_w.cpu(), want_w), "combine: topk weights")


def test_a_captured_dispatch_and_combine_replay_with_fresh_tokens(world, buffer):
    """get_dispatch_layout + dispatch (num_worst_tokens) + combine in one graph; each replay takes
    fresh tokens and fresh routing written into the captured inputs, and gives what the same
    layer run eagerly gives (rows received, their ids, source tokens, the combined rows)."""
    rank, n, _ = world
    dev = torch.device("cuda")
    x, ids, weights = (t.to(dev) for t in _inputs(rank, n, 11))

    def layer():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, n * EXPERTS_PER_RANK)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=ids, topk_weights=weights, num_worst_tokens=TOKENS * n)
        y = (recv_x.float() * 2).to(torch.bfloat16)
        return recv_x, recv_idx, handle[3], buffer.combine(y, handle)[0]

    layer()  # warm: the Buffer is set up outside the capture
    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True, timeout=TIMEOUT_S)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for replay in range(5):
        fresh_x, fresh_ids, fresh_w = _inputs(rank, n, 100 + replay)
        x.copy_(fresh_x.to(dev)), ids.copy_(fresh_ids.to(dev)), weights.copy_(fresh_w.to(dev))
        want = [t.clone() for t in layer()]
        graph.replay()
        torch.cuda.synchronize()
        received = want[2] >= 0  # the rows received (past them: padding, not data)
        _expect(torch.equal(captured[2], want[2]) and torch.equal(captured[1], want[1]),
                f"replay {replay}: recv_src_idx / recv_topk_idx")
        _expect(torch.equal(captured[0][received].view(torch.uint8), want[0][received].view(torch.uint8)),
                f"replay {replay}: dispatched rows")
        _expect(torch.equal(captured[3], want[3]), f"replay {replay}: combined rows")
    del graph


def test_a_rank_over_its_tokens_is_refused_on_every_rank(world, buffer):
    rank, n, _ = world
    dev = torch.device("cuda")
    tokens = buffer.tokens_per_rank + 1 if rank == n - 1 else 8
    x, topk_idx, weights = (t.to(dev) for t in _inputs(rank, n, 21, tokens))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=weights)
        _expect(False, "the dispatch was not refused")
    except pydatacopy.Error as error:
        _expect(rank != n - 1 or f"{tokens} tokens" in str(error), f"the refusal names the tokens: {error}")
    x, topk_idx, weights = (t.to(dev) for t in _inputs(rank, n, 22, 8))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
    recv = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=weights)
    want = sum(1 for e in _gather(topk_idx.cpu()) for row in e.tolist()
               if rank in {v // EXPERTS_PER_RANK for v in row if v >= 0})
    _expect(recv[0].shape[0] == want, f"the dispatch after the refusal: {recv[0].shape[0]} rows, want {want}")


LL_TOKENS, LL_HIDDEN, LL_TOPK, LL_EXPERTS_PER_RANK = 64, 1024, 6, 4


@pytest.fixture(scope="module")
def ll_buffer(world):
    n = world[1]
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_TOKENS, LL_HIDDEN, n, n * LL_EXPERTS_PER_RANK)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=LL_EXPERTS_PER_RANK,
                         explicitly_destroy=True)
    yield buf
    torch.cuda.synchronize()
    buf.destroy()


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_round", "fp8_ue8m0"])
def test_low_latency_as_deep_eps_test(world, ll_buffer, mode):
    """DeepEP's test_low_latency usage: x = rank - 128 with the token index in the last 128
    channels; recv_count, layout_range and src_info checked against every rank's routing, the rows
    by rank (check_data), and combine's weighted sum byte-exact against a reference (float32, k in
    order, rounded once), with out= and with zero_copy."""
    rank, n, _ = world
    dev = torch.device("cuda")
    experts, local = n * LL_EXPERTS_PER_RANK, LL_EXPERTS_PER_RANK
    use_fp8, round_scale, ue8m0 = mode != "bf16", mode in ("fp8_round", "fp8_ue8m0"), mode == "fp8_ue8m0"
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.full((LL_TOKENS, LL_HIDDEN), rank - 128, dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(LL_TOKENS).to(torch.bfloat16).view(-1, 1)
    ids = torch.topk(torch.rand((LL_TOKENS, experts), generator=g), LL_TOPK, dim=-1)[1]
    for _ in range(10):
        ids[int(torch.randint(LL_TOKENS, (1,), generator=g)), int(torch.randint(LL_TOPK, (1,), generator=g))] = -1
    weights = torch.rand((LL_TOKENS, LL_TOPK), generator=g)
    every_ids = _gather(ids)
    stats = torch.zeros(local, dtype=torch.int32, device=dev)
    recv_x, recv_count, handle, event, hook = ll_buffer.low_latency_dispatch(
        x.to(dev), ids.to(dev), LL_TOKENS, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=ue8m0, async_finish=True)
    event.current_stream_wait()
    rows3d = recv_x[0] if use_fp8 else recv_x
    plain = rows3d.float()
    if use_fp8:  # DeepEP's per_token_cast_back: the fp8 rows times their block's scale
        scales = recv_x[1].contiguous()
        if ue8m0:  # packed exponents, four to an int32
            scales = torch.exp2(scales.view(torch.uint8).float() - 127)
        plain = (plain.view(local, -1, LL_HIDDEN // 128, 128) * scales.unsqueeze(-1)).view(rows3d.shape)
    for e in range(local):
        expert = rank * local + e
        want = [int((every_ids[s] == expert).sum()) for s in range(n)]
        count = int(recv_count[e])
        _expect(count == sum(want) == int(stats[e]), f"expert {e}: recv_count {count}, want {sum(want)}")
        ranges = handle[1][e].cpu()
        _expect([int(v) & 0xFFFFFFFF for v in ranges] == want, f"expert {e}: layout_range counts")
        for s in range(n):
            begin, got = int(ranges[s]) >> 32, int(ranges[s]) & 0xFFFFFFFF
            src = handle[0][e, begin:begin + got].cpu()
            want_src = [t for t in range(LL_TOKENS) if expert in every_ids[s][t].tolist()]
            _expect(src.tolist() == want_src, f"expert {e}, rank {s}: src_info")
            block = plain[e, begin:begin + got]
            want_rows = torch.full((got, LL_HIDDEN), float(s - 128), device=dev)
            want_rows[:, -128:] = src.to(dev).float().view(-1, 1)
            # exact for bf16; fp8 keeps 3 mantissa bits (a relative error of at most 1/16)
            tolerance = 0.0 if not use_fp8 else 1 / 16
            _expect(bool(((block - want_rows).abs() <= tolerance * want_rows.abs()).all()),
                    f"expert {e}, rank {s}: rows' values (rank - 128, then the token index)")
    y = (plain * (torch.arange(local, device=dev).view(-1, 1, 1) + 1 + rank * local)).to(torch.bfloat16)
    every_y = _gather((y.cpu(), handle[0].cpu(), handle[1].cpu()))
    out = torch.empty((LL_TOKENS, LL_HIDDEN), dtype=torch.bfloat16, device=dev)
    combined, event, hook = ll_buffer.low_latency_combine(y, ids.to(dev), weights.to(dev), handle, out=out,
                                                          return_recv_hook=True)
    hook()
    ll_buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    zero_copy, _, _ = ll_buffer.low_latency_combine(y, ids.to(dev), weights.to(dev), handle, zero_copy=True)
    want = torch.zeros((LL_TOKENS, LL_HIDDEN), dtype=torch.float32)
    for t in range(LL_TOKENS):
        acc = torch.zeros(LL_HIDDEN, dtype=torch.float32)
        for k, expert in enumerate(ids[t].tolist()):
            if expert < 0:
                continue
            r, e = divmod(expert, local)
            r_y, r_src, r_ranges = every_y[r]
            begin, got = int(r_ranges[e][rank]) >> 32, int(r_ranges[e][rank]) & 0xFFFFFFFF
            i = begin + r_src[e, begin:begin + got].tolist().index(t)
            acc = acc + weights[t, k] * r_y[e, i].float()
        want[t] = acc
    _expect(combined is out and torch.equal(out.cpu(), want.to(torch.bfloat16)), "low_latency_combine: rows")
    _expect(torch.equal(zero_copy.cpu(), want.to(torch.bfloat16)), "low_latency_combine(zero_copy=True): rows")
