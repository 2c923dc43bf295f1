"""pydatacopy: move GPU data between processes, GPUs and servers over NVSHMEM.

Start it from torch.distributed (no MPI)::

    import torch.distributed as dist, pydatacopy
    dist.init_process_group("nccl")
    pydatacopy.init()                       # rank 0's NVSHMEM ID travels through torch.distributed
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens=4096, token_size=7168)
    ...
    dbm.cleanup(); pydatacopy.finalize()
"""

from __future__ import annotations

from . import _C, moe, registration, rma, runtime, send_recv, token_exchange
# Each feature's __all__ is its public API, exported whole here; of moe, the calls below only
# (its layout helpers and plans stay in pydatacopy.moe).
from .moe import AllToAll, MoeDispatcher, MoeHandle, all_to_all_v
from .registration import *  # noqa: F403
from .rma import *  # noqa: F403
from .runtime import *  # noqa: F403
from .send_recv import *  # noqa: F403
from .token_exchange import *  # noqa: F403

__version__: str = _C.__version__

#: The one exception type of pydatacopy (a RuntimeError subclass).
Error = _C.Error
Error.__doc__ = """The one exception type of pydatacopy, a RuntimeError.

Every failure a caller can cause (a bad argument, a bad environment variable, a call before
init(), an error reported by CUDA or NVSHMEM) raises it, with a message that names the call and
the setting involved and says what to do. Errors from the C++ core end with their file:line."""
#: A blocking wait ran past its timeout; a subclass of Error.
TimeoutError = _C.TimeoutError  # noqa: A001 - the project's own, deliberately named
TimeoutError.__doc__ = """A wait on a peer ran past its timeout; a subclass of pydatacopy.Error.

For send/recv the timeout is a watchdog on progress: the call's channel moved nothing for that
long. The PE waited on is marked: calls with it are refused from then on, calls between live PEs
go on, and what needs every PE (barriers, allocation, setup_send_recv, the token exchange) refuses.

The message names the peer (PE) that did not arrive and the timeout that applied (``timeout=``,
PYDATACOPY_TIMEOUT_S, or PYDATACOPY_INIT_TIMEOUT_S for init()). Stream-ordered waits report it
at the next call or at check_errors(); blocking ones raise it at once."""


def nvshmem_versions() -> dict[str, str]:
    """The NVSHMEM version compiled in and the one loaded in this process."""
    return {"built": _C.built_nvshmem_version(), "loaded": _C.loaded_nvshmem_version()}


__all__ = [
    *token_exchange.__all__,
    *rma.__all__,
    *send_recv.__all__,
    *registration.__all__,
    *runtime.__all__,
    "AllToAll",
    "MoeDispatcher",
    "MoeHandle",
    "all_to_all_v",
    "Error",
    "TimeoutError",
    "nvshmem_versions",
]
