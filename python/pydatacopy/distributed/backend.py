"""The torch.distributed backend "pydatacopy": a process group whose CUDA point-to-point calls
(send, recv, isend, irecv, batch_isend_irecv), all_to_all_single and barrier move through
pydatacopy, and whose CPU tensors go to a gloo group made from the same store.

torch.distributed (2.11 on) takes a Python backend only as a whole ProcessGroup (its Backend has
no Python constructor there), which then replaces the group on every device: so CPU tensors are
delegated to gloo here, and "cpu:gloo,cuda:pydatacopy" keeps gloo's CPU semantics. By default
the creator returns the native c10d::Backend instead (native.py; PYDATACOPY_DISTRIBUTED_NATIVE=0
asks for this class as the group), torch keeps its own group around it, and this class serves
it as its delegate.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _C
from ..runtime import agreement as _agreement, startup as _startup
from ..send_recv import send_recv as _send_recv
from . import native as _native, work as _work

Error = _C.Error

BACKEND_NAME = "pydatacopy"

# What each collective a CUDA tensor cannot take on this backend should use instead.
_REDUCTIONS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base",
               "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
_GATHERS = ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
            "all_gather_single", "all_gather_single_coalesced", "broadcast", "gather", "gather_into_tensor",
            "gather_single", "scatter", "alltoall")
_HOST_ONLY = ("monitored_barrier",)
_ALTERNATIVES = {
    **{name: "reductions need NCCL: make a second group for them, dist.new_group(backend='nccl') (or keep "
             "this one for the moves and NCCL as the default)" for name in _REDUCTIONS},
    **{name: "move the pieces with send/recv or all_to_all_single on this backend, or use NCCL for this "
             "collective (dist.new_group(backend='nccl'))" for name in _GATHERS},
    **{name: "monitored_barrier runs on gloo's CPU side only" for name in _HOST_ONLY},
}


def _tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _delegate_or_refuse(name: str):
    """A collective this backend leaves to gloo for CPU tensors and refuses for CUDA ones, with
    an error that names what to use."""

    def collective(self, *args, **kwargs):
        self._queue.flush()
        tensors = _tensors_in(list(args) + list(kwargs.values()))
        if any(t.is_cuda for t in tensors):
            raise Error(_refusal(name))
        return getattr(self._cpu, name)(*args, **kwargs)

    collective.__name__ = name
    return collective


def _refusal(name: str) -> str:
    """The error a collective this backend does not move gives for CUDA tensors."""
    alternative = _ALTERNATIVES.get(name, "use NCCL for it (dist.new_group(backend='nccl'))")
    return (f"torch.distributed {name} on CUDA tensors: the pydatacopy backend moves CUDA tensors with "
            f"send, recv, isend, irecv, batch_isend_irecv, all_to_all_single and barrier only; {alternative}")


class ProcessGroupPydatacopy(dist.ProcessGroup):
    """One torch.distributed group on the pydatacopy backend (made by torch through
    register_backend; see pydatacopy.distributed).

    Two roles: the native backend's delegate (native.py; the default), which calls it for what
    is not the hot path (refusals, all_to_all_single, barrier, CPU tensors) with the native
    queue as `queue`; or torch's group itself (PYDATACOPY_DISTRIBUTED_NATIVE=0, and wherever the
    native backend cannot be built; its queue is work.py's)."""

    # batch_isend_irecv asks this of the group's backend (torch 2.12 on): the backend coalesces
    # by itself (work.py), not through torch's coalescing manager.
    supports_coalescing = False
    # init_process_group(device_id=...) asks this of the group's backend: no split groups.
    supports_splitting = False

    def __init__(self, store, rank: int, size: int, timeout: timedelta, global_ranks: list[int],
                 queue=None) -> None:
        super().__init__(rank, size)
        # Where sends and recvs queue: work.py's functions, or the native backend's Queue.
        self._queue = _work if queue is None else queue
        self._rank, self._size = rank, size
        # The group's ranks as PEs (the default group's are the PEs themselves).
        self._pes = list(global_ranks) if global_ranks else list(range(size))
        self._timeout_s = _timeout_seconds(timeout)
        # CPU tensors: a gloo group over the same ranks, keyed apart in the group's store.
        self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("pydatacopy-cpu/", store), rank, size, timeout)

    # ---- what torch asks of every group ---------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def _get_backend(self, device):
        return self

    # torch sets a group's name and description on its backends, and a Python group has none:
    # without these, group.group_name raises "ProcessGroup name not set" (torch 2.14's pipelining
    # schedules key their batches by it).
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's names
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return getattr(self, "_group_desc", "")

    def shutdown(self) -> None:
        """destroy_process_group: what this thread queued is launched first (its peers may be
        waiting for it), as NCCL's operations are in flight before a group goes."""
        self._queue.flush()

    def set_timeout(self, timeout: timedelta) -> None:
        """dist.set_timeout (torch 2.12+): the timeout of this group's later calls, gloo's too."""
        self._timeout_s = _timeout_seconds(timeout)
        set_gloo = getattr(self._cpu, "_set_default_timeout", None)
        if set_gloo is not None:
            set_gloo(timeout)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ---- point to point ------------------------------------------------------------------
    def _peer(self, group_rank: int, call: str) -> int:
        if not isinstance(group_rank, int) or not 0 <= group_rank < self._size:
            raise Error(f"torch.distributed {call}: rank {group_rank} is not in this group of "
                        f"{self._size} ranks")
        if group_rank == self._rank:
            raise Error(f"torch.distributed {call}: rank {group_rank} is this rank; a rank does not "
                        "send to or receive from itself (copy the tensor instead)")
        return self._pes[group_rank]

    def _p2p(self, is_send: bool, tensors: list[torch.Tensor], group_rank: int, in_batch: bool = False):
        call = "send" if is_send else "recv"
        if len(tensors) != 1:
            raise Error(f"torch.distributed {call}: one tensor per call on the pydatacopy backend, "
                        f"got {len(tensors)}")
        tensor = tensors[0]
        if not tensor.is_cuda:
            if not in_batch:  # inside a batch its CUDA operations stay queued: one launch at its end
                self._queue.flush()
            return (self._cpu.send if is_send else self._cpu.recv)(tensors, group_rank, 0)
        if tensor.get_device() != _C.cuda_device():
            raise Error(f"torch.distributed {call}: the tensor is on {tensor.device}, but this "
                        f"process runs pydatacopy on cuda:{_C.cuda_device()}; move it there first")
        if not tensor.is_contiguous():
            raise Error(f"torch.distributed {call}: the tensor must be contiguous (.contiguous())")
        return self._queue.queue(is_send, tensor, self._peer(group_rank, call), self._timeout_s)

    def send(self, tensors, dstRank: int, tag: int = 0):  # noqa: N803 - torch's names
        """Queued, then launched with the others of this thread as one group (work.py). `tag`
        is accepted and not matched: as with NCCL, messages between two ranks match in order."""
        return self._p2p(True, tensors, dstRank)

    def recv(self, tensors, srcRank: int, tag: int = 0):  # noqa: N803 - torch's names
        return self._p2p(False, tensors, srcRank)

    # The native backend's, inside a coalesced batch (batch_isend_irecv).
    def send_in_batch(self, tensors, dstRank: int, tag: int = 0):  # noqa: N803
        return self._p2p(True, tensors, dstRank, in_batch=True)

    def recv_in_batch(self, tensors, srcRank: int, tag: int = 0):  # noqa: N803
        return self._p2p(False, tensors, srcRank, in_batch=True)

    def recv_anysource(self, tensors, tag: int = 0):
        if all(not t.is_cuda for t in tensors):
            self._queue.flush()
            return self._cpu.recv_anysource(tensors, tag)
        raise Error("torch.distributed recv from any source: the pydatacopy backend receives CUDA "
                    "tensors from a named rank only (src=...); receive CPU tensors from any "
                    "source on gloo")

    # ---- all to all ----------------------------------------------------------------------
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes,  # noqa: A002
                      input_split_sizes, opts=None):
        """dist.all_to_all_single: rows of `input` (split along dim 0) to every rank, as one
        pydatacopy group of sends and recvs on the current stream; this rank's own rows by a copy
        on that stream."""
        self._queue.flush()
        if not (output.is_cuda or input.is_cuda):
            return self._cpu.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                           opts or dist.AllToAllOptions())
        call = "all_to_all_single"
        for name, tensor in (("output", output), ("input", input)):
            if not tensor.is_cuda or tensor.get_device() != _C.cuda_device():
                raise Error(f"torch.distributed {call}: {name} is on {tensor.device}; both tensors "
                            f"must be on cuda:{_C.cuda_device()}, this process's pydatacopy device")
            if not tensor.is_contiguous():
                raise Error(f"torch.distributed {call}: {name} must be contiguous (.contiguous())")
        if output.dtype != input.dtype:
            raise Error(f"torch.distributed {call}: output is {output.dtype} and input {input.dtype}; "
                        "use one dtype")
        send_rows = self._splits(input, list(input_split_sizes or []), call, "input")
        recv_rows = self._splits(output, list(output_split_sizes or []), call, "output")
        # A row's bytes from the shape, not from the size: a rank may send or receive no row.
        send_row_bytes = input.element_size() * math.prod(input.shape[1:])
        recv_row_bytes = output.element_size() * math.prod(output.shape[1:])
        if send_row_bytes != recv_row_bytes:
            raise Error(f"torch.distributed {call}: a row of input is {send_row_bytes} bytes and a "
                        f"row of output {recv_row_bytes}; rows (dim 0) must have one size")
        flat_in, flat_out = input.view(-1).view(torch.uint8), output.view(-1).view(torch.uint8)
        send_at = _offsets(send_rows, send_row_bytes)
        recv_at = _offsets(recv_rows, recv_row_bytes)
        me = self._rank
        if send_rows[me] != recv_rows[me]:
            raise Error(f"torch.distributed {call}: this rank sends {send_rows[me]} rows to itself "
                        f"but expects {recv_rows[me]}")
        if send_rows[me]:
            flat_out[recv_at[me]:recv_at[me] + recv_rows[me] * recv_row_bytes].copy_(
                flat_in[send_at[me]:send_at[me] + send_rows[me] * send_row_bytes])
        # Peers in batches by shift (rank + s sent to, rank - s received from, for s in a batch):
        # every rank cuts the shifts alike, so no batch waits on a later one of another rank.
        shifts = list(range(1, self._size))
        per_batch = max(1, _C.MAX_GROUP_OPS // 2)
        last = None
        # (The queue is empty at each batch: flushed above, then each batch launched by result().)
        for first in range(0, len(shifts), per_batch):
            for shift in shifts[first:first + per_batch]:
                to, source = (me + shift) % self._size, (me - shift) % self._size
                self._queue.queue(True, flat_in[send_at[to]:send_at[to] + send_rows[to] * send_row_bytes],
                                  self._pes[to], self._timeout_s)
                last = self._queue.queue(
                    False, flat_out[recv_at[source]:recv_at[source] + recv_rows[source] * recv_row_bytes],
                    self._pes[source], self._timeout_s)
            last.result()  # launches this batch; raises a refusal at once
        return self._queue.batch_work(last, output) if last is not None else self._queue.done_work([output])

    all_to_all_single = alltoall_base

    def _splits(self, tensor: torch.Tensor, splits: list[int], call: str, name: str) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else 1
        if not splits:
            if rows % self._size:
                raise Error(f"torch.distributed {call}: {name} has {rows} rows, not a multiple of "
                            f"the group's {self._size} ranks; pass {name}_split_sizes")
            return [rows // self._size] * self._size
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise Error(f"torch.distributed {call}: {name}_split_sizes {splits} must be {self._size} "
                        f"sizes >= 0 summing to {name}'s {rows} rows")
        return splits

    # ---- barrier -------------------------------------------------------------------------
    def barrier(self, opts=None):
        """Every rank of the group meets (on the host, through gloo), after this rank's queued
        operations are launched and its current stream's work is done (NCCL's barrier blocks the
        host until then too)."""
        self._queue.flush()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # as NCCL's barrier: this rank's GPU work done
        self._cpu.barrier(opts or dist.BarrierOptions()).wait()
        return self._queue.done_work([])

    # ---- everything else: CPU tensors to gloo, CUDA ones refused with what to use -----------
    for _name in _ALTERNATIVES:
        locals()[_name] = _delegate_or_refuse(_name)
    del _name



def _offsets(rows: list[int], row_bytes: int) -> list[int]:
    at, total = [], 0
    for count in rows:
        at.append(total)
        total += count * row_bytes
    return at


def _timeout_seconds(timeout) -> float:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) if timeout is not None else _C.default_timeout_seconds()
    if not math.isfinite(seconds) or seconds <= 0:
        return _C.default_timeout_seconds()
    return min(seconds, _C.MAX_TIMEOUT_S)


def _start_runtime(store, rank: int, size: int, timeout_s: float) -> None:
    """NVSHMEM and the send/recv engine, started through the default group's store (a process
    that already called pydatacopy.init() as this rank keeps its runtime)."""
    _startup.start_from_store(store, rank, size, timeout=timeout_s, call="pydatacopy.distributed")


def _this_pe() -> tuple[int, int]:
    """(this process's PE, the job's PEs) of the running NVSHMEM."""
    return _C.my_pe(), _C.n_pes()


def _runtime_running() -> bool:
    return _C.is_initialized()


# Set once a group of this process fell back to the Python group for a peer without the native
# backend: the process's later groups are Python ones too (every rank of such a group reports
# none, so its peers follow).
_python_only = False


def create_process_group(options, backend_options=None) -> ProcessGroupPydatacopy:
    """register_backend's creator (extended_api=True): `options` carries the group's store, rank,
    size, timeout and global ranks (empty for the default group)."""
    global _python_only
    store, rank, size = options.store, options.group_rank, options.group_size
    timeout = options.timeout
    global_ranks = list(getattr(options, "global_ranks_in_group", []) or [])
    starts_runtime = not _runtime_running()
    if starts_runtime:
        # NVSHMEM starts with the default group (torch passes it no global ranks), or with a group
        # of every rank in the default group's order; never on a part of the job.
        world = dist.get_world_size() if dist.is_initialized() else size
        if global_ranks and global_ranks != list(range(world)):
            raise Error(f"pydatacopy.distributed: a group of ranks {global_ranks} on the pydatacopy "
                        "backend needs NVSHMEM running on every rank: create the default group on "
                        "this backend (init_process_group('cpu:gloo,cuda:pydatacopy')) or call "
                        "pydatacopy.init() on every rank first")
    # The native backend (its setting read, its build, about 20 s once) before the ranks wait for
    # each other at the store, and before NVSHMEM starts on a setting that is refused.
    native = None if _python_only else _native.load()
    if starts_runtime:
        _start_runtime(store, rank, size, _timeout_seconds(timeout))
    # The group's ranks are PEs: agreed through the group's store, so that a numbering that
    # differs (NVSHMEM started by init_nvshmem with other ranks) is refused on every rank alike.
    # So is the implementation: the native backend and the Python group batch differently (one
    # Work and a launch at a batch's end, or a queue until the first wait), so a rank whose build
    # failed would leave its peers waiting: every rank is native, or none is.
    want = global_ranks or list(range(size))
    exchange = _agreement.StoreExchange(store, rank, size, _timeout_seconds(timeout), "pydatacopy.distributed")
    pes = exchange.gather("pes", _this_pe())
    wrong = [r for r, (pe, n_pes) in enumerate(pes) if pe != want[r] or n_pes <= max(want)]
    if wrong:
        raise Error(f"pydatacopy.distributed: rank {wrong[0]} of this group is global rank "
                    f"{want[wrong[0]]} but runs NVSHMEM as PE {pes[wrong[0]][0]} of {pes[wrong[0]][1]}; "
                    "the backend needs PE == global rank (start NVSHMEM with pydatacopy.init() on "
                    "the default group, or let the backend start it)")
    without = [r for r, built in enumerate(exchange.gather("native", native is not None)) if not built]
    if native is not None and without:
        warnings.warn(f"pydatacopy.distributed: rank(s) {without} of this group run the Python process "
                      "group (the native backend was not built or not asked for there: their warning "
                      "says why), so this rank does too, in this group and the later ones (about 5 us "
                      "more host time a call)", stacklevel=2)
        # For the process's later groups too: a process with groups of both kinds would keep two
        # queues, which do not launch each other first, over the same channels.
        native, _python_only = None, True
    if native is None:
        return ProcessGroupPydatacopy(store, rank, size, timeout, global_ranks)
    device = _native_device(native)
    delegate = ProcessGroupPydatacopy(store, rank, size, timeout, global_ranks, queue=native.Queue(device))
    return native.Backend(rank, size, delegate._pes, delegate._timeout_s, device, delegate)


def _native_device(native):
    """This process's device for the native backend: its CUDA device, the core reached through
    _C's table (tests/test_distributed_native_cpu.py replaces it with the module's FakeDevice)."""
    _send_recv._require_engine("distributed")  # set up now; launches use the current one
    return native.cuda_device(_C.cuda_device(), _C.torch_backend_api())


def register() -> None:
    """Register the backend with torch.distributed (import pydatacopy.distributed does it)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    # Both devices: a group made as plain "pydatacopy" gets this backend for CPU tensors too, and
    # sends them to its gloo group; "cpu:gloo,cuda:pydatacopy" gives them to torch's gloo.
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
