"""MoE dispatch/combine and the all-to-all-v on the CPU, without a GPU or NVSHMEM.

- The layout functions (dispatch_plan, receive_layout, combine_slots) run for several simulated
  PEs with a torch all-to-all in between, and must give exactly what a plain-Python reference of
  dispatch and combine gives: random routing, skew, zero tokens, several experts of one PE,
  missing experts (-1), odd widths.
- combine_reduce's torch arithmetic (the reference of the CUDA kernel) against a scalar loop.
- The custom ops: torch.library.opcheck against a one-PE loopback buffer, fake kernels' shapes,
  tracing with make_fx.
- Argument checks that need no NVSHMEM.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pydatacopy
from pydatacopy import moe as _moe
from pydatacopy.moe import all_to_all as _moe_a2a
from pydatacopy.moe import layout as _moe_layout

from moe_world import Loopback as _Loopback
from moe_world import RefusingBuffer as _RefusingBuffer
from moe_world import exchange as _exchange
from moe_world import traced_dispatcher


# ---- a simulated world ----------------------------------------------------------------------

def _expert_output(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: row x (global expert + 1), in float32, rounded to the rows' dtype."""
    return (rows.float() * (experts.float() + 1)[:, None]).to(rows.dtype)


def _simulate(xs, topks, weights, num_experts, capacity):
    n = len(xs)
    per_pe = num_experts // n
    topk = topks[0].shape[1]
    plans = [_moe.dispatch_plan(t, num_experts, n) for t in topks]
    received = _exchange([[x, p.meta] for x, p in zip(xs, plans)], [p.send_counts for p in plans],
                         [p.send_index for p in plans], capacity)
    recv_xs, layouts, ys = [], [], []
    for r in range(n):
        (tokens, meta), counts, _ = received[r]
        layout = _moe.receive_layout(meta, counts, r, per_pe, topk)
        recv_x = _moe.gather_rows(tokens, layout.row_of, layout.num_rows)
        y = _expert_output(recv_x, layout.expert_of_row + r * per_pe)
        recv_xs.append(recv_x)
        layouts.append(layout)
        ys.append(y)
    back = _exchange([[y] for y in ys], [lay.combine_counts for lay in layouts],
                     [lay.combine_index for lay in layouts], capacity * topk)
    outs = []
    for s in range(n):
        (rows,), counts, offsets = back[s]
        slots = _moe_layout.combine_slots(plans[s].pair_pe, plans[s].pair_rank, counts, offsets, n)
        outs.append(_moe.combine_reduce(rows, slots, weights[s]))
    return recv_xs, layouts, outs


def _reference(xs, topks, weights, num_experts):
    """Dispatch and combine written out: per PE and local expert, the (source, token) rows in
    (source, token, k) order; per token, the weighted sum in k order in float32."""
    n = len(xs)
    per_pe = num_experts // n
    groups = [[[] for _ in range(per_pe)] for _ in range(n)]
    for s in range(n):
        for t in range(xs[s].shape[0]):
            for k in range(topks[s].shape[1]):
                e = int(topks[s][t, k])
                if 0 <= e < num_experts:
                    groups[e // per_pe][e % per_pe].append((s, t))
    outs = []
    for s in range(n):
        acc = torch.zeros(xs[s].shape, dtype=torch.float32)
        for t in range(xs[s].shape[0]):
            for k in range(topks[s].shape[1]):
                e = int(topks[s][t, k])
                if 0 <= e < num_experts:
                    y = _expert_output(xs[s][t:t + 1], torch.tensor([e]))[0].float()
                    acc[t] = acc[t] + weights[s][t, k] * y
        outs.append(acc.to(xs[s].dtype))
    return groups, outs


def _routing(n, tokens, topk, num_experts, kind, rng):
    if kind == "random":
        return [torch.stack([torch.randperm(num_experts, generator=rng)[:topk] for _ in range(tokens[p])])
                if tokens[p] else torch.zeros(0, topk, dtype=torch.int64) for p in range(n)]
    if kind == "skew":  # every token to PE 0's experts; PE n-1 gets none
        per_pe = num_experts // n
        return [torch.randint(0, per_pe, (tokens[p], topk), generator=rng) for p in range(n)]
    if kind == "missing":  # some slots without an expert
        ids = [torch.randint(0, num_experts, (tokens[p], topk), generator=rng) for p in range(n)]
        for t in ids:
            t[torch.rand(t.shape, generator=rng) < 0.3] = -1
        return ids
    raise AssertionError(kind)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["random", "skew", "missing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulated_dispatch_and_combine_match_the_reference(n, kind, dtype):
    rng = torch.Generator().manual_seed(n * 100 + len(kind))
    per_pe, topk, hidden, capacity = 3, 4, 5, 9  # odd widths; topk > experts per PE
    num_experts = per_pe * n
    tokens = [random.Random(p + n).randint(0, capacity) for p in range(n)]
    tokens[0] = 0  # a PE with zero tokens
    tokens[-1] = capacity
    topks = _routing(n, tokens, topk, num_experts, kind, rng)
    xs = [torch.randn(tokens[p], hidden, generator=rng).to(dtype) for p in range(n)]
    weights = [torch.rand(tokens[p], topk, generator=rng) for p in range(n)]
    recv_xs, layouts, outs = _simulate(xs, topks, weights, num_experts, capacity)
    groups, want = _reference(xs, topks, weights, num_experts)
    for r in range(n):
        layout = layouts[r]
        counts = [len(g) for g in groups[r]]
        assert layout.expert_counts.tolist() == counts
        assert layout.expert_offsets.tolist() == [sum(counts[:e]) for e in range(per_pe)]
        assert int(layout.num_rows) == sum(counts)
        flat = [row for group in groups[r] for row in group]
        for i, (s, t) in enumerate(flat):
            assert torch.equal(recv_xs[r][i].view(torch.uint8), xs[s][t].view(torch.uint8)), (r, i)
            assert (int(layout.source_pe[i]), int(layout.source_token[i])) == (s, t)
        assert layout.expert_of_row[:len(flat)].tolist() == [e for e, g in enumerate(groups[r]) for _ in g]
        assert (layout.source_pe[len(flat):] == -1).all()
    for s in range(n):
        assert torch.equal(outs[s].view(torch.uint8), want[s].view(torch.uint8)), s


def test_a_token_with_several_experts_on_one_pe_travels_once():
    topk_idx = torch.tensor([[0, 1, 2, 5], [3, 4, 5, 0]])  # 2 PEs, 3 experts each
    plan = _moe.dispatch_plan(topk_idx, 6, 2)
    assert plan.send_counts.tolist() == [2, 2]  # each token once per PE
    assert plan.send_index[:4].tolist() == [0, 1, 0, 1]


def test_combine_reduce_reference_is_the_scalar_arithmetic():
    rng = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 3, generator=rng).to(torch.bfloat16)
    slots = torch.tensor([[0, 5, -1], [2, 2, 1]])
    weights = torch.rand(2, 3, generator=rng)
    out = _moe.combine_reduce(rows, slots, weights)
    for t in range(2):
        for h in range(3):
            acc = torch.zeros((), dtype=torch.float32)
            for k in range(3):
                if slots[t, k] >= 0:
                    acc = acc + weights[t, k] * rows[slots[t, k], h].float()
            assert out[t, h].view(torch.int16) == acc.to(torch.bfloat16).view(torch.int16)


def test_combine_reduce_refuses_other_dtypes():
    with pytest.raises(pydatacopy.Error, match="float32, bfloat16 or float16"):
        _moe.combine_reduce(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64),
                            torch.zeros(1, 1))


# ---- the ops ------------------------------------------------------------------------------------

@pytest.fixture
def loopback():
    buffer = _Loopback(capacity=8)
    number = 10**6 + random.randrange(10**6)
    _moe_a2a._buffers[number] = buffer
    yield number, buffer
    _moe_a2a._buffers.pop(number, None)


def test_opcheck_all_to_all_v(loopback):
    number, _ = loopback
    sends = [torch.arange(12, dtype=torch.float32).reshape(6, 2), torch.arange(6, dtype=torch.int32)]
    args = (number, sends, torch.tensor([4]), torch.tensor([5, 4, 3, 2, 1, 0]), None, None,
            torch.zeros(1, dtype=torch.uint8))
    torch.library.opcheck(_moe.OPS["all_to_all_v"], args)


def test_opcheck_gather_rows():
    src = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    args = (src, torch.tensor([4, 0, 2, 2]), torch.tensor(3), None)
    torch.library.opcheck(_moe.OPS["moe_gather_rows"], args)
    assert torch.equal(_moe.gather_rows(*args[:3])[:3], src[[4, 0, 2]])


def test_opcheck_combine_reduce():
    rows = torch.randn(5, 4).to(torch.bfloat16)
    args = (rows, torch.tensor([[0, -1], [4, 2]]), torch.rand(2, 2), None)
    torch.library.opcheck(_moe.OPS["moe_combine_reduce"], args)


def test_opcheck_dispatch_layout():
    """The GPU layout kernel's op: on the CPU it runs dispatch_plan's torch code."""
    topk_idx = torch.tensor([[0, 5], [3, -1], [7, 7], [2, 4]])
    args = (topk_idx, 8, 2, None)
    torch.library.opcheck(_moe.OPS["moe_dispatch_layout"], args)
    got = _moe.OPS["moe_dispatch_layout"](*args)
    want = _moe_layout.dispatch_plan_reference(topk_idx, 8, 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_layout_scratch_is_asked_for_large_inputs_only_and_stays_small():
    """Past 8192 pairs the multi-block layouts take a scratch (the counts of units of at least 32
    tokens or 256 pairs, at most 65536 counts, and the bins' starts); none below, none for sizes
    the layouts refuse (their errors say why)."""
    from pydatacopy import _C
    def bytes_of(words):  # int32 words, in 16-byte multiples
        return (words * 4 + 15) // 16 * 16

    most = bytes_of((1 << 16) + 257 + 64)
    assert _C.moe_dispatch_layout_scratch_bytes(1024, 8, 4) == 0
    assert _C.moe_dispatch_layout_scratch_bytes(8192, 1, 4) == 0
    assert _C.moe_receive_layout_scratch_bytes(1024, 8, 64) == 0
    assert _C.moe_dispatch_layout_scratch_bytes(0, 8, 4) == 0
    # 4096 tokens, top-8, 4 PEs: 128 units of 32 tokens, 9 counts each, 9 offsets, the rows sent.
    assert _C.moe_dispatch_layout_scratch_bytes(4096, 8, 4) == bytes_of(128 * 9 + 9 + 1)
    # 16384 rows, top-8, 64 experts per PE: 512 units of 256 pairs, 65 bins, 64 sources' partials.
    assert _C.moe_receive_layout_scratch_bytes(16384, 8, 64) == bytes_of(512 * 65 + 65 + 64)
    for tokens, topk, n_pes in [(1025, 8, 1), (140000, 8, 8), (20000, 4, 64), (1 << 27, 8, 64)]:
        assert 0 < _C.moe_dispatch_layout_scratch_bytes(tokens, topk, n_pes) <= most
    for rows, topk, experts_per_pe in [(1025, 8, 1), (20000, 8, 256), ((1 << 31) // 9 - 1, 9, 256)]:
        assert 0 < _C.moe_receive_layout_scratch_bytes(rows, topk, experts_per_pe) <= most
    assert _C.moe_dispatch_layout_scratch_bytes(1 << 29, 8, 4) == 0  # past 2^31 pairs: refused
    assert _C.moe_dispatch_layout_scratch_bytes(4096, 8, 65) == 0  # past 64 PEs: refused
    assert _C.moe_receive_layout_scratch_bytes(16384, 8, 257) == 0


def test_opcheck_receive_layout():
    meta = torch.tensor([[0, 5, 11], [3, -1, 12], [7, 2, 13], [1, 1, 14]], dtype=torch.int32)
    args = (meta, torch.tensor([2, 1]), 0, 4, 2, None)
    torch.library.opcheck(_moe.OPS["moe_receive_layout"], args)
    got = _moe.OPS["moe_receive_layout"](*args)
    want = _moe_layout.receive_layout_reference(meta, torch.tensor([2, 1]), 0, 4, 2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_fake_shapes(loopback):
    number, _ = loopback
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        send = torch.empty(3, 7, dtype=torch.bfloat16)
        *recvs, counts, offsets = torch.ops.pydatacopy.all_to_all_v(
            number, [send], torch.empty(1, dtype=torch.int64), None, None, None,
            torch.empty(1, dtype=torch.uint8))
        assert tuple(recvs[0].shape) == (8, 7) and recvs[0].dtype == torch.bfloat16
        assert len(recvs) == 4 and all(r.numel() == 0 for r in recvs[1:])
        assert tuple(counts.shape) == (1,) and tuple(offsets.shape) == (1,)
        out = torch.ops.pydatacopy.moe_combine_reduce(torch.empty(8, 7), torch.empty(3, 2, dtype=torch.int64),
                                                      torch.empty(3, 2), None)
        assert tuple(out.shape) == (3, 7)


def test_make_fx_traces_the_op_and_runs_it(loopback):
    number, buffer = loopback
    order = torch.zeros(1, dtype=torch.uint8)

    def step(send, counts):
        recvs, got, _ = _moe_a2a._exchange_op(number, [send], counts, None, None, None, order)
        return recvs[0] * 2, got

    send, counts = torch.arange(6.0).reshape(3, 2), torch.tensor([2])
    graph = make_fx(step)(send, counts)
    assert "pydatacopy.all_to_all_v" in str(graph.graph)
    before = buffer.calls
    recv, got = graph(send, counts)
    assert buffer.calls == before + 1
    assert got.tolist() == [2] and torch.equal(recv[:2], send[:2] * 2)


def test_combine_reduce_traces_through_the_op():
    graph = make_fx(lambda r, s, w: _moe.combine_reduce(r, s, w))(
        torch.randn(4, 3), torch.tensor([[0, 1]]), torch.rand(1, 2))
    assert "pydatacopy.moe_combine_reduce" in str(graph.graph)


# ---- checks without NVSHMEM ------------------------------------------------------------------

def test_setup_needs_init_and_good_sizes():
    if pydatacopy.is_initialized():
        pytest.skip("NVSHMEM is initialised in this process")
    with pytest.raises(pydatacopy.Error, match="capacity"):
        pydatacopy.AllToAll(0, 16)
    with pytest.raises(pydatacopy.Error, match="max_row_bytes"):
        pydatacopy.AllToAll(4, 1 << 24)
    with pytest.raises(pydatacopy.Error, match="pydatacopy.init"):
        pydatacopy.AllToAll(4, 16)
    with pytest.raises(pydatacopy.Error, match="pydatacopy.init"):
        pydatacopy.MoeDispatcher(8, 16, 2, 4)


def test_symmetric_bytes_needed():
    one = pydatacopy.AllToAll.symmetric_bytes_needed(100, 64, 4)
    assert one >= 2 * 4 * 100 * 64  # two sets of four regions
    assert one % 256 == 0
    assert pydatacopy.AllToAll.symmetric_bytes_needed(100, 64, 8) > one
    with pytest.raises(pydatacopy.Error, match="PEs"):
        pydatacopy.AllToAll.symmetric_bytes_needed(100, 64, 5000)


def test_public_names():
    for name in ("AllToAll", "all_to_all_v", "MoeDispatcher", "MoeHandle"):
        assert name in pydatacopy.__all__ and hasattr(pydatacopy, name)


def test_torch_compile_traces_dispatch_and_combine_whole():
    """dispatch, an expert and combine under torch.compile(fullgraph=True): no graph break, the
    two exchanges and the reduction as ops, the result as the arithmetic says (one PE, loopback)."""
    tokens, hidden, topk, experts = 5, 8, 2, 4
    with traced_dispatcher(tokens, hidden, topk, experts, (tokens, tokens * topk)) as (moe, loopbacks):

        def layer(x, ids, weights):
            recv_x, handle = moe.dispatch(x, ids)
            return moe.combine(recv_x * 2, handle, weights)

        rng = torch.Generator().manual_seed(9)
        x = torch.randn(tokens, hidden, generator=rng)
        ids = torch.stack([torch.randperm(experts, generator=rng)[:topk] for _ in range(tokens)])
        ids[1, 0] = -1  # a slot without an expert
        weights = torch.rand(tokens, topk, generator=rng)
        torch._dynamo.reset()
        out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, ids, weights)
        want = torch.zeros(tokens, hidden)
        for k in range(topk):
            want = want + torch.where(ids[:, k:k + 1] >= 0, weights[:, k:k + 1] * (x * 2), 0.0)
        assert torch.equal(out, want)
        assert [lb.calls for lb in loopbacks] == [1, 1]  # each exchange ran once


# ---- the one-call dispatch's workspace (include/pydatacopy/moe.hpp), through _C -------------

_SIZES = [(0, 1, 1, 1, 1, 16), (5, 2, 2, 3, 8, 20), (64, 8, 8, 32, 512, 14336), (3000, 8, 4, 64, 12000, 7168),
          (1, 1, 64, 256, 64, 2)]


@pytest.mark.parametrize("tokens, topk, n_pes, experts_per_pe, recv_rows, row_bytes", _SIZES)
def test_dispatch_workspace_parts_aligned_apart_and_large_enough(tokens, topk, n_pes, experts_per_pe, recv_rows,
                                                                 row_bytes):
    from pydatacopy import _C
    totals, parts = _C.moe_dispatch_workspace(tokens, topk, n_pes, experts_per_pe, recv_rows, row_bytes)
    assert totals == _C.moe_dispatch_workspace_bytes(tokens, topk, n_pes, experts_per_pe, recv_rows, row_bytes)
    assert set(totals) == {"recv_x", "handle", "scratch"}
    align = _C.MOE_DISPATCH_WORKSPACE_ALIGNMENT
    pairs = recv_rows * topk
    want = {"send_counts": 8 * n_pes, "send_index": 8 * (n_pes * tokens + 1), "meta": 4 * tokens * (topk + 1),
            "pair_pe": 8 * tokens * topk, "pair_rank": 8 * tokens * topk,
            "dispatch_scratch": _C.moe_dispatch_layout_scratch_bytes(tokens, topk, n_pes),
            "recv_meta": 4 * recv_rows * (topk + 1), "recv_counts": 8 * n_pes, "recv_offsets": 8 * n_pes,
            "positions": 8 * pairs, "row_of": 8 * pairs, "expert_counts": 8 * experts_per_pe,
            "expert_offsets": 8 * experts_per_pe, "num_rows": 8, "expert_of_row": 8 * pairs,
            "source_pe": 8 * pairs, "source_token": 8 * pairs, "combine_index": 8 * (pairs + 1),
            "combine_counts": 8 * n_pes,
            "receive_scratch": _C.moe_receive_layout_scratch_bytes(recv_rows, topk, experts_per_pe),
            "recv_x": pairs * row_bytes}
    assert {name: size for name, (_, _, size) in parts.items()} == want
    # Split by lifetime: recv_x alone; MoeHandle's tensors together (and nothing else); the rest
    # scratch (freed after the call).
    handle = {"expert_counts", "expert_offsets", "num_rows", "expert_of_row", "source_pe", "source_token",
              "recv_counts", "combine_index", "combine_counts", "pair_pe", "pair_rank"}
    assert handle == set(pydatacopy.MoeHandle._fields)
    assert {name: region for name, (region, _, _) in parts.items()} == \
        {name: "recv_x" if name == "recv_x" else "handle" if name in handle else "scratch" for name in want}
    for region, total in totals.items():
        spans = sorted((offset, offset + size) for r, offset, size in parts.values() if r == region)
        assert all(offset % align == 0 for offset, _ in spans), region
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), region  # apart
        assert spans[0][0] == 0 and spans[-1][1] == total, region  # unpadded: ends at the last part
    assert totals["recv_x"] == pairs * row_bytes  # exactly recv_x's [pairs, hidden] tensor


@pytest.mark.parametrize("tokens, topk, n_pes, experts_per_pe, max_tokens, row_bytes",
                         [(0, 1, 1, 1, 1, 2), (1, 2, 2, 3, 16, 130), (7, 8, 4, 32, 16, 14336),
                          (128, 8, 8, 32, 128, 14336), (4096, 8, 4, 64, 4096, 14336), (5, 3, 3, 5, 9, 16)])
def test_native_dispatch_cuts_the_handle_as_the_workspace_places_it(tokens, topk, n_pes, experts_per_pe,
                                                                    max_tokens, row_bytes):
    """The eager dispatch cuts its handle tensors out of one int64 tensor in a single split
    (MoeDispatcher._workspace): each is exactly the workspace's part, shape and address."""
    import types

    from pydatacopy import _C
    from pydatacopy.moe.dispatcher import MoeDispatcher

    fake = types.SimpleNamespace(topk=topk, n_pes=n_pes, experts_per_pe=experts_per_pe, max_tokens=max_tokens,
                                 _workspaces={})
    totals, (sizes, pick) = MoeDispatcher._workspace(fake, tokens, row_bytes)
    assert MoeDispatcher._workspace(fake, tokens, row_bytes)[0] is totals  # asked of the core once
    _, parts = _C.moe_dispatch_workspace(tokens, topk, n_pes, experts_per_pe, n_pes * max_tokens, row_bytes)
    kept = torch.empty(totals["handle"], dtype=torch.uint8)
    pieces = kept.view(torch.int64).split_with_sizes(sizes)
    assert sum(sizes) * 8 == totals["handle"]
    for name in pydatacopy.MoeHandle._fields:
        region, offset, size = parts[name]
        assert region == "handle"
        piece = pieces[pick[name]]
        assert piece.numel() * 8 == size, name
        if size:  # (torch gives an empty view the address 0, as slicing did)
            assert piece.data_ptr() == kept.data_ptr() + offset, name


def test_dispatch_workspace_grows_with_every_size():
    from pydatacopy import _C
    base = (16, 2, 4, 8, 64, 32)
    for i in range(len(base)):
        sizes = list(base)
        previous = _C.moe_dispatch_workspace_bytes(*sizes)
        for step in (1, 2, 7, 50):
            sizes[i] = base[i] + step
            now = _C.moe_dispatch_workspace_bytes(*sizes)
            assert all(now[region] >= previous[region] for region in now), (i, sizes)
            previous = now


def test_dispatch_workspace_past_the_layout_kernels():
    from pydatacopy import _C
    assert _C.moe_dispatch_workspace(4, 2, _C.MOE_LAYOUT_MAX_PES + 1, 1, 8, 16) is None
    assert _C.moe_dispatch_workspace(4, 2, 2, _C.MOE_LAYOUT_MAX_EXPERTS_PER_PE + 1, 8, 16) is None
    with pytest.raises(pydatacopy.Error, match="outside the layout kernels' limits"):
        _C.moe_dispatch_workspace_bytes(4, 2, _C.MOE_LAYOUT_MAX_PES + 1, 1, 8, 16)


def test_moe_facts_come_from_the_core():
    from pydatacopy import _C
    from pydatacopy.moe import common
    assert common._REDUCE_DTYPES == {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    assert (common.MAX_FIELDS, common.MAX_ROW_BYTES, common.MAX_CAPACITY, common.MAX_PES) == \
        (4, (1 << 24) - 1, (1 << 31) - 1, 1024)
    assert _C.MOE_REGION_ROW_ALIGNMENT == 16
    # The Python fit rule (read by traced code, which cannot call _C) is the core's.
    limits = (_C.MOE_LAYOUT_MAX_PES, _C.MOE_LAYOUT_MAX_EXPERTS_PER_PE, _C.MOE_LAYOUT_MAX_PAIRS)
    for n_pes in (1, limits[0], limits[0] + 1):
        for experts in (1, limits[1], limits[1] + 1):
            for pairs in (0, limits[2] - 1, limits[2], limits[2] + 1):
                assert _moe_layout._layout_kernels_fit(n_pes, experts, pairs) == \
                    _C.moe_layout_kernels_fit(n_pes, experts, pairs)


# ---- a PE's own refusal still takes part in the round (the host side of it) ---------------------

def _bare_dispatcher(n_pes=2, max_tokens=4, topk=2, hidden=8):
    d = object.__new__(pydatacopy.MoeDispatcher)
    d.num_experts, d.hidden, d.topk, d.max_tokens = 2 * n_pes, hidden, topk, max_tokens
    d.dtype = d.combine_dtype = torch.bfloat16
    d.n_pes, d.experts_per_pe, d.my_pe = n_pes, 2, 0
    d._dispatch, d._combine = _RefusingBuffer(7), _RefusingBuffer(8)
    return d


def test_dispatch_refusals_run_the_round_on_the_dispatch_buffer():
    """More tokens than max_tokens (and another num_experts) on this PE: refused through the
    dispatch buffer's round (its peers' calls complete), not raised on this host alone."""
    d = _bare_dispatcher()
    x = torch.zeros(5, 8, dtype=torch.bfloat16)
    with pytest.raises(pydatacopy.Error, match="max_tokens"):
        d.dispatch(x, torch.zeros(5, 2, dtype=torch.int64))
    with pytest.raises(pydatacopy.Error, match="num_experts"):
        d.dispatch(x[:2], torch.zeros(2, 2, dtype=torch.int64), 99)
    assert len(d._dispatch.refused) == 2 and "max_tokens" in d._dispatch.refused[0]
    assert d._combine.refused == []


def test_combine_refuses_another_dispatchers_handle_through_the_round():
    """A handle tagged by another dispatcher's dispatch buffer, and a y of the wrong shape: refused
    through the combine buffer's round. The tag names the dispatch buffer and the call."""
    d = _bare_dispatcher()
    pairs = d.recv_rows
    longs = lambda *shape: torch.zeros(*shape, dtype=torch.int64)  # noqa: E731
    handle = pydatacopy.MoeHandle(longs(2), longs(2), longs(()), longs(pairs), longs(pairs), longs(pairs),
                                  longs(2), longs(pairs + 1), longs(2), longs(3, 2), longs(3, 2))
    assert d._tag(5) == (7 << 40) | 6 and d._tag(0) != 0
    handle.combine_counts._pydatacopy_dispatch = (9 << 40) | 1  # dispatcher 9's
    y = torch.zeros(pairs, 8, dtype=torch.bfloat16)
    with pytest.raises(pydatacopy.Error, match="another MoeDispatcher"):
        d.combine(y, handle, torch.zeros(3, 2))
    handle.combine_counts._pydatacopy_dispatch = d._tag(3)
    with pytest.raises(pydatacopy.Error, match="y must be"):
        d.combine(y[:1], handle, torch.zeros(3, 2))
    assert len(d._combine.refused) == 2 and d._dispatch.refused == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zero_past_keeps_the_rows_in_use_and_zeroes_the_rest(dtype):
    """The traced path's zero_unused_rows: rows [used, ...) zero bytes, rows before bit-exact."""
    rows = torch.randint(0, 256, (6, 10), dtype=torch.uint8).view(dtype)
    got = _moe_a2a._zero_past(rows, torch.tensor(4))
    assert torch.equal(got[:4].view(torch.uint8), rows[:4].view(torch.uint8))
    assert int(got[4:].view(torch.uint8).ne(0).sum()) == 0
    assert _moe_a2a._zero_past(rows, torch.tensor(9)).view(torch.uint8).equal(rows.view(torch.uint8))
