"""MoE token exchange: an all-to-all-v whose counts stay on the GPU, and dispatch/combine.

``AllToAll`` owns the symmetric receive regions (collective setup: a row capacity per source PE
and a row width fixed then). ``all_to_all_v`` moves rows; ``MoeDispatcher`` builds dispatch and
combine on it. Every call is stream-ordered, never synchronises with the host and can be
captured in a CUDA graph and replayed with fresh counts or routing (written into the captured
input tensors). Layout and protocol: docs/moe.md and include/pydatacopy/all_to_all.hpp.

Under torch.compile (and make_fx, FakeTensorMode) the exchanges run as the custom ops
``torch.ops.pydatacopy.all_to_all_v`` and ``torch.ops.pydatacopy.moe_combine_reduce`` (fake
kernels give the output shapes); the layout work around them is plain torch code.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import NamedTuple, Sequence

import torch
from torch._C import _len_torch_dispatch_stack

from . import _C
from ._torch_utils import check_int, stream_handle, timeout_seconds

Error = _C.Error

MAX_FIELDS = 4  # AllToAllLayout::kMaxFields
MAX_ROW_BYTES = (1 << 24) - 1  # AllToAllLayout::kMaxRowBytes
MAX_CAPACITY = (1 << 31) - 1
_REDUCE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# MoeDispatcher's eager calls (and CUDA graph captures) read the rows received straight from the
# all-to-all's receive regions (no compaction copy); False: the compacting path that traced
# (torch.compile) calls take. A switch for comparing the two, and a way back if needed.
IN_REGION = True


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
                     timeout: float | None = None):
        """See pydatacopy.all_to_all_v."""
        recvs, counts, offsets = self.exchange([send], send_counts, stream=stream, timeout=timeout)
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

    def _exchange_eager(self, sends, send_counts, send_index, stream, timeout):
        send_counts = self._check(sends, send_counts, send_index)
        seconds = timeout_seconds(timeout)
        handle = stream_handle(stream, self._device)
        recv_rows = self.recv_rows
        with _on_stream(stream):  # the call's stream: the conversion and outputs are ordered there
            if send_counts.dtype != torch.int64:
                send_counts = send_counts.to(torch.int64)
            recvs = [torch.empty((recv_rows, *s.shape[1:]), dtype=s.dtype, device=s.device) for s in sends]
            counts = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
            offsets = torch.empty(self._n_pes, dtype=torch.int64, device=send_counts.device)
        fields = [(s.data_ptr(), r.data_ptr(), _row_bytes(s), s.shape[0], recv_rows)
                  for s, r in zip(sends, recvs)]
        index = 0 if send_index is None else send_index.data_ptr()
        index_rows = 0 if send_index is None else send_index.shape[0]
        self._core.exchange(fields, send_counts.data_ptr(), index, index_rows, counts.data_ptr(),
                            offsets.data_ptr(), handle, seconds)
        if stream is not None:  # on another stream: the inputs stay allocated until it is done
            from ._torch_utils import keep_alive as _keep_alive
            _keep_alive(stream, *sends, send_counts, *([] if send_index is None else [send_index]))
        return recvs, counts, offsets


    def _exchange_in_region(self, sends, in_region, send_counts, send_index, timeout):
        """_exchange_eager, but the fields with in_region[i] True stay in the receive region
        (None in recvs): the caller reads them with its own kernels (``self._core.in_region(i)``,
        source s's rows ``self._core.region_stride`` bytes after source s - 1's), then MUST call
        ``self._core.release(call, stream)`` on the current stream. Eager only (no op); returns
        (recvs, recv_counts, recv_offsets, call)."""
        send_counts = self._check(sends, send_counts, send_index)
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
                                   offsets.data_ptr(), handle, seconds)
        return recvs, counts, offsets, call


def _check_cuda(tensor: object, name: str, device: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"pydatacopy.all_to_all_v: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.get_device() != device:
        where = "not on a CUDA device (use .cuda() first)" if not tensor.is_cuda else \
            f"on {tensor.device}, but this process runs pydatacopy on cuda:{device}"
        raise Error(f"pydatacopy.all_to_all_v: {name} is {where}")
    if not tensor.is_contiguous():
        raise Error(f"pydatacopy.all_to_all_v: {name} must be contiguous (call .contiguous() first)")


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


def all_to_all_v(send: torch.Tensor, send_counts: torch.Tensor, buffer: AllToAll, *, stream=None,
                 timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-to-all with counts on the GPU (collective, stream-ordered, capturable).

    ``send``: ``[rows, ...]``, any dtype, contiguous, on this PE's GPU: the rows for PE 0 first,
    then PE 1's, and so on. ``send_counts``: an integer tensor ``[n_pes]`` on the GPU; PE ``d``
    gets rows ``[sum(send_counts[:d]), + send_counts[d])``. Nothing is read on the host.

    Returns ``(recv, recv_counts, recv_offsets)``: ``recv`` is ``[n_pes * buffer.capacity, ...]``
    of send's dtype with the rows received grouped by source PE (source ``s``'s rows at
    ``recv[recv_offsets[s] : recv_offsets[s] + recv_counts[s]]``, in the order ``s`` sent them;
    rows past ``recv_counts.sum()`` are unspecified); ``recv_counts`` and ``recv_offsets`` are
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
    return buffer.all_to_all_v(send, send_counts, stream=stream, timeout=timeout)


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


# ---- the ops ----------------------------------------------------------------------------------

# Four receive tensors whatever the fields (unused ones empty): functionalization (torch.compile)
# refuses a Tensor[] output of an op that also mutates an argument (the order tensor).
_SCHEMA_EXCHANGE = ("(int buffer, Tensor[] sends, Tensor send_counts, Tensor? send_index, int? stream, "
                    "float? timeout, Tensor(a!) order) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_SCHEMA_REDUCE = "(Tensor rows, Tensor slots, Tensor weights, int? stream) -> Tensor"


def _eager(function, *args):
    """Run an op's real kernel as eager code even under a dispatch mode that handed it on."""
    if _len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return function(*args)
    return function(*args)


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


def _dispatch_layout_real(topk_idx, num_experts, n_pes, stream):
    if not topk_idx.is_cuda:  # opcheck and references on the CPU: the torch code
        return tuple(t.clone() for t in dispatch_plan_reference(topk_idx, num_experts, n_pes))
    return _eager(_dispatch_layout_eager, topk_idx, num_experts, n_pes, stream)


_dispatch_layout_custom = torch.library.custom_op(
    "pydatacopy::moe_dispatch_layout", _dispatch_layout_real, mutates_args=(),
    schema="(Tensor topk_idx, int num_experts, int n_pes, int? stream) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@_dispatch_layout_custom.register_fake
def _dispatch_layout_fake(topk_idx, num_experts, n_pes, stream):
    tokens, topk = topk_idx.shape
    longs = dict(dtype=torch.int64)
    return (topk_idx.new_empty((n_pes,), **longs), topk_idx.new_empty((n_pes * tokens + 1,), **longs),
            topk_idx.new_empty((tokens, topk + 1), dtype=torch.int32),
            topk_idx.new_empty((tokens, topk), **longs), topk_idx.new_empty((tokens, topk), **longs))


def _receive_layout_real(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream):
    if not recv_meta.is_cuda:
        return tuple(t.clone() for t in receive_layout_reference(recv_meta, recv_counts, my_pe,
                                                                 experts_per_pe, topk))
    return _eager(_receive_layout_eager, recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream)


_receive_layout_custom = torch.library.custom_op(
    "pydatacopy::moe_receive_layout", _receive_layout_real, mutates_args=(),
    schema="(Tensor recv_meta, Tensor recv_counts, int my_pe, int experts_per_pe, int topk, int? stream) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_receive_layout_custom.register_fake
def _receive_layout_fake(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream):
    pairs = recv_meta.shape[0] * topk
    n_pes = recv_counts.shape[0]

    def longs(*shape):
        return recv_meta.new_empty(shape, dtype=torch.int64)

    return (longs(pairs), longs(experts_per_pe), longs(experts_per_pe), longs(), longs(pairs),
            longs(pairs), longs(pairs), longs(pairs + 1), longs(n_pes))


def _exchange_op(number, sends, send_counts, send_index, stream, timeout, order):
    handle = None if stream is None else (stream if isinstance(stream, int) else stream.cuda_stream)
    *recvs, counts, offsets = torch.ops.pydatacopy.all_to_all_v(
        number, sends, send_counts, send_index, handle, None if timeout is None else float(timeout), order)
    return list(recvs[:len(sends)]), counts, offsets


OPS = {"all_to_all_v": torch.ops.pydatacopy.all_to_all_v.default,
       "moe_gather_rows": torch.ops.pydatacopy.moe_gather_rows.default,
       "moe_combine_reduce": torch.ops.pydatacopy.moe_combine_reduce.default,
       "moe_dispatch_layout": torch.ops.pydatacopy.moe_dispatch_layout.default,
       "moe_receive_layout": torch.ops.pydatacopy.moe_receive_layout.default}


# ---- dispatch / combine -------------------------------------------------------------------------

class MoeHandle(NamedTuple):
    """What dispatch() leaves for combine() and for the expert computation; tensors on the GPU.

    ``expert_counts`` / ``expert_offsets`` (int64 ``[experts_per_pe]``): rows of each local expert
    in ``recv_x`` (expert ``e``'s rows at ``recv_x[expert_offsets[e] : + expert_counts[e]]``);
    ``num_rows`` (int64, 0-dim): rows of recv_x in use (their sum); ``expert_of_row`` (int64
    ``[rows of recv_x]``): the local expert of each row (``experts_per_pe`` past num_rows);
    ``source_pe`` / ``source_token`` (int64 ``[rows of recv_x]``): where each row came from (-1
    past num_rows); ``recv_counts`` (int64 ``[n_pes]``): tokens received from each PE. The rest is
    combine's."""
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: torch.Tensor
    expert_of_row: torch.Tensor
    source_pe: torch.Tensor
    source_token: torch.Tensor
    recv_counts: torch.Tensor
    combine_index: torch.Tensor   # [pairs + 1]: recv_x row of each pair, sent back in this order
    combine_counts: torch.Tensor  # [n_pes]: rows sent back to each PE
    pair_pe: torch.Tensor         # [tokens, topk]: the PE of each of this PE's (token, k), or n_pes
    pair_rank: torch.Tensor       # [tokens, topk]: its position among this PE's pairs with that PE


class MoeDispatcher:
    """MoE dispatch and combine over ``n_pes`` PEs, ``num_experts`` split evenly (PE ``p`` holds
    experts ``[p * E / n, (p + 1) * E / n)``).

    ``dispatch(x, topk_idx)`` sends every token (a row of ``x [tokens, hidden]``) to each PE that
    holds one of its top-k experts, once per PE however many of its experts that PE holds, and
    returns ``recv_x`` grouped by local expert (a token with two experts here appears in both
    groups) and a ``MoeHandle``. ``combine(y, handle, topk_weights)`` sends the expert outputs
    ``y`` (recv_x's layout) back and returns ``out [tokens, hidden]``,
    ``out[t] = sum_k topk_weights[t, k] * y(t, k)`` in float32, k in order, rounded to y's dtype.

    Setup (collective, blocking): two AllToAll buffers, one per direction. ``max_tokens``: tokens
    per PE and call at most (dispatch's capacity per source); the combine direction carries one
    row per (token, expert) pair, ``max_tokens x topk`` per source. Both are symmetric memory:
    ``symmetric_bytes``. More tokens than ``max_tokens`` is refused as a capacity overflow
    (pydatacopy.check_errors()), never truncated.

    Every call is stream-ordered on torch's current stream, reads nothing on the host, and can
    be captured in a CUDA graph (replays take the routing written into the captured inputs).
    """

    def __init__(self, num_experts: int, hidden: int, topk: int, max_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, *, combine_dtype: torch.dtype | None = None) -> None:
        call = "pydatacopy.MoeDispatcher"
        _refuse_tracing("MoeDispatcher")
        if not _C.is_initialized():
            raise Error(f"{call} needs NVSHMEM: call pydatacopy.init() (or pydatacopy.init_nvshmem()) first")
        n = _C.n_pes()
        check_int("num_experts", num_experts, 1, call=call)
        check_int("hidden", hidden, 1, call=call)
        check_int("topk", topk, 1, num_experts, call=call)
        check_int("max_tokens", max_tokens, 1, MAX_CAPACITY // topk, call=call)
        if num_experts % n:
            raise Error(f"{call}: num_experts={num_experts} does not split evenly over {n} PEs; "
                        "use a multiple of the PE count")
        if not isinstance(dtype, torch.dtype):
            raise Error(f"{call}: dtype must be a torch.dtype, got {dtype!r}")
        combine_dtype = dtype if combine_dtype is None else combine_dtype
        if combine_dtype not in _REDUCE_DTYPES:
            raise Error(f"{call}: combine_dtype (the expert outputs') must be float32, bfloat16 or "
                        f"float16, got {combine_dtype}")
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.dtype, self.combine_dtype = dtype, combine_dtype
        self.n_pes, self.experts_per_pe = n, num_experts // n
        self.my_pe = _C.my_pe()
        element = torch.empty((), dtype=dtype).element_size()
        combine_element = torch.empty((), dtype=combine_dtype).element_size()
        # Dispatch moves each token with its top-k expert ids and its index (int32), so that the
        # receiver can group by expert and tell where a row came from; combine moves one output row per (token, expert) pair.
        self._dispatch = AllToAll(max_tokens, hidden * element + (topk + 1) * 4)
        try:
            self._combine = AllToAll(max_tokens * topk, hidden * combine_element)
        except BaseException:
            self._dispatch.close()
            raise

    @property
    def recv_rows(self) -> int:
        """Rows of recv_x (and of the y combine takes): n_pes x max_tokens x topk."""
        return self.n_pes * self.max_tokens * self.topk

    @property
    def symmetric_bytes(self) -> int:
        return self._dispatch.symmetric_bytes + self._combine.symmetric_bytes

    def close(self) -> None:
        """Free both buffers on every PE (collective, blocking)."""
        self._dispatch.close()
        self._combine.close()

    def __enter__(self) -> "MoeDispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int | None = None,
                 *, timeout: float | None = None) -> tuple[torch.Tensor, MoeHandle]:
        """Send each token to the PEs of its experts; returns ``(recv_x, handle)``.

        ``x``: ``[tokens, hidden]`` of the dispatcher's dtype (bytes are moved as they are: bf16,
        fp8, anything of that element size), ``tokens <= max_tokens``. ``topk_idx``: integer
        ``[tokens, topk]`` on the GPU, global expert ids; a negative id means "no expert" for
        that slot. ``recv_x``: ``[recv_rows, hidden]``, rows grouped by local expert (see
        MoeHandle), within an expert by source PE and then by the source's token order; rows
        past ``handle.num_rows`` are unspecified. Collective: every PE calls it, in the same order.
        """
        if num_experts is not None and num_experts != self.num_experts:
            raise Error(f"pydatacopy.MoeDispatcher.dispatch: num_experts={num_experts}, but the "
                        f"dispatcher was set up for {self.num_experts}")
        self._check_tokens(x, topk_idx, "dispatch")
        plan = dispatch_plan(topk_idx, self.num_experts, self.n_pes)
        if _traced() or not IN_REGION:
            (recv_tokens, recv_meta), recv_counts, _ = self._dispatch.exchange(
                [x, plan.meta], plan.send_counts, plan.send_index, timeout=timeout)
            layout = receive_layout(recv_meta, recv_counts, self.my_pe, self.experts_per_pe, self.topk)
            recv_x = gather_rows(recv_tokens, layout.row_of, layout.num_rows)
        else:
            # The token rows stay in the receive region: the grouping by expert reads them there
            # (one copy of the rows received, not two); the meta rows are compacted for the layout.
            buffer = self._dispatch
            (_, recv_meta), recv_counts, recv_offsets, call = buffer._exchange_in_region(
                [x, plan.meta], [True, False], plan.send_counts, plan.send_index, timeout)
            try:
                received = recv_meta.shape[0]
                row_bytes = _row_bytes(x)
                stream = stream_handle(None, buffer._device)
                region, stride = buffer._core.in_region(0), buffer._core.region_stride
                if row_bytes % 16 == 0 and _layout_kernels_fit(self.n_pes, self.experts_per_pe,
                                                               received * self.topk + 1):
                    # Each received row read once and written to each of its experts' rows.
                    positions = torch.empty(received * self.topk, dtype=torch.int64, device=x.device)
                    layout = ReceiveLayout(*_receive_layout_eager(recv_meta, recv_counts, self.my_pe,
                                                                  self.experts_per_pe, self.topk, None,
                                                                  positions))
                    rows = layout.row_of.shape[0]
                    recv_x = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
                    _C.scatter_region_rows(recv_x.data_ptr(), rows, region, stride, recv_offsets.data_ptr(),
                                           recv_counts.data_ptr(), self.n_pes, positions.data_ptr(),
                                           self.topk, received, row_bytes, stream)
                else:
                    layout = receive_layout(recv_meta, recv_counts, self.my_pe, self.experts_per_pe, self.topk)
                    rows = layout.row_of.shape[0]
                    recv_x = torch.empty((rows, self.hidden), dtype=x.dtype, device=x.device)
                    _C.gather_region_rows(recv_x.data_ptr(), region, stride, recv_offsets.data_ptr(),
                                          recv_counts.data_ptr(), self.n_pes, layout.row_of.data_ptr(),
                                          layout.num_rows.data_ptr(), rows, row_bytes, stream)
            finally:
                buffer._core.release(call, stream_handle(None, buffer._device))
        handle = MoeHandle(layout.expert_counts, layout.expert_offsets, layout.num_rows,
                           layout.expert_of_row, layout.source_pe, layout.source_token, recv_counts,
                           layout.combine_index, layout.combine_counts, plan.pair_pe, plan.pair_rank)
        return recv_x, handle

    def combine(self, y: torch.Tensor, handle: MoeHandle, topk_weights: torch.Tensor, *,
                timeout: float | None = None) -> torch.Tensor:
        """Send the expert outputs back and sum them per token; returns ``[tokens, hidden]``.

        ``y``: ``[recv_rows, hidden]`` (recv_x's layout; rows past handle.num_rows are not read)
        of combine_dtype. ``topk_weights``: ``[tokens, topk]`` on the GPU (any float dtype, used
        as float32), this PE's tokens as dispatched. Collective, like dispatch.
        """
        if y.dim() != 2 or y.shape[0] != self.recv_rows or y.shape[1] != self.hidden:
            raise Error(f"pydatacopy.MoeDispatcher.combine: y must be [{self.recv_rows}, {self.hidden}] "
                        f"(recv_x's shape), got {tuple(y.shape)}")
        if y.dtype != self.combine_dtype:
            raise Error(f"pydatacopy.MoeDispatcher.combine: y must be {self.combine_dtype} (combine_dtype), got {y.dtype}")
        if tuple(topk_weights.shape) != tuple(handle.pair_pe.shape):
            raise Error(f"pydatacopy.MoeDispatcher.combine: topk_weights must be {tuple(handle.pair_pe.shape)} "
                        f"([tokens, topk] as dispatched), got {tuple(topk_weights.shape)}")
        if _traced() or not IN_REGION or not topk_weights.is_cuda:
            (back,), back_counts, back_offsets = self._combine.exchange(
                [y], handle.combine_counts, handle.combine_index, timeout=timeout)
            slots = combine_slots(handle.pair_pe, handle.pair_rank, back_counts, back_offsets, self.n_pes)
            return combine_reduce(back, slots, topk_weights)
        # The expert outputs stay in the receive region: the reduction reads each (token, k)'s
        # row there (source pair_pe, row pair_rank), with no compaction copy and no slot tensor.
        buffer = self._combine
        y = y.contiguous()
        tokens, topk = handle.pair_pe.shape
        (_,), back_counts, _, call = buffer._exchange_in_region(
            [y], [True], handle.combine_counts, handle.combine_index, timeout)
        try:
            weights = topk_weights.to(torch.float32).contiguous()
            out = torch.empty((tokens, self.hidden), dtype=y.dtype, device=y.device)
            # Held in locals until the launch is queued: a temporary copy freed as soon as its
            # data_ptr() is read could hand its memory to the next one before the kernel runs.
            pair_pe, pair_rank = handle.pair_pe.contiguous(), handle.pair_rank.contiguous()
            _C.moe_combine_reduce_region(out.data_ptr(), buffer._core.in_region(0), buffer._core.region_stride,
                                         pair_pe.data_ptr(), pair_rank.data_ptr(), back_counts.data_ptr(),
                                         self.n_pes, weights.data_ptr(), tokens, topk, self.hidden,
                                         _REDUCE_DTYPES[y.dtype], stream_handle(None, buffer._device))
        finally:
            buffer._core.release(call, stream_handle(None, buffer._device))
        return out

    def _check_tokens(self, x, topk_idx, what) -> None:
        call = f"pydatacopy.MoeDispatcher.{what}"
        if not isinstance(x, torch.Tensor) or not isinstance(topk_idx, torch.Tensor):
            raise Error(f"{call}: x and topk_idx must be tensors")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise Error(f"{call}: x must be [tokens, {self.hidden}], got {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise Error(f"{call}: {x.shape[0]} tokens, more than max_tokens={self.max_tokens} set up")
        if x.element_size() != torch.empty((), dtype=self.dtype).element_size():
            raise Error(f"{call}: x is {x.dtype}, the dispatcher moves {self.dtype} rows; use a "
                        "dtype of that element size")
        if topk_idx.dim() != 2 or tuple(topk_idx.shape) != (x.shape[0], self.topk):
            raise Error(f"{call}: topk_idx must be [tokens, topk] = [{x.shape[0]}, {self.topk}], got "
                        f"{tuple(topk_idx.shape)}")
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            raise Error(f"{call}: topk_idx must be an integer tensor, got {topk_idx.dtype}")


# ---- layout (plain torch, graph-safe: fixed shapes, no host reads) -----------------------------

class DispatchPlan(NamedTuple):
    send_counts: torch.Tensor  # [n_pes] tokens for each PE
    send_index: torch.Tensor   # [n_pes * tokens + 1]: token of each row sent, PE-major
    meta: torch.Tensor         # [tokens, topk + 1] int32 sent along: expert ids (-1: none), token
    pair_pe: torch.Tensor      # [tokens, topk]: PE of each (token, k), n_pes when none
    pair_rank: torch.Tensor    # [tokens, topk]: rank among this PE's (token, k) pairs with that PE


def _layout_kernels_fit(n_pes: int, experts_per_pe: int, pairs: int) -> bool:
    """Within the one-block layout kernels' limits (all_to_all.hpp); past them: the torch code."""
    return (n_pes <= _C.MOE_LAYOUT_MAX_PES and experts_per_pe <= _C.MOE_LAYOUT_MAX_EXPERTS_PER_PE
            and pairs < _C.MOE_LAYOUT_MAX_PAIRS)


def dispatch_plan(topk_idx: torch.Tensor, num_experts: int, n_pes: int) -> DispatchPlan:
    """Which PE each token goes to, and in which order (the sender's side of dispatch).

    On the GPU one kernel computes it (moe_dispatch_layout in the core; under torch.compile the
    op ``pydatacopy::moe_dispatch_layout``); on the CPU, or past the kernel's limits, the torch
    code of ``dispatch_plan_reference`` (the same values)."""
    tokens, topk = topk_idx.shape
    if topk_idx.is_cuda and _layout_kernels_fit(n_pes, 1, tokens * topk):
        if _traced():
            return DispatchPlan(*torch.ops.pydatacopy.moe_dispatch_layout(topk_idx, num_experts, n_pes, None))
        return DispatchPlan(*_dispatch_layout_eager(topk_idx, num_experts, n_pes, None))
    return dispatch_plan_reference(topk_idx, num_experts, n_pes)


def _dispatch_layout_eager(topk_idx, num_experts, n_pes, stream):
    tokens, topk = topk_idx.shape
    device = topk_idx.device
    with _on_stream(stream):
        if topk_idx.dtype not in (torch.int32, torch.int64):
            topk_idx = topk_idx.to(torch.int64)
        topk_idx = topk_idx.contiguous()
        send_counts = torch.empty(n_pes, dtype=torch.int64, device=device)
        send_index = torch.empty(n_pes * tokens + 1, dtype=torch.int64, device=device)
        meta = torch.empty((tokens, topk + 1), dtype=torch.int32, device=device)
        pair_pe = torch.empty((tokens, topk), dtype=torch.int64, device=device)
        pair_rank = torch.empty((tokens, topk), dtype=torch.int64, device=device)
        # Large inputs: the multi-block kernels' counts (none for small ones). Held until the
        # launches are queued; freed after, stream-ordered like the outputs.
        scratch_bytes = _C.moe_dispatch_layout_scratch_bytes(tokens, topk, n_pes)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if scratch_bytes else None
    _C.moe_dispatch_layout(topk_idx.data_ptr(), topk_idx.element_size(), tokens, topk, num_experts, n_pes,
                           send_counts.data_ptr(), send_index.data_ptr(), meta.data_ptr(),
                           pair_pe.data_ptr(), pair_rank.data_ptr(), stream_handle(stream, topk_idx.get_device()),
                           0 if scratch is None else scratch.data_ptr(), scratch_bytes)
    return send_counts, send_index, meta, pair_pe, pair_rank


def dispatch_plan_reference(topk_idx: torch.Tensor, num_experts: int, n_pes: int) -> DispatchPlan:
    """dispatch_plan in plain torch (CPU, tests; the kernel's reference). send_index entries past
    the rows sent are not specified (the kernel writes zeros)."""
    tokens, topk = topk_idx.shape
    device = topk_idx.device
    ids = topk_idx.to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    pair_pe = torch.where(valid, ids // (num_experts // n_pes), n_pes)
    hit = torch.zeros((tokens, n_pes + 1), dtype=torch.int64, device=device)
    hit.scatter_(1, pair_pe, 1)
    hit = hit[:, :n_pes]
    send_counts = hit.sum(0)
    flat = hit.t().reshape(-1)  # PE-major: [pe][token]
    position = torch.cumsum(flat, 0) - 1
    dump = n_pes * tokens  # one spare entry takes every write of a token that does not go there
    target = torch.where(flat > 0, position, dump)
    send_index = torch.zeros(n_pes * tokens + 1, dtype=torch.int64, device=device)
    send_index.scatter_(0, target, torch.arange(n_pes * tokens, device=device) % max(tokens, 1))
    # Rank of each (token, k) among this PE's pairs with the same PE, in (token, k) order: the
    # order in which that PE sends the pairs' outputs back.
    one_hot = torch.zeros((tokens * topk, n_pes + 1), dtype=torch.int64, device=device)
    one_hot.scatter_(1, pair_pe.reshape(-1, 1), 1)
    pair_rank = (torch.cumsum(one_hot, 0) - 1).gather(1, pair_pe.reshape(-1, 1)).reshape(tokens, topk)
    meta = torch.cat([torch.where(valid, ids, -1),
                      torch.arange(tokens, device=device).reshape(tokens, 1)], 1).to(torch.int32)
    return DispatchPlan(send_counts, send_index, meta, pair_pe, pair_rank)


class ReceiveLayout(NamedTuple):
    row_of: torch.Tensor          # [R * topk]: the received row behind each recv_x row
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: torch.Tensor
    expert_of_row: torch.Tensor
    source_pe: torch.Tensor
    source_token: torch.Tensor
    combine_index: torch.Tensor
    combine_counts: torch.Tensor


def receive_layout(recv_meta: torch.Tensor, recv_counts: torch.Tensor, my_pe: int,
                   experts_per_pe: int, topk: int) -> ReceiveLayout:
    """The receiver's side of dispatch: group the received tokens by local expert, and the order
    in which combine sends the outputs back. ``recv_meta``: ``[R, topk + 1]`` int32 of the
    received rows (grouped by source, ``recv_counts`` of each): expert ids, then the source's
    token index.

    On the GPU one kernel computes it (moe_receive_layout in the core; under torch.compile the op
    ``pydatacopy::moe_receive_layout``); on the CPU, or past the kernel's limits,
    ``receive_layout_reference``."""
    n_pes = recv_counts.shape[0]
    if recv_meta.dim() != 2 or recv_meta.shape[1] != topk + 1:
        raise Error(f"pydatacopy receive_layout: recv_meta must be [rows, topk + 1] = [rows, {topk + 1}], "
                    f"got {tuple(recv_meta.shape)}")
    if (recv_meta.is_cuda and recv_meta.dtype == torch.int32 and n_pes >= 1 and 0 <= my_pe < n_pes
            and _layout_kernels_fit(n_pes, experts_per_pe, recv_meta.shape[0] * topk + 1)):
        if _traced():
            return ReceiveLayout(*torch.ops.pydatacopy.moe_receive_layout(
                recv_meta, recv_counts, my_pe, experts_per_pe, topk, None))
        return ReceiveLayout(*_receive_layout_eager(recv_meta, recv_counts, my_pe, experts_per_pe, topk, None))
    return receive_layout_reference(recv_meta, recv_counts, my_pe, experts_per_pe, topk)


def _receive_layout_eager(recv_meta, recv_counts, my_pe, experts_per_pe, topk, stream, positions=None):
    """The kernel; ``positions`` (int64 [rows * topk], or None): also each pair's recv_x row (-1
    for a pair with no local expert), for scatter_region_rows."""
    if recv_meta.dim() != 2 or recv_meta.shape[1] != topk + 1:  # the kernel reads topk + 1 per row
        raise Error(f"pydatacopy receive_layout: recv_meta must be [rows, topk + 1] = [rows, {topk + 1}], "
                    f"got {tuple(recv_meta.shape)}")
    rows = recv_meta.shape[0]
    n_pes = recv_counts.shape[0]
    pairs = rows * topk
    device = recv_meta.device

    def longs(*shape):
        return torch.empty(shape, dtype=torch.int64, device=device)

    with _on_stream(stream):
        recv_meta = recv_meta.contiguous()
        if recv_counts.dtype != torch.int64:
            recv_counts = recv_counts.to(torch.int64)
        recv_counts = recv_counts.contiguous()
        out = ReceiveLayout(row_of=longs(pairs), expert_counts=longs(experts_per_pe),
                            expert_offsets=longs(experts_per_pe), num_rows=longs(),
                            expert_of_row=longs(pairs), source_pe=longs(pairs), source_token=longs(pairs),
                            combine_index=longs(pairs + 1), combine_counts=longs(n_pes))
        scratch_bytes = _C.moe_receive_layout_scratch_bytes(rows, topk, experts_per_pe)  # (as in _dispatch_layout_eager)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if scratch_bytes else None
    _C.moe_receive_layout(recv_meta.data_ptr(), rows, topk, recv_counts.data_ptr(), n_pes, my_pe,
                          experts_per_pe, *(t.data_ptr() for t in out),
                          0 if positions is None else positions.data_ptr(),
                          stream_handle(stream, recv_meta.get_device()),
                          0 if scratch is None else scratch.data_ptr(), scratch_bytes)
    return tuple(out)


def receive_layout_reference(recv_meta: torch.Tensor, recv_counts: torch.Tensor, my_pe: int,
                             experts_per_pe: int, topk: int) -> ReceiveLayout:
    """receive_layout in plain torch (CPU, tests; the kernel's reference). combine_index entries
    past the pairs sent back are not specified (the kernel writes zeros)."""
    rows = recv_meta.shape[0]
    n_pes = recv_counts.shape[0]
    device = recv_meta.device
    pairs = rows * topk
    received = torch.cumsum(recv_counts, 0)
    total = received[-1] if n_pes else torch.zeros((), dtype=torch.int64, device=device)
    row_ids = torch.arange(rows, device=device)
    row_in_use = row_ids < total
    ids = recv_meta[:, :topk].to(torch.int64)
    local = ids - my_pe * experts_per_pe
    pair_valid = row_in_use[:, None] & (ids >= 0) & (local >= 0) & (local < experts_per_pe)
    flat_valid = pair_valid.reshape(-1)
    flat_ids = torch.arange(pairs, device=device)
    expert = torch.where(pair_valid, local, experts_per_pe).reshape(-1)
    # Sort by (expert, received row, k): pairs of no local expert go last. Keys stay unique.
    order = torch.sort(expert * pairs + flat_ids).indices
    row_of = order // topk
    expert_counts = torch.zeros(experts_per_pe + 1, dtype=torch.int64, device=device)
    expert_counts.scatter_add_(0, expert, torch.ones_like(expert))
    expert_counts = expert_counts[:experts_per_pe]
    expert_offsets = torch.cumsum(expert_counts, 0) - expert_counts
    num_rows = expert_counts.sum()
    in_use = torch.arange(pairs, device=device) < num_rows
    expert_of_row = torch.where(in_use, expert.gather(0, order), experts_per_pe)
    source_pe_of_row = torch.searchsorted(received, row_ids, right=True)  # [R]
    starts = received - recv_counts
    source_pe = torch.where(in_use, source_pe_of_row.gather(0, row_of), -1)
    source_token = torch.where(in_use, recv_meta[:, topk].to(torch.int64).gather(0, row_of), -1)
    # Combine sends the outputs back in (received row, k) order: the sender's (token, k) order.
    recv_x_row = torch.empty(pairs, dtype=torch.int64, device=device)
    recv_x_row.scatter_(0, order, torch.arange(pairs, device=device))
    back = torch.cumsum(flat_valid.to(torch.int64), 0) - 1
    combine_index = torch.zeros(pairs + 1, dtype=torch.int64, device=device)
    combine_index.scatter_(0, torch.where(flat_valid, back, pairs), recv_x_row)
    per_row = pair_valid.sum(1)
    cumulative = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(per_row, 0)])
    combine_counts = cumulative.gather(0, received) - cumulative.gather(0, starts)
    return ReceiveLayout(row_of, expert_counts, expert_offsets, num_rows, expert_of_row, source_pe,
                         source_token, combine_index, combine_counts)


def combine_slots(pair_pe: torch.Tensor, pair_rank: torch.Tensor, back_counts: torch.Tensor,
                  back_offsets: torch.Tensor, n_pes: int) -> torch.Tensor:
    """Row of combine's receive tensor holding each (token, k)'s output, -1 for none (no expert,
    or fewer rows came back from that PE than expected: a refused round)."""
    pe = pair_pe.clamp(max=n_pes - 1)
    came = back_counts.gather(0, pe.reshape(-1)).reshape(pe.shape)
    start = back_offsets.gather(0, pe.reshape(-1)).reshape(pe.shape)
    valid = (pair_pe < n_pes) & (pair_rank < came)
    return torch.where(valid, start + pair_rank, -1)
