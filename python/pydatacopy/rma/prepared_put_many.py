"""put_many prepared once (the core's prepared_put_many.cpp): PreparedPutMany checks the rows and
resolves their routes once, keeps the table on the GPU, and run() moves them in one launch."""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _C, _torch_utils, ops
from ..ops import dispatch_modes as _dispatch_modes, dynamo_compiling as _dynamo_compiling, refuse_capture
from .._torch_utils import check_pe as _check_pe, check_tensor as _check_tensor, keep_alive as _keep_alive
from .._torch_utils import core_property, require_init as _require_init, resolve_stream as _stream
from .._torch_utils import stream_handle
from .transfer import PATHS

Error = _C.Error

# run()'s fast path reads these as globals of this module, as transfer.py's calls do (see there).
_device: int | None = None
_n_pes = 0
_torch_utils.keeps_bound_facts(__name__)
_raw_stream = _torch_utils.current_raw_stream


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
        self._op_number = ops.register_object(self)  # what a traced run() names it by

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
        if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
            return ops.put_many_prepared(self, self._op_number, *(self._keep or ((), ())), stream=stream)
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

    pieces = core_property("pieces", "Rows of the device table: empty rows left out, rows over 64 "
                                     "KiB cut into pieces.")

    bytes = core_property("bytes", "Bytes one run moves.")

    direct = core_property("direct", "True when the rows are stored directly into the peer's "
                                     "memory (False: NVSHMEM RMA).")

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
