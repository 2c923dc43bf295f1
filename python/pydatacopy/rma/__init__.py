"""pydatacopy.rma: one-sided transfers on symmetric memory.

Owns the symmetric heap's tensors (symmetric.py: empty, free, peer_view), put/get, signals,
quiet and barrier (transfer.py), and prepared put_many tables (prepared_put_many.py). May import
``ops``, ``_C`` and the shared ``_torch_utils``/``_limits``; no other feature.
"""

from __future__ import annotations

from .prepared_put_many import PreparedPutMany, prepare_put_many
from .symmetric import empty, free, is_symmetric, peer_view
from .transfer import (
    barrier,
    get,
    put,
    put_blocks,
    put_many,
    put_signal,
    quiet,
    signal_set,
    signal_wait,
)

__all__ = [
    "PreparedPutMany",
    "barrier",
    "empty",
    "free",
    "get",
    "is_symmetric",
    "peer_view",
    "prepare_put_many",
    "put",
    "put_blocks",
    "put_many",
    "put_signal",
    "quiet",
    "signal_set",
    "signal_wait",
]
