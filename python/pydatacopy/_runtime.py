"""Start-up: the unique ID, its broadcast through torch.distributed, NVSHMEM init and teardown."""

from __future__ import annotations

import hashlib
import os
from typing import Sequence, Union

import torch

from . import _C, _network, _transfer
from ._torch_utils import check_int, timeout_seconds

Error = _C.Error
UNIQUE_ID_BYTES: int = _C.UNIQUE_ID_BYTES

UniqueIdLike = Union[bytes, bytearray, Sequence[int], torch.Tensor]

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    # NVLink multicast can take shared GPUs down; a user who wants it sets these explicitly.
    os.environ.setdefault(_name, _value)


def get_unique_id() -> list[int]:
    """A fresh NVSHMEM unique ID: 128 ints in [0, 255] (picklable). Needs no GPU.

    Call it on one rank (rank 0) and send the result to every rank. The ID carries the address
    rank 0 listens on for NVSHMEM's bootstrap, so the interface settings (NCCL_SOCKET_IFNAME ->
    NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, see _network) are applied first.
    """
    _network.apply_network_settings()
    return _C.get_unique_id()


def _id_to_list(root_unique_id: UniqueIdLike) -> list[int]:
    if isinstance(root_unique_id, torch.Tensor):
        if root_unique_id.dtype != torch.uint8:
            raise Error(f"a unique ID tensor must be uint8, got {root_unique_id.dtype}")
        values = root_unique_id.detach().cpu().reshape(-1).tolist()
    elif isinstance(root_unique_id, (bytes, bytearray, memoryview)):
        values = list(bytes(root_unique_id))
    elif isinstance(root_unique_id, (list, tuple)):
        values = list(root_unique_id)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in values):
            raise Error("a unique ID given as a sequence must hold ints in [0, 255]")
    else:
        raise Error("root_unique_id must be bytes, bytearray, a list of ints or a uint8 tensor "
                    f"(what get_unique_id() returned on rank 0), got {type(root_unique_id).__name__}")
    if len(values) != UNIQUE_ID_BYTES:
        raise Error(f"root_unique_id must be {UNIQUE_ID_BYTES} bytes (from get_unique_id()), "
                    f"got {len(values)}")
    return values


def choose_device(rank: int) -> int:
    """The CUDA device this process uses. The rule, in order:

    1. if torch has already initialised CUDA in this process, its current device (the caller
       chose one, e.g. with torch.cuda.set_device);
    2. else LOCAL_RANK from the environment (torchrun and the SLURM recipes set it);
    3. else rank modulo the number of visible devices.
    """
    count = torch.cuda.device_count()
    if count == 0:
        raise Error("no CUDA device is visible to this process: pydatacopy needs one GPU per "
                    "process (check nvidia-smi, CUDA_VISIBLE_DEVICES and that torch is a CUDA build)")
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        try:
            device = int(local_rank)
        except ValueError:
            raise Error(f"LOCAL_RANK={local_rank!r} is not an integer") from None
        if not 0 <= device < count:
            raise Error(f"LOCAL_RANK={device} but this process sees {count} CUDA device(s); "
                        "check CUDA_VISIBLE_DEVICES and --nproc_per_node")
        return device
    return rank % count


def _init_timeout(timeout: float | None) -> float:
    if timeout is None:
        return _C.default_init_timeout_seconds()
    return timeout_seconds(timeout)


def init_nvshmem(root_unique_id: UniqueIdLike, rank: int, world_size: int,
                 device: int | None = None, *, timeout: float | None = None) -> int:
    """Join the NVSHMEM job named by rank 0's unique ID (collective). Returns this PE (== rank).

    The design note's entry point: every rank calls it with the same ID. `device` overrides the
    device rule of `choose_device`. Calling it again with the same ID is harmless.

    Raises TimeoutError when not every rank joined within `timeout` seconds (default:
    PYDATACOPY_INIT_TIMEOUT_S, else 300). NVSHMEM's bootstrap cannot be cancelled, so after that
    error this process cannot start NVSHMEM again: exit it.
    """
    values = _id_to_list(root_unique_id)
    init_timeout = _init_timeout(timeout)
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0)
    if rank >= world_size:
        raise Error(f"rank must be in [0, world_size={world_size}), got {rank}")
    if _C.is_initialized():
        return _C.init_nvshmem(values, rank, world_size, _C.cuda_device(), init_timeout)
    if device is None:
        device = choose_device(rank)
    else:
        check_int("device", device, 0)
    if torch.cuda.device_count() > device:
        torch.cuda.set_device(device)  # torch's current device and stream follow ours
    _network.apply_network_settings()
    _network.check_transport_preconditions(world_size)
    pe = _C.init_nvshmem(values, rank, world_size, device, init_timeout)
    _transfer.setup_send_recv()  # collective, like the init itself
    return pe


def share_unique_id(group=None) -> list[int]:
    """Create the ID on the group's first rank and broadcast it through torch.distributed.

    Works with nccl and gloo groups; every rank checks that it holds the same ID as every other.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Error("torch.distributed is not initialised: call "
                    "torch.distributed.init_process_group() first (torchrun sets its environment)")
    group_rank = dist.get_rank(group)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    payload = [get_unique_id() if group_rank == 0 else None]
    device = None
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.broadcast_object_list(payload, src=source, group=group, device=device)
    unique_id = _id_to_list(payload[0])
    digest = hashlib.sha256(bytes(unique_id)).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise Error("ranks received different NVSHMEM unique IDs; check that every rank of the "
                    "group calls init() once, in the same order")
    return unique_id


def init(group=None, *, device: int | None = None, timeout: float | None = None) -> int:
    """Start NVSHMEM on every rank of a torch.distributed group (collective). Returns this PE.

    Rank 0 of `group` (default: the world) creates the ID; it travels through torch.distributed
    (under the group's own timeout, set by init_process_group); every rank checks it and joins.
    The CUDA device follows `choose_device` unless `device` is given. `timeout` bounds NVSHMEM's
    start (see init_nvshmem). Calling it again is harmless.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Error("init() needs torch.distributed: call torch.distributed.init_process_group() "
                    "first (torchrun sets its environment), or use get_unique_id()/init_nvshmem()")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if _C.is_initialized():
        if (_C.my_pe(), _C.n_pes()) != (rank, world_size):
            raise Error(f"already initialised as PE {_C.my_pe()} of {_C.n_pes()}, which does not "
                        f"match rank {rank} of {world_size} in this group")
        return _C.my_pe()
    if device is None:
        device = choose_device(rank)
    torch.cuda.set_device(device)
    unique_id = share_unique_id(group)
    return init_nvshmem(unique_id, rank, world_size, device=device, timeout=timeout)


def finalize() -> None:
    """Collective teardown: send/recv staging, tensors from empty(), then NVSHMEM. Harmless when
    not initialised or called twice. DoubleBufferManagers must be cleaned up before.

    Every collective step first meets the peers in a barrier bounded by PYDATACOPY_TIMEOUT_S:
    when one does not come, the rest is released locally only and TimeoutError is raised; the
    process should then exit. NVSHMEM cannot be started again in this process afterwards."""
    timed_out = None
    if _C.is_initialized():
        try:
            _transfer.teardown_send_recv()
            _transfer.free_all_symmetric()
        except _C.TimeoutError as error:  # a peer did not come to the collective frees
            timed_out = error
            _transfer.free_all_symmetric()  # now local only: nothing waits on the peer
    _C.finalize()  # after a timeout it skips NVSHMEM's collective teardown
    if timed_out is not None:
        raise timed_out


def is_initialized() -> bool:
    return _C.is_initialized()


def my_pe() -> int:
    return _C.my_pe()


def n_pes() -> int:
    return _C.n_pes()


def check_errors() -> None:
    """Raise the first error a stream-ordered device-side wait has reported (TimeoutError)."""
    _C.check_device_errors()
