"""What the MoE modules share: limits, the tracing and capture checks, row sizes, the stream
context, and running an op's real kernel as eager code."""

from __future__ import annotations

import sys

import torch
from torch._C import _len_torch_dispatch_stack

from .. import _C

Error = _C.Error

# The core's limits (AllToAllLayout in include/pydatacopy/all_to_all.hpp), read from _C.
MAX_FIELDS = _C.ALL_TO_ALL_MAX_FIELDS
MAX_ROW_BYTES = _C.ALL_TO_ALL_MAX_ROW_BYTES
MAX_CAPACITY = _C.ALL_TO_ALL_MAX_CAPACITY
MAX_PES = _C.ALL_TO_ALL_MAX_PES
# The reductions' dtype codes (ReduceDtype), by torch dtype.
_REDUCE_DTYPES = {getattr(torch, name): code for name, code in _C.REDUCE_DTYPES.items()}


def _traced() -> bool:
    """Dynamo tracing, or a torch dispatch mode active (make_fx, FakeTensorMode): the ops, not _C."""
    return torch.compiler.is_dynamo_compiling() or _len_torch_dispatch_stack() > 0


def _refuse_tracing(what: str) -> None:
    if _traced():
        raise Error(f"pydatacopy.{what} allocates or frees on every PE, so it cannot be part of a "
                    "traced or compiled graph: call it before or after the compiled function")


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise Error(f"pydatacopy.{what} blocks (it waits for every PE), so it cannot be captured in a "
                    "CUDA graph: call it before or after the capture")


def _mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """torch._dynamo.mark_static_address without importing torch._dynamo (2 s) when not loaded."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.mark_static_address(tensor)
    else:
        tensor._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    return tensor


def _row_bytes(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    per_row = tensor.numel() // rows if rows else _row_numel(tensor)
    return per_row * tensor.element_size()


def _row_numel(tensor: torch.Tensor) -> int:
    numel = 1
    for extent in tensor.shape[1:]:
        numel *= extent
    return numel


class _on_stream:
    """torch.cuda.stream(stream) for a torch stream or a raw cudaStream_t; nothing for None."""

    def __init__(self, stream) -> None:
        if isinstance(stream, int) and not isinstance(stream, bool):
            stream = torch.cuda.ExternalStream(stream)
        self._context = torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else None

    def __enter__(self):
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)


def _eager(function, *args):
    """Run an op's real kernel as eager code even under a dispatch mode that handed it on."""
    if _len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return function(*args)
    return function(*args)
