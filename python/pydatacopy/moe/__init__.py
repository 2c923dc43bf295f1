"""pydatacopy.moe: MoE token exchange: an all-to-all-v whose counts stay on the GPU, and
dispatch/combine.

Owns ``AllToAll``/``all_to_all_v`` (all_to_all.py), ``MoeDispatcher``/``MoeHandle``
(dispatcher.py; its modes: expand=False in tokens.py, pre_reduce in reduced.py, the expanded
dispatch's Python steps in grouped.py), the layouts (layout.py), the row kernels (rows.py) and their custom ops
``torch.ops.pydatacopy.all_to_all_v`` and ``moe_*``. May import torch, ``_C`` and the shared
``_torch_utils``; no other feature, and not ``ops`` (its ops are its own).

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

import torch

from .all_to_all import AllToAll, all_to_all_v
from .dispatcher import MoeDispatcher, MoeHandle
from .layout import (DispatchPlan, MoeReducedHandle, MoeTokenHandle, ReceiveLayout, dispatch_plan, local_topk, receive_layout,
                     token_destinations)
from .rows import combine_reduce, gather_rows

OPS = {"all_to_all_v": torch.ops.pydatacopy.all_to_all_v.default,
       "moe_gather_rows": torch.ops.pydatacopy.moe_gather_rows.default,
       "moe_combine_reduce": torch.ops.pydatacopy.moe_combine_reduce.default,
       "moe_dispatch_layout": torch.ops.pydatacopy.moe_dispatch_layout.default,
       "moe_receive_layout": torch.ops.pydatacopy.moe_receive_layout.default}

__all__ = [
    "AllToAll",
    "DispatchPlan",
    "MoeDispatcher",
    "MoeHandle",
    "MoeReducedHandle",
    "MoeTokenHandle",
    "OPS",
    "ReceiveLayout",
    "all_to_all_v",
    "combine_reduce",
    "dispatch_plan",
    "gather_rows",
    "local_topk",
    "receive_layout",
    "token_destinations",
]
