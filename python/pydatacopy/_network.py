"""Network settings for NVSHMEM's bootstrap and transports, following NCCL's where NVSHMEM's are
unset, and checks that keep NVSHMEM from ending the process on a setup it cannot run."""

from __future__ import annotations

import os

from . import _C
from ._env import NCCL_TO_NVSHMEM, nvshmem_bool  # NCCL_TO_NVSHMEM: NCCL name -> NVSHMEM name

Error = _C.Error


def infiniband_devices() -> list[str]:
    """RDMA devices the kernel exposes (/sys/class/infiniband)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def apply_network_settings(environ=os.environ) -> dict[str, str]:
    """Copy NCCL's interface/HCA choices to NVSHMEM's variables where those are unset, and turn
    on IBGDA when PYDATACOPY_IBGDA=1. Returns what it set. init()/init_nvshmem() call it before
    NVSHMEM starts (NVSHMEM reads its environment once, at init)."""
    applied = {}
    for nccl_name, nvshmem_name in NCCL_TO_NVSHMEM.items():
        if nccl_name in environ and nvshmem_name not in environ:
            environ[nvshmem_name] = applied[nvshmem_name] = environ[nccl_name]
    if environ.get("PYDATACOPY_IBGDA") == "1" and "NVSHMEM_IB_ENABLE_IBGDA" not in environ:
        environ["NVSHMEM_IB_ENABLE_IBGDA"] = applied["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    return applied


def check_transport_preconditions(world_size: int, environ=os.environ, *,
                                  call: str = "pydatacopy.init") -> None:
    """Refuse set-ups on which NVSHMEM would print an error and exit() the whole process.

    With NVSHMEM_DISABLE_P2P=1 and more than one PE, NVSHMEM needs a remote transport (an
    InfiniBand/RoCE NIC, or UCX/libfabric); without one it ends the process during init
    ("Unable to initialize any transports"), as seen on the 2-GPU machine.
    """
    p2p_off = "NVSHMEM_DISABLE_P2P" in environ and nvshmem_bool(environ["NVSHMEM_DISABLE_P2P"])
    if world_size > 1 and p2p_off and not infiniband_devices() \
            and environ.get("NVSHMEM_REMOTE_TRANSPORT", "").lower() not in ("ucx", "libfabric"):
        raise Error(f"{call}: NVSHMEM_DISABLE_P2P={environ['NVSHMEM_DISABLE_P2P']} leaves NVSHMEM "
                    "no way to reach the other PEs here (no InfiniBand device in /sys/class/infiniband, no NVSHMEM_REMOTE_TRANSPORT=ucx or "
                    "libfabric), and NVSHMEM would end the process. Unset NVSHMEM_DISABLE_P2P; to "
                    "exercise the path a remote peer takes on one machine, set PYDATACOPY_FORCE_RMA=1")
