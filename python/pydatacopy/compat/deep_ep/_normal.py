"""Buffer.dispatch / Buffer.combine of pydatacopy.compat.deep_ep (DeepEP's normal mode) over the
expand=False MoeDispatcher the Buffer sets up: DeepEP's argument checks (a refusal runs every
round of the call, so that every rank's call fails alike instead of its peers timing out), the
per-call counts exchange (rank_prefix_matrix, tokens per local expert), and DeepEP's outputs."""

from __future__ import annotations

import torch

from ...moe.common import Error
from ...moe.dispatcher import IN_REGION, _handle_tag
from ...moe.layout import local_expert_ids
from ...moe.tokens import combine_tokens, dispatch_tokens
from .utils import EXPERTS_ROOM, SCALE_BLOCK, TOPK_ROOM, Config, check as _check, event_after as _event, wait_event as _wait

_DISPATCH = "pydatacopy.compat.deep_ep.Buffer.dispatch"
_COMBINE = "pydatacopy.compat.deep_ep.Buffer.combine"



class DispatchHandle(tuple):
    """DeepEP's intranode handle, the same six items in the same order: ``(rank_prefix_matrix``
    (int32 ``[ranks, ranks]``, [i][j]: tokens rank j receives from ranks 0..i), ``channel_prefix_matrix``
    (int32 ``[ranks, 1]``: one channel, the tokens sent to each rank), ``recv_channel_prefix_matrix``
    (int32 ``[ranks, 1]``, zeros: one channel starting at each source's first row),
    ``recv_src_idx`` (int32 ``[received rows]``: each row's token index at its source, -1 past
    the rows received), ``is_token_in_rank``, ``send_head`` (int32 ``[tokens, ranks]``: the token's
    position among those sent to that rank, -1 where not sent)``)``; and pydatacopy's own handle
    of the dispatch, which combine uses."""

    def __new__(cls, items, token_handle, buffer_id: int):
        handle = super().__new__(cls, items)
        handle._token_handle, handle._buffer_id = token_handle, buffer_id
        return handle


def _refused(rounds, check) -> None:
    """Runs ``check``; on its Error every buffer in ``rounds`` (the call's exchanges, in order)
    gets a refusal round, so that the peers' calls complete and report it, then it is raised."""
    try:
        check()
    except Error as error:
        _refuse(rounds, error)
        raise


def _refuse(rounds, error) -> None:
    for buffer in rounds:
        try:
            buffer._refuse(error, None, None)
        except Error:
            pass


def _small(buf, device) -> dict:
    """Per-device constants of the calls (made once): the ranks as routing ids, and the counts
    exchange's one row to every rank."""
    cache = buf.__dict__.setdefault("_constants", {})
    if device not in cache:
        n = buf.group_size
        cache[device] = {"ranks": torch.arange(n, dtype=torch.int32, device=device),
                         "ones": torch.ones(n, dtype=torch.int64, device=device),
                         "zeros": torch.zeros(n, dtype=torch.int64, device=device)}
    return cache[device]


def _check_dispatch(buf, x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                    topk_idx, topk_weights, expert_alignment, num_worst_tokens, config) -> None:
    n, call = buf.group_size, _DISPATCH
    tokens = x.shape[0]
    _check(x.is_contiguous() and x.element_size() <= 2, f"{call}: x must be contiguous, of 1- or 2-byte elements "
           f"(bf16, or fp8 with scales), got {x.dtype}{'' if x.is_contiguous() else ' (not contiguous)'}")
    _check(x.shape[1] * x.element_size() % 16 == 0, f"{call}: a row of x must be a multiple of 16 bytes, got "
           f"{x.shape[1]} x {x.element_size()}")
    _check(x.shape[1] <= buf._hidden, f"{call}: x has hidden {x.shape[1]}; this Buffer was set up at its first "
           f"dispatch for rows of at most {buf._hidden}: use another Buffer for wider rows")
    _check(tokens <= buf.tokens_per_rank, f"{call}: {tokens} tokens, but num_nvl_bytes={buf.num_nvl_bytes} holds "
           f"{buf.tokens_per_rank} per rank (pydatacopy keeps every received token at once); pass num_nvl_bytes >= "
           f"Config.get_nvl_buffer_size_hint's for {tokens} tokens per rank")
    if x_scales is not None:
        _check(isinstance(x_scales, torch.Tensor) and x_scales.dim() == 2 and x_scales.shape[0] == tokens
               and x_scales.dtype in (torch.float32, torch.int32)
               and x_scales.shape[1] <= -(-buf._hidden // SCALE_BLOCK),
               f"{call}: the scales must be float32 or int32 [tokens, hidden / {SCALE_BLOCK} at most], got "
               f"{tuple(getattr(x_scales, 'shape', ()))} {getattr(x_scales, 'dtype', type(x_scales))}")
    _check((topk_idx is None) == (topk_weights is None), f"{call}: pass topk_idx and topk_weights together")
    if handle is not None:
        _check(isinstance(handle, DispatchHandle) and handle._buffer_id == id(buf),
               f"{call}: handle must be the one this Buffer's dispatch returned")
        _check(topk_idx is None, f"{call}: a cached dispatch (handle=) takes no topk_idx / topk_weights")
        _check(handle[4].shape[0] == tokens, f"{call}: the handle's dispatch had {handle[4].shape[0]} tokens, x has {tokens}")
    else:
        _check(all(isinstance(t, torch.Tensor) for t in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)),
               f"{call}: without a handle, pass num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert "
               "(Buffer.get_dispatch_layout gives them)")
        _check(is_token_in_rank.dtype == torch.bool and tuple(is_token_in_rank.shape) == (tokens, n)
               and is_token_in_rank.is_contiguous(),
               f"{call}: is_token_in_rank must be a contiguous bool [{tokens}, {n}], got "
               f"{is_token_in_rank.dtype} {tuple(is_token_in_rank.shape)}")
        experts = num_tokens_per_expert.shape[0] if num_tokens_per_expert.dim() == 1 else -1
        _check(num_tokens_per_expert.dtype == torch.int32 and experts > 0 and experts % n == 0
               and experts <= EXPERTS_ROOM,
               f"{call}: num_tokens_per_expert must be int32 [experts], experts a multiple of {n} and at most "
               f"{EXPERTS_ROOM}, got {num_tokens_per_expert.dtype} {tuple(num_tokens_per_expert.shape)}")
        _check(num_tokens_per_rank.dtype == torch.int32 and tuple(num_tokens_per_rank.shape) == (n,),
               f"{call}: num_tokens_per_rank must be int32 [{n}]")
    if topk_idx is not None:
        _check(isinstance(topk_idx, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
               and topk_idx.dim() == 2 and topk_idx.shape[0] == tokens and not topk_idx.dtype.is_floating_point
               and tuple(topk_weights.shape) == tuple(topk_idx.shape) and topk_weights.dtype == torch.float32,
               f"{call}: topk_idx (integer) and topk_weights (float32) must be [{tokens}, topk]")
        _check(topk_idx.shape[1] <= TOPK_ROOM, f"{call}: topk {topk_idx.shape[1]} past the {TOPK_ROOM} a row holds")
    others = [t for t in (x_scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                          topk_weights) if isinstance(t, torch.Tensor)]
    _check(all(t.device == x.device for t in others), f"{call}: every tensor must be on x's device ({x.device})")
    _check(isinstance(expert_alignment, int) and expert_alignment >= 1, f"{call}: expert_alignment must be >= 1")
    _check(isinstance(num_worst_tokens, int) and 0 <= num_worst_tokens <= n * buf.tokens_per_rank,
           f"{call}: num_worst_tokens must be 0 (read the count) or at most {n * buf.tokens_per_rank} (the rows this "
           f"Buffer receives), got {num_worst_tokens!r}")
    _check(not num_worst_tokens or handle is not None or topk_idx is not None,
           f"{call}: num_worst_tokens needs topk_idx and topk_weights (as DeepEP's)")
    _check(config is None or isinstance(config, Config), f"{call}: config must be a deep_ep Config")


def dispatch(buf, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
             expert_alignment, num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream):
    x, x_scales = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
    shaped = isinstance(x, torch.Tensor) and x.dim() == 2
    if buf._moe is None:  # the set-up is collective: only what it needs is checked before it
        _check(shaped, f"{_DISPATCH}: x must be a [tokens, hidden] tensor or an (x, scales) tuple")
        buf._setup(x.shape[1])
    moe, n = buf._moe, buf.group_size
    cached = handle is not None
    rounds = [moe._dispatch] + ([] if cached else [buf._notify])

    def check():
        _check(shaped, f"{_DISPATCH}: x must be a [tokens, hidden] tensor or an (x, scales) tuple")
        _check_dispatch(buf, x, x_scales, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                        topk_idx, topk_weights, expert_alignment, num_worst_tokens, config)
    _refused(rounds, check)
    _wait(previous_event)
    if cached:
        is_token_in_rank = handle[4]
    constants = _small(buf, x.device)
    route = torch.where(is_token_in_rank, constants["ranks"], -1)  # rank r as "expert" r
    extras = []
    if topk_idx is not None:
        extras.append(torch.cat([topk_idx.to(torch.int32), topk_weights.view(torch.int32)], 1))
    if x_scales is not None:
        extras.append(x_scales.contiguous())
    try:
        got = dispatch_tokens(moe, x, route, None, None, False, extras)
    except Exception as error:  # refused in the exchange's own checks: the counts round still runs
        _refuse(rounds[1:], error if isinstance(error, Error) else Error(f"{_DISPATCH}: {error}"))
        raise
    recv_all, token_handle, recv_extras = got[0], got[3], (got[4] if extras else [])
    if cached:
        rows = handle[3].shape[0]
    else:
        sent = is_token_in_rank.sum(0, dtype=torch.int32)
        row = torch.cat([sent, num_tokens_per_expert]).view(1, -1)
        (got,), got_counts, got_offsets = buf._notify._exchange_eager([row], constants["ones"], constants["zeros"],
                                                                      None, None)
        # Each source's row at its offset; a source that refused this call sent none (its row: zeros,
        # never the next source's shifted up).
        counts = got.index_select(0, got_offsets.clamp(0, n - 1)) * (got_counts == 1).to(got.dtype)[:, None]
        rank_prefix_matrix = counts[:, :n].cumsum(0).to(torch.int32)
        per_pe = num_tokens_per_expert.shape[0] // n
        expert_counts = counts[:, n + buf.rank * per_pe:n + (buf.rank + 1) * per_pe].sum(0)
        per_expert_list = []
        if num_worst_tokens:
            rows = num_worst_tokens
        else:  # DeepEP reads the counts on the host here too
            host = torch.cat([token_handle.num_rows.view(1), expert_counts.to(torch.int64)]).tolist()
            buf._check_errors()  # a refusal of this dispatch on any rank raises here, on every rank
            rows = host[0]
            per_expert_list = [-(-c // expert_alignment) * expert_alignment for c in host[1:]]
    recv_x = recv_all[:rows]
    if x_scales is not None:
        recv_x = (recv_x, recv_extras[-1][:rows])
    if cached:
        return recv_x, None, None, None, None, _event(async_finish, (x, recv_all))
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        packed, k = recv_extras[0][:rows], topk_idx.shape[1]
        in_use = torch.arange(rows, device=packed.device) < token_handle.num_rows
        recv_topk_idx, recv_topk_weights = local_expert_ids(packed[:, :k], packed[:, k:].view(torch.float32), in_use,
                                                            buf.rank, num_tokens_per_expert.shape[0] // n)
        recv_topk_idx = recv_topk_idx.to(topk_idx.dtype)
    send_head = torch.where(is_token_in_rank, is_token_in_rank.cumsum(0, dtype=torch.int32) - 1, -1).to(torch.int32)
    items = (rank_prefix_matrix, sent.view(n, 1), torch.zeros((n, 1), dtype=torch.int32, device=sent.device),
             token_handle.source_token[:rows].to(torch.int32), is_token_in_rank, send_head)
    new_handle = DispatchHandle(items, token_handle, id(buf))
    return (recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle,
            _event(async_finish, (x, recv_all)))


def combine(buf, x, handle, topk_weights, bias, config, previous_event, async_finish):
    moe, call = buf._moe, _COMBINE
    _check(moe is not None, f"{call}: no dispatch has run on this Buffer; pass the handle its dispatch returned")
    rounds = [moe._combine] * (1 if topk_weights is None else 2)

    def check():
        _check(isinstance(handle, DispatchHandle) and handle._buffer_id == id(buf),
               f"{call}: handle must be the one this Buffer's dispatch returned")
        _check(bias is None, f"{call}: bias is not supported by pydatacopy's combine; add it to the result")
        rows = handle[3].shape[0]
        _check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == torch.bfloat16
               and x.shape[1] <= moe.hidden and x.shape[0] == rows,
               f"{call}: x must be bfloat16 [{rows}, hidden] (one row per row dispatch returned), got "
               f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        if topk_weights is not None:
            _check(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32
                   and topk_weights.dim() == 2 and topk_weights.shape[0] == rows
                   and topk_weights.device == x.device,
                   f"{call}: topk_weights must be float32 [{x.shape[0]}, topk] (dispatch's recv_topk_weights)")
        _check(config is None or isinstance(config, Config), f"{call}: config must be a deep_ep Config")
    _refused(rounds, check)
    _wait(previous_event)
    token_handle = handle._token_handle
    tag = _handle_tag(token_handle)
    try:
        combined_x = combine_tokens(moe, x.contiguous(), token_handle, None, tag, IN_REGION)
    except Exception as error:  # refused in the exchange's own checks: the weights' round still runs
        _refuse(rounds[1:], error if isinstance(error, Error) else Error(f"{call}: {error}"))
        raise
    combined_weights = None
    if topk_weights is not None:
        combined_weights = combine_tokens(moe, topk_weights.contiguous(), token_handle, None, tag, IN_REGION)
    return combined_x, combined_weights, _event(async_finish, (x, combined_x))
