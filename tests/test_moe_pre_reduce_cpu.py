"""MoeDispatcher(pre_reduce=True) (issue 37 item 2: the expert-side reduction for the expanded
layout) on the CPU, without a GPU or NVSHMEM.

- received_pairs (each received token's recv_x rows and weights) against the receive layout's
  own fields: every row in use named once, by its token and its local expert.
- Dispatch and combine for 1 to 4 simulated PEs (tests/moe_world.py's ThreadWorld: the real
  MoeDispatcher, an all-to-all between threads), byte-exact against loops over every PE's
  inputs: each PE's partial sum of a token's local experts in k order in float32, rounded to
  the output dtype, then the PEs' partials in ascending PE order in float32, rounded once.
- The traced path under torch.compile(fullgraph=True) on a one-PE loopback.
- Argument checks through the round.
"""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy import moe as _moe
from pydatacopy.moe import reduced as _reduced

from moe_world import RefusingBuffer as _RefusingBuffer
from moe_world import ThreadedAllToAll, ThreadWorld, traced_dispatcher


def _routing(tokens, topk, experts, rng, kind):
    ids = torch.randint(0, experts, (tokens, topk), generator=rng)
    if kind == "distinct":  # no expert twice in a token (-1 for the slots past the experts)
        for t in range(tokens):
            ids[t] = torch.cat([torch.randperm(experts, generator=rng), torch.full((topk,), -1)])[:topk]
    elif kind == "holes" and tokens:
        ids[torch.rand(tokens, topk, generator=rng) < 0.3] = -1
        ids[0] = -1  # a token sent nowhere
        if topk > 1 and tokens > 1:
            ids[1, 1] = experts + 3  # past the experts: no expert
    return ids


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("kind", ["random", "distinct", "holes"])
def test_received_pairs_name_every_row_in_use_once_by_its_token_and_expert(n, kind):
    rng = torch.Generator().manual_seed(11 * n + len(kind))
    per_pe, topk, rows = 3, 4, 10
    experts = n * per_pe
    for my_pe in range(n):
        counts = torch.randint(0, rows // n + 1, (n,), generator=rng)
        used = int(counts.sum())
        meta = torch.cat([_routing(rows, topk, experts, rng, kind), torch.arange(rows).reshape(rows, 1)], 1)
        meta = meta.to(torch.int32)
        weights = torch.rand(rows, topk, generator=rng)
        layout = _moe.layout.receive_layout_reference(meta, counts, my_pe, per_pe, topk)
        pair_row, pair_weight = _reduced.received_pairs(meta, weights, counts, layout.combine_index, my_pe,
                                                        per_pe, topk)
        named = []
        for j in range(rows):
            for k in range(topk):
                e = int(meta[j, k])
                local = e - my_pe * per_pe if j < used and 0 <= e < experts and e // per_pe == my_pe else -1
                row = int(pair_row[j, k])
                if local < 0:
                    assert row == -1 and float(pair_weight[j, k]) == 0.0, (j, k)
                    continue
                assert int(layout.row_of[row]) == j and int(layout.expert_of_row[row]) == local, (j, k, row)
                assert float(pair_weight[j, k]) == float(weights[j, k])
                named.append(row)
        assert sorted(named) == list(range(int(layout.num_rows)))


def _dispatcher(world, rank, n, num_experts, hidden, topk, max_tokens, dtype):
    moe = object.__new__(pydatacopy.MoeDispatcher)
    moe.num_experts, moe.hidden, moe.topk, moe.max_tokens = num_experts, hidden, topk, max_tokens
    moe.dtype = moe.combine_dtype = dtype
    moe.expand, moe.pre_reduce, moe.n_pes, moe.experts_per_pe, moe.my_pe = True, True, n, num_experts // n, rank
    moe._workspaces = {}
    # Made in the same order on every rank (their numbers match, as on the device).
    moe._dispatch = ThreadedAllToAll(world, rank, max_tokens, 3000)
    moe._combine = ThreadedAllToAll(world, rank, max_tokens, 3001)  # one row per (token, PE) back
    moe._unit_weights = torch.ones((max_tokens, min(topk, n)), dtype=torch.float32)
    return moe


def _expert_output(recv_x, handle, my_pe, per_pe, dtype):
    """The caller's experts: row i times (its global expert + 1), rounded to dtype."""
    scale = (handle.expert_of_row + my_pe * per_pe + 1).to(torch.float32)[:, None]
    return (recv_x.to(torch.float32) * scale).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["random", "distinct", "holes"])
def test_simulated_pre_reduce_dispatch_and_combine_match_loops(n, dtype, kind):
    per_pe, topk, hidden, max_tokens = 3, 5, 7, 6
    experts = n * per_pe
    rng = torch.Generator().manual_seed(97 * n + len(kind) + (dtype == torch.bfloat16))
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=rng)) for _ in range(n)]
    xs = [torch.randn(t, hidden, generator=rng).to(dtype) for t in tokens]
    ids = [_routing(t, topk, experts, rng, kind) for t in tokens]
    weights = [torch.rand(t, topk, generator=rng) for t in tokens]
    world = ThreadWorld(n)

    def body(rank):
        moe = _dispatcher(world, rank, n, experts, hidden, topk, max_tokens, dtype)
        recv_x, handle = moe.dispatch(xs[rank], ids[rank], topk_weights=weights[rank])
        assert isinstance(handle, _moe.MoeReducedHandle)
        y = _expert_output(recv_x, handle, rank, per_pe, dtype)
        out = moe.combine(y, handle)
        return recv_x, handle, out

    results = world.run(body)
    for p, (recv_x, handle, _) in enumerate(results):  # recv_x grouped by expert, as expand=True
        used = int(handle.num_rows)
        for i in range(used):
            s, t = int(handle.source_pe[i]), int(handle.source_token[i])
            assert torch.equal(recv_x[i].view(torch.uint8), xs[s][t].view(torch.uint8))
            assert int(ids[s][t].eq(int(handle.expert_of_row[i]) + p * per_pe).sum()) >= 1
    for s in range(n):
        want = torch.zeros(tokens[s], hidden, dtype=torch.float32)
        for t in range(tokens[s]):
            for p in range(n):  # ascending PE order
                partial = torch.zeros(hidden, dtype=torch.float32)
                hit = False
                for k in range(topk):  # k order within the PE
                    e = int(ids[s][t, k])
                    if 0 <= e < experts and e // per_pe == p:
                        y = (xs[s][t].to(torch.float32) * float(e + 1)).to(dtype)
                        partial = partial + weights[s][t, k] * y.to(torch.float32)
                        hit = True
                if hit:
                    want[t] = want[t] + partial.to(dtype).to(torch.float32)
        got = results[s][2]
        assert got.dtype == dtype and got.shape == (tokens[s], hidden)
        assert torch.equal(got.view(torch.uint8), want.to(dtype).view(torch.uint8)), s


@pytest.mark.parametrize("pre_reduce", [True, False])
def test_each_pe_s_partial_is_rounded_before_the_sum_across_pes(pre_reduce):
    """Two simulated PEs, bfloat16, one token of ones with experts 0 and 1 on PE 0 and 2 on PE 1,
    outputs 1, 2^-8 and 2^-8 (weights 1). pre_reduce: PE 0's partial 1 + 2^-8 rounds (to even)
    to 1, then 1 + 2^-8 rounds to 1 again; the default sums once: 1 + 2^-7, exact in bf16."""
    world = ThreadWorld(2)
    scale = {0: 1.0, 1: 2.0 ** -8, 2: 2.0 ** -8}

    def body(rank):
        moe = _dispatcher(world, rank, 2, 4, 2, 3, 1, torch.bfloat16)
        moe.pre_reduce = pre_reduce
        if not pre_reduce:  # the default's combine buffer: a row per (token, expert)
            moe._combine = ThreadedAllToAll(world, rank, 3, 3001)
        x = torch.ones(1 if rank == 0 else 0, 2, dtype=torch.bfloat16)
        ids = torch.tensor([[0, 1, 2]]) if rank == 0 else torch.zeros(0, 3, dtype=torch.int64)
        weights = torch.ones(ids.shape)
        if pre_reduce:
            recv_x, handle = moe.dispatch(x, ids, topk_weights=weights)
        else:
            recv_x, handle = moe.dispatch(x, ids)
        per_row = [scale.get(int(e) + 2 * rank, 0.0) for e in handle.expert_of_row]
        y = (recv_x.float() * torch.tensor(per_row)[:, None]).to(torch.bfloat16)
        return moe.combine(y, handle) if pre_reduce else moe.combine(y, handle, weights)

    out = world.run(body)[0]
    assert out.tolist() == ([[1.0, 1.0]] if pre_reduce else [[1.0078125, 1.0078125]])


def test_torch_compile_traces_pre_reduce_dispatch_and_combine_whole():
    """dispatch (with weights), an expert and combine under torch.compile(fullgraph): no graph
    break, two exchanges through the op, the output as the arithmetic says (one PE)."""
    tokens, hidden, topk, experts = 5, 8, 3, 4
    with traced_dispatcher(tokens, hidden, topk, experts, (tokens, tokens), pre_reduce=True,
                           _unit_weights=torch.ones((tokens, 1))) as (moe, loopbacks):

        def layer(x, ids, weights):
            recv_x, handle = moe.dispatch(x, ids, topk_weights=weights)
            y = recv_x * (handle.expert_of_row + 1).to(torch.float32)[:, None]
            return moe.combine(y, handle)

        rng = torch.Generator().manual_seed(4)
        x = torch.randn(tokens, hidden, generator=rng)
        ids = torch.stack([torch.randperm(experts, generator=rng)[:topk] for _ in range(tokens)])
        ids[1] = -1  # a token sent nowhere: zeros back
        ids[2, 0] = -1
        weights = torch.rand(tokens, topk, generator=rng)
        torch._dynamo.reset()
        out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, ids, weights)
        want = torch.zeros(tokens, hidden)
        for t in range(tokens):
            partial = torch.zeros(hidden)
            for k in range(topk):
                if int(ids[t, k]) >= 0:
                    partial = partial + weights[t, k] * (x[t] * float(ids[t, k] + 1))
            want[t] = 0.0 + partial
        assert torch.equal(out, want)
        assert [lb.calls for lb in loopbacks] == [1, 1]


# ---- argument checks without NVSHMEM ---------------------------------------------------------------

def _bare(n_pes=2, max_tokens=4, topk=2, hidden=8):
    d = object.__new__(pydatacopy.MoeDispatcher)
    d.num_experts, d.hidden, d.topk, d.max_tokens = 2 * n_pes, hidden, topk, max_tokens
    d.dtype = d.combine_dtype = torch.bfloat16
    d.n_pes, d.experts_per_pe, d.my_pe, d.expand, d.pre_reduce = n_pes, 2, 0, True, True
    d._dispatch, d._combine = _RefusingBuffer(7), _RefusingBuffer(8)
    return d


def _reduced_handle(n_pes=2, max_tokens=4, topk=2, tokens=3):
    longs = lambda *shape: torch.zeros(*shape, dtype=torch.int64)  # noqa: E731
    rows = n_pes * max_tokens
    return _moe.MoeReducedHandle(longs(2), longs(2), longs(()), longs(rows * topk), longs(rows * topk),
                                 longs(rows * topk), longs(n_pes), longs(n_pes), longs(rows, topk),
                                 torch.zeros(rows, topk), longs(tokens, min(topk, n_pes)),
                                 longs(tokens, min(topk, n_pes)))


def test_pre_reduce_needs_expand_and_a_bool():
    with pytest.raises(pydatacopy.Error, match="pre_reduce.*needs expand=True"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4, expand=False, pre_reduce=True)
    with pytest.raises(pydatacopy.Error, match="pre_reduce.*must be a bool"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4, pre_reduce=1)


def test_a_pre_reduce_dispatch_without_weights_is_refused_through_the_round():
    d = _bare()
    x, ids = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(pydatacopy.Error, match="pass topk_weights"):
        d.dispatch(x, ids)
    with pytest.raises(pydatacopy.Error, match="topk_weights must be"):
        d.dispatch(x, ids, topk_weights=torch.zeros(3, 3))
    assert len(d._dispatch.refused) == 2 and d._dispatch.compact == [False, False]


def test_pre_reduce_combine_refusals_run_the_round():
    d = _bare()
    y = torch.zeros(d.recv_rows, 8, dtype=torch.bfloat16)
    assert d.recv_rows == 2 * 4 * 2  # recv_x is expand=True's
    with pytest.raises(pydatacopy.Error, match="takes no topk_weights"):
        d.combine(y, _reduced_handle(), torch.zeros(3, 2))
    longs = lambda *shape: torch.zeros(*shape, dtype=torch.int64)  # noqa: E731
    expanded = pydatacopy.MoeHandle(longs(2), longs(2), longs(()), longs(16), longs(16), longs(16), longs(2),
                                    longs(17), longs(2), longs(3, 2), longs(3, 2))
    with pytest.raises(pydatacopy.Error, match="MoeReducedHandle.*another mode"):
        d.combine(y, expanded)
    with pytest.raises(pydatacopy.Error, match="pair_row"):
        d.combine(y, _reduced_handle(max_tokens=5))
    with pytest.raises(pydatacopy.Error, match="y must be"):
        d.combine(y[:-1], _reduced_handle())
    assert len(d._combine.refused) == 4 and d._combine.compact == [False] * 4
    assert d._dispatch.refused == []


def test_sums_this_pe_cannot_allocate_are_refused_through_the_round(monkeypatch):
    """The two-step combine's sums come before its round: one PE out of memory there still takes
    part (refused), so the other's combine completes and its check_errors reports it."""
    import threading

    world, failing = ThreadWorld(2), set()
    real = _reduced.combine_reduce

    def combine_reduce(*args):
        if threading.get_ident() in failing:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(_reduced, "combine_reduce", combine_reduce)

    def body(rank):
        moe = _dispatcher(world, rank, 2, 4, 3, 2, 2, torch.float32)
        x, ids = torch.ones(2, 3), torch.tensor([[0, 2], [1, 3]])
        recv_x, handle = moe.dispatch(x, ids, topk_weights=torch.ones(2, 2))
        if rank == 1:
            failing.add(threading.get_ident())
        try:
            moe.combine(recv_x, handle)
            world.raise_errors(rank)
        except pydatacopy.Error as error:
            return str(error)
        return None

    messages = world.run(body)
    assert all(m is not None and "could not be allocated" in m for m in messages), messages
