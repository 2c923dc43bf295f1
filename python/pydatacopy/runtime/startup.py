"""Start-up: the unique ID, its broadcast through torch.distributed, NVSHMEM init and teardown."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import warnings
from typing import NamedTuple, Sequence, Union

import torch

from . import _C, _network, _ops, _probes, _send_recv, _settings, _symmetric, _torch_utils
from ._limits import INT32_MAX
from ._torch_utils import check_int, require_init, timeout_seconds

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
    _ops.refuse_tracing(call.removeprefix("pydatacopy."))
    values = _id_to_list(root_unique_id, call)
    check_int("world_size", world_size, 1, INT32_MAX, call=call)
    check_int("rank", rank, 0, INT32_MAX, call=call)
    if rank >= world_size:
        raise Error(f"{call}: rank must be in [0, world_size={world_size}), got {rank}")
    device = _device_index(device, call)
    init_timeout = _init_timeout(timeout, call)
    _ops.refuse_capture(call.removeprefix("pydatacopy."))
    if _C.is_initialized():
        pe = _C.init_nvshmem(values, rank, world_size, _C.cuda_device(), init_timeout)
        if _ops._order is None:
            _ops.make_order_token(_C.cuda_device())
        return pe
    _settings.check_environment(call)
    if device is None:
        device = _choose_device(rank, call, world_size)
    torch.cuda.set_device(device)  # torch's current device and stream follow ours
    _network.apply_network_settings()
    if not preflight_done:
        _network.check_transport_preconditions(world_size, call=call, nodes=nodes)
    _C.set_rma_options(*_settings.rma_options())
    pe = _C.init_nvshmem(values, rank, world_size, device, init_timeout)
    _send_recv.setup_send_recv()  # collective, like the init itself
    _ops.make_order_token(device)  # what the traced calls order themselves by (_ops.py)
    return pe


def share_unique_id(group=None) -> list[int]:
    """Create the ID on the group's first rank and broadcast it through torch.distributed.

    Works with nccl and gloo groups; every rank checks that it holds the same ID as every other.
    """
    return _share_unique_id(group)[0]


def _share_unique_id(group=None) -> tuple[list[int], int]:
    """share_unique_id, and the number of distinct hosts among the group's ranks (gathered in
    the same collective as the ID's check)."""
    unique_id, ranks = _share_unique_id_and_ranks(group)
    return unique_id, len({rank.host for rank in ranks})


class RankInfo(NamedTuple):
    """What init() learns about each rank of its group, in the ID's check (one collective)."""
    digest: str  # of the unique ID the rank received
    host: str  # _network.host_identity()
    gpu: str | None  # the GPU's UUID (None: no CUDA device here); one physical GPU, one UUID
    mps: bool  # an MPS control daemon runs for this rank (_probes.mps_control_pipe)
    thread_percentage: float | None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, None when unset


def _gpu_identity() -> str | None:
    """The UUID of this process's current CUDA device (the same in every process and container
    that uses that GPU, and different for each MIG instance), else its host and PCI bus as a
    stand-in; None without a CUDA device."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid.strip("0-") == "":
        bus = getattr(props, "pci_bus_id", device)
        uuid = f"{_network.host_identity()}/pci:{getattr(props, 'pci_domain_id', 0)}:{bus}"
    return uuid


def _this_rank(digest: str) -> RankInfo:
    try:
        percentage = _settings.mps_thread_percentage()
    except _settings.SettingError:
        percentage = None  # check_environment refused it already where init() runs
    return RankInfo(digest, _network.host_identity(), _gpu_identity(),
                    _probes.mps_control_pipe() is not None, percentage)


def _share_unique_id_and_ranks(group=None) -> tuple[list[int], list[RankInfo]]:
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
    try:
        dist.broadcast_object_list(payload, src=source, group=group, device=device)
    except Exception as error:
        if "duplicate gpu" not in str(error).lower():
            raise
        raise Error(f"pydatacopy.init: {_NCCL_REFUSES} (NCCL said: {error})") from error
    unique_id = _id_to_list(payload[0], "pydatacopy.share_unique_id")
    digest = hashlib.sha256(bytes(unique_id)).hexdigest()
    gathered: list[RankInfo | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, tuple(_this_rank(digest)), group=group)
    ranks = [RankInfo(*entry) for entry in gathered]
    if len({rank.digest for rank in ranks}) != 1:
        raise Error("pydatacopy.share_unique_id: ranks received different NVSHMEM unique IDs; "
                    "check that every rank of the group calls pydatacopy.init() once, in the same "
                    "order")
    return unique_id, ranks


_NCCL_REFUSES_HOWTO = (
    "NCCL refuses two ranks on one GPU ('Duplicate GPU detected'). Create the group with "
    "torch.distributed.init_process_group('gloo') (pydatacopy only sends its 128-byte ID through "
    "it; the data moves through NVSHMEM, which runs several ranks on one GPU), or give every "
    "rank a GPU of its own (PYDATACOPY_RANKS_PER_GPU=1)")
_NCCL_REFUSES = ("ranks of this torch.distributed group share a GPU, and its backend is nccl: "
                 + _NCCL_REFUSES_HOWTO)


def shared_gpus(ranks: Sequence[RankInfo]) -> list[list[int]]:
    """The ranks (group ranks, ascending) of every GPU that more than one rank uses."""
    by_gpu: dict[str, list[int]] = {}
    for index, rank in enumerate(ranks):
        if rank.gpu is not None:
            by_gpu.setdefault(rank.gpu, []).append(index)
    return [members for members in by_gpu.values() if len(members) > 1]


def shared_gpu_verdict(ranks: Sequence[RankInfo], ignore_percentage: bool = False
                       ) -> tuple[str | None, list[str]]:
    """(refusal or None, warnings) for ranks sharing GPUs, the same on every rank (all see the
    same `ranks`), so that every rank refuses alike.

    NVSHMEM's rules for several PEs on one GPU ("multiple processes per GPU", MPG; its
    init.cpp, and NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its environment
    variables): full support only under CUDA MPS with the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of
    the PEs of one GPU summing to at most 100; otherwise "limited MPG" support, and past 100
    "NVSHMEM synchronizing APIs might deadlock". Without MPS the GPU time-slices between the
    processes, so a kernel waiting for a peer on the same GPU still lets the peer run: right,
    but slow (sendrecv 64 MiB about 7 GB/s per direction on an H200, 135 GB/s under MPS): a
    warning. Under MPS there is no time slicing: the clients' kernels run side by side only
    while they fit, and a waiting kernel that holds SMs the peer needs never gives them up
    (seen: a 256-block send/recv between two clients with no limit ran past 60 s). So a sum
    above 100 that every client set explicitly is refused (unless
    NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE asks NVSHMEM to run anyway: then a
    warning); an unset percentage takes the MPS daemon's default, which this process cannot
    read (100 unless set_default_active_thread_percentage changed it): a warning.
    """
    refusals, warnings_ = [], []
    for members in shared_gpus(ranks):
        k = len(members)
        names = f"ranks {', '.join(map(str, members))} share GPU {ranks[members[0]].gpu}"
        if not all(ranks[m].mps for m in members):
            warnings_.append(
                f"{names} without CUDA MPS: NVSHMEM runs them time-sliced, right but slow (about "
                "7 GB/s per direction for a 64 MiB sendrecv on an H200, 135 GB/s under MPS). "
                "Start MPS (nvidia-cuda-mps-control -d) and give each rank "
                f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // k}; see docs/shared-gpu.md")
            continue
        shares = [ranks[m].thread_percentage for m in members]
        howto = (f"set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={100 // k} (100 / {k} ranks) on each "
                 "of them")
        if any(share is None for share in shares):
            unset = [m for m, share in zip(members, shares) if share is None]
            warnings_.append(
                f"{names} under CUDA MPS, and rank {', '.join(map(str, unset))} did not set "
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: it gets the MPS daemon's default (100% unless "
                "changed), and when the shares of one GPU sum to more than 100, NVSHMEM gives "
                "only limited support and a kernel waiting for a peer on the same GPU can hold "
                f"the SMs the peer needs until its timeout: {howto}")
            continue
        total = sum(shares)
        if total <= 100:
            continue
        text = (f"{names} under CUDA MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                f"{' + '.join(f'{share:g}' for share in shares)} = {total:g} > 100: NVSHMEM "
                "supports several PEs on one GPU fully only when their shares sum to at most "
                "100; beyond, a kernel waiting for a peer on the same GPU can hold the SMs the "
                f"peer needs, and transfers hang until their timeout. {howto}")
        if ignore_percentage:
            warnings_.append(text + " (NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set: "
                                    "going on at your own risk)")
        else:
            refusals.append(text + ", or set NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 "
                                   "to go on at your own risk")
    return ("; ".join(refusals) or None), warnings_


def _check_shared_gpus(group, ranks: Sequence[RankInfo], call: str) -> None:
    """Refuse (on every rank alike) or warn (on the group's rank 0) per shared_gpu_verdict."""
    import torch.distributed as dist

    ignore = _settings.nvshmem_bool(os.environ.get("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0"))
    refusal, notes = shared_gpu_verdict(ranks, ignore)
    if refusal:
        raise Error(f"{call}: NVSHMEM was not started on any rank: {refusal}")
    if notes and dist.get_rank(group) == 0:
        for note in notes:
            warnings.warn(f"{call}: {note}", RuntimeWarning, stacklevel=3)


def init(group=None, *, device: DeviceLike = None, timeout: float | None = None) -> int:
    """Start NVSHMEM on every rank of a torch.distributed group (collective). Returns this PE.

    Rank 0 of `group` (default: the world) creates the ID; it travels through torch.distributed
    (under the group's own timeout, set by init_process_group); every rank checks it and joins.
    The CUDA device follows `choose_device` unless `device` (an index, ``"cuda:N"`` or a
    torch.device) is given. `timeout` bounds NVSHMEM's start (see init_nvshmem). The arguments
    and the environment are checked before anything starts. Calling it again is harmless.
    """
    import torch.distributed as dist

    _ops.refuse_tracing("init")
    call = "pydatacopy.init"
    device = _device_index(device, call)
    _init_timeout(timeout, call)
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{call} needs torch.distributed: call torch.distributed.init_process_group() "
                    "first (torchrun sets its environment), or use get_unique_id()/init_nvshmem()")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    _ops.refuse_capture("init")
    if _C.is_initialized():
        if (_C.my_pe(), _C.n_pes()) != (rank, world_size):
            raise Error(f"{call}: already initialised as PE {_C.my_pe()} of {_C.n_pes()}, which "
                        f"does not match rank {rank} of {world_size} in this group; call "
                        "pydatacopy.finalize() first (NVSHMEM starts once per process)")
        return _C.my_pe()
    # What each rank checks alone (its environment, its device) is gathered before anything
    # else, so that every rank refuses alike: a rank refusing alone would leave the others in
    # the ID's broadcast. On an nccl group, NCCL's first collective fails on the ranks that share
    # a GPU only ('Duplicate GPU detected') while the others wait, so there the facts travel
    # through the group's store, and sharing is refused before NCCL is touched.
    problem, per_gpu, gpu = None, None, None
    try:
        _settings.check_environment(call)
        per_gpu = _settings.ranks_per_gpu()
        if device is None:
            device = _choose_device(rank, call, world_size)
        torch.cuda.set_device(device)
        gpu = _gpu_identity()
    except (Error, _settings.SettingError) as error:
        problem = str(error).removeprefix(f"{call}: ")
    except Exception as error:  # CUDA refused the device here (MPS busy, say): still agree
        problem = f"selecting the CUDA device failed: {type(error).__name__}: {error}"
    facts = _gather_before_start(group, (problem, per_gpu, gpu), _init_timeout(timeout, call), call)
    _refuse_unless_all_can_start(facts, dist.get_backend(group) == "nccl", call)
    unique_id, ranks = _share_unique_id_and_ranks(group)
    nodes = len({r.host for r in ranks})
    if dist.get_backend(group) == "nccl" and shared_gpus(ranks):  # NCCL let it pass: say so anyway
        raise Error(f"{call}: {_NCCL_REFUSES}")
    _check_shared_gpus(group, ranks, call)
    _network.apply_network_settings()
    _agree_on_preflight(group, world_size, nodes, call)
    return _start(unique_id, rank, world_size, device, timeout, call, nodes=nodes, preflight_done=True)


_gather_attempts: dict[tuple[int, ...], int] = {}


def _gather_before_start(group, mine: tuple, timeout_s: float, call: str) -> list[tuple]:
    """Every rank's `mine`, indexed by group rank (collective). Gloo and other backends: an
    all_gather_object. NCCL: through the default store (no NCCL collective), keyed by the group's
    members and a count of these gathers, so that a later init() does not read stale entries."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    size = dist.get_world_size(group)
    store = None
    if dist.get_backend(group) == "nccl":
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # a torch without it: NCCL's own gather, as before
            store = None
    if store is None:
        gathered: list = [None] * size
        dist.all_gather_object(gathered, mine, group=group)
        return gathered
    members = tuple(dist.get_process_group_ranks(group) if group is not None else range(size))
    attempt = _gather_attempts.get(members, 0)
    _gather_attempts[members] = attempt + 1
    prefix = (f"pydatacopy/init/{hashlib.sha256(repr(members).encode()).hexdigest()[:16]}"
              f"/{attempt}/")
    store.set(prefix + str(dist.get_rank()), pickle.dumps(mine))
    keys = [prefix + str(member) for member in members]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as error:
        missing = [index for index, key in enumerate(keys) if not store.check([key])]
        raise _C.TimeoutError(
            f"{call}: rank(s) {', '.join(map(str, missing)) or '?'} of the group did not reach "
            f"init within {timeout_s:g} s (PYDATACOPY_INIT_TIMEOUT_S or timeout=): every rank "
            f"must call pydatacopy.init() ({type(error).__name__}: {error})") from None
    return [pickle.loads(store.get(key)) for key in keys]


def _refuse_unless_all_can_start(facts: Sequence[tuple], nccl: bool, call: str) -> None:
    """Refuse on every rank alike (all see the same `facts`: (problem, ranks per GPU, GPU) per
    group rank) when a rank cannot start, or when an nccl group would put ranks on one GPU."""
    refused = [rank for rank, (problem, _, _) in enumerate(facts) if problem]
    if refused:
        raise Error(f"{call}: NVSHMEM was not started on any rank, because on rank "
                    f"{', '.join(map(str, refused))} of the group: {facts[refused[0]][0]}")
    if not nccl:
        return
    settings = sorted({per_gpu for _, per_gpu, _ in facts})
    several = [rank for rank, (_, per_gpu, _) in enumerate(facts) if per_gpu and per_gpu > 1]
    shared = shared_gpus([RankInfo("", "", gpu, False, None) for _, _, gpu in facts])
    if several or shared:
        why = []
        if several:
            why.append(f"PYDATACOPY_RANKS_PER_GPU > 1 on rank {', '.join(map(str, several))}"
                       + (f" (the ranks disagree: {settings}; set it alike on every rank)"
                          if len(settings) > 1 else ""))
        if shared:
            why.append("; ".join(f"ranks {', '.join(map(str, m))} on GPU {facts[m[0]][2]}"
                                 for m in shared))
        raise Error(f"{call}: NVSHMEM was not started on any rank: {' and '.join(why)} put "
                    f"several ranks on one GPU, and the torch.distributed group's backend is "
                    f"nccl: {_NCCL_REFUSES_HOWTO}")


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
    _ops.refuse_tracing("finalize")
    timed_out = None
    _torch_utils.unbind()  # the calls' fast paths stop here; their checked paths say why
    _ops.drop_order_token()
    if _C.is_initialized():
        _ops.refuse_capture("finalize")
        try:
            _send_recv.teardown_send_recv()
            _symmetric.free_all_symmetric()
        except _C.TimeoutError as error:  # a peer did not come to the collective frees
            timed_out = error
            _symmetric.free_all_symmetric()  # now local only: nothing waits on the peer
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
    require_init("my_pe")
    return _C.my_pe()


def n_pes() -> int:
    """The number of PEs (processes) in the NVSHMEM job. Needs init()."""
    require_init("n_pes")
    return _C.n_pes()


# Fixed for the life of the process once initialised: torch.compile takes them as constants
# (torch._dynamo.assume_constant_result, by its attribute: importing torch._dynamo here would
# add about 2 s to `import pydatacopy`), so `peer = 1 - my_pe()` traces with no graph break.
my_pe._dynamo_marked_constant = True  # type: ignore[attr-defined]
n_pes._dynamo_marked_constant = True  # type: ignore[attr-defined]


def check_errors() -> None:
    """Raise what stream-ordered device-side work has reported since the last look: a timeout
    (TimeoutError, each timed-out PE once; calls with that PE keep refusing), a send/recv whose
    two sides disagreed on the byte count (Error: on the receiver once its recv has run, on the
    sender once the receiver has looked, even when the send had completed before), an
    all_to_all_v / MoE dispatch or combine refusal (Error, on the sender and on the receiver of a
    count over the buffer's capacity; a bad count or index, on the sender), or a put_blocks index
    out of range (Error)."""
    _send_recv.service_zero_copy()  # peers' zero-copy mapping requests, answered without waiting
    _C.check_device_errors()
    _send_recv.check_send_recv_refusals()
