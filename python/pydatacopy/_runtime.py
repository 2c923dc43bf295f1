"""Start-up: the unique ID, its broadcast through torch.distributed, NVSHMEM init and teardown."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from typing import Sequence, Union

import torch

from . import _C, _env, _network, _transfer
from ._torch_utils import check_int, timeout_seconds

Error = _C.Error
UNIQUE_ID_BYTES: int = _C.UNIQUE_ID_BYTES

UniqueIdLike = Union[bytes, bytearray, Sequence[int], torch.Tensor]
DeviceLike = Union[int, str, torch.device, None]

#: The variables pydatacopy set at import because they were unset (the doctor tells these apart
#: from the ones the user set): NVLink multicast can take shared GPUs down, so it stays off unless
#: a user asks for it by setting them.
SET_AT_IMPORT: dict[str, str] = {}
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    if _name not in os.environ:
        os.environ[_name] = SET_AT_IMPORT[_name] = _value


def _bootstrap_settings() -> str:
    names = sorted(n for n in os.environ if n.startswith("NVSHMEM_BOOTSTRAP"))
    return ", ".join(f"{n}={os.environ[n]!r}" for n in names)


def get_unique_id() -> list[int]:
    """A fresh NVSHMEM unique ID: 128 ints in [0, 255] (picklable). Needs no GPU.

    Call it on one rank (rank 0) and send the result to every rank. The ID carries the address
    rank 0 listens on for NVSHMEM's bootstrap, so the interface settings (NCCL_SOCKET_IFNAME ->
    NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, see _network) are checked and applied first, and so is
    every NVSHMEM setting NVSHMEM would crash on (NVSHMEM_SYMMETRIC_SIZE...): pydatacopy.Error.
    """
    _env.check_nvshmem_environment("pydatacopy.get_unique_id")
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


def _choose_device(rank: int, call: str) -> int:
    try:
        device = _env.local_rank()
    except _env.SettingError as error:
        raise Error(f"{call}: {error}; or pass device= to {call}") from None
    count = torch.cuda.device_count()
    if count == 0:
        raise Error(f"{call}: {_NO_GPU}")
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    if device is not None:
        if device >= count:
            raise Error(f"{call}: LOCAL_RANK={device} but this process sees {count} CUDA "
                        "device(s); check CUDA_VISIBLE_DEVICES and torchrun's --nproc_per_node")
        return device
    return rank % count


def choose_device(rank: int) -> int:
    """The CUDA device this process uses. The rule, in order:

    1. if torch has already initialised CUDA in this process, its current device (the caller
       chose one, e.g. with torch.cuda.set_device);
    2. else LOCAL_RANK from the environment (torchrun and the SLURM recipes set it);
    3. else rank modulo the number of visible devices.
    """
    check_int("rank", rank, 0, _env.INT32_MAX, call="pydatacopy.choose_device")
    return _choose_device(rank, "pydatacopy.choose_device")


def _init_timeout(timeout: float | None, call: str) -> float:
    try:
        if timeout is None:
            return _C.default_init_timeout_seconds()
        return timeout_seconds(timeout)
    except Error as error:
        raise Error(f"{call}: {error}") from None


def init_nvshmem(root_unique_id: UniqueIdLike, rank: int, world_size: int,
                 device: DeviceLike = None, *, timeout: float | None = None) -> int:
    """Join the NVSHMEM job named by rank 0's unique ID (collective). Returns this PE (== rank).

    The design note's entry point: every rank calls it with the same ID. `device` (an index,
    ``"cuda:N"`` or a torch.device) overrides the device rule of `choose_device`. Calling it
    again with the same ID is harmless. The arguments and the environment (NVSHMEM_SYMMETRIC_SIZE,
    PYDATACOPY_*, the interface settings) are checked before NVSHMEM sees them.

    Raises TimeoutError when not every rank joined within `timeout` seconds (default:
    PYDATACOPY_INIT_TIMEOUT_S, else 300). NVSHMEM's bootstrap cannot be cancelled, so after that
    error this process cannot start NVSHMEM again: exit it.
    """
    return _start(root_unique_id, rank, world_size, device, timeout, "pydatacopy.init_nvshmem", nodes=None)


def _start(root_unique_id: UniqueIdLike, rank: int, world_size: int, device: DeviceLike,
           timeout: float | None, call: str, nodes: int | None, preflight_done: bool = False) -> int:
    """init_nvshmem's work; `nodes` is the number of hosts among the ranks when init() saw them;
    `preflight_done`: init() has agreed on the remote-transport check with every rank (a
    second, local check could disagree and leave the others in NVSHMEM's bootstrap)."""
    values = _id_to_list(root_unique_id, call)
    check_int("world_size", world_size, 1, _env.INT32_MAX, call=call)
    check_int("rank", rank, 0, _env.INT32_MAX, call=call)
    if rank >= world_size:
        raise Error(f"{call}: rank must be in [0, world_size={world_size}), got {rank}")
    device = _device_index(device, call)
    init_timeout = _init_timeout(timeout, call)
    _transfer.refuse_capture(call.removeprefix("pydatacopy."))
    if _C.is_initialized():
        return _C.init_nvshmem(values, rank, world_size, _C.cuda_device(), init_timeout)
    _env.check_environment(call)
    if device is None:
        device = _choose_device(rank, call)
    torch.cuda.set_device(device)  # torch's current device and stream follow ours
    _network.apply_network_settings()
    if not preflight_done:
        _network.check_transport_preconditions(world_size, call=call, nodes=nodes)
    _C.set_rma_options(*_env.rma_options())
    pe = _C.init_nvshmem(values, rank, world_size, device, init_timeout)
    _transfer.setup_send_recv()  # collective, like the init itself
    return pe


def share_unique_id(group=None) -> list[int]:
    """Create the ID on the group's first rank and broadcast it through torch.distributed.

    Works with nccl and gloo groups; every rank checks that it holds the same ID as every other.
    """
    return _share_unique_id(group)[0]


def _share_unique_id(group=None) -> tuple[list[int], int]:
    """share_unique_id, and the number of distinct hosts among the group's ranks (gathered in
    the same collective as the ID's check)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Error("pydatacopy.share_unique_id needs torch.distributed: call "
                    "torch.distributed.init_process_group() first (torchrun sets its environment)")
    group_rank = dist.get_rank(group)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    payload = [get_unique_id() if group_rank == 0 else None]
    device = None
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.broadcast_object_list(payload, src=source, group=group, device=device)
    unique_id = _id_to_list(payload[0], "pydatacopy.share_unique_id")
    digest = hashlib.sha256(bytes(unique_id)).hexdigest()
    gathered: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (digest, _network.host_identity()), group=group)
    digests = {entry[0] for entry in gathered}
    if len(digests) != 1:
        raise Error("pydatacopy.share_unique_id: ranks received different NVSHMEM unique IDs; "
                    "check that every rank of the group calls pydatacopy.init() once, in the same "
                    "order")
    return unique_id, len({entry[1] for entry in gathered})


def init(group=None, *, device: DeviceLike = None, timeout: float | None = None) -> int:
    """Start NVSHMEM on every rank of a torch.distributed group (collective). Returns this PE.

    Rank 0 of `group` (default: the world) creates the ID; it travels through torch.distributed
    (under the group's own timeout, set by init_process_group); every rank checks it and joins.
    The CUDA device follows `choose_device` unless `device` (an index, ``"cuda:N"`` or a
    torch.device) is given. `timeout` bounds NVSHMEM's start (see init_nvshmem). The arguments
    and the environment are checked before anything starts. Calling it again is harmless.
    """
    import torch.distributed as dist

    call = "pydatacopy.init"
    device = _device_index(device, call)
    _init_timeout(timeout, call)
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{call} needs torch.distributed: call torch.distributed.init_process_group() "
                    "first (torchrun sets its environment), or use get_unique_id()/init_nvshmem()")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    _transfer.refuse_capture("init")
    if _C.is_initialized():
        if (_C.my_pe(), _C.n_pes()) != (rank, world_size):
            raise Error(f"{call}: already initialised as PE {_C.my_pe()} of {_C.n_pes()}, which "
                        f"does not match rank {rank} of {world_size} in this group; call "
                        "pydatacopy.finalize() first (NVSHMEM starts once per process)")
        return _C.my_pe()
    _env.check_environment(call)
    if device is None:
        device = _choose_device(rank, call)
    torch.cuda.set_device(device)
    unique_id, nodes = _share_unique_id(group)
    _network.apply_network_settings()
    _agree_on_preflight(group, world_size, nodes, call)
    return _start(unique_id, rank, world_size, device, timeout, call, nodes=nodes, preflight_done=True)


def _agree_on_preflight(group, world_size: int, nodes: int, call: str) -> None:
    """The remote-transport preflight on every rank, agreed (collective): NVSHMEM starts on all
    ranks or on none. Nodes differ (NICs, libraries), and a rank refusing alone would leave the
    others in NVSHMEM's bootstrap until the init timeout."""
    import torch.distributed as dist

    try:
        _network.check_transport_preconditions(world_size, call=call, nodes=nodes)
        mine = None
    except Error as error:
        mine = str(error).removeprefix(f"{call}: ")
    except Exception as error:  # the check itself failed here (sysfs, a loader): still agree
        mine = f"the remote-transport check failed: {type(error).__name__}: {error}"
    verdicts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, mine, group=group)
    refused = [rank for rank, verdict in enumerate(verdicts) if verdict]
    if refused:
        raise Error(f"{call}: NVSHMEM was not started on any rank, because on rank "
                    f"{', '.join(map(str, refused))} of the group: {verdicts[refused[0]]}")


def finalize() -> None:
    """Collective teardown: send/recv staging, tensors from empty(), then NVSHMEM. Harmless when
    not initialised or called twice. DoubleBufferManagers must be cleaned up before.

    Every collective step first meets the peers in a barrier bounded by PYDATACOPY_TIMEOUT_S:
    when one does not come, the rest is released locally only and TimeoutError is raised; the
    process should then exit.

    NVSHMEM is one per process. finalize() ends it only when pydatacopy started it and torch's
    symmetric memory is not set to the NVSHMEM backend (torch may still use it: its tensors stay
    valid and NVSHMEM ends with the process). Once ended, NVSHMEM cannot start again in this
    process."""
    timed_out = None
    if _C.is_initialized():
        _transfer.refuse_capture("finalize")
        try:
            _transfer.teardown_send_recv()
            _transfer.free_all_symmetric()
        except _C.TimeoutError as error:  # a peer did not come to the collective frees
            timed_out = error
            _transfer.free_all_symmetric()  # now local only: nothing waits on the peer
    _C.finalize(not _torch_uses_nvshmem())  # after a timeout it skips NVSHMEM's collective teardown
    if timed_out is not None:
        raise timed_out


def _torch_uses_nvshmem() -> bool:
    """True when torch's symmetric memory is set to NVSHMEM in this process (it then shares our
    NVSHMEM, started by whichever library came first)."""
    symm_mem = sys.modules.get("torch.distributed._symmetric_memory")
    if symm_mem is None or not torch.cuda.is_available():
        return False
    try:
        return symm_mem.get_backend(torch.device("cuda", torch.cuda.current_device())) == "NVSHMEM"
    except Exception:  # an older torch without get_backend: keep NVSHMEM, the safe side
        return True


def is_initialized() -> bool:
    """True between a successful init()/init_nvshmem() and finalize()."""
    return _C.is_initialized()


def my_pe() -> int:
    """This process's PE number, in [0, n_pes()): its rank in init()'s group. Needs init()."""
    _transfer._require_init("my_pe")
    return _C.my_pe()


def n_pes() -> int:
    """The number of PEs (processes) in the NVSHMEM job. Needs init()."""
    _transfer._require_init("n_pes")
    return _C.n_pes()


def check_errors() -> None:
    """Raise the first error a stream-ordered device-side wait has reported (TimeoutError)."""
    _C.check_device_errors()
