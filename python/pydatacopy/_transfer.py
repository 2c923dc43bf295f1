"""Tensor data movement: symmetric tensors, one-sided put/get/signals, send/recv of any tensor.

Everything here is stream-ordered on torch's current stream unless ``stream=`` says otherwise,
and checks its arguments before touching the GPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

from . import _C, _env, _ops, _torch_utils
from ._ops import dispatch_modes as _dispatch_modes, dynamo_compiling as _dynamo_compiling
from ._torch_utils import check_int, stream_handle, tensor_from_address, timeout_seconds

Error = _C.Error
Tensor = torch.Tensor

PATHS = {"auto": 0, "copy_engine": 1, "sm": 2, "rma": 3}
_BATCH_PATHS = {"auto": 0, "sm": 2, "rma": 3}  # one kernel moves every row: no copy engine
_PE_MAX = _env.INT32_MAX  # PEs cross to the core as C ints (it checks the range of live PEs)
_VALUE_MAX = 2**64 - 1  # signal values are uint64
_SIGNAL_DTYPES = (torch.uint64, torch.int64)
_INT64 = torch.int64

# ---- symmetric tensors ---------------------------------------------------------------------

_allocations: dict[int, int] = {}  # base address -> bytes, of tensors made by empty()


# ---- what every call asks, read once -------------------------------------------------------
# The hot calls (put, get, signals, put_blocks) take a fast path when every argument is as
# expected: its checks use these instead of asking the core on every call. Anything unexpected
# (not initialised, a wrong tensor, a bad PE...) goes to the checked path, which raises exactly
# what it always did; the core checks initialisation, the PE range and symmetry either way.
_device: int | None = None  # this process's CUDA device while initialised, else None
_n_pes = 0  # PEs while initialised, else 0 (every PE is then out of the fast path's range)
_raw_stream = _torch_utils.current_raw_stream  # torch's current cudaStream_t on a device


def _bind() -> None:
    """Read the facts above from the core (it is initialised); init does it, and so does the
    checked path of any call that finds them unset (NVSHMEM started through _C directly)."""
    global _device, _n_pes
    _torch_utils.default_timeout = _C.default_timeout_seconds()
    _n_pes = _C.n_pes()
    _device = _C.cuda_device()


def _unbind() -> None:
    """finalize(): the fast paths stop at once; the checked path says what to do."""
    global _device, _n_pes
    _device, _n_pes = None, 0
    _torch_utils.default_timeout = None


def _require_init(what: str) -> None:
    """`what`: the public call, without the package name (``put``)."""
    if not _C.is_initialized():
        raise Error(f"pydatacopy.{what} needs NVSHMEM: call pydatacopy.init() (or "
                    "pydatacopy.init_nvshmem()) first")
    if _device is None:
        _bind()


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor on the NVSHMEM symmetric heap (collective: every PE calls it with the same size,
    in the same order). Free it with ``free()``, also collective; the garbage collector never
    frees it. Both wait for every PE at most PYDATACOPY_TIMEOUT_S (60 s) and then raise
    TimeoutError naming the PE that did not come."""
    _ops.refuse_tracing("empty")
    _require_init("empty")
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
    _allocations[address] = num_bytes
    # A static address for torch.compile (CUDA graphs must use it in place, not a copy)
    return _ops.mark_static(tensor_from_address(address, shape, dtype, _C.cuda_device()))


def free(tensor: torch.Tensor) -> None:
    """Release a tensor made by ``empty()`` on every PE (collective, blocking). Views of it must
    not be used afterwards."""
    _ops.refuse_tracing("free")
    _require_init("free")
    refuse_capture("free")
    if not isinstance(tensor, torch.Tensor) or tensor.data_ptr() not in _allocations:
        raise Error("free() takes a tensor returned by pydatacopy.empty() (not a view or slice of it)")
    address = tensor.data_ptr()
    del _allocations[address]
    _C.symmetric_free(address)


def is_symmetric(tensor: torch.Tensor) -> bool:
    """True if the tensor's bytes lie in a live pydatacopy symmetric allocation."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_cuda
            and _C.is_symmetric(tensor.data_ptr(), _nbytes(tensor)))


def peer_view(tensor: torch.Tensor, pe: int) -> torch.Tensor | None:
    """PE `pe`'s copy of a symmetric tensor, as a tensor this process can read and write directly
    (through NVLink), or None when the peer is not directly reachable (another server, or
    PYDATACOPY_FORCE_RMA=1). torch places the view on the device that owns the memory."""
    _check_pe(pe, "peer_view")
    _check_tensor(tensor, "tensor", symmetric=True)
    address = _C.peer_pointer(tensor.data_ptr(), pe)
    if address == 0:
        return None
    if pe == _C.my_pe():
        return tensor
    return tensor_from_address(address, tuple(tensor.shape), tensor.dtype, None)


def free_all_symmetric() -> None:
    """Collective: free every tensor made by empty() (finalize() calls it)."""
    for address in list(_allocations):
        del _allocations[address]
        _C.symmetric_free(address)


# ---- checks --------------------------------------------------------------------------------

def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_tensor(tensor: object, name: str, symmetric: bool = False) -> torch.Tensor:
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
    if symmetric and not _C.is_symmetric(tensor.data_ptr(), max(_nbytes(tensor), 1)):
        raise Error(f"{name} must be a symmetric tensor (from pydatacopy.empty()), or a slice of one")
    return tensor


def _check_pair(dst: torch.Tensor, src: torch.Tensor, what: str) -> int:
    if dst.dtype != src.dtype:
        raise Error(f"pydatacopy.{what}: dtype mismatch: dst is {dst.dtype}, src is {src.dtype}; "
                    "use one dtype on both sides (src.to(dst.dtype))")
    if dst.numel() != src.numel():
        raise Error(f"pydatacopy.{what}: size mismatch: dst has {dst.numel()} elements, src has "
                    f"{src.numel()}; pass equal-sized tensors (a slice of the larger one)")
    return _nbytes(src)


def _check_pe(pe: object, what: str) -> int:
    _require_init(what)
    check_int("pe", pe)
    if not 0 <= pe < _C.n_pes():
        raise Error(f"pydatacopy.{what}: PE {pe} is out of range: there are {_C.n_pes()} PEs "
                    f"(0 to {_C.n_pes() - 1})")
    return pe


def _path(path: str) -> int:
    if path not in PATHS:
        raise Error(f"path must be one of {sorted(PATHS)}, got {path!r}")
    return PATHS[path]


def _stream(stream) -> int:
    return stream_handle(stream, _C.cuda_device() if _device is None else _device)


def _keep_alive(stream, *tensors: torch.Tensor) -> None:
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
            tensor.record_stream(stream)


def _capturing(handle: int | None = None) -> bool:
    """Whether torch's current stream, or the stream `handle`, is being captured into a graph."""
    if not torch.cuda.is_available():  # no GPU, no graph (and CPU builds of torch cannot tell)
        return False
    return torch.cuda.is_current_stream_capturing() or (handle is not None and _C.is_capturing(handle))


def refuse_capture(what: str, handle: int | None = None) -> None:
    """Calls that block (they wait for every PE, or for the GPU) cannot be part of a CUDA graph,
    nor of a traced one."""
    _ops.refuse_tracing(what)
    if _capturing(handle):
        raise Error(f"pydatacopy.{what} blocks (it waits for every PE or synchronises the GPU), so it "
                    "cannot be captured in a CUDA graph: call it before or after the capture")


def _check_signal(signal: torch.Tensor) -> torch.Tensor:
    _check_tensor(signal, "signal")  # the core checks that it is symmetric
    if signal.dtype not in (torch.uint64, torch.int64) or signal.numel() != 1:
        raise Error("signal must be a one-element uint64 (or int64) symmetric tensor, e.g. "
                    "pydatacopy.empty(1, dtype=torch.uint64)")
    return signal


# ---- one-sided operations ------------------------------------------------------------------

def put(dst: torch.Tensor, src: torch.Tensor, pe: int, *, stream=None, path: str = "auto") -> None:
    """Write local `src` into PE `pe`'s copy of symmetric `dst` (stream-ordered).

    ``src`` may be any CUDA tensor on this device. The data is visible at the peer once a later
    ``quiet()`` on the same stream has completed; ``put_signal`` or ``barrier`` tell the peer.
    ``path``: ``auto`` takes the copy engine (cudaMemcpyAsync into the peer's memory) whenever
    the peer is directly reachable (NVLink/PCIe), at every size: it won at every size measured,
    4 KiB to 1 GiB (docs/perf-notes.md, v3); else NVSHMEM RMA (another node, or
    PYDATACOPY_FORCE_RMA=1). ``copy_engine`` and ``sm`` (a copy kernel's stores) need a directly
    reachable peer; ``rma`` always takes NVSHMEM's put.

    Host cost: the checks below read each tensor's facts once (about 10 attribute reads) and
    cross into the core once; the core looks the destination up once (symmetry and the peer's
    address, resolved when it was allocated).
    """
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.put(dst, src, pe, stream=stream, path=path)
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(dst, Tensor) and isinstance(src, Tensor)
            and dst.get_device() == device and src.get_device() == device
            and dst.dtype is src.dtype and (nbytes := src.nbytes) == dst.nbytes
            and dst.is_contiguous() and src.is_contiguous() and path in PATHS):
        _C.put_fast(dst.data_ptr(), src.data_ptr(), nbytes, pe,
                    _raw_stream(device) if stream is None else stream_handle(stream, device), PATHS[path])
        if stream is not None:
            _keep_alive(stream, src)  # dst is symmetric (the core refuses any other)
        return
    # The checked path: whatever the fast one did not take, with the error that says what to do.
    _require_init("put")
    check_int("pe", pe, None, _PE_MAX)
    _check_tensor(dst, "dst")  # the core checks that dst is symmetric and pe in range
    _check_tensor(src, "src")
    nbytes = _check_pair(dst, src, "put")
    _C.put(dst.data_ptr(), src.data_ptr(), nbytes, pe, _stream(stream), _path(path))
    _keep_alive(stream, dst, src)


def get(dst: torch.Tensor, src: torch.Tensor, pe: int, *, stream=None, path: str = "auto") -> None:
    """Read PE `pe`'s copy of symmetric `src` into local `dst` (stream-ordered); ``path`` as in
    ``put``."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.get(dst, src, pe, stream=stream, path=path)
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(dst, Tensor) and isinstance(src, Tensor)
            and dst.get_device() == device and src.get_device() == device
            and dst.dtype is src.dtype and (nbytes := src.nbytes) == dst.nbytes
            and dst.is_contiguous() and src.is_contiguous() and path in PATHS):
        _C.get_fast(dst.data_ptr(), src.data_ptr(), nbytes, pe,
                    _raw_stream(device) if stream is None else stream_handle(stream, device), PATHS[path])
        if stream is not None:
            _keep_alive(stream, dst)  # src is symmetric (the core refuses any other)
        return
    _require_init("get")
    check_int("pe", pe, None, _PE_MAX)
    _check_tensor(dst, "dst")
    _check_tensor(src, "src")  # the core checks that src is symmetric and pe in range
    nbytes = _check_pair(dst, src, "get")
    _C.get(dst.data_ptr(), src.data_ptr(), nbytes, pe, _stream(stream), _path(path))
    _keep_alive(stream, dst, src)


def put_signal(dst: torch.Tensor, src: torch.Tensor, pe: int, signal: torch.Tensor, value: int,
               *, stream=None) -> None:
    """``put``, then set PE `pe`'s copy of `signal` to `value` once the data is visible there."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.put_signal(dst, src, pe, signal, value, stream=stream)
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(dst, Tensor) and isinstance(src, Tensor)
            and isinstance(signal, Tensor) and dst.get_device() == device
            and src.get_device() == device and signal.get_device() == device
            and dst.dtype is src.dtype and (nbytes := src.nbytes) == dst.nbytes
            and signal.dtype in _SIGNAL_DTYPES and signal.nbytes == 8
            and dst.is_contiguous() and src.is_contiguous() and signal.is_contiguous()
            and type(value) is int and 0 <= value <= _VALUE_MAX):
        _C.put_signal(dst.data_ptr(), src.data_ptr(), nbytes, signal.data_ptr(), value, pe,
                      _raw_stream(device) if stream is None else stream_handle(stream, device))
        if stream is not None:
            _keep_alive(stream, src)
        return
    _check_pe(pe, "put_signal")
    _check_tensor(dst, "dst")  # the core checks that dst and signal are symmetric
    _check_tensor(src, "src")
    nbytes = _check_pair(dst, src, "put_signal")
    _check_signal(signal)
    check_int("value", value, 0, _VALUE_MAX)
    _C.put_signal(dst.data_ptr(), src.data_ptr(), nbytes, signal.data_ptr(), value, pe, _stream(stream))
    _keep_alive(stream, src)


def signal_set(signal: torch.Tensor, value: int, pe: int, *, stream=None) -> None:
    """Set PE `pe`'s copy of `signal` to `value` after this stream's earlier puts are visible."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.signal_set(signal, value, pe, stream=stream)
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(signal, Tensor)
            and signal.get_device() == device and signal.dtype in _SIGNAL_DTYPES
            and signal.nbytes == 8 and signal.is_contiguous()
            and type(value) is int and 0 <= value <= _VALUE_MAX):
        _C.signal_set(signal.data_ptr(), value, pe,
                      _raw_stream(device) if stream is None else stream_handle(stream, device))
        return
    _check_pe(pe, "signal_set")
    _check_signal(signal)
    check_int("value", value, 0, _VALUE_MAX)
    _C.signal_set(signal.data_ptr(), value, pe, _stream(stream))


def signal_wait(signal: torch.Tensor, value: int, *, stream=None, timeout: float | None = None,
                blocking: bool = False, received: Sequence[torch.Tensor] = ()) -> None:
    """Stream-ordered wait until the local `signal` is >= `value`. With ``blocking=True`` it also
    synchronises the stream and raises TimeoutError here when the deadline passed.

    ``received``: under torch.compile, the tensors the peers wrote before setting the signal
    (reads of them are then kept after the wait); eager calls need none (the stream orders them)."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.signal_wait(signal, value, stream=stream, timeout=timeout, blocking=blocking,
                                received=received)
    device = _device
    if (not blocking and timeout is None and isinstance(signal, Tensor)
            and signal.get_device() == device and signal.dtype in _SIGNAL_DTYPES
            and signal.nbytes == 8 and signal.is_contiguous()
            and type(value) is int and 0 <= value <= _VALUE_MAX):
        _C.signal_wait(signal.data_ptr(), value,
                       _raw_stream(device) if stream is None else stream_handle(stream, device),
                       _torch_utils.default_timeout)
        return
    _require_init("signal_wait")
    _check_signal(signal)
    check_int("value", value, 0, _VALUE_MAX)
    handle = _stream(stream)
    if blocking:
        refuse_capture("signal_wait(blocking=True)", handle)
    # blocking: the core waits on the raw handle, with the GIL released (_C.wait_for_stream).
    _C.signal_wait(signal.data_ptr(), value, handle, timeout_seconds(timeout), blocking)


def quiet(*, stream=None) -> None:
    """Complete this PE's puts issued on the stream: delivered at the peers when it completes."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.quiet(stream=stream)
    device = _device
    if device is not None:
        _C.quiet(_raw_stream(device) if stream is None else stream_handle(stream, device))
        return
    _require_init("quiet")
    _C.quiet(_stream(stream))


def barrier(*, stream=None, timeout: float | None = None, blocking: bool = False,
            received: Sequence[torch.Tensor] = ()) -> None:
    """quiet, then wait for every PE to reach the barrier (stream-ordered, collective).

    A PE that does not arrive within `timeout` seconds (default PYDATACOPY_TIMEOUT_S, else 60)
    is reported as a TimeoutError naming it: here with ``blocking=True`` (which also
    synchronises the stream), else by the next call or ``check_errors()``. ``received`` as in
    ``signal_wait``: under torch.compile, the symmetric tensors peers wrote before the barrier.
    """
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.barrier(stream=stream, timeout=timeout, blocking=blocking, received=received)
    device = _device
    if device is not None and not blocking and timeout is None:
        _C.barrier(_raw_stream(device) if stream is None else stream_handle(stream, device),
                   _torch_utils.default_timeout)
        return
    _require_init("barrier")
    handle = _stream(stream)
    if blocking:
        refuse_capture("barrier(blocking=True)", handle)
    # blocking: the core waits on the raw handle, with the GIL released (_C.wait_for_stream).
    _C.barrier(handle, timeout_seconds(timeout), blocking)


def put_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], pe: int, *,
             stream=None, path: str = "auto") -> None:
    """Many puts to one PE in a single kernel launch (KV-cache blocks, expert tokens).

    dsts[i] (symmetric) receives srcs[i] (a list or tuple each); each pair is checked as in
    ``put``, in one pass in the native layer (no Python loop per row). Visibility as in ``put``;
    the lists may be dropped as soon as this returns (the table of addresses travels in the
    launch itself), the tensors as for any stream-ordered call. The call can be captured in a
    CUDA graph; a replay reads the addresses given at capture, so keep those tensors alive while
    the graph replays. ``path``: auto
    or sm (one kernel's direct stores where the peer is reachable, NVSHMEM RMA where it is
    not), or rma. For pools with device-side indices, ``put_blocks`` needs no host work per row.

    Host cost per call grows with the rows: each row's two tensors are asked about a dozen facts
    through torch's Python API (type, device, layout, address, size, dtype), about 0.5 us per
    row on the CPU it was measured on (scripts/profile_host_path.py, 2026-12-01; 0.8-1 ms for
    1024 rows on the GPU machine, issue 24), nearly all of it reading the tensors; then one
    symmetric lookup per row in the core. Lists that repeat are cheaper prepared once:
    ``prepare_put_many`` (no host work per row at run time).
    """
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.put_many(dsts, srcs, pe, stream=stream, path=path)
    _check_pe(pe, "put_many")
    if path not in ("auto", "sm", "rma"):
        raise Error(f"pydatacopy.put_many: path must be auto, sm or rma (one kernel moves the "
                    f"tensors), got {path!r}")
    _C.put_many_tensors(dsts, srcs, pe, _stream(stream), PATHS[path], _device, torch.Tensor)
    if stream is not None:
        _keep_alive(stream, *srcs)


class PreparedPutMany:
    """``put_many`` prepared once: ``PreparedPutMany(dsts, srcs, pe)`` checks the rows (every dst
    symmetric, dtypes and sizes equal, every src on this device) and resolves each row's route to
    PE `pe` once, and keeps the table in device memory; ``run()`` is then one kernel launch that
    reads it there, with no host work per row (like NIXL's prepared descriptor lists).
    ``from_addresses`` builds it from int64 CUDA tensors of addresses and sizes instead.

    ``path``: auto or sm (direct stores into the peer's memory where it is reachable by
    load/store, NVSHMEM RMA where it is not: then the sources are registered here, once), or rma.
    Rows of any size; long rows are cut into 64 KiB pieces so that warps share the work.

    The object keeps the tensors alive while it lives, and ``run()`` moves whatever they hold at
    that moment: refill the sources and run again. ``run()`` is stream-ordered and can be captured
    in a CUDA graph (a replay reads the table and the tensors' current data; keep the object
    alive while the graph replays). Preparing blocks (it copies the table to the device) and
    cannot be captured. ``release()`` (or dropping the object) frees the table: local, never
    collective, and it never waits (the memory goes once the streams it ran on are done with
    it). Visibility of the data at the peer as in ``put``.
    """

    __slots__ = ("_core", "_keep", "_streams", "_op_number", "pe", "path", "rows", "__weakref__")

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], pe: int, *,
                 path: str = "auto"):
        self._prepare(dsts, srcs, pe, path, "PreparedPutMany")

    def _prepare(self, dsts, srcs, pe: int, path: str, what: str) -> None:
        self._core = None
        _check_pe(pe, what)
        refuse_capture(what)
        path_code = _batch_path(path, what)
        self._core = _C.PreparedPutMany.from_tensors(dsts, srcs, pe, path_code, _device, torch.Tensor,
                                                     f"pydatacopy.{what}")
        self._init(pe, path, len(dsts), (tuple(dsts), tuple(srcs)))

    def _init(self, pe: int, path: str, rows: int, keep: tuple) -> None:
        self.pe, self.path, self.rows = pe, path, rows
        self._keep = keep
        self._streams: set[int] = set()
        self._op_number = _ops.register_object(self)  # what a traced run() names it by

    @classmethod
    def from_addresses(cls, dst_addrs: torch.Tensor, src_addrs: torch.Tensor, sizes: torch.Tensor,
                       pe: int, *, path: str = "auto", stream=None) -> "PreparedPutMany":
        """The table from three 1-D int64 CUDA tensors of equal length: destination addresses
        (inside symmetric tensors), source addresses (device memory on this process's device)
        and byte counts. They are read after the work on ``stream`` (torch's current one by
        default), which this synchronises; the memory they point to must stay allocated while
        the table runs (nothing here holds it)."""
        _check_pe(pe, "PreparedPutMany.from_addresses")
        refuse_capture("PreparedPutMany.from_addresses")
        for name, tensor in (("dst_addrs", dst_addrs), ("src_addrs", src_addrs), ("sizes", sizes)):
            _check_tensor(tensor, name)
            if tensor.dtype != torch.int64 or tensor.dim() != 1:
                raise Error(f"pydatacopy.PreparedPutMany.from_addresses: {name} must be a 1-D int64 "
                            f"CUDA tensor, got {tensor.dtype} with {tensor.dim()} dimension(s)")
        if not dst_addrs.numel() == src_addrs.numel() == sizes.numel():
            raise Error("pydatacopy.PreparedPutMany.from_addresses: dst_addrs, src_addrs and sizes "
                        f"must have one entry per row, got {dst_addrs.numel()}, {src_addrs.numel()} "
                        f"and {sizes.numel()}")
        path_code = _batch_path(path, "PreparedPutMany.from_addresses")
        self = cls.__new__(cls)
        self._core = None
        self._core = _C.PreparedPutMany.from_addresses(
            dst_addrs.data_ptr(), src_addrs.data_ptr(), sizes.data_ptr(), dst_addrs.numel(), pe,
            path_code, _stream(stream))
        self._init(pe, path, dst_addrs.numel(), ())
        return self

    def run(self, *, stream=None) -> None:
        """Every row, in one kernel launch on ``stream`` (torch's current one by default). A raw
        cudaStream_t given here must stay valid until the table is released (torch's streams
        always do): the release orders the free of the table after the work of each."""
        if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
            return _ops.put_many_prepared(self, self._op_number, *(self._keep or ((), ())), stream=stream)
        device = _device
        if device is None:
            _require_init("PreparedPutMany.run")
            device = _device
        if stream is None:
            self._core.run(_raw_stream(device))
            return
        handle = stream_handle(stream, device)
        if handle not in self._streams:
            self._streams.add(handle)  # as _keep_alive: the tensors stay until its work is done
        self._core.run(handle)

    def release(self) -> None:
        """Free the table now (idempotent; local). The table's memory and the tensors are let go
        once the streams the table ran on (``stream=``) are done with them; run() refuses
        afterwards."""
        core = self._core
        if core is None or core.released:
            return
        for handle in self._streams:
            _keep_alive(handle, *(t for group in self._keep for t in group))
        core.release()
        self._keep = ()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter exit torch or CUDA may be gone: nothing left to order
            pass

    @property
    def pieces(self) -> int:
        """Rows of the device table: empty rows left out, rows over 64 KiB cut into pieces."""
        return self._core.pieces

    @property
    def bytes(self) -> int:
        """Bytes one run moves."""
        return self._core.bytes

    @property
    def direct(self) -> bool:
        """True when the rows are stored directly into the peer's memory (False: NVSHMEM RMA)."""
        return self._core.direct

    def __repr__(self) -> str:
        state = "released" if self._core is None or self._core.released else f"{self.bytes} bytes"
        return f"PreparedPutMany({self.rows} rows to PE {self.pe}, path={self.path!r}, {state})"


def prepare_put_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], pe: int, *,
                     path: str = "auto") -> PreparedPutMany:
    """``PreparedPutMany(dsts, srcs, pe, path=path)``: put_many's rows checked and resolved once,
    the table kept on the GPU; ``.run(stream=None)`` moves them in one launch."""
    prepared = PreparedPutMany.__new__(PreparedPutMany)
    prepared._prepare(dsts, srcs, pe, path, "prepare_put_many")
    return prepared


def _batch_path(path: str, what: str) -> int:
    if path not in ("auto", "sm", "rma"):
        raise Error(f"pydatacopy.{what}: path must be auto, sm or rma (one kernel moves the "
                    f"tensors), got {path!r}")
    return PATHS[path]


def put_blocks(dst_pool: torch.Tensor, src_pool: torch.Tensor, dst_indices: torch.Tensor,
               src_indices: torch.Tensor, pe: int, *, stream=None, path: str = "auto") -> None:
    """KV-cache style, one launch: row ``dst_indices[i]`` of PE `pe`'s copy of the symmetric
    ``dst_pool`` receives row ``src_indices[i]`` of the local ``src_pool``.

    Pools are contiguous ``[num_blocks, ...]`` tensors of one dtype and row size; indices are
    int64 CUDA tensors of equal length (they stay on the GPU: nothing synchronises). An index
    out of range is skipped and raises pydatacopy.Error at the next call or check_errors().
    Visibility as in ``put``. ``path`` as in ``put_many``.
    """
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, stream=stream,
                               path=path)
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(dst_pool, Tensor)
            and isinstance(src_pool, Tensor) and isinstance(dst_indices, Tensor)
            and isinstance(src_indices, Tensor) and dst_pool.get_device() == device
            and src_pool.get_device() == device and dst_indices.get_device() == device
            and src_indices.get_device() == device and dst_pool.dim() >= 1 and src_pool.dim() >= 1
            and dst_pool.dtype is src_pool.dtype and dst_pool.shape[1:] == src_pool.shape[1:]
            and dst_indices.dtype is _INT64 and src_indices.dtype is _INT64
            and dst_indices.dim() == 1 and src_indices.dim() == 1
            and (count := dst_indices.numel()) == src_indices.numel()
            and dst_pool.is_contiguous() and src_pool.is_contiguous()
            and dst_indices.is_contiguous() and src_indices.is_contiguous() and path in _BATCH_PATHS):
        src_blocks = src_pool.shape[0]
        block_bytes = src_pool.nbytes // max(src_blocks, 1)
        if block_bytes == 0:
            return
        _C.put_blocks(dst_pool.data_ptr(), dst_pool.shape[0], src_pool.data_ptr(), src_blocks,
                      block_bytes, dst_indices.data_ptr(), src_indices.data_ptr(), count, pe,
                      _raw_stream(device) if stream is None else stream_handle(stream, device),
                      _BATCH_PATHS[path])
        if stream is not None:
            _keep_alive(stream, src_pool, dst_indices, src_indices)
        return
    _require_init("put_blocks")
    check_int("pe", pe, None, _PE_MAX)
    _check_tensor(dst_pool, "dst_pool")  # the core checks that it is symmetric
    _check_tensor(src_pool, "src_pool")
    if dst_pool.dim() < 1 or src_pool.dim() < 1:
        raise Error("put_blocks: pools must have a leading block dimension")
    if dst_pool.dtype != src_pool.dtype:
        raise Error(f"dtype mismatch: dst_pool is {dst_pool.dtype}, src_pool is {src_pool.dtype}")
    if dst_pool.shape[1:] != src_pool.shape[1:]:
        raise Error(f"size mismatch: dst_pool blocks are {tuple(dst_pool.shape[1:])}, src_pool "
                    f"blocks {tuple(src_pool.shape[1:])}")
    for name, index in (("dst_indices", dst_indices), ("src_indices", src_indices)):
        _check_tensor(index, name)
        if index.dtype != torch.int64 or index.dim() != 1:
            raise Error(f"{name} must be a 1-D int64 CUDA tensor")
    if dst_indices.numel() != src_indices.numel():
        raise Error(f"size mismatch: {dst_indices.numel()} dst_indices but {src_indices.numel()} src_indices")
    if path not in ("auto", "sm", "rma"):
        raise Error(f"pydatacopy.put_blocks: path must be auto, sm or rma (one kernel moves the "
                    f"blocks), got {path!r}")
    block_bytes = _nbytes(src_pool) // max(src_pool.shape[0], 1)
    if block_bytes == 0:
        return
    _C.put_blocks(dst_pool.data_ptr(), dst_pool.shape[0], src_pool.data_ptr(), src_pool.shape[0],
                  block_bytes, dst_indices.data_ptr(), src_indices.data_ptr(), dst_indices.numel(),
                  pe, _stream(stream), _path(path))
    _keep_alive(stream, src_pool, dst_indices, src_indices)


# ---- send / recv ---------------------------------------------------------------------------

_engine: "_C.SendRecvEngine | None" = None
_state = threading.local()


def send_recv_settings(call: str = "pydatacopy.setup_send_recv") -> tuple[int, int, int]:
    """(chunk_bytes, num_chunks, blocks) from PYDATACOPY_CHUNK_BYTES, PYDATACOPY_NUM_CHUNKS and
    PYDATACOPY_SEND_BLOCKS, else the defaults (8 MiB, 4, 128)."""
    try:
        return _env.send_recv_settings()
    except _env.SettingError as error:
        raise Error(f"{call}: {error}") from None


def setup_send_recv(chunk_bytes: int | None = None, num_chunks: int | None = None,
                    blocks: int | None = None) -> None:
    """(Re)create the send/recv staging (collective; init() calls it with the defaults).

    Defaults: PYDATACOPY_CHUNK_BYTES (8 MiB), PYDATACOPY_NUM_CHUNKS (4 per peer),
    PYDATACOPY_SEND_BLOCKS (128: the most thread blocks one message uses; since one block
    drives its slice of both directions of a sendrecv, twice the 64 that scripts/sweep-send-recv.sh
    chose when each direction had blocks of its own, docs/perf-notes.md v6/v8). Every PE must use
    the same settings.
    """
    global _engine
    _ops.refuse_tracing("setup_send_recv")
    _require_init("setup_send_recv")
    refuse_capture("setup_send_recv")
    defaults = send_recv_settings()
    chunk_bytes = defaults[0] if chunk_bytes is None else chunk_bytes
    num_chunks = defaults[1] if num_chunks is None else num_chunks
    blocks = defaults[2] if blocks is None else blocks
    for name, value in (("chunk_bytes", chunk_bytes), ("num_chunks", num_chunks), ("blocks", blocks)):
        check_int(name, value, *_env.SEND_RECV_RANGES[name], call="pydatacopy.setup_send_recv")
    teardown_send_recv()
    engine = _C.SendRecvEngine()
    engine.init(chunk_bytes, num_chunks, blocks)
    _engine = engine


def check_send_recv_refusals() -> None:
    """A size mismatch a receiver found after this PE's send had completed (check_errors())."""
    engine = _engine
    if engine is not None:
        engine.check_refusals()


def teardown_send_recv() -> None:
    """Collective: release the send/recv staging (finalize() calls it)."""
    global _engine
    if _engine is not None:
        engine, _engine = _engine, None
        engine.cleanup()


def service_zero_copy() -> None:
    """Serve the peers' zero-copy mapping requests without waiting (check_errors() calls it;
    every send/recv call does it for its own peers)."""
    if _engine is not None:
        _engine.service_zero_copy()


def zero_copy_min_bytes() -> int:
    """Messages of at least this many bytes between PEs that reach each other by load/store move
    once, from the sender's tensor into the receiver's (PYDATACOPY_ZERO_COPY_MIN_BYTES, default
    32 MiB; 0: never). Needs the send/recv engine (init())."""
    return _require_engine("zero_copy_min_bytes").zero_copy_min_bytes


def set_zero_copy_min_bytes(nbytes: int) -> None:
    """Collective and blocking: every PE calls it with the same value, between its send/recv
    calls (the benchmark and tests use it; 0 turns zero-copy off). Raises on every PE alike when
    the values differ, changing nothing."""
    check_int("nbytes", nbytes, 0, 2**63 - 1, call="pydatacopy.set_zero_copy_min_bytes")
    refuse_capture("set_zero_copy_min_bytes")
    _require_engine("set_zero_copy_min_bytes").set_zero_copy_min_bytes(nbytes)


def _require_engine(what: str) -> "_C.SendRecvEngine":
    _require_init(what)
    if _engine is None:
        raise Error("send/recv staging is not set up: pydatacopy.init()/init_nvshmem() do it, "
                    "or call pydatacopy.setup_send_recv() on every PE")
    return _engine


def _submit(engine, is_send: bool, tensor: torch.Tensor, peer: int, stream, seconds: float) -> None:
    pending = getattr(_state, "pending", None)
    if pending is None:
        # The engine's send/recv are a batch of one; their scalar arguments cross for a fraction
        # of a list of tuples' conversion (0.6 us against 2 us where measured).
        (engine.send if is_send else engine.recv)(tensor.data_ptr(), tensor.nbytes, peer, _stream(stream),
                                                  seconds)
        _keep_alive(stream, tensor)
        return
    # The stream is resolved here, where the call is made (torch.cuda.stream() inside the group
    # counts), not at the group's exit: that is where the caller ordered the tensor's producers.
    if stream is None:
        stream = pending["stream"]
    handle = _stream(stream)
    if pending["handle"] is None:
        pending["handle"] = handle
    elif pending["handle"] != handle:
        raise Error("pydatacopy.send/recv inside pydatacopy.group(): the group's operations run as "
                    f"one launch on one stream, but this call resolves to stream {handle:#x} and an "
                    f"earlier one to {pending['handle']:#x}; issue them on one stream (pass stream= "
                    "to group(), or make the calls under one torch.cuda.stream())")
    if stream is not None:
        pending["explicit"] = True  # _keep_alive's rule: tensors on a stream given explicitly
    pending["ops"].append((is_send, tensor.data_ptr(), _nbytes(tensor), peer))
    pending["tensors"].append(tensor)
    pending["timeout"] = max(pending["timeout"], seconds)


@contextlib.contextmanager
def group(*, stream=None) -> Iterator[None]:
    """Issue the send()/recv() calls inside together, as one kernel launch, so that they run at
    the same time: a PE that sends and receives at once must group them (as with NCCL's group
    calls). Up to 16 operations, any peers. The launch goes on the stream the calls were made
    on: ``stream=`` of group(), else each call's ``stream=``, else torch's current stream at the
    call; all of a group's calls must come to the same stream. Not traceable (torch.compile):
    use sendrecv there."""
    if _dynamo_compiling() or _dispatch_modes():
        _ops.refuse_group()
    if getattr(_state, "pending", None) is not None:
        raise Error("pydatacopy.group() cannot be nested: issue all the sends and recvs in one "
                    "group() block")
    _state.pending = {"stream": stream, "handle": None, "explicit": stream is not None, "ops": [],
                      "tensors": [], "timeout": 0.0}
    try:
        yield
        pending = _state.pending
    finally:
        _state.pending = None
    if not pending["ops"]:
        return
    handle = pending["handle"]
    _require_engine("group").batch(pending["ops"], handle, pending["timeout"])
    # The launch may be on a stream that is no longer torch's current one (the calls were made
    # under torch.cuda.stream(s)): keep the tensors allocated until that stream is done with them.
    if pending["explicit"] or handle != _stream(None):
        _keep_alive(handle, *pending["tensors"])


def send(tensor: torch.Tensor, dst_pe: int, *, stream=None, timeout: float | None = None) -> None:
    """Send a contiguous CUDA tensor of any dtype and size to `dst_pe`, which calls recv() with a
    tensor of the same number of bytes. Stream-ordered; no symmetric memory needed on either side.
    To send and receive at once, issue both inside ``with pydatacopy.group():`` (or sendrecv)."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.send(tensor, dst_pe, stream=stream, timeout=timeout)
    engine = _require_engine("send")
    check_int("dst_pe", dst_pe, None, _PE_MAX)  # the core checks the range, with the same words
    _check_tensor(tensor, "tensor")
    _submit(engine, True, tensor, dst_pe, stream, timeout_seconds(timeout))


def recv(tensor: torch.Tensor, src_pe: int, *, stream=None, timeout: float | None = None) -> None:
    """Receive into a contiguous CUDA tensor what `src_pe` sends with send() (same byte count)."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.recv(tensor, src_pe, stream=stream, timeout=timeout)
    engine = _require_engine("recv")
    check_int("src_pe", src_pe, None, _PE_MAX)  # the core checks the range, with the same words
    _check_tensor(tensor, "tensor")
    _submit(engine, False, tensor, src_pe, stream, timeout_seconds(timeout))


def sendrecv(send_tensor: torch.Tensor, dst_pe: int, recv_tensor: torch.Tensor, src_pe: int, *,
             stream=None, timeout: float | None = None) -> None:
    """send() and recv() at the same time, in one kernel launch."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (_ops.py), not _C
        return _ops.sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, stream=stream,
                             timeout=timeout)
    engine = _require_engine("sendrecv")
    if getattr(_state, "pending", None) is not None:
        raise Error("pydatacopy.sendrecv() runs its pair itself: call it outside group(), or use "
                    "send() and recv() inside the group")
    check_int("dst_pe", dst_pe, None, _PE_MAX)  # the core checks the ranges, with the same words
    check_int("src_pe", src_pe, None, _PE_MAX)
    _check_tensor(send_tensor, "send_tensor")
    _check_tensor(recv_tensor, "recv_tensor")
    engine.sendrecv(send_tensor.data_ptr(), _nbytes(send_tensor), dst_pe, recv_tensor.data_ptr(),
                    _nbytes(recv_tensor), src_pe, _stream(stream), timeout_seconds(timeout))
    _keep_alive(stream, send_tensor, recv_tensor)
