"""DeepEP v1's Python API (``deep_ep`` as of deepseek-ai/DeepEP 567632dd, the last commit before
its EPv2) over pydatacopy's MoE kernels, for code written against it::

    import pydatacopy.compat.deep_ep as deep_ep
    buffer = deep_ep.Buffer(group, num_nvl_bytes=...)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buffer.dispatch(x, ...)
    combined_x, _, _ = buffer.combine(y, handle)

What maps, what differs and what is refused: buffer.py's docstring and docs/moe.md.
"""

from __future__ import annotations

from .buffer import Buffer
from .utils import Config, EventHandle, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
