"""MoeDispatcher(expand=False) (DeepEP's normal-mode layout) on the CPU, without a GPU or NVSHMEM.

- token_destinations (combine's (token, PE) pairs) and local_topk (the receiver's local ids and
  weights) against brute-force loops: random routings, -1 ids, ids past the experts, tokens
  routed nowhere, every token to one PE, 1, 2, 4 and 8 PEs.
- Dispatch and combine for 1 to 8 simulated PEs with a plain all-to-all between them (the layout
  functions and the reduction's torch arithmetic), byte-exact against a loop over every PE's
  inputs: recv_x by source then token, recv_topk_idx / weights, combine's sum in ascending PE
  order in float32 rounded once.
- The traced path under torch.compile(fullgraph=True) on a one-PE loopback.
- Argument checks that need no NVSHMEM: refusals through the round, mismatched handles.
"""

from __future__ import annotations


import pytest
import torch

import pydatacopy
from pydatacopy import moe as _moe
from pydatacopy.moe import layout as _moe_layout

from moe_world import Loopback as _Loopback
from moe_world import RefusingBuffer as _RefusingBuffer
from moe_world import exchange as _exchange
from moe_world import traced_dispatcher

PES = [1, 2, 4, 8]
KINDS = ["random", "missing", "nowhere", "one_pe", "past"]


def _ids(kind: str, tokens: int, topk: int, n: int, per_pe: int, rng: torch.Generator) -> torch.Tensor:
    """Routings: random (repeats allowed), -1 slots, tokens with every slot -1, every token to
    PE n-1's experts, ids past the experts (no expert, as -1)."""
    experts = n * per_pe
    ids = torch.randint(0, experts, (tokens, topk), generator=rng)
    if kind == "missing":
        ids[torch.rand(ids.shape, generator=rng) < 0.3] = -1
    elif kind == "nowhere":
        ids[torch.rand(tokens, generator=rng) < 0.5] = -1
    elif kind == "one_pe":
        ids = (n - 1) * per_pe + torch.randint(0, per_pe, (tokens, topk), generator=rng)
    elif kind == "past":
        ids[torch.rand(ids.shape, generator=rng) < 0.3] = experts + 3
    return ids


def _destinations_loop(ids: torch.Tensor, n: int, per_pe: int):
    """Each token's PEs (ascending) and its rank among the tokens sent to each, by loops."""
    experts = n * per_pe
    sent_so_far = [0] * n
    pes, ranks = [], []
    for row in ids.tolist():
        mine = sorted({e // per_pe for e in row if 0 <= e < experts})
        pes.append(mine)
        ranks.append([sent_so_far[p] for p in mine])
        for p in mine:
            sent_so_far[p] += 1
    return pes, ranks


@pytest.mark.parametrize("n", PES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topk", [1, 3, 8])
def test_token_destinations_match_a_loop(n, kind, topk):
    rng = torch.Generator().manual_seed(7 * n + topk + len(kind))
    per_pe = 3
    for tokens in (0, 1, 37):
        ids = _ids(kind, tokens, topk, n, per_pe, rng)
        plan = _moe_layout.dispatch_plan_reference(ids, n * per_pe, n)
        token_pe, token_rank = _moe.token_destinations(plan.pair_pe, n)
        width = min(topk, n)
        assert token_pe.shape == token_rank.shape == (tokens, width)
        assert token_pe.dtype == token_rank.dtype == torch.int64
        pes, ranks = _destinations_loop(ids, n, per_pe)
        for t in range(tokens):
            want_pe = pes[t] + [n] * (width - len(pes[t]))
            want_rank = ranks[t] + [-1] * (width - len(ranks[t]))
            assert token_pe[t].tolist() == want_pe, (t, ids[t])
            assert token_rank[t].tolist() == want_rank, (t, ids[t])


@pytest.mark.parametrize("n", PES)
@pytest.mark.parametrize("with_weights", [True, False])
def test_local_topk_matches_a_loop(n, with_weights):
    rng = torch.Generator().manual_seed(n + 100 * with_weights)
    per_pe, topk, rows = 4, 5, 23
    experts = n * per_pe
    for my_pe in range(n):
        ids = torch.randint(0, experts, (rows, topk), generator=rng)
        ids[torch.rand(ids.shape, generator=rng) < 0.2] = -1
        meta = torch.cat([ids, torch.randint(0, 99, (rows, 1), generator=rng)], 1).to(torch.int32)
        weights = torch.randn(rows, topk, generator=rng) if with_weights else None
        used = int(torch.randint(0, rows + 1, (1,), generator=rng))
        idx, w, source_token = _moe.local_topk(meta, weights, torch.tensor(used), my_pe, per_pe, topk)
        assert idx.dtype == torch.int64 and idx.shape == (rows, topk)
        assert (w is None) == (not with_weights)
        for r in range(rows):
            assert int(source_token[r]) == (int(meta[r, topk]) if r < used else -1)
            for k in range(topk):
                e = int(meta[r, k])
                local = e - my_pe * per_pe if r < used and e >= 0 and 0 <= e - my_pe * per_pe < per_pe else -1
                assert int(idx[r, k]) == local, (my_pe, r, k)
                if with_weights:
                    want = float(weights[r, k]) if local >= 0 else 0.0
                    assert float(w[r, k]) == want and w.dtype == torch.float32


# ---- a simulated world -------------------------------------------------------------------------

def _expert(recv_x, idx, weights, my_pe, per_pe):
    """The caller's local experts, summed: y = sum over local k of w x row x (global expert + 1),
    float32, rounded to recv_x's dtype; rows with no local expert give zeros."""
    acc = torch.zeros(recv_x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        local = idx[:, k]
        scale = torch.where(local >= 0, weights[:, k] * (local + my_pe * per_pe + 1).float(), 0.0)
        acc = acc + scale[:, None] * recv_x.float()
    return acc.to(recv_x.dtype)


def _simulate(xs, ids, weights, n, per_pe, max_tokens):
    topk = ids[0].shape[1]
    plans = [_moe.dispatch_plan(t, n * per_pe, n) for t in ids]
    received = _exchange([[x, p.meta, w] for x, p, w in zip(xs, plans, weights)], [p.send_counts for p in plans],
                         [p.send_index for p in plans], max_tokens)
    recv, ys = [], []
    for r in range(n):
        (recv_x, meta, recv_w), counts, offsets = received[r]
        idx, w, source_token = _moe.local_topk(meta, recv_w, counts.sum(), r, per_pe, topk)
        recv.append((recv_x, idx, w, source_token, counts))
        ys.append(_expert(recv_x, idx, w, r, per_pe))
    back = _exchange([[y] for y in ys], [c for *_, c in recv], [None] * n, max_tokens)
    outs = []
    for s in range(n):
        (rows,), counts, offsets = back[s]
        token_pe, token_rank = _moe.token_destinations(plans[s].pair_pe, n)
        slots = _moe_layout.combine_slots(token_pe, token_rank, counts, offsets, n)
        outs.append(_moe.combine_reduce(rows, slots, torch.ones(slots.shape)))
    return recv, ys, outs


def _loop_reference(xs, ids, weights, n, per_pe):
    """By loops: each PE's received (source, token) in source then token order, its rows' local
    ids and weights; then each token's output: the PEs' rows summed in ascending PE order."""
    experts = n * per_pe
    topk = ids[0].shape[1]
    got = []
    for r in range(n):
        rows, idx, w = [], [], []
        for s in range(n):
            for t in range(xs[s].shape[0]):
                row_ids = [int(e) for e in ids[s][t]]
                if not any(0 <= e < experts and e // per_pe == r for e in row_ids):
                    continue
                rows.append((s, t))
                local = [e - r * per_pe if 0 <= e < experts and e // per_pe == r else -1 for e in row_ids]
                idx.append(local)
                w.append([float(weights[s][t, k]) if local[k] >= 0 else 0.0 for k in range(topk)])
        got.append((rows, idx, w))
    return got


def _loop_combine(ys, got, xs, n):
    outs = []
    for s in range(n):
        acc = torch.zeros(xs[s].shape, dtype=torch.float32)
        for p in range(n):  # ascending PE order
            for row, (source, t) in enumerate(got[p][0]):
                if source == s:
                    acc[t] = acc[t] + ys[p][row].float()
        outs.append(acc.to(ys[0].dtype))
    return outs


@pytest.mark.parametrize("n", PES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulated_dispatch_and_combine_match_loops(n, kind, dtype):
    rng = torch.Generator().manual_seed(31 * n + len(kind) + (dtype == torch.bfloat16))
    per_pe, topk, hidden, max_tokens = 3, 4, 9, 12
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=rng)) for _ in range(n)]
    tokens[-1] = 0 if n > 1 else tokens[-1]  # a PE with no tokens
    xs = [torch.randn(t, hidden, generator=rng).to(dtype) for t in tokens]
    ids = [_ids(kind, t, topk, n, per_pe, rng) for t in tokens]
    weights = [torch.rand(t, topk, generator=rng) for t in tokens]
    recv, ys, outs = _simulate(xs, ids, weights, n, per_pe, max_tokens)
    want = _loop_reference(xs, ids, weights, n, per_pe)
    for r in range(n):
        recv_x, idx, w, source_token, counts = recv[r]
        rows, want_idx, want_w = want[r]
        used = len(rows)
        assert recv_x.shape == (n * max_tokens, hidden)
        assert int(counts.sum()) == used
        if used:
            want_x = torch.stack([xs[s][t] for s, t in rows])
            assert torch.equal(recv_x[:used].view(torch.uint8) if dtype != torch.float32 else recv_x[:used],
                               want_x.view(torch.uint8) if dtype != torch.float32 else want_x)
            assert idx[:used].tolist() == want_idx
            assert w[:used].tolist() == want_w
            assert source_token[:used].tolist() == [t for _, t in rows]
        assert bool((idx[used:] == -1).all()) and bool((w[used:] == 0).all())
        assert bool((source_token[used:] == -1).all())
    for s, (got, expect) in enumerate(zip(outs, _loop_combine(ys, want, xs, n))):
        assert got.dtype == dtype and got.shape == xs[s].shape
        assert torch.equal(got.view(torch.int16) if dtype == torch.bfloat16 else got.view(torch.int32),
                           expect.view(torch.int16) if dtype == torch.bfloat16 else expect.view(torch.int32)), s


def test_the_sum_is_in_ascending_pe_order_not_another():
    """Three PEs' rows whose float32 sum depends on the order: (1e8 + 1) - 1e8 = 0 in ascending
    order, 1 in another. The reduction's arithmetic over the (token, PE) pairs must give 0."""
    rows = torch.tensor([[1e8], [1.0], [-1e8]])  # back from PE 0, 1, 2
    token_pe, token_rank = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 0, 0]])
    slots = _moe_layout.combine_slots(token_pe, token_rank, torch.ones(3, dtype=torch.int64),
                                      torch.arange(3), 3)
    out = _moe.combine_reduce(rows, slots, torch.ones(1, 3))
    assert float(out[0, 0]) == float((torch.tensor(1e8) + 1.0) - 1e8) == 0.0


# ---- the traced path ------------------------------------------------------------------------------

def test_torch_compile_traces_expand_false_dispatch_and_combine_whole():
    """dispatch (with weights), the caller's expert sum and combine under torch.compile(fullgraph):
    no graph break, two exchanges through the op, the output as the arithmetic says (one PE)."""
    tokens, hidden, topk, experts = 5, 8, 3, 4
    with traced_dispatcher(tokens, hidden, topk, experts, (tokens, tokens), expand=False) as (moe, loopbacks):

        def layer(x, ids, weights):
            recv_x, idx, w, handle = moe.dispatch(x, ids, topk_weights=weights)
            scale = torch.where(idx >= 0, w * (idx + 1).float(), 0.0).sum(1, keepdim=True)
            return moe.combine(recv_x * scale, handle), idx, w, handle.num_rows

        rng = torch.Generator().manual_seed(4)
        x = torch.randn(tokens, hidden, generator=rng)
        ids = torch.randint(0, experts, (tokens, topk), generator=rng)
        ids[1] = -1  # a token sent nowhere: zeros back
        ids[2, 0] = -1
        weights = torch.rand(tokens, topk, generator=rng)
        torch._dynamo.reset()
        out, idx, w, num_rows = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, ids, weights)
        assert int(num_rows) == tokens - 1
        sent = [t for t in range(tokens) if t != 1]
        assert torch.equal(idx[:tokens - 1], ids[sent]) and bool((idx[tokens - 1:] == -1).all())
        assert torch.equal(w[:tokens - 1], torch.where(ids[sent] >= 0, weights[sent], 0.0))
        want = torch.zeros(tokens, hidden)
        scale = torch.where(ids >= 0, weights * (ids + 1).float(), 0.0).sum(1, keepdim=True)
        want[sent] = 0.0 + x[sent] * scale[sent]
        assert torch.equal(out, want)
        assert [lb.calls for lb in loopbacks] == [1, 1]


# ---- argument checks without NVSHMEM ---------------------------------------------------------------

def _bare_dispatcher(expand: bool, n_pes=2, max_tokens=4, topk=2, hidden=8):
    d = object.__new__(pydatacopy.MoeDispatcher)
    d.num_experts, d.hidden, d.topk, d.max_tokens = 2 * n_pes, hidden, topk, max_tokens
    d.dtype = d.combine_dtype = torch.bfloat16
    d.n_pes, d.experts_per_pe, d.my_pe, d.expand = n_pes, 2, 0, expand
    d._dispatch, d._combine = _RefusingBuffer(7), _RefusingBuffer(8)
    return d


def _token_handle(tokens=3, width=2, n_pes=2, rows=8):
    longs = lambda *shape: torch.zeros(*shape, dtype=torch.int64)  # noqa: E731
    return _moe.MoeTokenHandle(longs(()), longs(n_pes), longs(n_pes), longs(rows), longs(tokens, width),
                               longs(tokens, width))


def _expanded_handle(pairs, n_pes=2):
    longs = lambda *shape: torch.zeros(*shape, dtype=torch.int64)  # noqa: E731
    return pydatacopy.MoeHandle(longs(2), longs(2), longs(()), longs(pairs), longs(pairs), longs(pairs),
                                longs(n_pes), longs(pairs + 1), longs(n_pes), longs(3, 2), longs(3, 2))


def test_recv_rows_are_one_per_token_and_source_with_expand_false():
    assert _bare_dispatcher(False).recv_rows == 2 * 4
    assert _bare_dispatcher(True).recv_rows == 2 * 4 * 2


def test_a_handle_of_the_other_mode_is_refused_through_the_round():
    """An expand=True handle at an expand=False combine and the reverse: pydatacopy.Error naming
    the mode, through the combine buffer's round (peers get Error, not a timeout)."""
    d = _bare_dispatcher(False)
    y = torch.zeros(d.recv_rows, 8, dtype=torch.bfloat16)
    with pytest.raises(pydatacopy.Error, match="expand=False.*MoeTokenHandle.*expand=True"):
        d.combine(y, _expanded_handle(2 * 4 * 2))
    e = _bare_dispatcher(True)
    with pytest.raises(pydatacopy.Error, match="expand=False dispatcher's handle; this dispatcher is expand=True"):
        e.combine(torch.zeros(e.recv_rows, 8, dtype=torch.bfloat16), _token_handle(), torch.zeros(3, 2))
    assert len(d._combine.refused) == 1 and len(e._combine.refused) == 1
    assert d._dispatch.refused == [] and e._dispatch.refused == []


def test_expand_false_combine_refusals_run_the_round():
    d = _bare_dispatcher(False)
    handle = _token_handle()
    y = torch.zeros(d.recv_rows, 8, dtype=torch.bfloat16)
    with pytest.raises(pydatacopy.Error, match="takes no topk_weights"):
        d.combine(y, handle, torch.zeros(3, 2))
    with pytest.raises(pydatacopy.Error, match="y must be"):
        d.combine(y[:3], handle)
    with pytest.raises(pydatacopy.Error, match="combine_dtype"):
        d.combine(y.float(), handle)
    with pytest.raises(pydatacopy.Error, match="token_pe"):
        d.combine(y, _token_handle(width=1))
    with pytest.raises(pydatacopy.Error, match="every field of the handle must be a tensor"):
        d.combine(y, handle._replace(token_pe=[[0, 1]] * 3))  # Error through the round, not AttributeError
    handle.recv_counts._pydatacopy_dispatch = (9 << 40) | 1  # dispatcher 9's dispatch
    with pytest.raises(pydatacopy.Error, match="another MoeDispatcher"):
        d.combine(y, handle)
    assert len(d._combine.refused) == 6 and d._dispatch.refused == []


def test_dispatch_weights_checks_run_the_round():
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    e = _bare_dispatcher(True)
    with pytest.raises(pydatacopy.Error, match="only by an expand=False or pre_reduce=True dispatcher"):
        e.dispatch(x, ids, topk_weights=torch.zeros(3, 2))
    d = _bare_dispatcher(False)
    with pytest.raises(pydatacopy.Error, match=r"topk_weights must be \[tokens, topk\]"):
        d.dispatch(x, ids, topk_weights=torch.zeros(3, 3))
    with pytest.raises(pydatacopy.Error, match="floating-point"):
        d.dispatch(x, ids, topk_weights=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(pydatacopy.Error, match="max_tokens"):
        d.dispatch(torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64))
    assert len(e._dispatch.refused) == 1 and len(d._dispatch.refused) == 3
    assert e._combine.refused == [] and d._combine.refused == []


def test_expand_must_be_a_bool():
    with pytest.raises(pydatacopy.Error, match="expand must be True"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4, expand="no")


def test_recv_in_region_needs_expand_false_and_a_bool():
    with pytest.raises(pydatacopy.Error, match="recv_in_region.*needs expand=False"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4, recv_in_region=True)
    with pytest.raises(pydatacopy.Error, match="recv_in_region.*must be a bool"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4, expand=False, recv_in_region=1)


def test_an_in_region_dispatch_refusal_takes_part_in_a_compact_round():
    """A refused dispatch of a recv_in_region dispatcher runs its round as a compact call (its
    peers wait for this PE to place their rows); combine's refusals stay plain."""
    d = _bare_dispatcher(False)
    d.recv_in_region = True
    with pytest.raises(pydatacopy.Error, match="max_tokens"):
        d.dispatch(torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64))
    with pytest.raises(pydatacopy.Error, match="takes no topk_weights"):
        d.combine(torch.zeros(d.recv_rows, 8, dtype=torch.bfloat16), _token_handle(), torch.zeros(3, 2))
    assert d._dispatch.compact == [True] and d._combine.compact == [False]
    plain = _bare_dispatcher(False)
    with pytest.raises(pydatacopy.Error, match="max_tokens"):
        plain.dispatch(torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64))
    assert plain._dispatch.compact == [False]


def test_an_in_region_dispatch_returns_the_compact_call_s_rows():
    """One PE, a compact call's stand-in whose buffers are kept across calls (rows past the count
    left from the call before): recv_x is its field 0, the ids and weights local, -1 and 0 past
    num_rows whatever the region held there, and the handle tagged with the call."""
    d = _bare_dispatcher(False, n_pes=1, max_tokens=6, topk=2, hidden=5)
    d.recv_in_region = True
    d._dispatch = _Loopback(6, pad=9)
    d._dispatch.number = 7
    rng = torch.Generator().manual_seed(5)
    for call, tokens in enumerate((6, 2)):
        x = torch.randn(tokens, 5, generator=rng).to(torch.bfloat16)
        ids = torch.randint(-1, 2, (tokens, 2), generator=rng)
        weights = torch.rand(tokens, 2, generator=rng)
        recv_x, idx, w, handle = d.dispatch(x, ids, topk_weights=weights)
        assert recv_x is d._dispatch.region[0]
        used = int(handle.num_rows)
        routed = [t for t in range(tokens) if bool((ids[t] >= 0).any())]
        assert used == len(routed)
        assert torch.equal(recv_x[:used].view(torch.int16), x[routed].view(torch.int16))
        for row, t in enumerate(routed):
            assert idx[row].tolist() == [int(e) if int(e) >= 0 else -1 for e in ids[t]]
            assert w[row].tolist() == [float(weights[t, k]) if int(ids[t, k]) >= 0 else 0.0 for k in range(2)]
        assert bool((idx[used:] == -1).all()) and bool((w[used:] == 0).all())
        assert handle.recv_counts._pydatacopy_dispatch == d._tag(call)
