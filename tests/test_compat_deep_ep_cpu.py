"""pydatacopy.compat.deep_ep (DeepEP v1's API) on the CPU: every rank a thread of one process,
exchanging through tests/moe_world.py's ThreadedAllToAll, the real Buffer, MoeDispatcher and
layout code above it. DeepEP's test_intranode usage (get_dispatch_layout, dispatch with and
without top-k, bf16 and an fp8 tuple with column-major scales, cached dispatch, num_worst_tokens,
expert_alignment, combine with weights) on 1, 2, 4 and 8 ranks, against references computed by
loops over every rank's inputs; and the refusals every rank must see."""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy.compat import deep_ep
from pydatacopy.compat.deep_ep import utils as _buffer

from moe_world import ThreadedAllToAll, ThreadWorld


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class SimBuffer(deep_ep.Buffer):
    """deep_ep.Buffer on a ThreadWorld: no NVSHMEM; buffers made in the same order on every rank
    share a number, as on the device."""

    def __init__(self, world: ThreadWorld, rank: int, **kwargs) -> None:
        self._world, self._made = world, 0
        super().__init__(_Group(rank, world.n), **kwargs)

    def _start(self, group) -> None:
        pass

    def _all_to_all(self, capacity: int) -> ThreadedAllToAll:
        self._made += 1
        return ThreadedAllToAll(self._world, self.rank, capacity, 1000 + self._made)

    def _new_dispatcher(self, hidden: int, max_tokens: int):
        n = self.group_size
        moe = object.__new__(pydatacopy.MoeDispatcher)
        moe.num_experts, moe.hidden, moe.topk, moe.max_tokens = n, hidden, n, max_tokens
        moe.dtype = moe.combine_dtype = torch.bfloat16
        moe.expand, moe.n_pes, moe.experts_per_pe, moe.my_pe = False, n, 1, self.rank
        moe._workspaces = {}
        moe._dispatch, moe._combine = self._all_to_all(max_tokens), self._all_to_all(max_tokens)
        moe._unit_weights = torch.ones((max_tokens, n), dtype=torch.float32)
        return moe

    def _new_all_to_all(self, capacity: int, row_bytes: int):
        return self._all_to_all(capacity)

    def _new_expanded_dispatcher(self, num_experts: int, hidden: int, topk: int, max_tokens: int):
        n = self.group_size
        moe = object.__new__(pydatacopy.MoeDispatcher)
        moe.num_experts, moe.hidden, moe.topk, moe.max_tokens = num_experts, hidden, topk, max_tokens
        moe.dtype = moe.combine_dtype = torch.bfloat16
        moe.expand, moe.n_pes, moe.experts_per_pe, moe.my_pe = True, n, num_experts // n, self.rank
        moe._workspaces = {}
        moe._dispatch, moe._combine = self._all_to_all(max_tokens), self._all_to_all(max_tokens * topk)
        return moe

    def _check_errors(self) -> None:
        self._world.raise_errors(self.rank)


HIDDEN, EXPERTS_PER_RANK, TOPK = 256, 3, 4


def _budget(tokens_per_rank: int, n: int) -> int:
    return _buffer.normal_symmetric_bytes(tokens_per_rank, HIDDEN, n)


def _inputs(rank: int, n: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    experts = n * EXPERTS_PER_RANK
    x = torch.randn((tokens, HIDDEN), generator=g).to(torch.bfloat16)
    scores = torch.rand((tokens, experts), generator=g) + 1
    topk = min(TOPK, experts)
    topk_idx = torch.topk(scores, topk, dim=-1, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_idx[torch.rand(topk_idx.shape, generator=g) < 0.2] = -1
    weights = torch.randn((tokens, topk), generator=g)
    return x, topk_idx, weights


def _layout_loop(topk_idx, n):
    experts = n * EXPERTS_PER_RANK
    tokens = topk_idx.shape[0]
    in_rank = torch.zeros((tokens, n), dtype=torch.bool)
    per_expert = torch.zeros(experts, dtype=torch.int32)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t, e // EXPERTS_PER_RANK] = True
                per_expert[e] += 1
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def _round_once(values):
    acc = torch.zeros_like(values[0], dtype=torch.float32)
    for v in values:
        acc = acc + v.to(torch.float32)
    return acc


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_and_combine_follow_deep_eps_test_usage(n, fp8):
    world = ThreadWorld(n)
    tokens_of = [5 + 7 * r % 11 for r in range(n)]
    inputs = [_inputs(r, n, tokens_of[r], 1) for r in range(n)]
    layouts = [_layout_loop(inputs[r][1], n) for r in range(n)]
    align = 4

    def body(rank):
        buf = SimBuffer(world, rank, num_nvl_bytes=_budget(64, n),
                        explicitly_destroy=True)
        x, topk_idx, weights = inputs[rank]
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
        sent = x
        if fp8:
            scales = (x.float().abs().amax(1, keepdim=True) / 448 + 1e-4).expand(-1, HIDDEN // 128).contiguous()
            sent = ((x.float() / scales.repeat_interleave(128, 1)).to(torch.float8_e4m3fn),
                    scales.T.contiguous().T)  # column-major scales, as DeepEP's test passes them
        out = {"layout": (per_rank, per_expert, in_rank), "sent": sent}
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            sent, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights, expert_alignment=align)
        out["dispatch"] = (recv_x, recv_idx, recv_w, counts, tuple(handle))
        worst = buf.dispatch(sent, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights,
                             num_worst_tokens=sum(tokens_of))
        out["worst"] = worst[:4]
        cached = buf.dispatch(sent, handle=handle)
        out["cached"] = cached
        plain = recv_x[0].to(torch.float32) * recv_x[1].repeat_interleave(128, 1) if fp8 else recv_x
        y = (plain.to(torch.float32) * (rank + 1)).to(torch.bfloat16)
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        out["combine"] = (y, combined, combined_w)
        buf.destroy()
        return out

    results = world.run(body)
    for r in range(n):
        per_rank, per_expert, in_rank = results[r]["layout"]
        want = layouts[r]
        assert torch.equal(per_rank, want[0]) and torch.equal(per_expert, want[1]) and torch.equal(in_rank, want[2])
    for r in range(n):
        recv_x, recv_idx, recv_w, counts, handle = results[r]["dispatch"]
        rows, idx_rows, w_rows, src = [], [], [], []
        for s in range(n):
            x, topk_idx, weights = inputs[s]
            for t in range(tokens_of[s]):
                if layouts[s][2][t, r]:
                    rows.append(s), src.append(t)
                    local = topk_idx[t] - r * EXPERTS_PER_RANK
                    mine = (topk_idx[t] >= 0) & (local >= 0) & (local < EXPERTS_PER_RANK)
                    idx_rows.append(torch.where(mine, local, -1))
                    w_rows.append(torch.where(mine, weights[t], 0.0))
        got_x = recv_x[0] if fp8 else recv_x
        assert got_x.shape[0] == len(rows)
        for i, (s, t) in enumerate(zip(rows, src)):  # each source's row (fp8: bytes and scales) at its place
            sent = results[s]["sent"]
            if fp8:
                assert torch.equal(recv_x[0][i].view(torch.uint8), sent[0][t].view(torch.uint8)), (r, i)
                assert torch.equal(recv_x[1][i], sent[1][t]), (r, i)
            else:
                assert torch.equal(recv_x[i], sent[t]), (r, i)
        ref_idx = torch.stack(idx_rows) if idx_rows else torch.empty((0, recv_idx.shape[1]), dtype=torch.int64)
        assert torch.equal(recv_idx, ref_idx)
        assert torch.equal(recv_w, torch.stack(w_rows) if w_rows else torch.empty((0, recv_w.shape[1])))
        assert handle[3].tolist() == src
        want_counts = sum(layouts[s][1][r * EXPERTS_PER_RANK:(r + 1) * EXPERTS_PER_RANK] for s in range(n))
        assert counts == [-(-c // 4) * 4 for c in want_counts.tolist()]
        matrix = torch.stack([layouts[s][0] for s in range(n)]).cumsum(0).to(torch.int32)
        assert torch.equal(handle[0], matrix)
        # worst: the same rows first, then -1 ids / 0 weights; cached: the same rows again
        worst_x, worst_idx, worst_w, worst_counts = results[r]["worst"]
        assert worst_counts == [] and (worst_x[0] if fp8 else worst_x).shape[0] == sum(tokens_of)
        assert torch.equal(worst_idx[:len(rows)], recv_idx) and torch.equal(worst_w[:len(rows)], recv_w)
        assert bool((worst_idx[len(rows):] == -1).all()) and bool((worst_w[len(rows):] == 0).all())
        cached_x = results[r]["cached"][0]
        if fp8:
            assert torch.equal(cached_x[0].view(torch.uint8), recv_x[0].view(torch.uint8))
            assert torch.equal(cached_x[1], recv_x[1])
        else:
            assert torch.equal(cached_x, recv_x)
        assert results[r]["cached"][1:5] == (None, None, None, None)
    # combine: each token's rows from the ranks it went to, ascending, float32, rounded once
    for s in range(n):
        _, combined, combined_w = results[s]["combine"]
        for t in range(tokens_of[s]):
            ranks = [r for r in range(n) if layouts[s][2][t, r]]
            ys, ws = [], []
            for r in ranks:
                handle = results[r]["dispatch"][4]
                i = next(i for i, (tok) in enumerate(handle[3].tolist())
                         if tok == t and (0 if s == 0 else handle[0][s - 1][r]) <= i < handle[0][s][r])
                ys.append(results[r]["combine"][0][i])
                ws.append(results[r]["dispatch"][2][i])
            want = _round_once(ys).to(torch.bfloat16) if ys else torch.zeros(HIDDEN, dtype=torch.bfloat16)
            assert torch.equal(combined[t], want), (s, t)
            want_w = _round_once(ws) if ws else torch.zeros(combined_w.shape[1])
            assert torch.equal(combined_w[t], want_w), (s, t)


def test_a_rank_over_its_tokens_is_refused_on_every_rank():
    n = 4
    world = ThreadWorld(n)

    def body(rank):
        buf = SimBuffer(world, rank, num_nvl_bytes=_budget(8, n))
        tokens = 9 if rank == 2 else 3  # rank 2: past the 8 a rank may send
        x, topk_idx, weights = _inputs(rank, n, tokens, 2)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
        with pytest.raises(pydatacopy.Error) as raised:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=topk_idx, topk_weights=weights)
        # the Buffer stays usable: the next dispatch on every rank succeeds
        x, topk_idx, weights = _inputs(rank, n, 3, 3)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
        recv = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
        return str(raised.value), recv[0].shape[0]

    results = world.run(body)
    assert "num_nvl_bytes" in results[2][0] and "9 tokens" in results[2][0]
    assert all("9 tokens" in message for message, _ in results), results


def test_ranks_combining_different_dispatches_are_refused_on_every_rank():
    n = 2
    world = ThreadWorld(n)

    def body(rank):
        buf = SimBuffer(world, rank, num_nvl_bytes=_budget(8, n))
        handles = []
        for seed in (4, 5):
            x, topk_idx, weights = _inputs(rank, n, 4, seed)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
            recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert)
            handles.append((recv_x, handle))
        recv_x, handle = handles[rank]  # rank 0 the first dispatch's, rank 1 the second's
        buf.combine(recv_x, handle)
        with pytest.raises(pydatacopy.Error, match="different dispatches"):
            buf._check_errors()
        return True

    assert world.run(body) == [True, True]


def test_what_deep_ep_offers_and_pydatacopy_does_not_is_refused_with_a_reason():
    world = ThreadWorld(1)
    buf = SimBuffer(world, 0, num_nvl_bytes=1 << 20)
    with pytest.raises(pydatacopy.Error, match="num_rdma_bytes"):  # no low-latency budget given
        buf.low_latency_dispatch(torch.zeros((2, 128), dtype=torch.bfloat16), torch.zeros((2, 1), dtype=torch.int64),
                                 4, 2)
    with pytest.raises(pydatacopy.Error, match="explicitly_destroy"):
        buf.destroy()
    with pytest.raises(pydatacopy.Error, match="mpi4py"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(pydatacopy.Error, match="even"):
        deep_ep.Buffer.set_num_sms(3)
    with pytest.raises(pydatacopy.Error, match="even"):
        deep_ep.Config(21)
    x, topk_idx, weights = _inputs(0, 1, 3, 6)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS_PER_RANK)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert)
    with pytest.raises(pydatacopy.Error, match="bias"):
        buf.combine(recv_x, handle, bias=recv_x)
    with pytest.raises(pydatacopy.Error, match="hidden"):
        wide = torch.zeros((3, 2 * HIDDEN), dtype=torch.bfloat16)
        buf.dispatch(wide, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    other = SimBuffer(world, 0, num_nvl_bytes=1 << 20)
    other.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(pydatacopy.Error, match="handle"):
        other.combine(recv_x, handle)


def test_the_size_hint_holds_the_tokens_it_names_and_no_more():
    from pydatacopy.compat.deep_ep import utils

    for n in (2, 8):
        config = deep_ep.Buffer.get_dispatch_config(n)
        hint = config.get_nvl_buffer_size_hint(7168 * 2, n)
        assert config.tokens_per_rank == 10 * 256
        assert utils.normal_tokens_per_rank(hint, 7168, n) == config.tokens_per_rank
        assert utils.normal_tokens_per_rank(hint - 1, 7168, n) == config.tokens_per_rank - 1
        # both parity sets of each buffer are counted: more than one set's rows alone
        dispatch_row, combine_row, _ = utils.normal_row_bytes(7168, n)
        assert hint > 2 * config.tokens_per_rank * n * (dispatch_row + combine_row)


def test_a_combine_of_other_rows_than_received_is_refused_on_every_rank():
    n = 2
    world = ThreadWorld(n)

    def body(rank):
        buf = SimBuffer(world, rank, num_nvl_bytes=_budget(8, n))
        x, topk_idx, weights = _inputs(rank, n, 4, 7)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, n * EXPERTS_PER_RANK)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert,
                                                  previous_event=deep_ep.EventOverlap())  # no event: no wait
        y = torch.cat([recv_x, recv_x[:1]]) if rank == 1 else recv_x  # rank 1: one row too many
        try:
            buf.combine(y, handle)
            buf._check_errors()
        except pydatacopy.Error as error:
            return str(error)
        return None

    messages = world.run(body)
    assert all(m is not None for m in messages), messages
    assert "one row per row dispatch returned" in messages[1]


def _cast_loop(row: torch.Tensor, round_scale: bool):
    """DeepEP's low-latency fp8 cast of one bf16 row, by 128-channel blocks in Python floats
    (float32 rounding where DeepEP's float arithmetic rounds)."""
    import math
    import struct

    def f32(v):
        return struct.unpack("f", struct.pack("f", v))[0]

    values, scales = [], []
    for b in range(0, row.numel(), 128):
        block = row[b:b + 128].float()
        amax = f32(max(f32(1e-4), float(block.abs().max())))
        if round_scale:
            mantissa, exponent = math.frexp(f32(amax * f32(1.0 / 448.0)))  # value = m x 2^e, m in [0.5, 1)
            up = exponent if mantissa != 0.5 else exponent - 1  # ceil(log2(value))
            scale, scale_inv = 2.0 ** -up, 2.0 ** up
        else:
            scale, scale_inv = f32(448.0 / amax), f32(amax * f32(1.0 / 448.0))
        values.append((block * scale).to(torch.float8_e4m3fn))
        scales.append(scale_inv)
    return torch.cat(values), torch.tensor(scales, dtype=torch.float32)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_round", "fp8_ue8m0"])
def test_low_latency_dispatch_and_combine_follow_deep_eps_test_usage(n, mode, monkeypatch):
    monkeypatch.setattr(pydatacopy.moe.dispatcher, "IN_REGION", False)  # the steps the simulated world has
    world = ThreadWorld(n)
    experts, topk, max_tokens, hidden = 4 * n, 3, 6, 512
    tokens_of = [max_tokens - r % 3 for r in range(n)]
    inputs = []
    for r in range(n):
        g = torch.Generator().manual_seed(40 + r)
        x = torch.randn((tokens_of[r], hidden), generator=g).to(torch.bfloat16)
        ids = torch.topk(torch.rand((tokens_of[r], experts), generator=g), topk, dim=-1)[1]
        ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
        inputs.append((x, ids, torch.rand((tokens_of[r], topk), generator=g)))
    use_fp8, round_scale, ue8m0 = mode != "bf16", mode in ("fp8_round", "fp8_ue8m0"), mode == "fp8_ue8m0"

    def body(rank):
        need = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, n, experts)
        buf = SimBuffer(world, rank, num_rdma_bytes=need, low_latency_mode=True)
        x, ids, weights = inputs[rank]
        stats = torch.zeros(experts // n, dtype=torch.int32)
        recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, ids, max_tokens, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=True)
        hook()
        plain = recv_x
        if use_fp8 and not ue8m0:
            plain = (recv_x[0].float().view(-1, hidden // 128, 128) * recv_x[1].reshape(-1, hidden // 128, 1))
            plain = plain.view(recv_x[0].shape).to(torch.bfloat16)
        elif use_fp8:
            plain = recv_x[0].float().to(torch.bfloat16)  # (the combine check below needs any bf16 rows)
        scale = torch.arange(1, experts // n + 1, dtype=torch.float32).view(-1, 1, 1) + rank * (experts // n)
        y = (plain.float() * scale).to(torch.bfloat16)
        out = torch.empty((x.shape[0], hidden), dtype=torch.bfloat16)
        combined, _, _ = buf.low_latency_combine(y, ids, weights, handle, out=out)
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        zero_copy, _, _ = buf.low_latency_combine(torch.empty(0), ids, weights, handle, zero_copy=True)
        return recv_x, recv_count, tuple(handle), stats, y, combined is out and out, zero_copy

    results = world.run(body)
    local = experts // n
    for r in range(n):
        recv_x, recv_count, handle, stats, _, _, _ = results[r]
        src_info, layout_range = handle[0], handle[1]
        for e in range(local):
            expert = r * local + e
            rows, sources, ranges = [], [], []
            for s in range(n):
                x, ids, _ = inputs[s]
                mine = [t for t in range(x.shape[0]) if expert in ids[t].tolist()]
                ranges.append((len(rows) << 32) | len(mine))
                rows += [x[t] for t in mine]
                sources += mine
            count = len(rows)
            assert int(recv_count[e]) == count == int(stats[e])
            assert layout_range[e].tolist() == ranges
            assert src_info[e, :count].tolist() == sources and bool((src_info[e, count:] == -1).all())
            for i, row in enumerate(rows):
                if not use_fp8:
                    assert torch.equal(recv_x[e, i], row), (r, e, i)
                    continue
                fp8, scales = _cast_loop(row, round_scale)
                assert torch.equal(recv_x[0][e, i].view(torch.uint8), fp8.view(torch.uint8)), (r, e, i)
                if ue8m0:
                    exponents = (scales.view(torch.int32) >> 23).to(torch.uint8)
                    packed = torch.tensor(recv_x[1][e, i].tolist(), dtype=torch.int32)
                    assert torch.equal(packed.view(torch.uint8), exponents), (r, e, i)
                else:
                    assert torch.equal(recv_x[1][e, i], scales), (r, e, i)
        if use_fp8:  # DeepEP's scale layout: column-major in the last two dims
            assert recv_x[1].stride(1) == 1 and recv_x[1].stride(2) == n * max_tokens
    for s in range(n):
        x, ids, weights = inputs[s]
        combined, zero_copy = results[s][5], results[s][6]
        for t in range(x.shape[0]):
            acc = torch.zeros(hidden, dtype=torch.float32)
            for k, expert in enumerate(ids[t].tolist()):
                if expert < 0:
                    continue
                r, e = divmod(expert, local)
                src_info, layout_range = results[r][2][0], results[r][2][1]
                begin = int(layout_range[e][s]) >> 32
                count = int(layout_range[e][s]) & 0xFFFFFFFF
                i = begin + [int(v) for v in src_info[e, begin:begin + count]].index(t)
                acc = acc + weights[t, k] * results[r][4][e, i].float()
            assert torch.equal(combined[t], acc.to(torch.bfloat16)), (s, t)
            assert torch.equal(zero_copy[t], combined[t]), (s, t)
