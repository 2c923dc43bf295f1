"""Buffer.low_latency_dispatch / low_latency_combine of pydatacopy.compat.deep_ep (DeepEP's
low-latency mode) over the default (expanded) MoeDispatcher: one row per (token, local expert),
grouped by local expert, within an expert by source rank ascending and then the source's token
order (deterministic, where DeepEP's order within a rank follows its atomics).

DeepEP's layout is ``[num_local_experts, num_ranks x num_max_dispatch_tokens_per_rank, hidden]``:
the dispatcher's rows (each expert's rows contiguous at its offset) are copied into it, and back
out of it for combine (one copy each way of the rows the dispatcher's receive tensor holds, an
extra cost DeepEP does not have: its kernels write that layout directly). fp8 (``use_fp8``) is
cast on the receiver from the bf16 rows (the same bytes DeepEP's sender-side cast gives: per token
and 128 channels, amax clamped to 1e-4, scale 448 / amax, or a power of two with
``round_scale``; ``use_ue8m0`` packs the exponents four to an int32); the rows travel as bf16."""

from __future__ import annotations

import torch

from ...moe.all_to_all import AllToAll
from ...moe.rows import gather_rows
from .utils import SCALE_BLOCK, check as _check, event_after as _event

_DISPATCH = "pydatacopy.compat.deep_ep.Buffer.low_latency_dispatch"
_COMBINE = "pydatacopy.compat.deep_ep.Buffer.low_latency_combine"
#: DeepEP's fp8 bound (torch.finfo(torch.float8_e4m3fn).max) and its amax floor.
_FP8_MAX, _AMAX_FLOOR = 448.0, 1e-4
#: The top-k DeepEP's low-latency kernels take at most (kNumMaxTopK): what the size hint makes room for.
MAX_TOPK = 11


def low_latency_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int) -> int:
    """Symmetric bytes of the low-latency dispatcher: MoeDispatcher(num_experts, hidden, num_topk,
    num_max_dispatch_tokens_per_rank) (bf16 rows with their ids and index; one combine row per
    (token, expert))."""
    needed = AllToAll.symmetric_bytes_needed
    return (needed(num_max_dispatch_tokens_per_rank, hidden * 2 + (num_topk + 1) * 4, num_ranks)
            + needed(num_max_dispatch_tokens_per_rank * num_topk, hidden * 2, num_ranks))


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle, the same five items: ``(src_info`` (int32 ``[local experts,
    ranks x max tokens]``, each row's token index at its source, -1 past the expert's count),
    ``layout_range`` (int64 ``[local experts, ranks]``: (first row << 32) | rows from that rank),
    ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts)``; and what combine needs."""

    def __new__(cls, items, moe_handle, dest, key, buffer_id: int):
        handle = super().__new__(cls, items)
        handle._moe_handle, handle._dest, handle._key, handle._buffer_id = moe_handle, dest, key, buffer_id
        return handle


def _dispatcher(buf, num_experts: int, hidden: int, topk: int, max_tokens: int):
    """The dispatcher of these sizes, set up at their first call (collective: every rank makes the
    same call) within num_rdma_bytes."""
    key = (num_experts, hidden, topk, max_tokens)
    made = buf.__dict__.setdefault("_low_latency", {})
    if key not in made:
        n = buf.group_size
        held = sum(low_latency_bytes(k[3], k[1], n, k[2]) for k in made)
        need = low_latency_bytes(max_tokens, hidden, n, topk)
        _check(held + need <= buf.num_rdma_bytes, f"{_DISPATCH}: num_rdma_bytes={buf.num_rdma_bytes} is too small "
               f"for {max_tokens} tokens per rank of hidden {hidden}, top-{topk} ({need} bytes, {held} held by "
               f"other sizes): pass more (Buffer.get_low_latency_rdma_size_hint)")
        _check(num_experts % n == 0, f"{_DISPATCH}: num_experts={num_experts} does not split over {n} ranks")
        made[key] = buf._new_expanded_dispatcher(num_experts, hidden, topk, max_tokens)
    return key, made[key]


def _fp8(rows: torch.Tensor, round_scale: bool, use_ue8m0: bool):
    """DeepEP's per-token, per-128-channel cast: (fp8 rows, scales [rows, hidden / 128] float32,
    or [rows, hidden / 512] int32 of packed exponents with use_ue8m0)."""
    blocks = rows.float().view(rows.shape[0], -1, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=_AMAX_FLOOR)
    if round_scale:  # DeepEP's fast_log2_ceil and fast_pow2: exact powers of two from the bits
        bits = (amax * (1.0 / _FP8_MAX)).view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale, scale_inv = ((127 - exponent) << 23).view(torch.float32), ((127 + exponent) << 23).view(torch.float32)
    else:
        # (448 / amax as a true division: torch's scalar / tensor is a reciprocal and a product,
        # one rounding more than DeepEP's float division)
        scale, scale_inv = torch.full_like(amax, _FP8_MAX).div(amax), amax * (1.0 / _FP8_MAX)
    fp8 = (blocks * scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(rows.shape)
    if not use_ue8m0:
        return fp8, scale_inv
    exponents = (scale_inv.view(torch.int32) >> 23).to(torch.uint8)
    return fp8, exponents.contiguous().view(torch.int32)


def dispatch(buf, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
             dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):
    n, call = buf.group_size, _DISPATCH
    # The sizes name the dispatcher (set up at their first call, collectively): checked here alone.
    _check(isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2,
           f"{call}: x must be [tokens, hidden] and topk_idx [tokens, topk]")
    hidden, topk, max_tokens = x.shape[1], topk_idx.shape[1], num_max_dispatch_tokens_per_rank
    key, moe = _dispatcher(buf, num_experts, hidden, topk, max_tokens)
    local, slots = num_experts // n, n * max_tokens

    def check():  # the rest through the dispatcher's round: every rank's call fails alike
        _check(x.dtype == torch.bfloat16 and topk_idx.shape[0] == x.shape[0],
               f"{call}: x must be bfloat16 [tokens, hidden] and topk_idx [tokens, topk], got {x.dtype} "
               f"{tuple(x.shape)} and {tuple(topk_idx.shape)}")
        _check(dispatch_wait_recv_cost_stats is None, f"{call}: dispatch_wait_recv_cost_stats (DeepEP's wait "
               "timings) are not measured by pydatacopy; pass None")
        _check(not use_ue8m0 or round_scale, f"{call}: use_ue8m0 needs round_scale=True (as DeepEP's)")
        block = 4 * SCALE_BLOCK if use_ue8m0 else SCALE_BLOCK
        _check(not use_fp8 or hidden % block == 0, f"{call}: fp8 needs hidden a multiple of {block}")
        stats = cumulative_local_expert_recv_stats
        _check(stats is None or (isinstance(stats, torch.Tensor) and tuple(stats.shape) == (local,)
                                 and stats.dtype == torch.int32 and stats.device == x.device),
               f"{call}: cumulative_local_expert_recv_stats must be int32 [{local}] on x's device")
        _check(not (async_finish and return_recv_hook), f"{call}: async_finish and return_recv_hook together "
               "(DeepEP refuses them too)")
    moe._refused(moe._dispatch, check, None)
    recv, handle = moe.dispatch(x, topk_idx, num_experts)  # its own refusals run its round too
    # Each received row's slot in DeepEP's layout (expert e's rows from e x slots on), a spare
    # slot past them for the rows not in use.
    rows = recv.shape[0]
    expert = handle.expert_of_row
    at = torch.arange(rows, device=recv.device) - handle.expert_offsets.index_select(0, expert.clamp(max=local - 1))
    in_use = (expert < local) & (at < slots)  # (a token naming one expert twice could overflow its slots)
    dest = torch.where(in_use, expert * slots + at, local * slots)
    src_info = torch.full((local * slots + 1,), -1, dtype=torch.int32, device=recv.device)
    src_info.index_copy_(0, dest, torch.where(in_use, handle.source_token, -1).to(torch.int32))
    src_info = src_info[:-1].view(local, slots)
    per_rank = torch.zeros(((local + 1) * (n + 1),), dtype=torch.int64, device=recv.device)
    per_rank.index_add_(0, expert * (n + 1) + torch.where(in_use, handle.source_pe, n),
                        torch.ones(rows, dtype=torch.int64, device=recv.device))
    per_rank = per_rank.view(local + 1, n + 1)[:local, :n]
    layout_range = ((per_rank.cumsum(1) - per_rank) << 32) | per_rank
    recv_count = handle.expert_counts.to(torch.int32)
    if cumulative_local_expert_recv_stats is not None:
        cumulative_local_expert_recv_stats.add_(recv_count)
    if use_fp8:
        fp8, scales = _fp8(recv, round_scale, use_ue8m0)
        packed = torch.empty((local * slots + 1, hidden), dtype=torch.float8_e4m3fn, device=recv.device)
        packed.view(torch.uint8).index_copy_(0, dest, fp8.view(torch.uint8))
        # DeepEP's scales: [local, slots, columns], column-major in the last two dims
        columns = scales.shape[1]
        scale_rows = torch.empty((local * slots + 1, columns), dtype=scales.dtype, device=recv.device)
        scale_rows.index_copy_(0, dest, scales)
        packed_scales = torch.empty((local, columns, slots), dtype=scales.dtype, device=recv.device).transpose(1, 2)
        packed_scales.copy_(scale_rows[:-1].view(local, slots, columns))
        recv_x = (packed[:-1].view(local, slots, hidden), packed_scales)
    else:
        packed = torch.empty((local * slots + 1, hidden), dtype=torch.bfloat16, device=recv.device)
        packed.index_copy_(0, dest, recv)
        recv_x = packed[:-1].view(local, slots, hidden)
    items = (src_info, layout_range, max_tokens, hidden, num_experts)
    low_handle = LowLatencyHandle(items, handle, dest, key, id(buf))
    tensors = (x, topk_idx, recv_x, recv_count, src_info, layout_range)
    return recv_x, recv_count, low_handle, _event(async_finish, tensors), _hook(return_recv_hook)


def _hook(asked: bool):
    """DeepEP's receive hook: the data is in place once the call's work on the stream is done
    (stream order), so the hook has nothing left to do; None when not asked, as DeepEP's."""
    return (lambda: None) if asked else None


def next_combine_buffer(buf, handle):
    """The tensor low_latency_combine(zero_copy=True) reads: one per dispatcher, kept."""
    _check(isinstance(handle, LowLatencyHandle) and handle._buffer_id == id(buf),
           "pydatacopy.compat.deep_ep.Buffer.get_next_low_latency_combine_buffer: handle must be the one this "
           "Buffer's low_latency_dispatch returned")
    num_experts, hidden, _, max_tokens = handle._key
    kept = buf.__dict__.setdefault("_low_latency_combine", {})
    if handle._key not in kept:
        local = num_experts // buf.group_size
        kept[handle._key] = torch.empty((local, buf.group_size * max_tokens, hidden), dtype=torch.bfloat16,
                                        device=handle._dest.device)
    return kept[handle._key]


def combine(buf, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats):
    call = _COMBINE
    _check(isinstance(handle, LowLatencyHandle) and handle._buffer_id == id(buf),
           f"{call}: handle must be the one this Buffer's low_latency_dispatch returned")
    num_experts, hidden, topk, max_tokens = handle._key
    moe = buf._low_latency[handle._key]
    local, slots = num_experts // buf.group_size, buf.group_size * max_tokens
    tokens = handle._moe_handle.pair_pe.shape[0]
    if zero_copy:
        x = next_combine_buffer(buf, handle)

    def check():  # through the combine's round: every rank's call fails alike
        _check(not use_logfmt, f"{call}: use_logfmt (DeepEP's 10-bit LogFMT) is not supported by pydatacopy")
        _check(combine_wait_recv_cost_stats is None, f"{call}: combine_wait_recv_cost_stats (DeepEP's wait "
               "timings) are not measured by pydatacopy; pass None")
        _check(isinstance(x, torch.Tensor) and tuple(x.shape) == (local, slots, hidden) and x.dtype == torch.bfloat16,
               f"{call}: x must be bfloat16 [{local}, {slots}, {hidden}] (low_latency_dispatch's layout)")
        _check(isinstance(topk_idx, torch.Tensor) and tuple(topk_idx.shape) == (tokens, topk),
               f"{call}: topk_idx must be the dispatched [{tokens}, {topk}]")
        _check(out is None or (isinstance(out, torch.Tensor) and tuple(out.shape) == (tokens, hidden)
                               and out.dtype == torch.bfloat16 and out.device == x.device),
               f"{call}: out must be bfloat16 [{tokens}, {hidden}] on x's device")
        _check(isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32,
               f"{call}: topk_weights must be float32 (as DeepEP's)")
        _check(not (async_finish and return_recv_hook), f"{call}: async_finish and return_recv_hook together "
               "(DeepEP refuses them too)")
    moe._refused(moe._combine, check, None)
    # The rows back in the dispatcher's order, only the rows in use (read on the GPU: no host read;
    # combine reads no row past them).
    y = gather_rows(x.reshape(local * slots, hidden), handle._dest.clamp(max=local * slots - 1),
                    handle._moe_handle.num_rows)
    combined = moe.combine(y, handle._moe_handle, topk_weights)
    if out is not None:
        out.copy_(combined)
        combined = out
    return combined, _event(async_finish, (x, topk_idx, topk_weights, combined)), _hook(return_recv_hook)
