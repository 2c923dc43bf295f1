"""MoeDispatcher's pre_reduce mode (issue 37 item 2, DeepEP's expert-side reduction for the
expanded layout): dispatch as expand=True (recv_x grouped by local expert) with the top-k
weights sent along; combine sums each received token's local experts' outputs, weighted, on the
expert side and sends one row per (token, PE) back, which the source sums across PEs as an
expand=False combine does. Dispatch: the exchange with one more field, the receive layout and
the grouping (grouped.py). Combine: eagerly with every peer direct, one native call whose send
kernel sums each row as it stores it (moe_combine_region_summed); else the reduction kernel,
then expand=False's combine. Functions of the dispatcher (``moe``), called by
MoeDispatcher.dispatch / combine after their argument checks."""

from __future__ import annotations

import contextlib

import torch

from .. import _C
from .._torch_utils import stream_handle, timeout_seconds
from .common import _REDUCE_DTYPES, Error, _traced
from .grouped import grouped_steps
from .layout import (MoeHandle, MoeReducedHandle, MoeTokenHandle, dispatch_plan, local_expert_ids,
                     token_destinations)
from .rows import combine_reduce
from . import tokens as _tokens

# Eager combines sum each token's local experts as its row is sent (moe_combine_region_summed:
# the partial rows never written and read back) where every peer takes direct stores; False: the
# reduction kernel first, then the rows sent as they are (what RMA peers and traced calls take).
SUM_IN_SEND = True


def check_setup(call: str, expand, pre_reduce) -> None:
    if not isinstance(pre_reduce, bool) or (pre_reduce and not expand):
        raise Error(f"{call}: pre_reduce (combine sums a token's local experts before sending it back) must be a "
                    f"bool and needs expand=True (expand=False's combine already takes one row per token); "
                    f"got pre_reduce={pre_reduce!r} with expand={expand}")


def check_dispatch(moe, x, topk_weights) -> None:
    if topk_weights is None:
        raise Error("pydatacopy.MoeDispatcher.dispatch: this dispatcher is pre_reduce=True: pass "
                    "topk_weights=[tokens, topk] to dispatch (combine weighs and sums each token's local "
                    "experts on the expert side, so the weights travel with the tokens)")
    _tokens.check_dispatch_weights(moe, x, topk_weights)


def check_combine(moe, handle, topk_weights) -> None:
    call = "pydatacopy.MoeDispatcher.combine"
    if not isinstance(handle, MoeReducedHandle):
        other = " (another mode's handle: this dispatcher is pre_reduce=True)" \
            if isinstance(handle, (MoeHandle, MoeTokenHandle)) else ""
        raise Error(f"{call}: handle must be the MoeReducedHandle dispatch() returned, got "
                    f"{type(handle).__name__}{other}")
    if not all(isinstance(field, torch.Tensor) for field in handle):
        raise Error(f"{call}: every field of the handle must be a tensor (the MoeReducedHandle dispatch() returned)")
    if topk_weights is not None:
        raise Error(f"{call}: a pre_reduce=True combine takes no topk_weights: they came with dispatch "
                    "(its topk_weights) and are in the handle")
    width = min(moe.topk, moe.n_pes)
    rows = moe.n_pes * moe.max_tokens
    if (tuple(handle.pair_row.shape) != (rows, moe.topk) or tuple(handle.pair_weight.shape) != (rows, moe.topk)
            or handle.token_pe.dim() != 2 or handle.token_pe.shape[1] != width
            or tuple(handle.token_rank.shape) != tuple(handle.token_pe.shape)
            or tuple(handle.recv_counts.shape) != (moe.n_pes,)):
        raise Error(f"{call}: the handle's pair_row / pair_weight must be [{rows}, {moe.topk}], token_pe / "
                    f"token_rank [tokens, {width}] and recv_counts [{moe.n_pes}] (a MoeReducedHandle of this "
                    "dispatcher's dispatch)")


def dispatch(moe, x, topk_idx, topk_weights, timeout, in_region: bool):
    """expand=True's dispatch with the weights as a third field; returns (recv_x, handle, call):
    call the dispatch buffer's call number (None for a traced call), for the handle's tag."""
    plan = dispatch_plan(topk_idx, moe.num_experts, moe.n_pes)
    recv_x, layout, recv_counts, recv_offsets, recv_meta, recv_weights, call, positions = grouped_steps(
        moe, x, plan, topk_weights.to(torch.float32).contiguous(), timeout, in_region, want_positions=True)
    if positions is not None:  # the receive layout kernel's own (the same values, no torch ops)
        pair_row = positions.view(recv_meta.shape[0], moe.topk)
        pair_weight = torch.where(pair_row >= 0, recv_weights, torch.zeros((), device=recv_weights.device))
    else:
        pair_row, pair_weight = received_pairs(recv_meta, recv_weights, recv_counts, layout.combine_index,
                                               moe.my_pe, moe.experts_per_pe, moe.topk)
    if not _traced() and _tokens._native_layouts_fit(moe, x.shape[0], recv_meta):
        token_pe, token_rank = _tokens._token_destinations_native(moe, plan, x.shape[0])
    else:
        token_pe, token_rank = token_destinations(plan.pair_pe, moe.n_pes)
    handle = MoeReducedHandle(layout.expert_counts, layout.expert_offsets, layout.num_rows, layout.expert_of_row,
                              layout.source_pe, layout.source_token, recv_counts, recv_offsets, pair_row,
                              pair_weight, token_pe, token_rank)
    return recv_x, handle, call


def received_pairs(recv_meta: torch.Tensor, recv_weights: torch.Tensor, recv_counts: torch.Tensor,
                   combine_index: torch.Tensor, my_pe: int, experts_per_pe: int, topk: int):
    """(pair_row, pair_weight) of MoeReducedHandle: for each received token (``recv_meta``'s
    rows, compacted by source) and slot k, the recv_x row of that (token, local expert), -1
    where the expert is elsewhere, and its weight (0 there). The receive layout's combine_index
    lists exactly those rows, in (received token, k) order (the order combine sends them back
    in: receive_layout_reference), so the n-th local pair's row is its n-th entry. Plain torch,
    fixed shapes, no host read (eager, captured and traced alike)."""
    rows = recv_meta.shape[0]
    in_use = torch.arange(rows, device=recv_meta.device) < recv_counts.sum()
    local, weights = local_expert_ids(recv_meta[:, :topk], recv_weights, in_use, my_pe, experts_per_pe)
    mine = (local >= 0).reshape(-1)
    nth = (torch.cumsum(mine.to(torch.int64), 0) - 1).clamp(min=0)
    pair_row = torch.where(mine, combine_index.gather(0, nth), -1).reshape(rows, topk)
    return pair_row, weights


def combine(moe, y, handle: MoeReducedHandle, timeout, tag: int, in_region: bool):
    """Each received token's local experts' rows of y (recv_x's layout), weighted and summed in
    float32 in k order and rounded to y's dtype, then expand=False's combine: one row per
    received token back to its source, summed there in ascending PE order in float32 and
    rounded once. Eagerly with every peer direct: one native call that sums as it sends
    (moe_combine_region_summed); else the reduction kernel, then the rows sent."""
    if not _traced() and in_region and SUM_IN_SEND and _summed_fits(moe, y, handle):
        buffer = moe._combine
        tokens, width = handle.token_pe.shape
        with _refused_if_out_of_memory(moe, timeout, "the combine's output"):
            y = y.contiguous()
            # Held in locals until the call has queued its kernels (as combine_tokens' inputs).
            pair_row, pair_weight = handle.pair_row.contiguous(), handle.pair_weight.contiguous()
            token_pe, token_rank = handle.token_pe.contiguous(), handle.token_rank.contiguous()
            out = torch.empty((tokens, y.shape[1]), dtype=y.dtype, device=y.device)
            back = torch.empty(2 * moe.n_pes, dtype=torch.int64, device=y.device)  # (scratch, as in combine)
        _C.moe_combine_region_summed(buffer._core, y.data_ptr(), y.shape[0], y.shape[1], _REDUCE_DTYPES[y.dtype],
                                     pair_row.data_ptr(), pair_weight.data_ptr(), pair_row.shape[0], moe.topk,
                                     handle.recv_counts.data_ptr(), token_pe.data_ptr(), token_rank.data_ptr(),
                                     moe._unit_weights.data_ptr(), tokens, width, out.data_ptr(), back.data_ptr(),
                                     back[moe.n_pes:].data_ptr(), stream_handle(None, buffer._device),
                                     timeout_seconds(timeout), tag)
        return out
    with _refused_if_out_of_memory(moe, timeout, f"the expert-side sums ({handle.pair_row.shape[0]} rows)"):
        partial = combine_reduce(y, handle.pair_row, handle.pair_weight)
    return _tokens.combine_tokens(moe, partial, handle, timeout, tag, in_region)


@contextlib.contextmanager
def _refused_if_out_of_memory(moe, timeout, what: str):
    """Work before the combine's round: an allocation this PE alone may fail (its memory) still
    takes part in the round, refused, so that the peers' calls end with Error, not a timeout."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        moe._combine._refuse(Error(f"pydatacopy.MoeDispatcher.combine: {what} could not be allocated on "
                                   f"this PE: {error}"), None, timeout)
        raise


def _summed_fits(moe, y, handle) -> bool:
    """Whether moe_combine_region_summed takes these tensors and this buffer (every peer direct);
    else the two steps (their checks)."""
    device = moe._combine._device
    used = (y, handle.pair_row, handle.pair_weight, handle.recv_counts, handle.token_pe, handle.token_rank)
    on_device = all(t.get_device() == device for t in used)  # the tensors the native call reads
    return (on_device and handle.recv_counts.dtype == torch.int64 and handle.recv_counts.is_contiguous()
            and handle.pair_row.dtype == torch.int64 and handle.pair_weight.dtype == torch.float32
            and handle.token_pe.dtype == torch.int64 and handle.token_rank.dtype == torch.int64
            and handle.token_pe.shape[0] <= moe.max_tokens and moe._combine._core.initialized
            and moe._combine._core.sums_in_send)
