"""pydatacopy.runtime: the process's NVSHMEM runtime.

Owns start-up and teardown (startup.py: init, init_nvshmem, finalize, my_pe, n_pes,
check_errors), the unique ID (unique_id.py), the device placement rule (placement.py), the
agreement between ranks before NVSHMEM starts (agreement.py), the environment's settings
(settings.py), the network and transport checks (network.py) and the host probes (probes.py).
May import ``ops``, ``_C``, the shared ``_torch_utils``/``_limits``, and, from startup.py only,
the features it starts and stops (``rma.symmetric``, ``send_recv.send_recv``).
"""

from __future__ import annotations

from .agreement import share_unique_id
from .placement import choose_device
from .startup import (
    check_errors,
    finalize,
    init,
    init_nvshmem,
    is_initialized,
    my_pe,
    n_pes,
)
from .unique_id import UNIQUE_ID_BYTES, get_unique_id

__all__ = [
    "UNIQUE_ID_BYTES",
    "check_errors",
    "choose_device",
    "finalize",
    "get_unique_id",
    "init",
    "init_nvshmem",
    "is_initialized",
    "my_pe",
    "n_pes",
    "share_unique_id",
]
