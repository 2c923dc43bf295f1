"""The NVSHMEM unique ID: made on one rank (after the settings its bootstrap address depends on),
and checked where a rank receives it."""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch

from .. import _C
from . import network as _network, settings as _settings

Error = _C.Error
UNIQUE_ID_BYTES: int = _C.UNIQUE_ID_BYTES

UniqueIdLike = Union[bytes, bytearray, Sequence[int], torch.Tensor]


def _bootstrap_settings() -> str:
    names = sorted(n for n in os.environ if n.startswith("NVSHMEM_BOOTSTRAP"))
    return ", ".join(f"{n}={os.environ[n]!r}" for n in names)


def get_unique_id() -> list[int]:
    """A fresh NVSHMEM unique ID: 128 ints in [0, 255] (picklable). Needs no GPU.

    Call it on one rank (rank 0) and send the result to every rank. The ID carries the address
    rank 0 listens on for NVSHMEM's bootstrap, so the interface settings (NCCL_SOCKET_IFNAME ->
    NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, see network.py) are checked and applied first, and so is
    every NVSHMEM setting NVSHMEM would crash on (NVSHMEM_SYMMETRIC_SIZE...): pydatacopy.Error.
    """
    _settings.check_nvshmem_environment("pydatacopy.get_unique_id")
    _network.apply_network_settings()
    try:
        return _C.get_unique_id()
    except Error as error:
        settings = _bootstrap_settings()
        raise Error(f"pydatacopy.get_unique_id: NVSHMEM could not create an ID ({error}). "
                    + (f"Check its bootstrap settings here, {settings}, or unset them to let "
                       "NVSHMEM choose" if settings else "python -m pydatacopy.doctor checks "
                       "the network settings")) from None


def _id_to_list(root_unique_id: UniqueIdLike, call: str) -> list[int]:
    if isinstance(root_unique_id, torch.Tensor):
        if root_unique_id.dtype != torch.uint8:
            raise Error(f"{call}: a unique ID tensor must be uint8, got {root_unique_id.dtype}")
        values = root_unique_id.detach().cpu().reshape(-1).tolist()
    elif isinstance(root_unique_id, (bytes, bytearray, memoryview)):
        values = list(bytes(root_unique_id))
    elif isinstance(root_unique_id, (list, tuple)):
        values = list(root_unique_id)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in values):
            raise Error(f"{call}: a unique ID given as a sequence must hold ints in [0, 255] "
                        "(pass what pydatacopy.get_unique_id() returned on rank 0)")
    else:
        raise Error(f"{call}: root_unique_id must be bytes, bytearray, a list of ints or a uint8 "
                    "tensor (what pydatacopy.get_unique_id() returned on rank 0), got "
                    f"{type(root_unique_id).__name__}")
    if len(values) != UNIQUE_ID_BYTES:
        raise Error(f"{call}: root_unique_id must be {UNIQUE_ID_BYTES} bytes (pass what "
                    f"pydatacopy.get_unique_id() returned on rank 0), got {len(values)}")
    return values
