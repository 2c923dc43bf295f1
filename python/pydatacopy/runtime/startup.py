"""Start-up and teardown: init(), init_nvshmem(), finalize(), and the calls of a running PE
(my_pe, n_pes, check_errors). The unique ID, device placement and the agreement between ranks
are unique_id.py, placement.py and agreement.py."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from .. import _C, _torch_utils, ops
from .._limits import INT32_MAX
from .._torch_utils import check_int, require_init, timeout_seconds
from ..ops import traced as _traced
from ..rma import symmetric as _symmetric
from ..send_recv import send_recv as _send_recv
from . import agreement as _agreement, network as _network, settings as _settings
from .placement import DeviceLike, _choose_device, _device_index
from .unique_id import UniqueIdLike, _id_to_list

Error = _C.Error

#: The variables pydatacopy set at import because they were unset (the doctor tells these apart
#: from the ones the user set): NVLink multicast can take shared GPUs down, so it stays off unless
#: a user asks for it by setting them.
SET_AT_IMPORT: dict[str, str] = {}
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    if _name not in os.environ:
        os.environ[_name] = SET_AT_IMPORT[_name] = _value


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
    ops.refuse_tracing(call.removeprefix("pydatacopy."))
    values = _id_to_list(root_unique_id, call)
    check_int("world_size", world_size, 1, INT32_MAX, call=call)
    check_int("rank", rank, 0, INT32_MAX, call=call)
    if rank >= world_size:
        raise Error(f"{call}: rank must be in [0, world_size={world_size}), got {rank}")
    device = _device_index(device, call)
    init_timeout = _init_timeout(timeout, call)
    ops.refuse_capture(call.removeprefix("pydatacopy."))
    if _C.is_initialized():
        pe = _C.init_nvshmem(values, rank, world_size, _C.cuda_device(), init_timeout)
        if _traced._order is None:
            ops.make_order_token(_C.cuda_device())
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
    _warn_staged_allocator()
    ops.make_order_token(device)  # what the traced calls order themselves by (ops/traced.py)
    return pe


def _warn_staged_allocator() -> None:
    """Said once per process: torch's cudaMallocAsync backend keeps every receive buffer staged
    (issue 36: the staged path chosen on purpose, and said)."""
    global _allocator_warned
    if _allocator_warned or _torch_utils.allocator_setting() != "cudaMallocAsync":
        return
    if _send_recv.zero_copy_min_bytes() == 0:
        return  # zero-copy off: nothing is lost
    _allocator_warned = True
    warnings.warn(f"pydatacopy: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: "
                  f"{_torch_utils.ALLOCATOR_ZERO_COPY['cudaMallocAsync']}", RuntimeWarning, stacklevel=3)


_allocator_warned = False


def _facts_before_start(rank: int, world_size: int, device: int | None, call: str) -> tuple:
    """What this rank checks alone before NVSHMEM starts (its environment, its device, chosen and
    set here unless given): (problem or None, PYDATACOPY_RANKS_PER_GPU, the GPU's identity, the
    device). A problem is returned, not raised: every rank must learn it and refuse alike."""
    problem, per_gpu, gpu = None, None, None
    try:
        _settings.check_environment(call)
        per_gpu = _settings.ranks_per_gpu()
        if device is None:
            device = _choose_device(rank, call, world_size)
        torch.cuda.set_device(device)
        gpu = _agreement._gpu_identity()
    except (Error, _settings.SettingError) as error:
        problem = str(error).removeprefix(f"{call}: ")
    except Exception as error:  # CUDA refused the device here (MPS busy, say): still agree
        problem = f"selecting the CUDA device failed: {type(error).__name__}: {error}"
    return problem, per_gpu, gpu, device


def init(group=None, *, device: DeviceLike = None, timeout: float | None = None) -> int:
    """Start NVSHMEM on every rank of a torch.distributed group (collective). Returns this PE.

    Rank 0 of `group` (default: the world) creates the ID; it travels through torch.distributed
    (under the group's own timeout, set by init_process_group); every rank checks it and joins.
    The CUDA device follows `choose_device` unless `device` (an index, ``"cuda:N"`` or a
    torch.device) is given. `timeout` bounds NVSHMEM's start (see init_nvshmem). The arguments
    and the environment are checked before anything starts. Calling it again is harmless.
    """
    import torch.distributed as dist

    ops.refuse_tracing("init")
    call = "pydatacopy.init"
    device = _device_index(device, call)
    _init_timeout(timeout, call)
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{call} needs torch.distributed: call torch.distributed.init_process_group() "
                    "first (torchrun sets its environment), or use get_unique_id()/init_nvshmem()")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    ops.refuse_capture("init")
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
    problem, per_gpu, gpu, device = _facts_before_start(rank, world_size, device, call)
    facts = _agreement._gather_before_start(group, (problem, per_gpu, gpu), _init_timeout(timeout, call),
                                            call)
    _agreement._refuse_unless_all_can_start(facts, dist.get_backend(group) == "nccl", call)
    unique_id, ranks = _agreement._share_unique_id_and_ranks(group)
    nodes = len({r.host for r in ranks})
    if dist.get_backend(group) == "nccl" and _agreement.shared_gpus(ranks):  # NCCL let it pass: say so anyway
        raise Error(f"{call}: {_agreement._NCCL_REFUSES}")
    _agreement._check_shared_gpus(group, ranks, call)
    _network.apply_network_settings()
    _agreement._agree_on_preflight(group, world_size, nodes, call)
    return _start(unique_id, rank, world_size, device, timeout, call, nodes=nodes, preflight_done=True)


def start_from_store(store, rank: int, world_size: int, *, timeout: float | None = None,
                     call: str = "pydatacopy.distributed") -> int:
    """init() for a process group that is being created (the torch.distributed backend,
    pydatacopy.distributed): the same checks and agreement as init(), through the group's c10d
    `store`, since the group cannot run collectives before it exists. Collective over the
    `world_size` ranks that share `store`; returns this PE (== rank). A process that already
    started NVSHMEM (pydatacopy.init()) as PE `rank` of `world_size` shares it."""
    ops.refuse_tracing(call.removeprefix("pydatacopy."))
    seconds = _init_timeout(timeout, call)
    if _C.is_initialized():
        if (_C.my_pe(), _C.n_pes()) != (rank, world_size):
            raise Error(f"{call}: NVSHMEM already runs in this process as PE {_C.my_pe()} of "
                        f"{_C.n_pes()}, which is not rank {rank} of {world_size} of this group; "
                        "create the pydatacopy backend on the default group, or call "
                        "pydatacopy.finalize() first")
        return _C.my_pe()
    ops.refuse_capture(call.removeprefix("pydatacopy."))
    exchange = _agreement.StoreExchange(store, rank, world_size, seconds, call)
    problem, per_gpu, gpu, device = _facts_before_start(rank, world_size, None, call)
    _agreement._refuse_unless_all_can_start(exchange.gather("facts", (problem, per_gpu, gpu)), False, call)
    unique_id, ranks = exchange.share_unique_id_and_ranks()
    nodes = len({r.host for r in ranks})
    _agreement.check_shared_gpu_verdict(ranks, rank == 0, call)
    _network.apply_network_settings()
    exchange.agree_on_preflight(world_size, nodes)
    return _start(unique_id, rank, world_size, device, timeout, call, nodes=nodes, preflight_done=True)


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
    ops.refuse_tracing("finalize")
    timed_out = None
    _torch_utils.unbind()  # the calls' fast paths stop here; their checked paths say why
    ops.drop_order_token()
    if _C.is_initialized():
        ops.refuse_capture("finalize")
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
