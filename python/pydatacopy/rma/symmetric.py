"""Symmetric tensors (the core's symmetric.cpp): empty(), free(), is_symmetric(), peer_view().

What is symmetric, and how big, is the core's to say: it keeps the map of live allocations
(symmetric_malloc/symmetric_free) and answers is_symmetric and peer_pointer from it. Python keeps
only which of them empty() handed out, the ones free() may release and finalize() releases: the
other users of the heap (the send/recv staging, a DoubleBufferManager's buffers, an AllToAll's)
free their own, and a tensor viewing one of them at its base must not free it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _C, ops
from ..ops import refuse_capture
from .._torch_utils import check_int, check_pe, check_tensor, nbytes, require_init, tensor_from_address

Error = _C.Error

# Base addresses of the tensors empty() made and free() has not freed, in allocation order (a dict
# as an ordered set: finalize() frees them collectively, so every PE must go in the same order).
_from_empty: dict[int, None] = {}


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor on the NVSHMEM symmetric heap (collective: every PE calls it with the same size,
    in the same order). Free it with ``free()``, also collective; the garbage collector never
    frees it. Both wait for every PE at most PYDATACOPY_TIMEOUT_S (60 s) and then raise
    TimeoutError naming the PE that did not come."""
    ops.refuse_tracing("empty")
    require_init("empty")
    refuse_capture("empty")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    for extent in shape:
        check_int("shape entries", extent, 0)
    if not isinstance(dtype, torch.dtype):
        raise Error(f"dtype must be a torch.dtype, got {dtype!r}")
    numel = 1
    for extent in shape:
        numel *= extent
    num_bytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    if num_bytes >= 2**63:
        raise Error(f"pydatacopy.empty: {shape} of {dtype} is {num_bytes} bytes, more than any "
                    "symmetric heap (NVSHMEM_SYMMETRIC_SIZE) can hold")
    address = _C.symmetric_malloc(num_bytes)
    _from_empty[address] = None
    # A static address for torch.compile (CUDA graphs must use it in place, not a copy)
    return ops.mark_static(tensor_from_address(address, shape, dtype, _C.cuda_device()))


def free(tensor: torch.Tensor) -> None:
    """Release a tensor made by ``empty()`` on every PE (collective, blocking). Views of it must
    not be used afterwards."""
    ops.refuse_tracing("free")
    require_init("free")
    refuse_capture("free")
    if not isinstance(tensor, torch.Tensor) or tensor.data_ptr() not in _from_empty:
        raise Error("free() takes a tensor returned by pydatacopy.empty() (not a view or slice of it)")
    address = tensor.data_ptr()
    del _from_empty[address]
    _C.symmetric_free(address)


def is_symmetric(tensor: torch.Tensor) -> bool:
    """True if the tensor's bytes lie in a live pydatacopy symmetric allocation."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_cuda
            and _C.is_symmetric(tensor.data_ptr(), nbytes(tensor)))


def peer_view(tensor: torch.Tensor, pe: int) -> torch.Tensor | None:
    """PE `pe`'s copy of a symmetric tensor, as a tensor this process can read and write directly
    (through NVLink), or None when the peer is not directly reachable (another server, or
    PYDATACOPY_FORCE_RMA=1). torch places the view on the device that owns the memory."""
    check_pe(pe, "peer_view")
    check_tensor(tensor, "tensor", symmetric=True)
    address = _C.peer_pointer(tensor.data_ptr(), pe)
    if address == 0:
        return None
    if pe == _C.my_pe():
        return tensor
    return tensor_from_address(address, tuple(tensor.shape), tensor.dtype, None)


def free_all_symmetric() -> None:
    """Collective: free every tensor made by empty() (finalize() calls it)."""
    for address in list(_from_empty):
        del _from_empty[address]
        _C.symmetric_free(address)

