"""MoE dispatch and combine (``MoeDispatcher``, ``MoeHandle``) on two AllToAll buffers, one per
direction. The eager host path (rows read in the receive regions) and the traced, compacting
path are both here."""

from __future__ import annotations

import torch

from .. import _C
from .._torch_utils import check_int, stream_handle, timeout_seconds
from .all_to_all import AllToAll
from .common import MAX_CAPACITY, _REDUCE_DTYPES, Error, _refuse_tracing, _row_bytes, _traced
from . import reduced as _reduced, tokens as _tokens
from .grouped import grouped_steps
from .layout import MoeHandle, MoeReducedHandle, MoeTokenHandle, combine_slots, dispatch_plan
from .rows import combine_reduce

# Eager calls and captures read the received rows in the receive regions (no compaction copy);
# False: the compacting path traced calls take (a switch for comparing the two, a way back).
IN_REGION = True


def _tagged_counts(handle):
    """The handle's tensor that carries its dispatch's tag: the counts its combine sends by."""
    return handle.recv_counts if isinstance(handle, (MoeTokenHandle, MoeReducedHandle)) else handle.combine_counts


def _handle_tag(handle) -> int:
    """The dispatch an eager handle carries (0: none, a traced or hand-made handle, or no handle)."""
    is_handle = isinstance(handle, (MoeHandle, MoeTokenHandle, MoeReducedHandle))
    return getattr(_tagged_counts(handle), "_pydatacopy_dispatch", 0) if is_handle else 0


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

    ``expand=False`` (DeepEP's normal-mode layout; every PE the same): each token arrives once
    per receiving PE and is not expanded by expert. ``dispatch(x, topk_idx, topk_weights=...)``
    returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``: recv_x ``[n_pes x max_tokens,
    hidden]`` by source PE ascending, then the source's token order; recv_topk_idx the local
    expert ids (-1 for experts elsewhere). ``combine(y, handle)`` takes one row per received
    token (the caller has summed its local experts' outputs, weighted) and returns ``out[t]`` =
    the rows of the PEs ``t`` went to, summed in ascending PE order in float32, rounded once to
    y's dtype. The combine buffer then holds ``max_tokens`` rows per source, not ``max_tokens x
    topk`` (docs/moe.md, "expand=False"). ``recv_in_region=True`` (expand=False only): recv_x and
    recv_topk_weights are views of the receive region, where each sender stored its rows (the
    bytes cross once, not twice), valid until this dispatcher's dispatch after next.

    ``pre_reduce=True`` (expand=True only): ``dispatch(x, topk_idx, topk_weights=...)`` returns
    ``(recv_x, handle)`` as expand=True (a MoeReducedHandle), and ``combine(y, handle)`` weighs
    and sums each token's local experts here (float32, k order, rounded to y's dtype) and sends
    one row per (token, PE) back, summed at the source in ascending PE order (float32, rounded
    once): DeepEP's expert-side reduction. Fewer bytes back (one row per PE, not per expert)
    and a combine buffer of ``max_tokens`` rows per source; two roundings, not one.

    Every call is stream-ordered on torch's current stream, reads nothing on the host, and can
    be captured in a CUDA graph (replays take the routing written into the captured inputs).
    """

    # The defaults (object.__new__ instances, e.g. tests' stand-ins, see them too).
    expand, recv_in_region, pre_reduce = True, False, False

    def __init__(self, num_experts: int, hidden: int, topk: int, max_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, *, combine_dtype: torch.dtype | None = None,
                 expand: bool = True, recv_in_region: bool = False, pre_reduce: bool = False) -> None:
        call = "pydatacopy.MoeDispatcher"
        _refuse_tracing("MoeDispatcher")
        _tokens.check_setup(call, expand, recv_in_region)
        _reduced.check_setup(call, expand, pre_reduce)
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
        self.dtype, self.combine_dtype, self.expand, self.recv_in_region = dtype, combine_dtype, expand, recv_in_region
        self.pre_reduce = pre_reduce
        self.n_pes, self.experts_per_pe = n, num_experts // n
        self.my_pe = _C.my_pe()
        self._workspaces: dict = {}  # _workspace's answers by (tokens, row bytes)
        element = torch.empty((), dtype=dtype).element_size()
        combine_element = torch.empty((), dtype=combine_dtype).element_size()
        # Dispatch moves each token with its top-k expert ids and its index (int32), so that the
        # receiver can group by expert and tell where a row came from; combine moves one output row per (token, expert) pair.
        # expand=False and pre_reduce: the top-k weights (float32) travel too, and combine moves one
        # row per (token, PE): max_tokens rows per source at most.
        per_token = not expand or pre_reduce
        self._dispatch = AllToAll(max_tokens, hidden * element + (topk + 1) * 4 + (topk * 4 if per_token else 0))
        try:
            self._combine = AllToAll(max_tokens if per_token else max_tokens * topk, hidden * combine_element)
        except BaseException:
            self._dispatch.close()
            raise
        if per_token:
            # combine's sum: the reduction kernel with weights 1 (exact), written before any combine
            # (on whatever stream) reads them.
            self._unit_weights = torch.ones((max_tokens, min(topk, n)), dtype=torch.float32,
                                            device=f"cuda:{self._combine._device}")
            torch.cuda.current_stream(self._combine._device).synchronize()

    @property
    def recv_rows(self) -> int:
        """Rows of recv_x (and of the y combine takes): n_pes x max_tokens x topk, or n_pes x
        max_tokens with expand=False."""
        return self.n_pes * self.max_tokens * (self.topk if self.expand else 1)

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

    def _tag(self, call: int) -> int:
        """combine's tag for the dispatch that was call `call` on the dispatch buffer: the same on
        every PE for the same dispatch (buffers are made, and called, in the same order on every
        PE), never 0 (a plain exchange's)."""
        return (self._dispatch.number << 40) | (call + 1)

    def _mark(self, handle, call: int):
        """Tags the handle with its dispatch (eager only: the tensor object carries it)."""
        _tagged_counts(handle)._pydatacopy_dispatch = self._tag(call)
        return handle

    def _refused(self, buffer: AllToAll, check, timeout) -> None:
        """Runs `check` (this PE's own argument checks); a refusal of an eager call still takes
        part in the round on `buffer` (AllToAll._refuse), so that every PE's call ends with
        pydatacopy.Error instead of its peers timing out."""
        try:
            check()
        except Error as error:
            buffer._refuse(error, None, timeout, compact=buffer is self._dispatch and self.recv_in_region)
            raise

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int | None = None,
                 *, topk_weights: torch.Tensor | None = None, timeout: float | None = None,
                 zero_unused_rows: bool = False):
        """Send each token to the PEs of its experts; returns ``(recv_x, handle)`` (expand=True),
        ``(recv_x, recv_topk_idx, recv_topk_weights, handle)`` with expand=False.

        ``x``: ``[tokens, hidden]`` of the dispatcher's dtype (bytes are moved as they are: bf16,
        fp8, anything of that element size), ``tokens <= max_tokens``. ``topk_idx``: integer
        ``[tokens, topk]`` on the GPU, global expert ids; a negative id means "no expert" for
        that slot. ``recv_x``: ``[recv_rows, hidden]``, rows grouped by local expert (see
        MoeHandle), within an expert by source PE and then by the source's token order. Rows past
        ``handle.num_rows`` are not data: left as the allocator gave them (their
        ``handle.expert_of_row`` is ``experts_per_pe`` and ``source_pe`` -1), or zeros with
        ``zero_unused_rows=True`` (one more small kernel writing those rows; with a large
        ``max_tokens`` they are most of recv_x). Collective: every PE calls it, in the same order.

        A refusal of this PE's arguments (more tokens than ``max_tokens``, a wrong shape or
        dtype, another ``num_experts``) still takes part in the exchange, sending nothing: every
        PE's dispatch ends with pydatacopy.Error (this PE's at once, the others' at their
        ``check_errors()``), and the dispatcher stays usable.

        expand=False (the dispatcher's setup): each token arrives once per PE holding one of its
        experts. ``recv_x`` ``[n_pes x max_tokens, hidden]``: source PE 0's tokens first, then PE
        1's, each source's in its token order; the rows in use are the first
        ``handle.num_rows`` (a MoeTokenHandle: recv_counts, recv_offsets, source_token).
        ``recv_topk_idx`` int64 ``[rows, topk]``: each row's experts as local ids (global id -
        my_pe x experts_per_pe), -1 for an expert on another PE or none, and -1 on rows past
        num_rows. ``topk_weights`` (``[tokens, topk]``, any float dtype, sent as float32; every PE
        passes them or none: rows of another width are refused on the device):
        ``recv_topk_weights`` float32 ``[rows, topk]``, 0 where recv_topk_idx is -1; None when
        not given. ``zero_unused_rows`` zeroes recv_x's rows past num_rows.
        """
        def check():
            if num_experts is not None and num_experts != self.num_experts:
                raise Error(f"pydatacopy.MoeDispatcher.dispatch: num_experts={num_experts}, but the "
                            f"dispatcher was set up for {self.num_experts}")
            self._check_tokens(x, topk_idx, "dispatch")
            if self.pre_reduce:
                _reduced.check_dispatch(self, x, topk_weights)
            elif topk_weights is not None:
                _tokens.check_dispatch_weights(self, x, topk_weights)
        self._refused(self._dispatch, check, timeout)
        if not self.expand:
            return _tokens.dispatch_tokens(self, x, topk_idx, topk_weights, timeout, zero_unused_rows)
        if self.pre_reduce:
            recv_x, handle, call = _reduced.dispatch(self, x, topk_idx, topk_weights, timeout, IN_REGION)
            return self._finish_dispatch(recv_x, handle, call, zero_unused_rows)
        if not _traced() and IN_REGION:
            native = self._dispatch_native(x, topk_idx, timeout)
            if native is not None:
                if zero_unused_rows:
                    self._zero_unused(*native)
                return native
        plan = dispatch_plan(topk_idx, self.num_experts, self.n_pes)
        recv_x, layout, recv_counts, _, _, _, call, _ = grouped_steps(self, x, plan, None, timeout, IN_REGION)
        handle = MoeHandle(layout.expert_counts, layout.expert_offsets, layout.num_rows,
                           layout.expert_of_row, layout.source_pe, layout.source_token, recv_counts,
                           layout.combine_index, layout.combine_counts, plan.pair_pe, plan.pair_rank)
        return self._finish_dispatch(recv_x, handle, call, zero_unused_rows)

    def _finish_dispatch(self, recv_x, handle, call, zero_unused_rows):
        """The handle tagged with its dispatch (eager calls), recv_x's unused rows zeroed if asked."""
        if call is not None:
            self._mark(handle, call)
        if zero_unused_rows:
            if _traced():
                from .all_to_all import _zero_past
                recv_x = _zero_past(recv_x, handle.num_rows)
            else:
                self._zero_unused(recv_x, handle)
        return recv_x, handle

    def _zero_unused(self, recv_x, handle) -> None:
        """Rows of recv_x past handle.num_rows set to zero (read on the GPU: no host read)."""
        _C.zero_rows_past(recv_x.data_ptr(), recv_x.shape[0], _row_bytes(recv_x), handle.num_rows.data_ptr(), 1,
                          stream_handle(None, self._dispatch._device))

    def _dispatch_native(self, x, topk_idx, timeout):
        """The region dispatch in one native call (moe_dispatch_region, include/pydatacopy/moe.hpp):
        both layouts, the exchange (token rows left in the receive region), the grouping by
        expert and the release, on three tensors split by lifetime (fresh per call, so an
        earlier call's outputs stay valid): recv_x its own; the handle's tensors views of one
        small tensor (they live together); the scratch (layouts' scratch and intermediates)
        one more, dropped on return. None where it does not apply (a tensor elsewhere, a
        closed buffer, sizes past the layout kernels): the steps in Python then run, and say
        what is wrong."""
        buffer = self._dispatch
        device = buffer._device
        if not (topk_idx.get_device() == device and x.get_device() == device and x.is_contiguous()
                and buffer._core.initialized):
            return None
        tokens, topk, n_pes = x.shape[0], self.topk, self.n_pes
        row_bytes = _row_bytes(x)
        layout = self._workspace(tokens, row_bytes)
        if layout is None:
            return None
        seconds = timeout_seconds(timeout)
        totals, handle_split = layout
        if topk_idx.dtype not in (torch.int32, torch.int64):
            topk_idx = topk_idx.to(torch.int64)
        topk_idx = topk_idx.contiguous()
        pairs = n_pes * self.max_tokens * topk
        recv_x = torch.empty((pairs, self.hidden), dtype=x.dtype, device=x.device)
        kept = torch.empty(totals["handle"], dtype=torch.uint8, device=x.device)
        # Freed when this returns: the call's kernels run on torch's current stream (the one
        # passed), and the caching allocator hands this memory out again only to work queued
        # after them in that stream's order, so nothing later can overwrite it under them.
        scratch = torch.empty(totals["scratch"], dtype=torch.uint8, device=x.device)
        call = _C.moe_dispatch_region(buffer._core, x.data_ptr(), row_bytes, topk_idx.data_ptr(), topk_idx.element_size(),
                               tokens, topk, self.num_experts, recv_x.data_ptr(),
                               recv_x.numel() * recv_x.element_size(), kept.data_ptr(), totals["handle"],
                               scratch.data_ptr(), totals["scratch"], stream_handle(None, device), seconds)
        del scratch
        # The handle's tensors cut from `kept` in one op (a view each cost about 3 us of host time).
        sizes, pick = handle_split
        pieces = kept.view(torch.int64).split_with_sizes(sizes)
        fields = {name: pieces[i] for name, i in pick.items()}
        fields["num_rows"] = fields["num_rows"].view(())
        fields["pair_pe"] = fields["pair_pe"].view(tokens, topk)
        fields["pair_rank"] = fields["pair_rank"].view(tokens, topk)
        return recv_x, self._mark(MoeHandle(**fields), call)

    def _workspace(self, tokens: int, row_bytes: int):
        """(region totals, (int64 split sizes of the handle region: its tensors and the gaps
        between them, {handle field: piece})), None past the layout kernels; asked once per shape."""
        key = (tokens, row_bytes)
        known = self._workspaces.get(key, False)
        if known is not False:
            return known
        layout = _C.moe_dispatch_workspace(tokens, self.topk, self.n_pes, self.experts_per_pe,
                                           self.n_pes * self.max_tokens, row_bytes)
        if layout is not None:
            totals, parts = layout
            sizes, pick, at = [], {}, 0
            for name, (_, offset, size) in sorted(((n, p) for n, p in parts.items() if p[0] == "handle"),
                                                  key=lambda item: item[1][1]):
                assert offset % 8 == 0 and size % 8 == 0 and offset >= at, (name, offset, size)
                if offset > at:
                    sizes.append((offset - at) // 8)  # alignment
                pick[name] = len(sizes)
                sizes.append(size // 8)
                at = offset + size
            if totals["handle"] > at:
                sizes.append((totals["handle"] - at) // 8)
            assert set(pick) == set(MoeHandle._fields), sorted(pick)
            layout = (totals, (sizes, pick))
        if len(self._workspaces) < 64:  # a handful of token counts in practice
            self._workspaces[key] = layout
        return layout

    def combine(self, y: torch.Tensor, handle, topk_weights: torch.Tensor | None = None, *,
                timeout: float | None = None) -> torch.Tensor:
        """Send the expert outputs back and sum them per token; returns ``[tokens, hidden]``.

        ``y``: ``[recv_rows, hidden]`` (recv_x's layout; rows past handle.num_rows are not read)
        of combine_dtype. ``topk_weights``: ``[tokens, topk]`` on the GPU (any float dtype, used
        as float32), this PE's tokens as dispatched. Collective, like dispatch.

        ``handle``: from any earlier dispatch of this dispatcher, with ``y`` in that dispatch's
        recv_x layout (combine reads nothing of the dispatch's receive region: recv_x and the
        handle are tensors of their own, so two dispatches in flight, e.g. micro-batches, are
        fine). Every PE must pass the handle of the same dispatch: each eager handle carries its
        dispatch (the dispatch buffer's call number, the same on every PE), and the exchange
        compares it on the device. PEs that combine different dispatches (a stale handle on one
        PE), or a handle of another dispatcher, get pydatacopy.Error on every PE (at once where
        this PE saw it, at ``check_errors()`` elsewhere; the rows of the mismatched pairs are
        dropped, never summed into the wrong tokens). Handles made by traced (compiled) calls or
        by hand carry no dispatch and are not compared.

        expand=False: ``y`` ``[n_pes x max_tokens, hidden]`` (recv_x's shape), one row per
        received token (the caller has summed its local experts' outputs, weighted; rows past
        handle.num_rows are not read), ``handle`` the MoeTokenHandle of that dispatch, no
        ``topk_weights``. Returns ``out[t]`` = the rows of the PEs token ``t`` was sent to, summed
        in ascending PE order in float32 (each sum rounded, no fused multiply-add), rounded once
        to y's dtype; zeros for a token sent nowhere. A handle of the other mode (a MoeHandle) is
        refused like any bad argument: through the round, pydatacopy.Error on every PE.
        """
        tag = _handle_tag(handle)

        def check():
            if not self.expand:
                _tokens.check_token_combine(self, y, handle, topk_weights)
            elif self.pre_reduce:
                _reduced.check_combine(self, handle, topk_weights)
            elif not isinstance(handle, MoeHandle):
                raise Error(f"pydatacopy.MoeDispatcher.combine: handle must be the MoeHandle dispatch() "
                            f"returned, got {type(handle).__name__}"
                            + (" (an expand=False dispatcher's handle; this dispatcher is expand=True)"
                               if isinstance(handle, MoeTokenHandle) else ""))
            if tag and tag >> 40 != self._dispatch.number:
                raise Error("pydatacopy.MoeDispatcher.combine: the handle comes from another MoeDispatcher's "
                            "dispatch; pass the handle of this dispatcher's dispatch")
            if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != self.recv_rows \
                    or y.shape[1] != self.hidden:
                raise Error(f"pydatacopy.MoeDispatcher.combine: y must be [{self.recv_rows}, {self.hidden}] "
                            f"(recv_x's shape), got {tuple(getattr(y, 'shape', ()))}")
            if y.dtype != self.combine_dtype:
                raise Error(f"pydatacopy.MoeDispatcher.combine: y must be {self.combine_dtype} (combine_dtype), "
                            f"got {y.dtype}")
            if not self.expand or self.pre_reduce:
                return
            if not isinstance(topk_weights, torch.Tensor) or \
                    tuple(topk_weights.shape) != tuple(handle.pair_pe.shape):
                raise Error(f"pydatacopy.MoeDispatcher.combine: topk_weights must be {tuple(handle.pair_pe.shape)} "
                            f"([tokens, topk] as dispatched), got {tuple(getattr(topk_weights, 'shape', ()))}")
        self._refused(self._combine, check, timeout)
        if not self.expand:
            return _tokens.combine_tokens(self, y, handle, timeout, tag, IN_REGION)
        if self.pre_reduce:
            return _reduced.combine(self, y, handle, timeout, tag, IN_REGION)
        if _traced() or not IN_REGION or not topk_weights.is_cuda:
            if _traced():
                (back,), back_counts, back_offsets = self._combine.exchange(
                    [y], handle.combine_counts, handle.combine_index, timeout=timeout)
            else:
                (back,), back_counts, back_offsets = self._combine._exchange_eager(
                    [y], handle.combine_counts, handle.combine_index, None, timeout, tag)
            slots = combine_slots(handle.pair_pe, handle.pair_rank, back_counts, back_offsets, self.n_pes)
            return combine_reduce(back, slots, topk_weights)
        # The expert outputs stay in the receive region: the reduction reads each (token, k)'s
        # row there (source pair_pe, row pair_rank), with no compaction copy and no slot tensor.
        buffer = self._combine
        y = y.contiguous()
        tokens, topk = handle.pair_pe.shape
        if self._combine_fits(y, handle):  # one native call: the exchange, the reduction, the release
            weights = topk_weights.to(torch.float32).contiguous()
            pair_pe, pair_rank = handle.pair_pe.contiguous(), handle.pair_rank.contiguous()
            out = torch.empty((tokens, self.hidden), dtype=y.dtype, device=y.device)
            # The exchange's counts and offsets: scratch, its own tensor (out shares nothing with
            # it), freed on return (stream-ordered, as dispatch's scratch).
            back = torch.empty(2 * self.n_pes, dtype=torch.int64, device=y.device)
            index = handle.combine_index
            _C.moe_combine_region(buffer._core, y.data_ptr(), y.shape[0], self.hidden, _REDUCE_DTYPES[y.dtype],
                                  handle.combine_counts.data_ptr(), index.data_ptr(), index.shape[0],
                                  pair_pe.data_ptr(), pair_rank.data_ptr(), weights.data_ptr(), tokens, topk,
                                  out.data_ptr(), back.data_ptr(), back[self.n_pes:].data_ptr(),
                                  stream_handle(None, buffer._device), timeout_seconds(timeout), tag)
            return out
        (_,), back_counts, _, call = buffer._exchange_in_region(
            [y], [True], handle.combine_counts, handle.combine_index, timeout, tag)
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

    def _combine_fits(self, y, handle) -> bool:
        """Whether moe_combine_region takes these tensors; else the steps in Python (their checks)."""
        device = self._combine._device
        counts, index = handle.combine_counts, handle.combine_index
        return (y.get_device() == device and counts.get_device() == device and index.get_device() == device
                and counts.dtype == torch.int64 and tuple(counts.shape) == (self.n_pes,) and counts.is_contiguous()
                and index.dtype == torch.int64 and index.dim() == 1 and index.is_contiguous()
                and self._combine._core.initialized)

    def _check_tokens(self, x, topk_idx, what) -> None:
        call = f"pydatacopy.MoeDispatcher.{what}"
        if not isinstance(x, torch.Tensor) or not isinstance(topk_idx, torch.Tensor):
            raise Error(f"{call}: x and topk_idx must be tensors")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise Error(f"{call}: x must be [tokens, {self.hidden}], got {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise Error(f"{call}: {x.shape[0]} tokens, more than max_tokens={self.max_tokens} set up")
        if x.element_size() != self.dtype.itemsize:
            raise Error(f"{call}: x is {x.dtype}, the dispatcher moves {self.dtype} rows; use a "
                        "dtype of that element size")
        if topk_idx.dim() != 2 or tuple(topk_idx.shape) != (x.shape[0], self.topk):
            raise Error(f"{call}: topk_idx must be [tokens, topk] = [{x.shape[0]}, {self.topk}], got "
                        f"{tuple(topk_idx.shape)}")
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            raise Error(f"{call}: topk_idx must be an integer tensor, got {topk_idx.dtype}")
