"""pydatacopy.token_exchange: the double-buffered token exchange (DoubleBufferManager). May
import ``ops``, ``_C`` and the shared ``_torch_utils``/``_limits``; no other feature.
"""

from __future__ import annotations

from .double_buffer import DoubleBufferManager

__all__ = ["DoubleBufferManager"]
