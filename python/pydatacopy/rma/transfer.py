"""One-sided transfers (the core's transfer.cpp): put/get, signals, quiet, barrier, put_many and
put_blocks, between symmetric tensors (symmetric.py) and any CUDA tensor of this device;
put_many prepared once is prepared_put_many.py.

Everything here is stream-ordered on torch's current stream unless ``stream=`` says otherwise,
and checks its arguments before touching the GPU.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from .. import _C, _torch_utils, ops
from .._limits import INT32_MAX
from ..ops import dispatch_modes as _dispatch_modes, dynamo_compiling as _dynamo_compiling, refuse_capture
from .._torch_utils import check_int, check_pair as _check_pair, check_pe as _check_pe
from .._torch_utils import check_tensor as _check_tensor, keep_alive as _keep_alive, nbytes as _nbytes
from .._torch_utils import require_init as _require_init, resolve_stream as _stream, stream_handle
from .._torch_utils import timeout_seconds

Error = _C.Error
Tensor = torch.Tensor

PATHS = _C.PATHS  # the core's Path codes (transfer.hpp)
_BATCH_PATHS = _C.BATCH_PATHS  # one kernel moves every row: no copy engine
_PE_MAX = INT32_MAX  # PEs cross to the core as C ints (it checks the range of live PEs)
_VALUE_MAX = 2**64 - 1  # signal values are uint64
_SIGNAL_DTYPES = (torch.uint64, torch.int64)
_INT64 = torch.int64

# The fast paths below read these as globals of this module (the cheapest read there is):
# _torch_utils.bind() and unbind() keep them equal to its own (see there).
_device: int | None = None  # this process's CUDA device while initialised, else None
_n_pes = 0  # PEs while initialised, else 0 (every PE is then out of the fast path's range)
_torch_utils.keeps_bound_facts(__name__)
_raw_stream = _torch_utils.current_raw_stream  # torch's current cudaStream_t on a device


def _path(path: str) -> int:
    if path not in PATHS:
        raise Error(f"path must be one of {sorted(PATHS)}, got {path!r}")
    return PATHS[path]


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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.put(dst, src, pe, stream=stream, path=path)
    _one_sided(True, dst, src, pe, stream, path)


def get(dst: torch.Tensor, src: torch.Tensor, pe: int, *, stream=None, path: str = "auto") -> None:
    """Read PE `pe`'s copy of symmetric `src` into local `dst` (stream-ordered); ``path`` as in
    ``put``."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.get(dst, src, pe, stream=stream, path=path)
    _one_sided(False, dst, src, pe, stream, path)


def _one_sided(is_put: bool, dst, src, pe, stream, path) -> None:
    """put's and get's eager body: the fast path, else the checked one. The symmetric side (put's
    dst, get's src) needs no keep-alive: the core refuses any other, and it lives until free()."""
    device = _device
    if (type(pe) is int and 0 <= pe < _n_pes and isinstance(dst, Tensor) and isinstance(src, Tensor)
            and dst.get_device() == device and src.get_device() == device
            and dst.dtype is src.dtype and (nbytes := src.nbytes) == dst.nbytes
            and dst.is_contiguous() and src.is_contiguous() and path in PATHS):
        (_C.put_fast if is_put else _C.get_fast)(
            dst.data_ptr(), src.data_ptr(), nbytes, pe,
            _raw_stream(device) if stream is None else stream_handle(stream, device), PATHS[path])
        if stream is not None:
            _keep_alive(stream, src if is_put else dst)
        return
    # The checked path: whatever the fast one did not take, with the error that says what to do.
    call = "put" if is_put else "get"
    _require_init(call)
    check_int("pe", pe, None, _PE_MAX)
    _check_tensor(dst, "dst")  # the core checks that the symmetric side is symmetric, pe in range
    _check_tensor(src, "src")
    nbytes = _check_pair(dst, src, call)
    (_C.put if is_put else _C.get)(dst.data_ptr(), src.data_ptr(), nbytes, pe, _stream(stream), _path(path))
    _keep_alive(stream, dst, src)


def put_signal(dst: torch.Tensor, src: torch.Tensor, pe: int, signal: torch.Tensor, value: int,
               *, stream=None) -> None:
    """``put``, then set PE `pe`'s copy of `signal` to `value` once the data is visible there."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.put_signal(dst, src, pe, signal, value, stream=stream)
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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.signal_set(signal, value, pe, stream=stream)
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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.signal_wait(signal, value, stream=stream, timeout=timeout, blocking=blocking,
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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.quiet(stream=stream)
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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.barrier(stream=stream, timeout=timeout, blocking=blocking, received=received)
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
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.put_many(dsts, srcs, pe, stream=stream, path=path)
    _check_pe(pe, "put_many")
    if path not in ("auto", "sm", "rma"):
        raise Error(f"pydatacopy.put_many: path must be auto, sm or rma (one kernel moves the "
                    f"tensors), got {path!r}")
    _C.put_many_tensors(dsts, srcs, pe, _stream(stream), PATHS[path], _device, torch.Tensor)
    if stream is not None:
        _keep_alive(stream, *srcs)


def put_blocks(dst_pool: torch.Tensor, src_pool: torch.Tensor, dst_indices: torch.Tensor,
               src_indices: torch.Tensor, pe: int, *, stream=None, path: str = "auto") -> None:
    """KV-cache style, one launch: row ``dst_indices[i]`` of PE `pe`'s copy of the symmetric
    ``dst_pool`` receives row ``src_indices[i]`` of the local ``src_pool``.

    Pools are contiguous ``[num_blocks, ...]`` tensors of one dtype and row size; indices are
    int64 CUDA tensors of equal length (they stay on the GPU: nothing synchronises). An index
    out of range is skipped and raises pydatacopy.Error at the next call or check_errors().
    Visibility as in ``put``. ``path`` as in ``put_many``.
    """
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, stream=stream,
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


# The ops' real kernels run these, read from this module when they run (so a function swapped
# here is the one run); ops imports no feature, so the feature names itself.
ops.implement(sys.modules[__name__], "put", "get", "put_signal", "signal_set", "signal_wait", "quiet",
              "barrier", "put_many", "put_blocks")
