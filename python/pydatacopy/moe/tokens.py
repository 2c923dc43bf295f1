"""MoeDispatcher's expand=False mode (DeepEP's normal-mode layout: each token arrives once per
receiving PE, grouped by source; combine returns one row per (token, PE) and sums across PEs).
Built from the default's pieces: the sender's layout (dispatch_plan), the exchange's compacted
output, the reduction kernel with weight 1, and plain torch for the small tensors
(token_destinations, local_topk in layout.py). Functions of the dispatcher (``moe``), called by
MoeDispatcher.dispatch / combine after their argument checks."""

from __future__ import annotations

import torch

from .. import _C
from .._torch_utils import stream_handle, timeout_seconds
from .common import _REDUCE_DTYPES, Error, _row_bytes, _traced
from .layout import (MoeHandle, MoeTokenHandle, _layout_kernels_fit, combine_slots, dispatch_plan, local_topk,
                     token_destinations)
from .rows import combine_reduce


def check_setup(call: str, expand, recv_in_region) -> None:
    """MoeDispatcher's expand and recv_in_region arguments."""
    if not isinstance(expand, bool):
        raise Error(f"{call}: expand must be True (rows grouped by local expert) or False (one row per "
                    f"received token, DeepEP's normal mode), got {expand!r}")
    if not isinstance(recv_in_region, bool) or (recv_in_region and expand):
        raise Error(f"{call}: recv_in_region (recv_x read where the senders stored it) must be a bool and "
                    f"needs expand=False; got recv_in_region={recv_in_region!r} with expand={expand}")


def check_dispatch_weights(moe, x, topk_weights) -> None:
    call = "pydatacopy.MoeDispatcher.dispatch"
    if moe.expand and not moe.pre_reduce:
        raise Error(f"{call}: topk_weights are taken at dispatch only by an expand=False or pre_reduce=True "
                    "dispatcher; this one (expand=True) takes them at combine(y, handle, topk_weights)")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (x.shape[0], moe.topk):
        raise Error(f"{call}: topk_weights must be [tokens, topk] = [{x.shape[0]}, {moe.topk}], got "
                    f"{tuple(getattr(topk_weights, 'shape', ()))}")
    if not topk_weights.dtype.is_floating_point:
        raise Error(f"{call}: topk_weights must be a floating-point tensor, got {topk_weights.dtype}")


def dispatch_tokens(moe, x, topk_idx, topk_weights, timeout, zero_unused_rows, extras=()):
    """expand=False's dispatch: the tokens (with their ids, index and weights) exchanged and
    compacted by source (the exchange's own output order: source ascending, then the order
    the source sent, its token order), then the local ids in torch (small tensors). The
    same steps eager, captured and traced. ``extras``: more per-token tensors (rows as x's)
    sent along (pydatacopy.compat.deep_ep: top-k and scales), received as the rows of x are;
    returned after the handle, in a list."""
    plan = dispatch_plan(topk_idx, moe.num_experts, moe.n_pes)
    sends = [x, plan.meta]
    if topk_weights is not None:
        sends.append(topk_weights.to(torch.float32).contiguous())
    sends.extend(extras)
    call = None
    if _traced():
        recvs, recv_counts, recv_offsets = moe._dispatch.exchange(
            sends, plan.send_counts, plan.send_index, timeout=timeout)
    elif moe.recv_in_region and not extras:
        # Every field left where its sender stored it, packed by source (one crossing, no copy):
        # valid until the dispatch after next (AllToAll._exchange_compact).
        recvs, recv_counts, recv_offsets = moe._dispatch._exchange_compact(
            sends, plan.send_counts, plan.send_index, timeout)
        call = moe._dispatch._core.calls - 1
        if zero_unused_rows:
            _C.zero_rows_past(recvs[0].data_ptr(), recvs[0].shape[0], _row_bytes(recvs[0]), recv_counts.data_ptr(),
                              moe.n_pes, stream_handle(None, recvs[0].device.index))
    else:
        recvs, recv_counts, recv_offsets = moe._dispatch._exchange_eager(
            sends, plan.send_counts, plan.send_index, None, timeout, zero_unused_rows=zero_unused_rows)
        call = moe._dispatch._core.calls - 1
    recv_x, recv_meta = recvs[0], recvs[1]
    if zero_unused_rows and _traced():
        from .all_to_all import _zero_past
        recv_x = _zero_past(recv_x, recv_counts.sum())
    recv_weights = recvs[2] if topk_weights is not None else None
    if _traced() or not _native_layouts_fit(moe, x.shape[0], recv_meta):
        num_rows = recv_counts.sum()
        recv_topk_idx, recv_topk_weights, source_token = local_topk(
            recv_meta, recv_weights, num_rows, moe.my_pe, moe.experts_per_pe, moe.topk)
        token_pe, token_rank = token_destinations(plan.pair_pe, moe.n_pes)
    else:
        # One kernel each for what the torch code above takes a dozen ops for (the same values).
        num_rows, recv_topk_idx, recv_topk_weights, source_token = _local_topk_native(
            moe, recv_meta, recv_weights, recv_counts)
        token_pe, token_rank = _token_destinations_native(moe, plan, x.shape[0])
    handle = MoeTokenHandle(num_rows, recv_counts, recv_offsets, source_token, token_pe, token_rank)
    if call is not None:
        moe._mark(handle, call)
    if extras:
        return recv_x, recv_topk_idx, recv_topk_weights, handle, recvs[len(sends) - len(extras):]
    return recv_x, recv_topk_idx, recv_topk_weights, handle


def _native_layouts_fit(moe, tokens: int, recv_meta) -> bool:
    """Whether the two layout kernels take these sizes (moe_token_destinations / moe_local_topk's
    limits, all_to_all.hpp) and tensors; else the torch code (the same values)."""
    rows = recv_meta.shape[0]
    return (recv_meta.is_cuda and _layout_kernels_fit(moe.n_pes, 1, tokens * max(moe.n_pes, moe.topk))
            and _layout_kernels_fit(moe.n_pes, 1, rows * moe.topk))


def _local_topk_native(moe, recv_meta, recv_weights, recv_counts):
    """local_topk and num_rows in one kernel (moe_local_topk); the received weights (a fresh
    tensor of the exchange's) are zeroed in place where the id is not local."""
    rows, topk, device = recv_meta.shape[0], moe.topk, recv_meta.device
    # The handle's two (kept while the handle lives) apart from recv_topk_idx (the caller's to drop).
    recv_topk_idx = torch.empty(rows * topk, dtype=torch.int64, device=device)
    source_token, num_rows = torch.empty(rows + 1, dtype=torch.int64, device=device).split_with_sizes((rows, 1))
    _C.moe_local_topk(recv_meta.data_ptr(), rows, topk, recv_counts.data_ptr(), moe.n_pes, moe.my_pe,
                      moe.experts_per_pe, recv_topk_idx.data_ptr(),
                      0 if recv_weights is None else recv_weights.data_ptr(), source_token.data_ptr(),
                      num_rows.data_ptr(), stream_handle(None, device.index))
    return num_rows.view(()), recv_topk_idx.view(rows, topk), recv_weights, source_token


def _token_destinations_native(moe, plan, tokens: int):
    """token_destinations in one kernel (moe_token_destinations), from the sender's layout."""
    width = min(moe.topk, moe.n_pes)
    device = plan.pair_pe.device
    both = torch.empty(2 * tokens * width, dtype=torch.int64, device=device)
    token_pe, token_rank = both.split_with_sizes((tokens * width, tokens * width))
    _C.moe_token_destinations(plan.send_counts.data_ptr(), plan.send_index.data_ptr(), plan.pair_pe.data_ptr(),
                              tokens, moe.topk, moe.n_pes, token_pe.data_ptr(), token_rank.data_ptr(),
                              stream_handle(None, device.index))
    return token_pe.view(tokens, width), token_rank.view(tokens, width)


def check_token_combine(moe, y, handle, topk_weights) -> None:
    call = "pydatacopy.MoeDispatcher.combine"
    if not isinstance(handle, MoeTokenHandle):
        raise Error(f"{call}: this dispatcher is expand=False: handle must be the MoeTokenHandle its "
                    f"dispatch() returned, got {type(handle).__name__}"
                    + (" (an expand=True dispatcher's handle)" if isinstance(handle, MoeHandle) else ""))
    if not all(isinstance(field, torch.Tensor) for field in handle):  # (a hand-made handle: Error, not AttributeError)
        raise Error(f"{call}: every field of the handle must be a tensor (the MoeTokenHandle dispatch() returned)")
    if topk_weights is not None:
        raise Error(f"{call}: an expand=False combine takes no topk_weights: y holds one row per received "
                    "token, its local experts' outputs already weighted and summed (the weights came "
                    "with dispatch's recv_topk_weights)")
    if tuple(handle.token_pe.shape) != tuple(handle.token_rank.shape) or handle.token_pe.dim() != 2 \
            or handle.token_pe.shape[1] != min(moe.topk, moe.n_pes) \
            or tuple(handle.recv_counts.shape) != (moe.n_pes,):
        raise Error(f"{call}: the handle's token_pe / token_rank must be [tokens, {min(moe.topk, moe.n_pes)}] "
                    f"and recv_counts [{moe.n_pes}] (a MoeTokenHandle of this dispatcher's dispatch)")


def combine_tokens(moe, y, handle, timeout, tag, in_region: bool):
    """expand=False's combine: each row of y goes back to its source (the rows are already in
    source order, recv_counts of each: no index), and the source sums the rows of each
    token's PEs in ascending PE order: the reduction kernel with the pairs (token, PE) and
    weight 1. in_region False: the compacting steps (as traced calls take). The row width is
    y's (the dispatcher's hidden, or narrower: compat.deep_ep sums its top-k weights so)."""
    tokens, width = handle.token_pe.shape
    hidden = y.shape[1]
    if _traced() or not in_region or not _combine_fits(moe, y, handle):
        if _traced():
            (back,), back_counts, back_offsets = moe._combine.exchange(
                [y], handle.recv_counts, None, timeout=timeout)
        else:
            (back,), back_counts, back_offsets = moe._combine._exchange_eager(
                [y], handle.recv_counts, None, None, timeout, tag)
        slots = combine_slots(handle.token_pe, handle.token_rank, back_counts, back_offsets, moe.n_pes)
        ones = torch.ones(slots.shape, dtype=torch.float32, device=slots.device)
        return combine_reduce(back, slots, ones)
    buffer = moe._combine
    y = y.contiguous()
    token_pe, token_rank = handle.token_pe.contiguous(), handle.token_rank.contiguous()
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    back = torch.empty(2 * moe.n_pes, dtype=torch.int64, device=y.device)  # (scratch, as in combine)
    # No index: y's rows are sent as they lie, recv_counts[d] of them to PE d in PE order.
    _C.moe_combine_region(buffer._core, y.data_ptr(), y.shape[0], hidden, _REDUCE_DTYPES[y.dtype],
                          handle.recv_counts.data_ptr(), 0, 0, token_pe.data_ptr(), token_rank.data_ptr(),
                          moe._unit_weights.data_ptr(), tokens, width, out.data_ptr(), back.data_ptr(),
                          back[moe.n_pes:].data_ptr(), stream_handle(None, buffer._device),
                          timeout_seconds(timeout), tag)
    return out


def _combine_fits(moe, y, handle) -> bool:
    """Whether moe_combine_region takes these tensors; else the steps in Python (their checks)."""
    device = moe._combine._device
    counts, token_pe, token_rank = handle.recv_counts, handle.token_pe, handle.token_rank
    return (y.get_device() == device and counts.get_device() == device and token_pe.get_device() == device
            and token_rank.get_device() == device and counts.dtype == torch.int64 and counts.is_contiguous()
            and token_pe.dtype == torch.int64 and token_rank.dtype == torch.int64
            and token_pe.shape[0] <= moe.max_tokens and moe._combine._core.initialized)
