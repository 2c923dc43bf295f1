"""pydatacopy.send_recv: two-sided transfers (send, recv, sendrecv, group) and the send/recv
engine's lifetime (setup_send_recv; runtime.startup sets it up and tears it down). May import
``ops``, ``runtime.settings``, ``_C`` and the shared ``_torch_utils``/``_limits``.
"""

from __future__ import annotations

from .send_recv import group, recv, send, sendrecv, setup_send_recv, stats

__all__ = ["group", "recv", "send", "sendrecv", "setup_send_recv", "stats"]
