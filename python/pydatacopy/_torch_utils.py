"""Torch-side helpers: streams, devices and tensors over raw device pointers."""

from __future__ import annotations

import torch

from . import _C
from ._env import MAX_TIMEOUT_S

Error = _C.Error


class _CudaArray:
    """A device buffer described by __cuda_array_interface__, so torch can view it zero-copy.

    torch keeps this object alive as long as the tensor lives; it owns nothing itself.
    """

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, address: int, num_bytes: int, owner: object):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self.owner = owner


def tensor_from_address(address: int, shape: tuple[int, ...], dtype: torch.dtype,
                        device: int | None, owner: object = None) -> torch.Tensor:
    """A torch tensor viewing `address` (no copy); device None: the device owning the memory."""
    numel = 1
    for extent in shape:
        numel *= extent
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    array = _CudaArray(address, max(num_bytes, 1), owner)
    flat = torch.as_tensor(array) if device is None else torch.as_tensor(array, device=f"cuda:{device}")
    return flat[:num_bytes].view(dtype).view(shape)


def _current_stream_handle(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# torch's current cudaStream_t on a device: the raw handle, without building a Stream object
# (this sits on every call's hot path), where this torch has it.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream_handle


def stream_handle(stream: torch.cuda.Stream | int | None, device: int) -> int:
    """The cudaStream_t of `stream`, torch's current stream on `device` when None."""
    if stream is None:
        return current_raw_stream(device)
    if isinstance(stream, int):
        return stream
    if isinstance(stream, (torch.cuda.Stream, torch.cuda.ExternalStream)):
        return stream.cuda_stream
    raise Error(f"stream must be a torch.cuda.Stream, a raw cudaStream_t int or None, got {type(stream).__name__}")


# PYDATACOPY_TIMEOUT_S as init read it (None: not initialised, read it now): a per-call timeout
# of None would otherwise scan the environment on every call (the core's collectives still read it
# afresh).
default_timeout: float | None = None


def timeout_seconds(timeout: float | None) -> float:
    """`timeout` as float seconds; None: PYDATACOPY_TIMEOUT_S (as read at init), else 60."""
    if timeout is None:
        return _C.default_timeout_seconds() if default_timeout is None else default_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or not timeout <= MAX_TIMEOUT_S:
        raise Error(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0e} "
                    f"(None for the default), got {timeout!r}")
    return float(timeout)


def check_int(name: str, value: object, minimum: int | None = None,
              maximum: int | None = None, call: str = "") -> int:
    """`value` if it is an int (not a bool) in [minimum, maximum], else pydatacopy.Error (its
    message starting with `call`, the public function, when given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        problem = f"{name} must be an int, got {type(value).__name__} {value!r}"
    elif minimum is not None and value < minimum:
        problem = f"{name} must be at least {minimum}, got {value}"
    elif maximum is not None and value > maximum:
        problem = f"{name} must be at most {maximum}, got {value}"
    else:
        return value
    raise Error(f"{call}: {problem}" if call else problem)
