"""pydatacopy.registration: registering memory not from the symmetric heap with NVSHMEM
(register, unregister, is_registered). May import ``ops``, ``_C`` and the shared
``_torch_utils``; no other feature.
"""

from __future__ import annotations

from .registration import is_registered, register, unregister

__all__ = ["is_registered", "register", "unregister"]
