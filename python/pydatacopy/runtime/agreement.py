"""Rank agreement before NVSHMEM starts: the unique ID's broadcast and check, what every rank
learns about the others (host, GPU, MPS), and the verdicts (shared GPUs, the remote-transport
preflight) that every rank reaches alike, so that NVSHMEM starts on all ranks or on none."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import NamedTuple, Sequence

import torch

from .. import _C
from . import network as _network, probes as _probes, settings as _settings
from .unique_id import _id_to_list, get_unique_id

Error = _C.Error


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

    check_shared_gpu_verdict(ranks, dist.get_rank(group) == 0, call)


def check_shared_gpu_verdict(ranks: Sequence[RankInfo], warn_here: bool, call: str) -> None:
    """shared_gpu_verdict's refusal raised (every rank alike), its warnings given where `warn_here`."""
    ignore = _settings.nvshmem_bool(os.environ.get("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0"))
    refusal, notes = shared_gpu_verdict(ranks, ignore)
    if refusal:
        raise Error(f"{call}: NVSHMEM was not started on any rank: {refusal}")
    if notes and warn_here:
        for note in notes:
            warnings.warn(f"{call}: {note}", RuntimeWarning, stacklevel=4)


_gather_attempts: dict[tuple[int, ...], int] = {}


def _gather_before_start(group, mine: tuple, timeout_s: float, call: str) -> list[tuple]:
    """Every rank's `mine`, indexed by group rank (collective). Gloo and other backends: an
    all_gather_object. NCCL: through the default store (no NCCL collective), keyed by the group's
    members and a count of these gathers, so that a later init() does not read stale entries."""
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
    return _store_gather(
        store, [prefix + str(member) for member in members], prefix + str(dist.get_rank()), mine, timeout_s,
        lambda missing, error: (
            f"{call}: rank(s) {missing} of the group did not reach init within {timeout_s:g} s "
            f"(PYDATACOPY_INIT_TIMEOUT_S or timeout=): every rank must call pydatacopy.init() "
            f"({type(error).__name__}: {error})"))


def _store_gather(store, keys: list[str], my_key: str, mine, timeout_s: float, late) -> list:
    """Every key's value once all are set, this rank's `mine` under `my_key` (collective through
    the c10d `store`). When some do not come within `timeout_s`: TimeoutError with the text
    late(missing, error), `missing` the late keys' indices in `keys` as text ('?' if none)."""
    import pickle
    from datetime import timedelta

    store.set(my_key, pickle.dumps(mine))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as error:
        missing = [index for index, key in enumerate(keys) if not store.check([key])]
        raise _C.TimeoutError(late(", ".join(map(str, missing)) or "?", error)) from None
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

    verdicts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, _preflight_here(world_size, nodes, call), group=group)
    _refuse_unless_preflight_passed(verdicts, call)


def _preflight_here(world_size: int, nodes: int, call: str) -> str | None:
    """This rank's remote-transport preflight: None, or why it refuses."""
    try:
        _network.check_transport_preconditions(world_size, call=call, nodes=nodes)
        return None
    except Error as error:
        return str(error).removeprefix(f"{call}: ")
    except Exception as error:  # the check itself failed here (sysfs, a loader): still agree
        return f"the remote-transport check failed: {type(error).__name__}: {error}"


def _refuse_unless_preflight_passed(verdicts: Sequence[str | None], call: str) -> None:
    refused = [rank for rank, verdict in enumerate(verdicts) if verdict]
    if refused:
        raise Error(f"{call}: NVSHMEM was not started on any rank, because on rank "
                    f"{', '.join(map(str, refused))} of the group: {verdicts[refused[0]]}")


class StoreExchange:
    """What init() agrees on through its group's collectives, through a c10d store instead: for a
    process group that is being created (pydatacopy.distributed's backend), which cannot run
    collectives yet. Keys live under the store's own prefix (torch gives each group's backend a
    prefix store) and the number of this exchange among this rank's on that store, counted in the
    store: every rank of the group makes the same exchanges on it, whatever other groups it made
    (a process-wide count would differ between ranks that joined different subgroups)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, call: str) -> None:
        self.store, self.rank, self.size, self.timeout_s, self.call = store, rank, size, timeout_s, call
        number = store.add(f"pydatacopy/exchanges/{rank}", 1)
        self.prefix = f"pydatacopy/start/{number}/"

    def gather(self, name: str, mine) -> list:
        """Every rank's `mine`, indexed by rank (collective)."""
        return _store_gather(
            self.store, [f"{self.prefix}{name}/{rank}" for rank in range(self.size)],
            f"{self.prefix}{name}/{self.rank}", mine, self.timeout_s,
            lambda missing, error: (
                f"{self.call}: rank(s) {missing} did not come within {self.timeout_s:g} s "
                f"(PYDATACOPY_INIT_TIMEOUT_S): every rank of the group must create it "
                f"({type(error).__name__}: {error})"))

    def share_unique_id_and_ranks(self) -> tuple[list[int], list[RankInfo]]:
        """Rank 0's unique ID to every rank, and what each rank is (_share_unique_id_and_ranks)."""
        unique_id = _id_to_list(self.gather("id", get_unique_id() if self.rank == 0 else None)[0], self.call)
        digest = hashlib.sha256(bytes(unique_id)).hexdigest()
        ranks = [RankInfo(*entry) for entry in self.gather("ranks", tuple(_this_rank(digest)))]
        if len({rank.digest for rank in ranks}) != 1:
            raise Error(f"{self.call}: ranks received different NVSHMEM unique IDs through the "
                        "group's store; create the group once on every rank")
        return unique_id, ranks

    def agree_on_preflight(self, world_size: int, nodes: int) -> None:
        _refuse_unless_preflight_passed(self.gather("preflight", _preflight_here(world_size, nodes, self.call)),
                                        self.call)
