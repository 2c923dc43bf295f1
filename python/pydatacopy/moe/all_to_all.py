"""The all-to-all-v whose counts stay on the GPU: ``AllToAll`` owns the symmetric receive regions
(collective setup: a row capacity per source PE and a row width fixed then); ``all_to_all_v``
moves rows. Every call is stream-ordered, never synchronises with the host and can be captured
in a CUDA graph. Under torch.compile (and make_fx, FakeTensorMode) the exchange runs as the
custom op ``torch.ops.pydatacopy.all_to_all_v``, defined here."""

from __future__ import annotations

import itertools
import weakref
from typing import Sequence

import torch

from .. import _C
from .._torch_utils import check_int, stream_handle, timeout_seconds
from .common import (MAX_CAPACITY, MAX_FIELDS, MAX_ROW_BYTES, Error, _eager, _mark_static, _on_stream,
                     _refuse_capture, _refuse_tracing, _row_bytes, _traced)

# ---- buffers, named by number in the ops (ops take no Python objects) ---------------------------

_buffers: "weakref.WeakValueDictionary[int, AllToAll]" = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


def _buffer(number: int) -> "AllToAll":
    buffer = _buffers.get(number)
    if buffer is None:
        raise Error("pydatacopy.all_to_all_v: the AllToAll buffer this compiled call was traced with "
                    "no longer exists; recompile with a live one")
    return buffer


class AllToAll:
    """Symmetric receive regions for ``all_to_all_v``: ``capacity`` rows per source PE and call,
    rows of at most ``max_row_bytes`` bytes (all fields of a call together).

    Construction is collective and blocking (every PE, same arguments, same order; not inside a
    CUDA graph capture or a compiled function). Each PE holds two sets (by the parity of its call
    count) of ``n_pes`` regions of ``capacity x max_row_bytes`` bytes on the symmetric heap
    (``symmetric_bytes``); ``close()`` frees them, collectively too (the garbage collector never
    does: freeing needs every PE, so a buffer dropped without close() stays until finalize()).

    A call that asks to send more than ``capacity`` rows to a PE sends it nothing and is refused
    on both PEs concerned: ``pydatacopy.check_errors()`` raises pydatacopy.Error there once the
    GPU has run the call (the receiver's ``recv_counts`` shows 0 rows from that source). Other
    pairs of the same call are delivered; the next call is a fresh round.

    A call that one PE refuses for its own arguments (a tensor of the wrong shape or device, rows
    wider than ``max_row_bytes``, a send tensor NVSHMEM cannot register on the RMA path) still
    takes part in the round on that PE, sending nothing: that PE raises pydatacopy.Error from the
    call, every other PE's call completes (0 rows from it) and its ``check_errors()`` raises
    pydatacopy.Error naming that PE. No PE is left waiting, and the buffer stays usable.
    """

    def __init__(self, capacity: int, max_row_bytes: int) -> None:
        call = "pydatacopy.AllToAll"
        _refuse_tracing("AllToAll")
        check_int("capacity", capacity, 1, MAX_CAPACITY, call=call)
        check_int("max_row_bytes", max_row_bytes, 1, MAX_ROW_BYTES, call=call)
        if not _C.is_initialized():
            raise Error(f"{call} needs NVSHMEM: call pydatacopy.init() (or pydatacopy.init_nvshmem()) first")
        _refuse_capture("AllToAll")
        self._core = _C.AllToAll()
        self._core.init(capacity, max_row_bytes)
        self._n_pes = _C.n_pes()
        self._device = _C.cuda_device()
        # Keeps this buffer's calls in program order when compiled (every op writes it).
        self._order = _mark_static(torch.zeros(1, dtype=torch.uint8, device=f"cuda:{self._device}"))
        self.number = next(_numbers)
        self._views: dict = {}  # compact calls' region views (_region_view)
        _buffers[self.number] = self

    @property
    def capacity(self) -> int:
        """Rows per source PE and call."""
        return self._core.capacity

    @property
    def max_row_bytes(self) -> int:
        """Bytes per row, all fields of a call together."""
        return self._core.max_row_bytes

    @property
    def n_pes(self) -> int:
        return self._n_pes

    @property
    def recv_rows(self) -> int:
        """Rows of every receive tensor: n_pes x capacity."""
        return self._n_pes * self.capacity

    @property
    def symmetric_bytes(self) -> int:
        """Symmetric heap bytes this buffer takes on each PE."""
        return self._core.symmetric_bytes

    @staticmethod
    def symmetric_bytes_needed(capacity: int, max_row_bytes: int, n_pes: int) -> int:
        """What AllToAll(capacity, max_row_bytes) takes on each of n_pes PEs (no GPU needed)."""
        return _C.AllToAll.symmetric_bytes_needed(capacity, max_row_bytes, n_pes)

    def close(self) -> None:
        """Free the regions on every PE (collective, blocking); harmless twice."""
        _refuse_tracing("AllToAll.close")
        _refuse_capture("AllToAll.close")
        self._views.clear()
        self._core.cleanup()

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if not self._core.initialized:
            return "AllToAll(closed)"
        return f"AllToAll(capacity={self.capacity}, max_row_bytes={self.max_row_bytes}, n_pes={self._n_pes})"

    # ---- the exchange -------------------------------------------------------------------------
    def all_to_all_v(self, send: torch.Tensor, send_counts: torch.Tensor, *, stream=None,
                     timeout: float | None = None, zero_unused_rows: bool = False):
        """See pydatacopy.all_to_all_v."""
        if not _traced():
            recvs, counts, offsets = self._exchange_eager([send], send_counts, None, stream, timeout,
                                                          zero_unused_rows=zero_unused_rows)
            return recvs[0], counts, offsets
        recvs, counts, offsets = self.exchange([send], send_counts, stream=stream, timeout=timeout)
        if zero_unused_rows:
            recvs[0] = _zero_past(recvs[0], counts.sum())
        return recvs[0], counts, offsets

    def exchange(self, sends: Sequence[torch.Tensor], send_counts: torch.Tensor,
                 send_index: torch.Tensor | None = None, *, stream=None,
                 timeout: float | None = None):
        """``all_to_all_v`` of 1 to 4 tensors ("fields") that share the counts: row i of each goes
        together. With ``send_index`` (int64 on the GPU), the rows sent are ``send[send_index[j]]``
        in destination order instead of the contiguous rows. Returns (recvs, recv_counts,
        recv_offsets)."""
        sends = list(sends)
        if _traced():
            return _exchange_op(self.number, sends, send_counts, send_index, stream, timeout, self._order)
        return self._exchange_eager(sends, send_counts, send_index, stream, timeout)

    def _check(self, sends, send_counts, send_index) -> torch.Tensor:
        if not self._core.initialized:
            raise Error("pydatacopy.all_to_all_v: this AllToAll buffer was closed")
        if not 1 <= len(sends) <= MAX_FIELDS:
            raise Error(f"pydatacopy.all_to_all_v: 1 to {MAX_FIELDS} send tensors per call, got {len(sends)}")
        rows = None
        for i, send in enumerate(sends):
            _check_cuda(send, f"send[{i}]" if len(sends) > 1 else "send", self._device)
            if send.dim() == 0:
                raise Error("pydatacopy.all_to_all_v: send must have at least one dimension (rows)")
            if rows is not None and send.shape[0] != rows:
                raise Error(f"pydatacopy.all_to_all_v: every send tensor needs the same rows "
                            f"(send[0]: {rows}, send[{i}]: {send.shape[0]})")
            rows = send.shape[0]
        _check_cuda(send_counts, "send_counts", self._device)
        if send_counts.dtype.is_floating_point or send_counts.dtype.is_complex or send_counts.dtype == torch.bool:
            raise Error(f"pydatacopy.all_to_all_v: send_counts must be an integer tensor, got {send_counts.dtype}")
        if send_counts.shape != (self._n_pes,):
            raise Error(f"pydatacopy.all_to_all_v: send_counts must have shape ({self._n_pes},) "
                        f"(one count per PE), got {tuple(send_counts.shape)}")
        if send_index is not None:
            _check_cuda(send_index, "send_index", self._device)
            if send_index.dtype != torch.int64 or send_index.dim() != 1:
                raise Error("pydatacopy.all_to_all_v: send_index must be a 1-D int64 tensor")
        return send_counts

    def _refuse(self, error: Exception, stream, timeout, compact: bool = False):
        """This PE refuses a call its peers make (its own arguments): a round in refuse mode, so
        that their calls complete and record the refusal, then ``error`` raised here. Not
        possible on a closed buffer or from a traced call: raised at once there."""
        if not self._core.initialized or _traced():
            raise error
        try:
            handle, seconds = stream_handle(stream, self._device), timeout_seconds(timeout)
        except Exception:
            raise error from None  # no round can be run with these: the first error
        self._core.refuse(str(error), handle, seconds, compact)

    def _checked(self, sends, send_counts, send_index, stream, timeout) -> torch.Tensor:
        try:
            return self._check(sends, send_counts, send_index)
        except Error as error:
            self._refuse(error, stream, timeout)
            raise  # (refuse always raises)

    def _exchange_eager(self, sends, send_counts, send_index, stream, timeout, tag: int = 0,
                        zero_unused_rows: bool = False):
        send_counts = self._checked(sends, send_counts, send_index, stream, timeout)
        seconds = timeout_seconds(timeout)
        handle = stream_handle(stream, self._device)
        recv_rows = self.recv_rows
        try:
            with _on_stream(stream):  # the call's stream: the conversion and outputs are ordered there
                if send_counts.dtype != torch.int64:
                    send_counts = send_counts.to(torch.int64)
                recvs = [torch.empty((recv_rows, *s.shape[1:]), dtype=s.dtype, device=s.device) for s in sends]
                counts = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
                offsets = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
        except torch.OutOfMemoryError as error:  # this PE alone, maybe: its peers still get the round
            self._refuse(Error(f"pydatacopy.all_to_all_v: the receive tensors ({recv_rows} rows each) could not "
                               f"be allocated on this PE: {error}"), stream, timeout)
        fields = [(s.data_ptr(), r.data_ptr(), _row_bytes(s), s.shape[0], recv_rows)
                  for s, r in zip(sends, recvs)]
        index = 0 if send_index is None else send_index.data_ptr()
        index_rows = 0 if send_index is None else send_index.shape[0]
        self._core.exchange(fields, send_counts.data_ptr(), index, index_rows, counts.data_ptr(),
                            offsets.data_ptr(), handle, seconds, tag)
        if zero_unused_rows:  # rows past those received: zeros, not what the allocator held
            for recv in recvs:
                _C.zero_rows_past(recv.data_ptr(), recv_rows, _row_bytes(recv), counts.data_ptr(), self._n_pes,
                                  handle)
        if stream is not None:  # on another stream: the inputs stay allocated until it is done
            from .._torch_utils import keep_alive as _keep_alive
            _keep_alive(stream, *sends, send_counts, *([] if send_index is None else [send_index]))
        return recvs, counts, offsets


    def _exchange_in_region(self, sends, in_region, send_counts, send_index, timeout, tag: int = 0):
        """_exchange_eager, but the fields with in_region[i] True stay in the receive region
        (None in recvs): the caller reads them with its own kernels (``self._core.in_region(i)``,
        source s's rows ``self._core.region_stride`` bytes after source s - 1's), then MUST call
        ``self._core.release(call, stream)`` on the current stream. Eager only (no op); returns
        (recvs, recv_counts, recv_offsets, call)."""
        send_counts = self._checked(sends, send_counts, send_index, None, timeout)
        seconds = timeout_seconds(timeout)
        handle = stream_handle(None, self._device)
        recv_rows = self.recv_rows
        if send_counts.dtype != torch.int64:
            send_counts = send_counts.to(torch.int64)
        recvs = [None if keep else torch.empty((recv_rows, *s.shape[1:]), dtype=s.dtype, device=s.device)
                 for s, keep in zip(sends, in_region)]
        counts = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
        offsets = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
        fields = [(s.data_ptr(), 0 if r is None else r.data_ptr(), _row_bytes(s), s.shape[0],
                   0 if r is None else recv_rows) for s, r in zip(sends, recvs)]
        index = 0 if send_index is None else send_index.data_ptr()
        index_rows = 0 if send_index is None else send_index.shape[0]
        call = self._core.exchange(fields, send_counts.data_ptr(), index, index_rows, counts.data_ptr(),
                                   offsets.data_ptr(), handle, seconds, tag)
        return recvs, counts, offsets, call

    def _exchange_compact(self, sends, send_counts, send_index, timeout, tag: int = 0):
        """_exchange_in_region with every field left in the region, packed by source (a compact
        call, all_to_all.hpp): each sender stores its rows straight at their final place, so the
        bytes cross once. Returns (views, recv_counts, recv_offsets): views are tensors of
        ``recv_rows`` rows over the region (rows past ``recv_counts.sum()`` are not data), valid
        until this PE's call two later on this buffer, which hands the region back to the
        sources (no release call) after what its stream holds before it (readers on other streams
        are the caller's to order; a captured call's replays reuse one region: each replay's rows
        replace the last's). Eager only."""
        try:
            send_counts = self._check(sends, send_counts, send_index)
        except Error as error:
            self._refuse(error, None, timeout, compact=True)
            raise
        seconds = timeout_seconds(timeout)
        handle = stream_handle(None, self._device)
        try:
            if send_counts.dtype != torch.int64:
                send_counts = send_counts.to(torch.int64)
            both = torch.empty(2 * self._n_pes, dtype=torch.int64, device=send_counts.device)
        except torch.OutOfMemoryError as error:  # this PE alone, maybe: its peers wait for its places
            self._refuse(Error(f"pydatacopy.all_to_all_v: the counts could not be allocated on this PE: {error}"),
                         None, timeout, compact=True)
        counts, offsets = both[:self._n_pes], both[self._n_pes:]
        fields = [(s.data_ptr(), _row_bytes(s), s.shape[0]) for s in sends]
        index = 0 if send_index is None else send_index.data_ptr()
        index_rows = 0 if send_index is None else send_index.shape[0]
        call, addresses = self._core.exchange_compact(fields, send_counts.data_ptr(), index, index_rows,
                                                      counts.data_ptr(), offsets.data_ptr(), handle, seconds, tag)
        return [self._region_view(address, s) for address, s in zip(addresses, sends)], counts, offsets

    def _region_view(self, address: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of recv_rows rows shaped like `like`'s over the packed rows at `address` (one
        per address, shape and dtype: a set's field is at the same address every other call,
        so made once)."""
        key = (address, tuple(like.shape[1:]), like.dtype)
        view = self._views.get(key)
        if view is None:
            from .._torch_utils import tensor_from_address
            view = tensor_from_address(address, (self.recv_rows, *like.shape[1:]), like.dtype, self._device)
            if len(self._views) >= 64:  # a handful of shapes in practice
                self._views.clear()
            self._views[key] = view
        return view


def _zero_past(rows: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """rows with rows [used, ...) zeroed, in torch ops (traced calls: no _C, no host read)."""
    keep = torch.arange(rows.shape[0], device=rows.device) < used
    flat = rows.reshape(rows.shape[0], -1).view(torch.uint8)
    return torch.where(keep[:, None], flat, torch.zeros((), dtype=torch.uint8, device=rows.device)) \
        .view(rows.dtype).reshape(rows.shape)


def _check_cuda(tensor: object, name: str, device: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"pydatacopy.all_to_all_v: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.get_device() != device:
        where = "not on a CUDA device (use .cuda() first)" if not tensor.is_cuda else \
            f"on {tensor.device}, but this process runs pydatacopy on cuda:{device}"
        raise Error(f"pydatacopy.all_to_all_v: {name} is {where}")
    if not tensor.is_contiguous():
        raise Error(f"pydatacopy.all_to_all_v: {name} must be contiguous (call .contiguous() first)")


def all_to_all_v(send: torch.Tensor, send_counts: torch.Tensor, buffer: AllToAll, *, stream=None,
                 timeout: float | None = None,
                 zero_unused_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-to-all with counts on the GPU (collective, stream-ordered, capturable).

    ``send``: ``[rows, ...]``, any dtype, contiguous, on this PE's GPU: the rows for PE 0 first,
    then PE 1's, and so on. ``send_counts``: an integer tensor ``[n_pes]`` on the GPU; PE ``d``
    gets rows ``[sum(send_counts[:d]), + send_counts[d])``. Nothing is read on the host.

    Returns ``(recv, recv_counts, recv_offsets)``: ``recv`` is ``[n_pes * buffer.capacity, ...]``
    of send's dtype with the rows received grouped by source PE (source ``s``'s rows at
    ``recv[recv_offsets[s] : recv_offsets[s] + recv_counts[s]]``, in the order ``s`` sent them;
    rows past ``recv_counts.sum()`` are left as the allocator gave them (not data; zeros with
    ``zero_unused_rows=True``, one small kernel writing those rows)); ``recv_counts`` and ``recv_offsets`` are
    int64 ``[n_pes]``, written on the GPU by the call. Every PE must call it, in the same order,
    with rows of the same width and dtype.

    A count over ``buffer.capacity`` (or negative, or past ``send``'s rows) is refused: that PE
    gets nothing from this PE, and pydatacopy.check_errors() raises pydatacopy.Error on both
    (sender and receiver) once the GPU has run the call. A peer that does not come makes the
    call's waits time out (``timeout``, default PYDATACOPY_TIMEOUT_S): TimeoutError at
    check_errors() or the next call, on every PE that waited on it.
    """
    if not _traced():
        if not _C.is_initialized():
            raise Error("pydatacopy.all_to_all_v needs NVSHMEM: call pydatacopy.init() (or "
                        "pydatacopy.init_nvshmem()) first, then set up a pydatacopy.AllToAll buffer")
        if not isinstance(buffer, AllToAll):
            raise Error(f"pydatacopy.all_to_all_v: buffer must be a pydatacopy.AllToAll (made once, "
                        f"collectively, with the row capacity), got {type(buffer).__name__}")
    return buffer.all_to_all_v(send, send_counts, stream=stream, timeout=timeout, zero_unused_rows=zero_unused_rows)


# ---- the ops ----------------------------------------------------------------------------------

# Four receive tensors whatever the fields (unused ones empty): functionalization (torch.compile)
# refuses a Tensor[] output of an op that also mutates an argument (the order tensor).
_SCHEMA_EXCHANGE = ("(int buffer, Tensor[] sends, Tensor send_counts, Tensor? send_index, int? stream, "
                    "float? timeout, Tensor(a!) order) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _exchange_real(buffer, sends, send_counts, send_index, stream, timeout, order):
    recvs, counts, offsets = _eager(_buffer(buffer)._exchange_eager, list(sends), send_counts,
                                    send_index, stream, timeout)
    return (*_four(recvs, send_counts), counts, offsets)


def _four(recvs, like: torch.Tensor) -> list[torch.Tensor]:
    return list(recvs) + [like.new_empty((0,)) for _ in range(MAX_FIELDS - len(recvs))]


_exchange_custom = torch.library.custom_op("pydatacopy::all_to_all_v", _exchange_real,
                                           mutates_args=("order",), schema=_SCHEMA_EXCHANGE)


@_exchange_custom.register_fake
def _exchange_fake(buffer, sends, send_counts, send_index, stream, timeout, order):
    b = _buffer(buffer)
    recvs = [s.new_empty((b.recv_rows, *s.shape[1:])) for s in sends]
    return (*_four(recvs, send_counts), send_counts.new_empty((b.n_pes,), dtype=torch.int64),
            send_counts.new_empty((b.n_pes,), dtype=torch.int64))


def _exchange_op(number, sends, send_counts, send_index, stream, timeout, order):
    handle = None if stream is None else (stream if isinstance(stream, int) else stream.cuda_stream)
    *recvs, counts, offsets = torch.ops.pydatacopy.all_to_all_v(
        number, sends, send_counts, send_index, handle, None if timeout is None else float(timeout), order)
    return list(recvs[:len(sends)]), counts, offsets
