"""DeepEP v1's ``Buffer`` (deep_ep/buffer.py as of deepseek-ai/DeepEP 567632dd) over
pydatacopy.moe: the normal mode's ``get_dispatch_layout``, ``dispatch`` (bf16 or an fp8 tuple
with scales, with or without top-k, cached with a ``handle``, ``num_worst_tokens``) and
``combine``, on one ``MoeDispatcher(expand=False)`` routed by rank.

How it maps: dispatch routes by ``is_token_in_rank`` (as DeepEP does): each token goes once to
each rank marked, as "expert" r of a dispatcher with one expert per rank; its top-k ids and
weights and its fp8 scales travel with it as extra fields. Rows arrive grouped by source rank in
ascending order, then in the source's token order (deterministic; a cached dispatch repeats the
layout). combine sums the rows of every rank a token went to in ascending rank order in float32,
rounded once. pydatacopy holds every received token at once (DeepEP streams through rings):
``num_nvl_bytes`` sets how many tokens a rank may send per call (``tokens_per_rank``); more is
refused with pydatacopy.Error on every rank. The dispatcher is set up at the first dispatch
(collective, blocking, not capturable: run one eagerly before capturing a CUDA graph) for that
call's hidden size; later calls may be as wide or narrower. Everything runs on torch's current
stream; events record there (``async_finish``), ``previous_event`` is waited for there.

The low-latency calls run on the default (expanded) MoeDispatcher: _low_latency.py.

Not honoured, refused with pydatacopy.Error: ``bias`` in combine, ``use_logfmt``, the wait-time
statistics, an mpi4py ``comm``, ``enable_shrink``, ``get_local_buffer_tensor``."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ... import _C
from ...moe.all_to_all import AllToAll
from ...moe.common import Error
from ...moe.dispatcher import MoeDispatcher
from ...runtime import check_errors, init as _init_pydatacopy
from . import _low_latency, _normal
from .utils import Config, EventHandle, EventOverlap, _room, check as _check, normal_row_bytes, normal_symmetric_bytes
from .utils import normal_tokens_per_rank
from .utils import event_after as _event, wait_event as _wait

class Buffer:
    """DeepEP's ``Buffer`` on pydatacopy (the module docstring says what maps and what is refused)."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None) -> None:
        call = "pydatacopy.compat.deep_ep.Buffer"
        _check(group is not None, f"{call}: pass the torch.distributed group: pydatacopy starts from "
               "torch.distributed (an mpi4py comm is not supported)")
        _check(not enable_shrink, f"{call}: enable_shrink (masking ranks) is not supported by pydatacopy")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                   f"{call}: {name} must be an int >= 0, got {value!r}")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.enable_shrink = False
        self._start(group)
        self._moe: Optional[MoeDispatcher] = None    # set up at the first dispatch
        self._notify: Optional[AllToAll] = None      # the per-call counts (rank_prefix_matrix, experts)
        self._hidden = 0                             # elements of 2 bytes a row holds (the first x's)
        self.tokens_per_rank = 0                     # tokens a rank may send per call
        self._destroyed = False

    # ---- set-up (tests replace these three with a simulated world) -------------------------------

    def _start(self, group) -> None:
        """pydatacopy on every rank of the group (started here if not yet), one PE per rank."""
        _init_pydatacopy(group)
        _check((_C.my_pe(), _C.n_pes()) == (self.rank, self.group_size),
               f"pydatacopy.compat.deep_ep.Buffer: the group must be every PE in rank order (PE {_C.my_pe()} of "
               f"{_C.n_pes()}, rank {self.rank} of {self.group_size}); pass the group pydatacopy.init() used")

    def _new_dispatcher(self, hidden: int, max_tokens: int) -> MoeDispatcher:
        n = self.group_size
        return MoeDispatcher(n, hidden, n, max_tokens, torch.bfloat16, expand=False)

    def _new_expanded_dispatcher(self, num_experts: int, hidden: int, topk: int, max_tokens: int) -> MoeDispatcher:
        return MoeDispatcher(num_experts, hidden, topk, max_tokens, torch.bfloat16)

    def _new_all_to_all(self, capacity: int, row_bytes: int) -> AllToAll:
        return AllToAll(capacity, row_bytes)

    def _check_errors(self) -> None:
        check_errors()

    def _setup(self, hidden: int) -> None:
        """Collective (every rank's first dispatch): the dispatcher for rows of ``hidden``
        2-byte elements and as many tokens per rank as num_nvl_bytes holds."""
        n = self.group_size
        tokens = normal_tokens_per_rank(self.num_nvl_bytes, hidden, n)
        _check(tokens >= 1, f"pydatacopy.compat.deep_ep.Buffer.dispatch: num_nvl_bytes={self.num_nvl_bytes} holds "
               f"no token of hidden {hidden} from {n} ranks; one token per rank needs "
               f"{normal_symmetric_bytes(1, hidden, n)} (Config.get_nvl_buffer_size_hint sizes it)")
        moe = self._new_dispatcher(hidden + _room(hidden), tokens)
        try:
            self._notify = self._new_all_to_all(1, normal_row_bytes(hidden, n)[2])
        except BaseException:
            moe.close()
            raise
        self._moe, self._hidden, self.tokens_per_rank = moe, hidden, tokens

    # ---- DeepEP's static API ---------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True  # fp8 rows are moved as bytes: no architecture-specific kernel

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        _check(isinstance(new_num_sms, int) and new_num_sms > 0 and new_num_sms % 2 == 0,
               f"pydatacopy.compat.deep_ep.Buffer.set_num_sms: the SM count must be even and positive, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 6 if num_ranks > 2 else 24, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 9 if num_ranks > 2 else 10, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` the low-latency calls of these sizes need, for top-k up to
        DeepEP's low-latency limit (11)."""
        return _low_latency.low_latency_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                              _low_latency.MAX_TOPK)

    # ---- lifetime ------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the buffers on every rank (collective, blocking). Needs explicitly_destroy=True,
        as DeepEP's; without it the memory stays allocated until pydatacopy.finalize() (a
        destructor never waits for peers)."""
        _check(self.explicitly_destroy, "pydatacopy.compat.deep_ep.Buffer.destroy: `explicitly_destroy` flag must be set")
        self._destroyed = True
        low_latency = self.__dict__.pop("_low_latency", {})
        for buffer in (self._moe, self._notify, *low_latency.values()):
            if buffer is not None:
                buffer.close()
        self._moe = self._notify = None

    def _alive(self, what: str) -> None:
        _check(not self._destroyed, f"pydatacopy.compat.deep_ep.Buffer.{what}: the buffer was destroyed")

    def get_comm_stream(self) -> torch.cuda.Stream:
        """torch's current stream: pydatacopy's calls run on the caller's stream."""
        return torch.cuda.current_stream()

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise Error("pydatacopy.compat.deep_ep.Buffer.get_local_buffer_tensor: pydatacopy's buffers are not one raw "
                    "region; not supported")

    # ---- normal mode ---------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank`` int32 [ranks], ``None``, ``num_tokens_per_expert`` int32 [experts],
        ``is_token_in_rank`` bool [tokens, ranks], event``)``; plain torch on the current stream (no
        host read: capturable)."""
        self._alive("get_dispatch_layout")
        n, call = self.group_size, "pydatacopy.compat.deep_ep.Buffer.get_dispatch_layout"
        _check(isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 and not topk_idx.dtype.is_floating_point,
               f"{call}: topk_idx must be an integer [tokens, topk] tensor")
        _check(isinstance(num_experts, int) and num_experts > 0 and num_experts % n == 0,
               f"{call}: num_experts must be a positive multiple of the {n} ranks, got {num_experts!r}")
        _wait(previous_event)
        ids = topk_idx.to(torch.int64)
        valid = (ids >= 0) & (ids < num_experts)
        device = ids.device
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        per_expert.scatter_add_(0, torch.where(valid, ids, num_experts).reshape(-1),
                                torch.ones(ids.numel(), dtype=torch.int32, device=device))
        hit = torch.zeros((ids.shape[0], n + 1), dtype=torch.bool, device=device)
        hit.scatter_(1, torch.where(valid, ids // (num_experts // n), n), True)
        is_token_in_rank = hit[:, :n].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        return (num_tokens_per_rank, None, per_expert[:num_experts], is_token_in_rank,
                _event(async_finish, (topk_idx, num_tokens_per_rank, is_token_in_rank)))

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's ``dispatch``: ``(recv_x`` (or ``(recv_x, recv_x_scales)``), ``recv_topk_idx``,
        ``recv_topk_weights``, ``num_recv_tokens_per_expert_list``, ``handle``, ``event)``; a cached
        dispatch (``handle=``) returns ``(recv_x, None, None, None, None, event)``. Without
        ``num_worst_tokens`` the received count is read on the host (as DeepEP does); with it
        nothing is, rows past the count have ``recv_topk_idx`` -1 and weights 0 (recv_x's rows there
        are not data), and the call can be captured in a CUDA graph."""
        self._alive("dispatch")
        return _normal.dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's ``combine``: ``(combined_x, combined_topk_weights, event)``: each token's rows from
        the ranks it went to, summed in ascending rank order in float32 and rounded once; the
        top-k weights summed alike (None without)."""
        self._alive("combine")
        return _normal.combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish)

    # ---- low-latency mode ---------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: pydatacopy's buffers carry no state between calls that a normal-mode
        call could leave dirty."""
        self._alive("clean_low_latency_buffer")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's ``low_latency_dispatch``: ``(recv_x`` (``[local experts, ranks x max tokens, hidden]``
        bf16, or an (fp8, scales) tuple), ``recv_count`` (int32 [local experts]), ``handle``,
        ``event``, ``hook)``. Rows within an expert: by source rank ascending, then the source's
        token order. The dispatcher of these sizes is set up at their first call (collective, within
        num_rdma_bytes). How it maps, and its extra copies: _low_latency.py."""
        self._alive("low_latency_dispatch")
        return _low_latency.dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                     round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """DeepEP's ``low_latency_combine``: ``(combined_x, event, hook)``, ``combined_x[t] = sum_k
        topk_weights[t, k] x expert_k(t)`` in float32, k in order, rounded once (experts -1: none)."""
        self._alive("low_latency_combine")
        return _low_latency.combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                    return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The bf16 ``[local experts, ranks x max tokens, hidden]`` tensor that
        ``low_latency_combine(..., zero_copy=True)`` reads."""
        self._alive("get_next_low_latency_combine_buffer")
        return _low_latency.next_combine_buffer(self, handle)
