"""Registered memory for NVSHMEM's remote transports (the core's registration.cpp).

Across servers, NVSHMEM's transports (InfiniBand, UCX, libfabric) need the local side of every
put and get, the source of a send, and put_blocks' and put_many's sources to be symmetric or
registered. pydatacopy registers a tensor's whole CUDA allocation the first time it is used on
that path (PYDATACOPY_AUTO_REGISTER=1, the default); that first use blocks like a cudaMalloc
(inside a CUDA graph capture it happens at capture time; the buffer keeps its address for every
replay). register() does it up front for long-lived buffers (KV pools, weights), and is required
when PYDATACOPY_AUTO_REGISTER=0.
"""

from __future__ import annotations

import torch

from .. import _C
from ..ops import refuse_capture
from .._torch_utils import check_tensor as _check_tensor, nbytes as _nbytes, require_init as _require_init

Error = _C.Error


def _checked(tensor: torch.Tensor, what: str) -> torch.Tensor:
    _require_init(what)
    refuse_capture(what)
    return _check_tensor(tensor, "tensor")


def register(tensor: torch.Tensor) -> None:
    """Register the CUDA allocation holding `tensor` with NVSHMEM, so that it can be the local
    side of transfers to peers on other servers with no extra copy and no first-use cost.

    Local (no peer takes part) and blocking. Counted: each call needs one ``unregister()``.
    Symmetric tensors (``empty()``) need no registration: a no-op for them. Registrations end
    at ``finalize()``. Freeing the tensor's memory (torch.cuda.empty_cache()) ends it too: a new
    allocation at the same address is told apart and registered afresh."""
    _checked(tensor, "register")
    if _nbytes(tensor) == 0:
        raise Error("pydatacopy.register: the tensor is empty; register a tensor with bytes in it")
    _C.register_memory(tensor.data_ptr(), _nbytes(tensor))


def unregister(tensor: torch.Tensor) -> None:
    """Undo one ``register(tensor)``; the allocation is unregistered from NVSHMEM when none is
    left, unless a transfer has used it (a captured graph may replay that transfer: it then
    stays registered until its memory is freed or ``finalize()``). Call it only after the
    transfers that use the tensor are done (synchronise their stream)."""
    _checked(tensor, "unregister")
    _C.unregister_memory(tensor.data_ptr())  # a no-op for symmetric memory


def is_registered(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s bytes can be the local side of a remote transfer as they are: they
    are symmetric, or their allocation is registered (by register() or by a transfer)."""
    _require_init("is_registered")
    _check_tensor(tensor, "tensor")
    return _C.is_rma_ready(tensor.data_ptr(), _nbytes(tensor))
