"""expand=True's dispatch in steps from Python: the exchange, the receive layout and the grouping
by local expert. Traced calls (the compacting exchange and the ops), sizes past the native call's
layout kernels (the token rows read in the receive region), and pre_reduce's dispatch, whose
top-k weights travel as one more field, take them."""

from __future__ import annotations

import torch

from .. import _C
from .._torch_utils import stream_handle
from .common import _row_bytes, _traced
from .layout import ReceiveLayout, _layout_kernels_fit, _receive_layout_eager, receive_layout
from .rows import gather_rows


def grouped_steps(moe, x, plan, weights, timeout, in_region: bool, want_positions: bool = False):
    """Sends x's rows with ``plan`` (and ``weights``, float32 [tokens, topk], when not None);
    returns (recv_x grouped by local expert, the ReceiveLayout, recv_counts, recv_offsets,
    recv_meta and recv_weights compacted by source (None without weights), call, positions):
    call the dispatch buffer's call number, None for a traced call; positions (want_positions,
    eager calls whose receive layout is the kernel; else None) int64 [rows x topk]: each
    received (token, k)'s recv_x row, -1 where that expert is not local (the kernel's output:
    received_pairs' pair_row). in_region False (or CPU tensors): the compacting exchange."""
    sends = [x, plan.meta] + ([] if weights is None else [weights])
    buffer, call, positions = moe._dispatch, None, None

    def layout_of(recv_meta, recv_counts):
        nonlocal positions
        rows = recv_meta.shape[0]
        if (want_positions and not _traced() and recv_meta.is_cuda and recv_meta.dtype == torch.int32
                and _layout_kernels_fit(moe.n_pes, moe.experts_per_pe, rows * moe.topk + 1)):
            positions = torch.empty(rows * moe.topk, dtype=torch.int64, device=recv_meta.device)
            return ReceiveLayout(*_receive_layout_eager(recv_meta, recv_counts, moe.my_pe, moe.experts_per_pe,
                                                        moe.topk, None, positions))
        return receive_layout(recv_meta, recv_counts, moe.my_pe, moe.experts_per_pe, moe.topk)

    if _traced() or not in_region or not x.is_cuda:
        if _traced():
            recvs, recv_counts, recv_offsets = buffer.exchange(sends, plan.send_counts, plan.send_index,
                                                               timeout=timeout)
        else:
            recvs, recv_counts, recv_offsets = buffer._exchange_eager(sends, plan.send_counts, plan.send_index,
                                                                      None, timeout)
            call = buffer._core.calls - 1
        layout = layout_of(recvs[1], recv_counts)
        recv_x = gather_rows(recvs[0], layout.row_of, layout.num_rows)
    else:
        # The token rows read where their senders stored them (meta and weights compacted for the layout).
        recvs, recv_counts, recv_offsets, call = buffer._exchange_in_region(
            sends, [True] + [False] * (len(sends) - 1), plan.send_counts, plan.send_index, timeout)
        try:
            stream = stream_handle(None, buffer._device)
            layout = layout_of(recvs[1], recv_counts)
            rows = layout.row_of.shape[0]
            recv_x = torch.empty((rows, moe.hidden), dtype=x.dtype, device=x.device)
            region, stride = buffer._core.in_region(0), buffer._core.region_stride
            if positions is not None and _row_bytes(x) % _C.MOE_REGION_ROW_ALIGNMENT == 0:
                # Each received row read once and stored to each of its expert rows (as the
                # native dispatch groups them), where gathering reads a row once per expert.
                _C.scatter_region_rows(recv_x.data_ptr(), rows, region, stride, recv_offsets.data_ptr(),
                                       recv_counts.data_ptr(), moe.n_pes, positions.data_ptr(), moe.topk,
                                       recvs[1].shape[0], _row_bytes(x), stream)
            else:
                _C.gather_region_rows(recv_x.data_ptr(), region, stride, recv_offsets.data_ptr(),
                                      recv_counts.data_ptr(), moe.n_pes, layout.row_of.data_ptr(),
                                      layout.num_rows.data_ptr(), rows, _row_bytes(x), stream)
        finally:
            buffer._core.release(call, stream_handle(None, buffer._device))
    recv_weights = recvs[2] if weights is not None else None
    return recv_x, layout, recv_counts, recv_offsets, recvs[1], recv_weights, call, positions
