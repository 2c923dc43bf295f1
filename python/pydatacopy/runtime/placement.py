"""Device placement: which CUDA device a rank uses (choose_device's rule, device=), and the
refusals that every rank of a group reaches alike."""

from __future__ import annotations

import os
import re
from typing import Union

import torch

from .. import _C
from .._limits import INT32_MAX
from .._torch_utils import check_int
from . import settings as _settings

Error = _C.Error

DeviceLike = Union[int, str, torch.device, None]


_NO_GPU = ("no CUDA device is visible to this process: pydatacopy needs one GPU per process "
           "(check nvidia-smi, CUDA_VISIBLE_DEVICES and that torch is a CUDA build)")


def _device_index(device: DeviceLike, call: str) -> int | None:
    """An explicit device= as an index of a visible CUDA device; None: follow choose_device."""
    if device is None:
        return None
    if isinstance(device, str):
        match = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
        if not match:
            raise Error(f"{call}: device={device!r} is not a CUDA device: pass an index (0), "
                        "'cuda:0' or torch.device('cuda', 0)")
        device = torch.device("cuda", int(match.group(1))) if match.group(1) else torch.device("cuda")
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise Error(f"{call}: device={str(device)!r} is not a CUDA device: pydatacopy moves GPU "
                        "memory; pass an index (0), 'cuda:0' or torch.device('cuda', 0)")
        if device.index is None:
            return None
        device = device.index
    if isinstance(device, bool) or not isinstance(device, int):
        raise Error(f"{call}: device must be an int, a 'cuda:N' string or a torch.device, got "
                    f"{type(device).__name__} {device!r}")
    check_int("device", device, 0, call=call)
    count = torch.cuda.device_count()
    if count == 0:
        raise Error(f"{call}: {_NO_GPU}")
    if device >= count:
        raise Error(f"{call}: device={device} is out of range: this process sees {count} CUDA "
                    f"device(s), 0 to {count - 1}; check CUDA_VISIBLE_DEVICES")
    return device


def _world_size_from_environment() -> int | None:
    text = os.environ.get("WORLD_SIZE", "").strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None


def _choose_device(rank: int, call: str, world_size: int | None = None) -> int:
    """choose_device's rule; `world_size` (the group's, else WORLD_SIZE) lets every rank refuse
    alike when, without LOCAL_RANK, the last rank's device does not exist."""
    try:
        local = _settings.local_rank()
        per_gpu = _settings.ranks_per_gpu()
    except _settings.SettingError as error:
        raise Error(f"{call}: {error}; or pass device= to {call}") from None
    count = torch.cuda.device_count()
    if count == 0:
        raise Error(f"{call}: {_NO_GPU}")
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    if local is None:
        # The rank itself picks the device (one node, or a launcher that sets only RANK). A rank
        # whose device does not exist is refused, never folded onto another by a modulo; every
        # rank checks the last rank of the group, so that all refuse alike (none is left
        # waiting in the ID's broadcast).
        last = max(rank, (world_size or _world_size_from_environment() or 0) - 1)
        if last // per_gpu >= count:
            who = (f"rank {last} of {last + 1}" if last != rank
                   else f"rank {rank}")
            raise Error(
                f"{call}: LOCAL_RANK is unset, so the rank picks the device: with "
                f"PYDATACOPY_RANKS_PER_GPU={per_gpu}, rank r uses device r // {per_gpu}, and "
                f"{who} would need device {last // per_gpu}, but this process sees {count} CUDA "
                f"device(s). Set LOCAL_RANK (the rank's index on its node; torchrun sets it) on "
                f"every rank, set PYDATACOPY_RANKS_PER_GPU={-(-(last + 1) // count)} on every "
                "rank to put that many ranks on each GPU (with torch.distributed on gloo: NCCL "
                f"refuses two ranks on one GPU), or pass device= to {call}")
        return rank // per_gpu
    # Every rank of the node reads the same LOCAL_WORLD_SIZE, so all of them refuse here alike,
    # before any collective: none is left waiting in the ID's broadcast for a rank that refused.
    on_node = _settings.local_world_size()
    needed = max(local + 1, on_node or 0)
    if needed > count * per_gpu:
        where = (f"LOCAL_WORLD_SIZE={on_node} ranks on this node" if on_node and on_node > local
                 else f"LOCAL_RANK={local}")
        share = -(-needed // count)  # ceil: ranks each GPU must take
        raise Error(
            f"{call}: {where} but this process sees {count} CUDA device(s), and with "
            f"PYDATACOPY_RANKS_PER_GPU={per_gpu} local rank r uses device r // {per_gpu}, so "
            f"LOCAL_RANK={needed - 1} would need device {(needed - 1) // per_gpu}. To run several "
            f"ranks on one GPU, set PYDATACOPY_RANKS_PER_GPU={share} on every rank (with "
            "torch.distributed on gloo: NCCL refuses two ranks on one GPU; CUDA MPS recommended, "
            f"see docs/shared-gpu.md), or pass device= to {call}; otherwise "
            "check CUDA_VISIBLE_DEVICES and torchrun's --nproc_per_node")
    return local // per_gpu


def choose_device(rank: int) -> int:
    """The CUDA device this process uses. The rule, in order:

    1. if torch has already initialised CUDA in this process, its current device (the caller
       chose one, e.g. with torch.cuda.set_device);
    2. else LOCAL_RANK // PYDATACOPY_RANKS_PER_GPU (torchrun and the SLURM recipes set
       LOCAL_RANK; PYDATACOPY_RANKS_PER_GPU, default 1, says how many ranks of a node share one
       GPU: with 4 ranks and PYDATACOPY_RANKS_PER_GPU=2, local ranks 0 and 1 use cuda:0, 2 and
       3 cuda:1). A local rank, or a LOCAL_WORLD_SIZE, that needs more devices than this process
       sees is refused (pydatacopy.Error naming PYDATACOPY_RANKS_PER_GPU and device=): ranks are
       never folded onto devices by a silent modulo;
    3. else rank // PYDATACOPY_RANKS_PER_GPU (no LOCAL_RANK: one node, or a launcher that sets
       only RANK). When the last rank (WORLD_SIZE - 1, or this rank without WORLD_SIZE) would
       need a device this process does not see, every rank is refused (pydatacopy.Error naming
       LOCAL_RANK, PYDATACOPY_RANKS_PER_GPU and device=): no modulo either.

    init(device=...) and init_nvshmem(..., device) override the rule.
    """
    check_int("rank", rank, 0, INT32_MAX, call="pydatacopy.choose_device")
    return _choose_device(rank, "pydatacopy.choose_device")
