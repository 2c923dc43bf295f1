"""DeepEP v1's small types: ``Config``, ``EventHandle``, ``EventOverlap``, ``topk_idx_t``
(deep_ep/utils.py and deep_ep_cpp's, as of deepseek-ai/DeepEP 567632dd)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ...moe.all_to_all import AllToAll
from ...moe.common import MAX_CAPACITY, Error

#: The dtype of top-k expert ids (DeepEP's ``deep_ep.topk_idx_t``).
topk_idx_t = torch.int64

#: Top-k entries a dispatched row makes room for (ids and weights, 8 bytes each).
TOPK_ROOM = 32
#: Hidden elements per fp8 scale (DeepEP's per-token, per-128-channel scales).
SCALE_BLOCK = 128
#: Experts the per-call counts exchange makes room for (each rank's num_tokens_per_expert).
EXPERTS_ROOM = 1024


def _room(hidden: int) -> int:
    """bfloat16 elements of a dispatched row past x's (hidden of 2-byte elements): the top-k
    (TOPK_ROOM ids and weights) and the scales (a float32 per SCALE_BLOCK channels)."""
    extra_bytes = TOPK_ROOM * 8 + -(-hidden // SCALE_BLOCK) * 4
    return -(-extra_bytes // 2)


def normal_row_bytes(hidden: int, num_ranks: int) -> tuple[int, int, int]:
    """(dispatch, combine, counts) row bytes of the normal mode's three buffers for x rows of
    ``hidden`` elements of at most 2 bytes: MoeDispatcher(expand=False) with one "expert" per rank
    (its rows: x's width and the room, the routing ids and index, its weights' room) and the
    per-call counts exchange (each rank's tokens per rank and per expert)."""
    width = hidden + _room(hidden)
    return width * 2 + (num_ranks + 1) * 4 + num_ranks * 4, width * 2, 4 * (num_ranks + EXPERTS_ROOM)


def normal_symmetric_bytes(tokens_per_rank: int, hidden: int, num_ranks: int) -> int:
    """Symmetric memory the normal mode's buffers take (AllToAll.symmetric_bytes_needed, both
    parity sets) for ``tokens_per_rank`` tokens a rank may send per call."""
    dispatch, combine, counts = normal_row_bytes(hidden, num_ranks)
    needed = AllToAll.symmetric_bytes_needed
    return (needed(tokens_per_rank, dispatch, num_ranks) + needed(tokens_per_rank, combine, num_ranks)
            + needed(1, counts, num_ranks))


def normal_tokens_per_rank(num_nvl_bytes: int, hidden: int, num_ranks: int) -> int:
    """The most tokens per rank and call whose buffers fit in ``num_nvl_bytes`` (0: not one)."""
    low, high = 0, MAX_CAPACITY // num_ranks
    while low < high:
        mid = (low + high + 1) // 2
        if normal_symmetric_bytes(mid, hidden, num_ranks) <= num_nvl_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Error(message)


class Config:
    """DeepEP's performance config. pydatacopy's kernels size their own grids, so ``num_sms``
    and the chunk sizes are hints; ``num_max_nvl_chunked_recv_tokens`` x ``num_sms / 2``
    (DeepEP's channels) is the tokens per source rank that its buffer-size hints make room
    for (``get_nvl_buffer_size_hint``), as DeepEP's rings hold that many in flight."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        for name, value in (("num_sms", num_sms), ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Error(f"pydatacopy.compat.deep_ep.Config: {name} must be a positive int, got {value!r}")
        if num_sms % 2:
            raise Error(f"pydatacopy.compat.deep_ep.Config: num_sms must be even (DeepEP's channels are SM "
                        f"pairs), got {num_sms}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    @property
    def tokens_per_rank(self) -> int:
        """Tokens per source rank the size hints make room for."""
        return self.num_sms // 2 * self.num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``Buffer(num_nvl_bytes=...)`` that hold ``tokens_per_rank`` tokens of
        ``hidden_bytes`` from each of ``num_ranks`` ranks (dispatch and combine, fp8 scales and
        up to 32 top-k entries included): what DeepEP's rings hold in flight."""
        return normal_symmetric_bytes(self.tokens_per_rank, hidden_bytes // 2, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: pydatacopy's normal mode keeps every rank's tokens in ``num_nvl_bytes`` (no RDMA part)."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens})")


class EventHandle:
    """A CUDA event recorded on torch's current stream when made (DeepEP's ``EventHandle``)."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's ``EventOverlap``: an event (None when the call finished in stream order) and the
    tensors to keep alive until it completes (``extra_tensors``, CUDA-graph-safe record_stream).
    ``current_stream_wait()`` makes torch's current stream wait for it; ``with`` does the same
    on exit."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise Error("pydatacopy.compat.deep_ep.EventOverlap.current_stream_wait: no event (the call was not "
                        "asked for async_finish=True)")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def wait_event(previous_event: Optional[EventOverlap]) -> None:
    """The current stream waits for ``previous_event``'s event; none (or no event in it): no wait,
    as DeepEP's ``getattr(previous_event, 'event', None)``."""
    event = getattr(previous_event, "event", None)
    if event is not None:
        event.current_stream_wait()


def event_after(async_finish: bool, tensors) -> EventOverlap:
    """The call's EventOverlap: an event on the current stream where asked (the work is queued
    there already), keeping ``tensors`` referenced as DeepEP's does."""
    return EventOverlap(EventHandle(), tuple(tensors)) if async_finish else EventOverlap()
