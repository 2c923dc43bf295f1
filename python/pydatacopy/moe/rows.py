"""Row kernels of dispatch and combine: ``gather_rows`` (dispatch's grouping by expert) and
``combine_reduce`` (combine's weighted sum), with their custom ops
``torch.ops.pydatacopy.moe_gather_rows`` and ``moe_combine_reduce``."""

from __future__ import annotations

import torch

from .. import _C
from .._torch_utils import stream_handle
from .common import _REDUCE_DTYPES, Error, _eager, _row_numel, _traced

def combine_reduce(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * rows[slots[t, k]]`` (slots < 0 skipped), accumulated in
    float32 in k order, each product and sum rounded (no fused multiply-add), then rounded to
    rows' dtype (float32, bfloat16 or float16). CUDA tensors run the core's kernel; CPU tensors
    (tests, references) the same arithmetic in torch."""
    if _traced():
        return torch.ops.pydatacopy.moe_combine_reduce(rows, slots, weights, None)
    return _combine_reduce_eager(rows, slots, weights, None)


def gather_rows(src: torch.Tensor, index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``out[i] = src[index[i]]`` for ``i < count`` (a 0-dim int64 tensor on src's device, read by
    the kernel: no host synchronisation); ``out`` has ``index.shape[0]`` rows, those past the count
    unspecified. dispatch's grouping by expert: only the rows in use are copied (an index_select
    would copy every row of the fixed-size output)."""
    if _traced():
        return torch.ops.pydatacopy.moe_gather_rows(src, index, count, None)
    return _gather_rows_eager(src, index, count, None)


def _gather_rows_eager(src, index, count, stream) -> torch.Tensor:
    if index.dtype != torch.int64 or index.dim() != 1 or count.dtype != torch.int64 or count.numel() != 1:
        raise Error("pydatacopy gather_rows: index must be a 1-D int64 tensor and count one int64")
    if not src.is_cuda:  # tests, references: every row (those past the count are unspecified)
        return src.index_select(0, index.clamp(0, max(src.shape[0] - 1, 0))) if src.shape[0] else \
            src.new_empty((index.shape[0], *src.shape[1:]))
    src, index, count = src.contiguous(), index.contiguous(), count.contiguous()
    out = torch.empty((index.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    _C.gather_rows(out.data_ptr(), src.data_ptr(), index.data_ptr(), count.data_ptr(), index.shape[0],
                   src.shape[0], _row_numel(src) * src.element_size(),
                   stream_handle(stream, src.get_device()))
    return out


def _combine_reduce_eager(rows, slots, weights, stream) -> torch.Tensor:
    if rows.dtype not in _REDUCE_DTYPES:
        raise Error(f"pydatacopy combine: expert outputs must be float32, bfloat16 or float16, got {rows.dtype}")
    if slots.dim() != 2 or slots.shape != weights.shape:
        raise Error(f"pydatacopy combine: slots and weights must both be [tokens, topk], got "
                    f"{tuple(slots.shape)} and {tuple(weights.shape)}")
    tokens, topk = slots.shape
    hidden = _row_numel(rows)
    out = torch.empty((tokens, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    weights = weights.to(torch.float32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    if not rows.is_cuda:
        return _combine_reduce_reference(rows, slots, weights)
    rows = rows.contiguous()
    _C.moe_combine_reduce(out.data_ptr(), rows.data_ptr(), rows.shape[0], slots.data_ptr(),
                          weights.data_ptr(), tokens, topk, hidden, _REDUCE_DTYPES[rows.dtype],
                          stream_handle(stream, rows.get_device()))
    return out


def _combine_reduce_reference(rows, slots, weights) -> torch.Tensor:
    """The reduction's arithmetic in torch, step by step (float32, k order)."""
    tokens, topk = slots.shape
    flat = rows.reshape(rows.shape[0], -1)
    acc = torch.zeros((tokens, flat.shape[1]), dtype=torch.float32, device=rows.device)
    for k in range(topk):
        slot = slots[:, k]
        valid = (slot >= 0) & (slot < rows.shape[0])
        picked = flat.index_select(0, torch.where(valid, slot, 0)).to(torch.float32)
        product = weights[:, k:k + 1] * picked
        acc = torch.where(valid[:, None], acc + product, acc)
    return acc.to(rows.dtype).reshape((tokens, *rows.shape[1:]))


_SCHEMA_REDUCE = "(Tensor rows, Tensor slots, Tensor weights, int? stream) -> Tensor"


def _gather_real(src, index, count, stream):
    return _eager(_gather_rows_eager, src, index, count, stream)


_gather_custom = torch.library.custom_op("pydatacopy::moe_gather_rows", _gather_real, mutates_args=(),
                                         schema="(Tensor src, Tensor index, Tensor count, int? stream) -> Tensor")


@_gather_custom.register_fake
def _gather_fake(src, index, count, stream):
    return src.new_empty((index.shape[0], *src.shape[1:]))


def _reduce_real(rows, slots, weights, stream):
    return _eager(_combine_reduce_eager, rows, slots, weights, stream)


_reduce_custom = torch.library.custom_op("pydatacopy::moe_combine_reduce", _reduce_real,
                                         mutates_args=(), schema=_SCHEMA_REDUCE)


@_reduce_custom.register_fake
def _reduce_fake(rows, slots, weights, stream):
    return rows.new_empty((slots.shape[0], *rows.shape[1:]))
