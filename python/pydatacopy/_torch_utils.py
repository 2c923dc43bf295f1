"""Torch-side helpers every call shares: what it asks the core once (the bound facts), the checks of
its tensors and ints, streams, and tensors over raw device pointers.

Python checks here what only it sees (a tensor's type, device, layout, dtype, size); the core
checks initialisation, the PE range and symmetry (``check_tensor(symmetric=True)`` aside, for
the calls whose core entry does not)."""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from . import _C
from ._limits import MAX_TIMEOUT_S

Error = _C.Error


def allocator_conf(environ=None) -> str:
    """torch's allocator configuration string: PYTORCH_ALLOC_CONF, or else the older
    PYTORCH_CUDA_ALLOC_CONF (torch's own order); "" when neither is set."""
    import os

    environ = os.environ if environ is None else environ
    return environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def allocator_setting(conf: str | None = None) -> str:
    """torch's CUDA allocator setting as zero-copy sees it: ``cudaMallocAsync``
    (backend:cudaMallocAsync: its pool allows no handle type, so receive buffers stay staged),
    ``expandable_segments`` (expandable_segments:True: moved once, chunk by chunk) or ``default``
    (cudaMalloc segments: moved once). From torch's PYTORCH_ALLOC_CONF, or else the older
    PYTORCH_CUDA_ALLOC_CONF (torch's own order), unless `conf` is given; the last value of a key
    wins, as in torch's parser. A setting changed at run time
    (torch.cuda.memory._set_allocator_settings) is not seen here."""
    if conf is None:
        conf = allocator_conf()
    options = {}
    for item in conf.split(","):
        key, _, value = item.partition(":")
        options[key.strip()] = value.strip()
    if options.get("backend") == "cudaMallocAsync":
        return "cudaMallocAsync"
    if options.get("expandable_segments", "").lower() == "true":
        return "expandable_segments"
    return "default"


#: What each allocator setting means for a send/recv between PEs on one node (doctor, init's warning).
ALLOCATOR_ZERO_COPY = {
    "default": "large send/recv messages between PEs on one node move once (CUDA IPC of torch's segments)",
    "expandable_segments": "large send/recv messages between PEs on one node move once, chunk by chunk "
                           "(each chunk's handle passed as a file descriptor over a Unix socket); peers on "
                           "other servers cannot send from expandable memory (the remote path refuses it)",
    "cudaMallocAsync": "receive buffers from torch's cudaMallocAsync pool cannot be exported (the pool allows "
                       "no handle type): send/recv into them stays staged, two copies; torch's default "
                       "allocator or expandable_segments:True move large messages once",
}


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
    return stream_argument(stream)


def stream_argument(stream: torch.cuda.Stream | int | None) -> int | None:
    """A stream argument as a raw cudaStream_t int, None left as None (the ops read torch's
    current stream when they run, so that a capture records them on its stream): the one
    conversion every layer uses."""
    if stream is None or isinstance(stream, int):
        return stream
    if isinstance(stream, (torch.cuda.Stream, torch.cuda.ExternalStream)):
        return stream.cuda_stream
    raise Error(f"stream must be a torch.cuda.Stream, a raw cudaStream_t int or None, got {type(stream).__name__}")


# ---- what every call asks, read once -------------------------------------------------------
# The hot calls (put, get, signals, put_blocks: rma/transfer.py) take a fast path when every argument
# is as expected: its checks use these instead of asking the core on every call. Anything
# unexpected (not initialised, a wrong tensor, a bad PE...) goes to the checked path, which raises
# exactly what it always did; the core checks initialisation, the PE range and symmetry either way.
# A module whose fast path reads them keeps its own copies, as module globals `_device` and
# `_n_pes` (a global read is the cheapest there is), registered with keeps_bound_facts: bind()
# and unbind() set them there too.
_device: int | None = None  # this process's CUDA device while initialised, else None
_n_pes = 0  # PEs while initialised, else 0 (every PE is then out of the fast path's range)
_fast_path_modules: list[ModuleType] = []

# PYDATACOPY_TIMEOUT_S as init read it (None: not initialised, read it now): a per-call timeout
# of None would otherwise scan the environment on every call (the core's collectives still read it
# afresh).
default_timeout: float | None = None


def keeps_bound_facts(module_name: str) -> None:
    """`module_name`'s `_device` and `_n_pes` follow bind() and unbind() from now on."""
    module = sys.modules[module_name]
    module._device, module._n_pes = _device, _n_pes
    _fast_path_modules.append(module)


def bind() -> None:
    """Read the facts above from the core (it is initialised); init does it, and so does the
    checked path of any call that finds them unset (NVSHMEM started through _C directly)."""
    global _device, _n_pes, default_timeout
    default_timeout = _C.default_timeout_seconds()
    _n_pes = _C.n_pes()
    _device = _C.cuda_device()
    for module in _fast_path_modules:
        module._device, module._n_pes = _device, _n_pes


def unbind() -> None:
    """finalize(): the fast paths stop at once; the checked path says what to do."""
    global _device, _n_pes, default_timeout
    _device, _n_pes = None, 0
    for module in _fast_path_modules:
        module._device, module._n_pes = None, 0
    default_timeout = None


def require_init(what: str) -> None:
    """`what`: the public call, without the package name (``put``)."""
    if not _C.is_initialized():
        raise Error(f"pydatacopy.{what} needs NVSHMEM: call pydatacopy.init() (or "
                    "pydatacopy.init_nvshmem()) first")
    if _device is None:
        bind()


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


# ---- the checked path's checks ---------------------------------------------------------------

def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_tensor(tensor: object, name: str, symmetric: bool = False) -> torch.Tensor:
    """Type, device and layout; `symmetric` also checks the heap here (the core checks it again
    for put/get, whose hot path therefore skips it)."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.get_device() != (_C.cuda_device() if _device is None else _device):  # -1 for CPU tensors
        if not tensor.is_cuda:
            raise Error(f"{name} is on {tensor.device}; pydatacopy moves CUDA tensors: use .cuda() first")
        raise Error(f"{name} is on {tensor.device}, but this process runs pydatacopy on "
                    f"cuda:{_C.cuda_device()}; move it there first")
    if not tensor.is_contiguous():
        raise Error(f"{name} must be contiguous (call .contiguous() first)")
    if symmetric and not _C.is_symmetric(tensor.data_ptr(), max(nbytes(tensor), 1)):
        raise Error(f"{name} must be a symmetric tensor (from pydatacopy.empty()), or a slice of one")
    return tensor


def check_pair(dst: torch.Tensor, src: torch.Tensor, what: str) -> int:
    if dst.dtype != src.dtype:
        raise Error(f"pydatacopy.{what}: dtype mismatch: dst is {dst.dtype}, src is {src.dtype}; "
                    "use one dtype on both sides (src.to(dst.dtype))")
    if dst.numel() != src.numel():
        raise Error(f"pydatacopy.{what}: size mismatch: dst has {dst.numel()} elements, src has "
                    f"{src.numel()}; pass equal-sized tensors (a slice of the larger one)")
    return nbytes(src)


def check_pe(pe: object, what: str) -> int:
    require_init(what)
    check_int("pe", pe)
    if not 0 <= pe < _C.n_pes():
        raise Error(f"pydatacopy.{what}: PE {pe} is out of range: there are {_C.n_pes()} PEs "
                    f"(0 to {_C.n_pes() - 1})")
    return pe


def resolve_stream(stream) -> int:
    """stream_handle on this process's device (the checked path's)."""
    return stream_handle(stream, _C.cuda_device() if _device is None else _device)


def keep_alive(stream, *tensors: torch.Tensor) -> None:
    """Tensors handed to a call on a stream other than torch's current one stay allocated until
    that stream's work is done: torch's caching allocator would otherwise give their memory out
    again as soon as the caller drops them (as with NCCL's process groups, record_stream)."""
    if stream is None:
        return
    if not isinstance(stream, torch.cuda.Stream):
        stream = torch.cuda.ExternalStream(stream)
    for tensor in tensors:
        # Symmetric tensors are not the allocator's (and its cudaMallocAsync backend asserts on
        # foreign pointers); they live until free().
        if not _C.is_symmetric(tensor.data_ptr(), 1):
            try:
                tensor.record_stream(stream)
            except RuntimeError:
                # Memory not the allocator's (DLPack, from_blob: cudaMallocAsync's backend refuses
                # it) needs no record; the tensors after it still need theirs.
                pass


def core_property(name: str, doc: str) -> property:
    """A read-only attribute passed through from the wrapped core object (``self._core``)."""
    return property(lambda self: getattr(self._core, name), doc=doc)
