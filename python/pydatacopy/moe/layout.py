"""MoE layout: which PE each token goes to (``dispatch_plan``, the sender's side) and how the
received tokens group by local expert (``receive_layout``, the receiver's side), on the GPU by
the core's kernels (custom ops ``moe_dispatch_layout``, ``moe_receive_layout``), else in plain
torch (graph-safe: fixed shapes, no host reads)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _C
from .._torch_utils import stream_handle
from .common import Error, _eager, _on_stream, _traced

class DispatchPlan(NamedTuple):
    send_counts: torch.Tensor  # [n_pes] tokens for each PE
    send_index: torch.Tensor   # [n_pes * tokens + 1]: token of each row sent, PE-major
    meta: torch.Tensor         # [tokens, topk + 1] int32 sent along: expert ids (-1: none), token
    pair_pe: torch.Tensor      # [tokens, topk]: PE of each (token, k), n_pes when none
    pair_rank: torch.Tensor    # [tokens, topk]: rank among this PE's (token, k) pairs with that PE


def _layout_kernels_fit(n_pes: int, experts_per_pe: int, pairs: int) -> bool:
    """Within the one-block layout kernels' limits (all_to_all.hpp); past them: the torch code."""
    return (n_pes <= _C.MOE_LAYOUT_MAX_PES and experts_per_pe <= _C.MOE_LAYOUT_MAX_EXPERTS_PER_PE
            and pairs < _C.MOE_LAYOUT_MAX_PAIRS)


def dispatch_plan(topk_idx: torch.Tensor, num_experts: int, n_pes: int) -> DispatchPlan:
    """Which PE each token goes to, and in which order (the sender's side of dispatch).

    On the GPU one kernel computes it (moe_dispatch_layout in the core; under torch.compile the
    op ``pydatacopy::moe_dispatch_layout``); on the CPU, or past the kernel's limits, the torch
    code of ``dispatch_plan_reference`` (the same values)."""
    tokens, topk = topk_idx.shape
    if topk_idx.is_cuda and _layout_kernels_fit(n_pes, 1, tokens * topk):
        if _traced():
            return DispatchPlan(*torch.ops.pydatacopy.moe_dispatch_layout(topk_idx, num_experts, n_pes, None))
        return DispatchPlan(*_dispatch_layout_eager(topk_idx, num_experts, n_pes, None))
    return dispatch_plan_reference(topk_idx, num_experts, n_pes)


def _dispatch_layout_eager(topk_idx, num_experts, n_pes, stream):
    tokens, topk = topk_idx.shape
    device = topk_idx.device
    with _on_stream(stream):
        if topk_idx.dtype not in (torch.int32, torch.int64):
            topk_idx = topk_idx.to(torch.int64)
        topk_idx = topk_idx.contiguous()
        send_counts = torch.empty(n_pes, dtype=torch.int64, device=device)
        send_index = torch.empty(n_pes * tokens + 1, dtype=torch.int64, device=device)
        meta = torch.empty((tokens, topk + 1), dtype=torch.int32, device=device)
        pair_pe = torch.empty((tokens, topk), dtype=torch.int64, device=device)
        pair_rank = torch.empty((tokens, topk), dtype=torch.int64, device=device)
        # Large inputs: the multi-block kernels' counts (none for small ones). Held until the
        # launches are queued; freed after, stream-ordered like the outputs.
        scratch_bytes = _C.moe_dispatch_layout_scratch_bytes(tokens, topk, n_pes)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if scratch_bytes else None
    _C.moe_dispatch_layout(topk_idx.data_ptr(), topk_idx.element_size(), tokens, topk, num_experts, n_pes,
                           send_counts.data_ptr(), send_index.data_ptr(), meta.data_ptr(),
                           pair_pe.data_ptr(), pair_rank.data_ptr(), stream_handle(stream, topk_idx.get_device()),
                           0 if scratch is None else scratch.data_ptr(), scratch_bytes)
    return send_counts, send_index, meta, pair_pe, pair_rank


def dispatch_plan_reference(topk_idx: torch.Tensor, num_experts: int, n_pes: int) -> DispatchPlan:
    """dispatch_plan in plain torch (CPU, tests; the kernel's reference). send_index entries past
    the rows sent are not specified (the kernel writes zeros)."""
    tokens, topk = topk_idx.shape
    device = topk_idx.device
    ids = topk_idx.to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    pair_pe = torch.where(valid, ids // (num_experts // n_pes), n_pes)
    hit = torch.zeros((tokens, n_pes + 1), dtype=torch.int64, device=device)
    hit.scatter_(1, pair_pe, 1)
    hit = hit[:, :n_pes]
    send_counts = hit.sum(0)
    flat = hit.t().reshape(-1)  # PE-major: [pe][token]
    position = torch.cumsum(flat, 0) - 1
    dump = n_pes * tokens  # one spare entry takes every write of a token that does not go there
    target = torch.where(flat > 0, position, dump)
    send_index = torch.zeros(n_pes * tokens + 1, dtype=torch.int64, device=device)
    send_index.scatter_(0, target, torch.arange(n_pes * tokens, device=device) % max(tokens, 1))
    # Rank of each (token, k) among this PE's pairs with the same PE, in (token, k) order: the
    # order in which that PE sends the pairs' outputs back.
    one_hot = torch.zeros((tokens * topk, n_pes + 1), dtype=torch.int64, device=device)
    one_hot.scatter_(1, pair_pe.reshape(-1, 1), 1)
    pair_rank = (torch.cumsum(one_hot, 0) - 1).gather(1, pair_pe.reshape(-1, 1)).reshape(tokens, topk)
    meta = torch.cat([torch.where(valid, ids, -1),
                      torch.arange(tokens, device=device).reshape(tokens, 1)], 1).to(torch.int32)
    return DispatchPlan(send_counts, send_index, meta, pair_pe, pair_rank)


class MoeHandle(NamedTuple):
    """What dispatch() leaves for combine() and for the expert computation; tensors on the GPU.

    ``expert_counts`` / ``expert_offsets`` (int64 ``[experts_per_pe]``): rows of each local expert
    in ``recv_x`` (expert ``e``'s rows at ``recv_x[expert_offsets[e] : + expert_counts[e]]``);
    ``num_rows`` (int64, 0-dim): rows of recv_x in use (their sum); ``expert_of_row`` (int64
    ``[rows of recv_x]``): the local expert of each row (``experts_per_pe`` past num_rows);
    ``source_pe`` / ``source_token`` (int64 ``[rows of recv_x]``): where each row came from (-1
    past num_rows); ``recv_counts`` (int64 ``[n_pes]``): tokens received from each PE. The rest is
    combine's."""
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: torch.Tensor
    expert_of_row: torch.Tensor
    source_pe: torch.Tensor
    source_token: torch.Tensor
    recv_counts: torch.Tensor
    combine_index: torch.Tensor   # [pairs + 1]: recv_x row of each pair, sent back in this order
    combine_counts: torch.Tensor  # [n_pes]: rows sent back to each PE
    pair_pe: torch.Tensor         # [tokens, topk]: the PE of each of this PE's (token, k), or n_pes
    pair_rank: torch.Tensor       # [tokens, topk]: its position among this PE's pairs with that PE


# MoeHandle's first six fields (for the expert computation), then its own.
MoeReducedHandle = NamedTuple("MoeReducedHandle", [(name, torch.Tensor) for name in MoeHandle._fields[:6]] + [
    (name, torch.Tensor) for name in ("recv_counts", "recv_offsets", "pair_row", "pair_weight", "token_pe",
                                      "token_rank")])
MoeReducedHandle.__doc__ = """What a ``pre_reduce=True`` dispatch leaves (recv_x grouped by local
    expert, as MoeHandle's; combine sums each received token's local experts here and sends one
    row per (token, PE) back); tensors on the GPU. The first six fields are MoeHandle's, for the expert computation.
    ``recv_counts`` / ``recv_offsets`` (int64 ``[n_pes]``): tokens received from each PE and
    where each source's start among the received tokens (source order, then the source's token
    order). ``pair_row`` (int64 ``[n_pes x max_tokens, topk]``): for received token ``j`` and
    slot ``k``, the recv_x row of that (token, local expert), -1 where expert ``k`` is elsewhere
    (or ``j`` was not received); ``pair_weight`` (float32, same shape): its top-k weight as
    dispatched, 0 where ``pair_row`` is -1. ``token_pe`` / ``token_rank``: MoeTokenHandle's,
    the sender's side of combine."""


# The receiver's layout: the received row behind each recv_x row, then the handle's grouping and
# combine order (MoeHandle's fields but recv_counts, which the exchange gives, and pair_pe and
# pair_rank, which the sender's dispatch_plan gives).
ReceiveLayout = NamedTuple("ReceiveLayout", [("row_of", torch.Tensor)] + [
    (name, torch.Tensor) for name in MoeHandle._fields if name not in ("recv_counts", "pair_pe", "pair_rank")])


def receive_layout(recv_meta: torch.Tensor, recv_counts: torch.Tensor, my_pe: int,
                   experts_per_pe: int, topk: int) -> ReceiveLayout:
    """The receiver's side of dispatch: group the received tokens by local expert, and the order
    in which combine sends the outputs back. ``recv_meta``: ``[R, topk + 1]`` int32 of the
    received rows (grouped by source, ``recv_counts`` of each): expert ids, then the source's
    token index.

    On the GPU one kernel computes it (moe_receive_layout in the core; under torch.compile the op
    ``pydatacopy::moe_receive_layout``); on the CPU, or past the kernel's limits,
    ``receive_layout_reference``."""
    n_pes = recv_counts.shape[0]
    if recv_meta.dim() != 2 or recv_meta.shape[1] != topk + 1:
        raise Error(f"pydatacopy receive_layout: recv_meta must be [rows, topk + 1] = [rows, {topk + 1}], "
                    f"got {tuple(recv_meta.shape)}")
    if (recv_meta.is_cuda and recv_meta.dtype == torch.int32 and n_pes >= 1 and 0 <= my_pe < n_pes
            and _layout_kernels_fit(n_pes, experts_per_pe, recv_meta.shape[0] * topk + 1)):
        if _traced():
            return ReceiveLayout(*torch.ops.pydatacopy.moe_receive_layout(
                recv_meta, recv_counts, my_pe, experts_per_pe, topk, None))
        return ReceiveLayout(*_receive_layout_eager(recv_meta, recv_counts, my_pe, experts_per_pe, topk, None))
    return receive_layout_reference(recv_meta, recv_counts, my_pe, experts_per_pe, topk)


def _receive_layout_eager(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream, positions=None):
    """The kernel; ``positions`` (int64 [rows * topk], or None): also each pair's recv_x row (-1
    for a pair with no local expert), for scatter_region_rows."""
    if recv_meta.dim() != 2 or recv_meta.shape[1] != topk + 1:  # the kernel reads topk + 1 per row
        raise Error(f"pydatacopy receive_layout: recv_meta must be [rows, topk + 1] = [rows, {topk + 1}], "
                    f"got {tuple(recv_meta.shape)}")
    rows = recv_meta.shape[0]
    n_pes = recv_counts.shape[0]
    pairs = rows * topk
    device = recv_meta.device

    def longs(*shape):
        return torch.empty(shape, dtype=torch.int64, device=device)

    with _on_stream(stream):
        recv_meta = recv_meta.contiguous()
        if recv_counts.dtype != torch.int64:
            recv_counts = recv_counts.to(torch.int64)
        recv_counts = recv_counts.contiguous()
        out = ReceiveLayout(row_of=longs(pairs), expert_counts=longs(experts_per_pe),
                            expert_offsets=longs(experts_per_pe), num_rows=longs(),
                            expert_of_row=longs(pairs), source_pe=longs(pairs), source_token=longs(pairs),
                            combine_index=longs(pairs + 1), combine_counts=longs(n_pes))
        scratch_bytes = _C.moe_receive_layout_scratch_bytes(rows, topk, experts_per_pe)  # (as in _dispatch_layout_eager)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if scratch_bytes else None
    _C.moe_receive_layout(recv_meta.data_ptr(), rows, topk, recv_counts.data_ptr(), n_pes, my_pe,
                          experts_per_pe, *(t.data_ptr() for t in out),
                          0 if positions is None else positions.data_ptr(),
                          stream_handle(stream, recv_meta.get_device()),
                          0 if scratch is None else scratch.data_ptr(), scratch_bytes)
    return tuple(out)


def receive_layout_reference(recv_meta: torch.Tensor, recv_counts: torch.Tensor, my_pe: int,
                             experts_per_pe: int, topk: int) -> ReceiveLayout:
    """receive_layout in plain torch (CPU, tests; the kernel's reference). combine_index entries
    past the pairs sent back are not specified (the kernel writes zeros)."""
    rows = recv_meta.shape[0]
    n_pes = recv_counts.shape[0]
    device = recv_meta.device
    pairs = rows * topk
    received = torch.cumsum(recv_counts, 0)
    total = received[-1] if n_pes else torch.zeros((), dtype=torch.int64, device=device)
    row_ids = torch.arange(rows, device=device)
    row_in_use = row_ids < total
    ids = recv_meta[:, :topk].to(torch.int64)
    local = ids - my_pe * experts_per_pe
    pair_valid = row_in_use[:, None] & (ids >= 0) & (local >= 0) & (local < experts_per_pe)
    flat_valid = pair_valid.reshape(-1)
    flat_ids = torch.arange(pairs, device=device)
    expert = torch.where(pair_valid, local, experts_per_pe).reshape(-1)
    # Sort by (expert, received row, k): pairs of no local expert go last. Keys stay unique.
    order = torch.sort(expert * pairs + flat_ids).indices
    row_of = order // topk
    expert_counts = torch.zeros(experts_per_pe + 1, dtype=torch.int64, device=device)
    expert_counts.scatter_add_(0, expert, torch.ones_like(expert))
    expert_counts = expert_counts[:experts_per_pe]
    expert_offsets = torch.cumsum(expert_counts, 0) - expert_counts
    num_rows = expert_counts.sum()
    in_use = torch.arange(pairs, device=device) < num_rows
    expert_of_row = torch.where(in_use, expert.gather(0, order), experts_per_pe)
    source_pe_of_row = torch.searchsorted(received, row_ids, right=True)  # [R]
    starts = received - recv_counts
    source_pe = torch.where(in_use, source_pe_of_row.gather(0, row_of), -1)
    source_token = torch.where(in_use, recv_meta[:, topk].to(torch.int64).gather(0, row_of), -1)
    # Combine sends the outputs back in (received row, k) order: the sender's (token, k) order.
    recv_x_row = torch.empty(pairs, dtype=torch.int64, device=device)
    recv_x_row.scatter_(0, order, torch.arange(pairs, device=device))
    back = torch.cumsum(flat_valid.to(torch.int64), 0) - 1
    combine_index = torch.zeros(pairs + 1, dtype=torch.int64, device=device)
    combine_index.scatter_(0, torch.where(flat_valid, back, pairs), recv_x_row)
    per_row = pair_valid.sum(1)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(per_row, 0)])
    combine_counts = cumulative.gather(0, received) - cumulative.gather(0, starts)
    return ReceiveLayout(row_of, expert_counts, expert_offsets, num_rows, expert_of_row, source_pe,
                         source_token, combine_index, combine_counts)


def combine_slots(pair_pe: torch.Tensor, pair_rank: torch.Tensor, back_counts: torch.Tensor,
                  back_offsets: torch.Tensor, n_pes: int) -> torch.Tensor:
    """Row of combine's receive tensor holding each (token, k)'s output, -1 for none (no expert,
    or fewer rows came back from that PE than expected: a refused round)."""
    pe = pair_pe.clamp(max=n_pes - 1)
    came = back_counts.gather(0, pe.reshape(-1)).reshape(pe.shape)
    start = back_offsets.gather(0, pe.reshape(-1)).reshape(pe.shape)
    valid = (pair_pe < n_pes) & (pair_rank < came)
    return torch.where(valid, start + pair_rank, -1)


class MoeTokenHandle(NamedTuple):
    """What an ``expand=False`` dispatch leaves for combine (DeepEP's normal-mode layout: each
    token arrives once per receiving PE, recv_x grouped by source PE); tensors on the GPU.

    ``num_rows`` (int64, 0-dim): rows of recv_x in use, the tokens received (``recv_counts``
    summed); ``recv_counts`` / ``recv_offsets`` (int64 ``[n_pes]``): source ``s``'s tokens are
    recv_x rows ``[recv_offsets[s], + recv_counts[s])``, in ``s``'s token order;
    ``source_token`` (int64 ``[rows of recv_x]``): each row's token index on its source (-1 past
    num_rows). The rest is combine's: ``token_pe`` / ``token_rank`` (int64 ``[tokens, width]``,
    width = min(topk, n_pes)): the PEs this PE's token ``t`` was sent to, ascending (``n_pes``
    pads the rest), and ``t``'s position among the tokens this PE sent to each (-1 where
    ``token_pe`` pads)."""
    num_rows: torch.Tensor
    recv_counts: torch.Tensor
    recv_offsets: torch.Tensor
    source_token: torch.Tensor
    token_pe: torch.Tensor
    token_rank: torch.Tensor


def token_destinations(pair_pe: torch.Tensor, n_pes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sender's side of an ``expand=False`` combine: from dispatch_plan's ``pair_pe``
    (``[tokens, topk]``, ``n_pes`` for a slot with no expert), each token's destination PEs in
    ascending order and its rank among the tokens sent to each: ``(token_pe, token_rank)``, int64
    ``[tokens, min(topk, n_pes)]`` (``n_pes`` / -1 past a token's PEs). combine sums the rows
    that come back in that order. Plain torch, fixed shapes, no host read (eager, captured and
    traced alike; the CPU reference is this same code)."""
    tokens, topk = pair_pe.shape
    width = min(topk, n_pes)
    device = pair_pe.device
    hit = torch.zeros((tokens, n_pes + 1), dtype=torch.int64, device=device)
    hit.scatter_(1, pair_pe.to(torch.int64), 1)  # several slots on one PE: one hit
    hit = hit[:, :n_pes]
    rank = torch.cumsum(hit, 0) - 1     # position among the tokens sent to that PE
    column = torch.cumsum(hit, 1) - 1   # position among the token's PEs, ascending
    # PEs not hit go to a spare column (width), dropped after: a token hits at most width PEs.
    target = torch.where(hit > 0, column, width)
    pes = torch.arange(n_pes, dtype=torch.int64, device=device).expand(tokens, n_pes).contiguous()
    token_pe = torch.full((tokens, width + 1), n_pes, dtype=torch.int64, device=device)
    token_pe.scatter_(1, target, pes)
    token_pe = token_pe[:, :width].contiguous()
    sent = token_pe < n_pes
    token_rank = torch.where(sent, rank.gather(1, token_pe.clamp(max=n_pes - 1)), -1)
    return token_pe, token_rank


def local_topk(recv_meta: torch.Tensor, recv_weights: torch.Tensor | None, num_rows: torch.Tensor, my_pe: int,
               experts_per_pe: int, topk: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The receiver's side of an ``expand=False`` dispatch: from the received meta rows
    (``[rows, topk + 1]`` int32: global expert ids, -1 for none, then the source's token) and
    weights (float32 ``[rows, topk]``, or None), ``(recv_topk_idx, recv_topk_weights,
    source_token)``: int64 local expert ids (global id - my_pe x experts_per_pe), -1 for an
    expert on another PE or none; the weights, 0 where the id is -1 (None without weights); the
    source's token index, -1 past num_rows. Rows past ``num_rows`` (0-dim int64 on the same
    device) are not data: -1 ids, 0 weights there. Plain torch, as token_destinations."""
    in_use = torch.arange(recv_meta.shape[0], device=recv_meta.device) < num_rows
    recv_topk_idx, recv_topk_weights = local_expert_ids(recv_meta[:, :topk], recv_weights, in_use, my_pe,
                                                        experts_per_pe)
    source_token = torch.where(in_use, recv_meta[:, topk].to(torch.int64), -1)
    return recv_topk_idx, recv_topk_weights, source_token


def local_expert_ids(ids: torch.Tensor, weights: torch.Tensor | None, in_use: torch.Tensor, my_pe: int,
                     experts_per_pe: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Received global expert ids (``[rows, topk]``, any integer dtype, -1 for none) as local ids
    (int64, global - my_pe x experts_per_pe; -1 for an expert elsewhere, none, or a row not
    ``in_use`` (bool ``[rows]``)) and their weights (float32, 0 where the id is -1; None without)."""
    ids = ids.to(torch.int64)
    local = ids - my_pe * experts_per_pe
    mine = in_use[:, None] & (ids >= 0) & (local >= 0) & (local < experts_per_pe)
    recv_topk_weights = None
    if weights is not None:
        zero = torch.zeros((), dtype=torch.float32, device=ids.device)
        recv_topk_weights = torch.where(mine, weights.to(torch.float32), zero)
    return torch.where(mine, local, -1), recv_topk_weights


# ---- the layout ops ----------------------------------------------------------------------------

def _dispatch_layout_real(topk_idx, num_experts, n_pes, stream):
    if not topk_idx.is_cuda:  # opcheck and references on the CPU: the torch code
        return tuple(t.clone() for t in dispatch_plan_reference(topk_idx, num_experts, n_pes))
    return _eager(_dispatch_layout_eager, topk_idx, num_experts, n_pes, stream)


_dispatch_layout_custom = torch.library.custom_op(
    "pydatacopy::moe_dispatch_layout", _dispatch_layout_real, mutates_args=(),
    schema="(Tensor topk_idx, int num_experts, int n_pes, int? stream) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@_dispatch_layout_custom.register_fake
def _dispatch_layout_fake(topk_idx, num_experts, n_pes, stream):
    tokens, topk = topk_idx.shape
    longs = dict(dtype=torch.int64)
    return (topk_idx.new_empty((n_pes,), **longs), topk_idx.new_empty((n_pes * tokens + 1,), **longs),
            topk_idx.new_empty((tokens, topk + 1), dtype=torch.int32),
            topk_idx.new_empty((tokens, topk), **longs), topk_idx.new_empty((tokens, topk), **longs))


def _receive_layout_real(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream):
    if not recv_meta.is_cuda:
        return tuple(t.clone() for t in receive_layout_reference(recv_meta, recv_counts, my_pe,
                                                                 experts_per_pe, topk))
    return _eager(_receive_layout_eager, recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream)


_receive_layout_custom = torch.library.custom_op(
    "pydatacopy::moe_receive_layout", _receive_layout_real, mutates_args=(),
    schema="(Tensor recv_meta, Tensor recv_counts, int my_pe, int experts_per_pe, int topk, int? stream) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_receive_layout_custom.register_fake
def _receive_layout_fake(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream):
    pairs = recv_meta.shape[0] * topk
    n_pes = recv_counts.shape[0]

    def longs(*shape):
        return recv_meta.new_empty(shape, dtype=torch.int64)

    return (longs(pairs), longs(experts_per_pe), longs(experts_per_pe), longs(), longs(pairs),
            longs(pairs), longs(pairs), longs(pairs + 1), longs(n_pes))
