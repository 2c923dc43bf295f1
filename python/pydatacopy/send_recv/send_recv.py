"""Two-sided transfers (the core's send_recv.cpp): send(), recv(), sendrecv() and group() of any
contiguous CUDA tensor, through the send/recv engine's symmetric staging (and zero-copy between
PEs that reach each other by load/store, docs/zero-copy.md). This module owns the engine's
lifetime: setup_send_recv() (init() calls it), teardown_send_recv() (finalize() does).
"""

from __future__ import annotations

import sys
import contextlib
import dataclasses
import threading
from typing import Iterator

import torch

from .. import _C, _torch_utils, ops
from .._limits import INT32_MAX
from ..ops import dispatch_modes as _dispatch_modes, dynamo_compiling as _dynamo_compiling, refuse_capture
from .._torch_utils import check_int, check_tensor as _check_tensor, keep_alive as _keep_alive
from .._torch_utils import nbytes as _nbytes, require_init as _require_init, resolve_stream as _stream
from .._torch_utils import stream_handle, timeout_seconds
from ..runtime import settings as _settings

Error = _C.Error
Tensor = torch.Tensor

_PE_MAX = INT32_MAX  # PEs cross to the core as C ints (it checks the range of live PEs)

# The fast paths of send, recv and sendrecv read these as globals of this module, as
# rma/transfer.py's do: _torch_utils.bind() and unbind() keep them equal to its own.
_device: int | None = None  # this process's CUDA device while initialised, else None
_n_pes = 0  # PEs while initialised, else 0 (every PE is then out of the fast path's range)
_torch_utils.keeps_bound_facts(__name__)
_raw_stream = _torch_utils.current_raw_stream  # torch's current cudaStream_t on a device

_engine: "_C.SendRecvEngine | None" = None
class _ThreadState(threading.local):
    # The open group()'s calls in this thread, else None. A class default: reading an attribute
    # that a thread never set would raise and catch AttributeError (0.45 us a call, measured).
    pending: dict | None = None
    # torch.distributed's Python group: what it queued on this thread, not launched yet
    # (distributed/work.py). A direct call launches it first: never overtakes it on a channel.
    # (The native backend's queue is the core's to launch: _C's direct calls do.)
    distributed_batch = None


_state = _ThreadState()

#: Called with True when a group() opens on this thread and with False when it closes: the native
#: torch.distributed backend's queue refuses operations inside one (distributed/native.py).
group_hooks: list = []


def _launch_distributed_batch() -> None:
    batch = _state.distributed_batch
    if batch is not None:
        _state.distributed_batch = None  # (also when another thread launched it already)
        batch.launch()
_SETUP = "pydatacopy.setup_send_recv"  # the call a config's errors name: the one that makes it


@dataclasses.dataclass(frozen=True)
class SendRecvConfig:
    """The send/recv staging's shape, every field checked here and nowhere else in Python (the
    core's SendRecvEngine::init checks again what it allocates by): bytes per chunk, chunks per
    peer, and the most thread blocks one message uses. Every PE must use the same."""

    chunk_bytes: int
    num_chunks: int
    blocks: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_int(field.name, getattr(self, field.name), *_settings.SEND_RECV_RANGES[field.name],
                      call=_SETUP)

    @classmethod
    def from_environment(cls, chunk_bytes: int | None = None, num_chunks: int | None = None,
                         blocks: int | None = None) -> "SendRecvConfig":
        """The arguments given, the rest from PYDATACOPY_CHUNK_BYTES, PYDATACOPY_NUM_CHUNKS and
        PYDATACOPY_SEND_BLOCKS, else the defaults (8 MiB, 4, 128). A bad variable is an Error
        naming the variable, even when its argument was given."""
        try:
            defaults = _settings.send_recv_settings()
        except _settings.SettingError as error:
            raise Error(f"{_SETUP}: {error}") from None
        return cls(defaults[0] if chunk_bytes is None else chunk_bytes,
                   defaults[1] if num_chunks is None else num_chunks,
                   defaults[2] if blocks is None else blocks)


def setup_send_recv(chunk_bytes: int | None = None, num_chunks: int | None = None,
                    blocks: int | None = None) -> None:
    """(Re)create the send/recv staging (collective; init() calls it with the defaults).

    Defaults: PYDATACOPY_CHUNK_BYTES (8 MiB), PYDATACOPY_NUM_CHUNKS (4 per peer),
    PYDATACOPY_SEND_BLOCKS (128: the most thread blocks one message uses; since one block
    drives its slice of both directions of a sendrecv, twice the 64 that scripts/sweep-send-recv.sh
    chose when each direction had blocks of its own, docs/perf-notes.md v6/v8). Messages under
    _C.NARROW_MESSAGE_BYTES (64 MiB) use at most PYDATACOPY_NARROW_SEND_BLOCKS
    (_C.DEFAULT_NARROW_SEND_BLOCKS, 32; 1024 cuts them as larger ones; read here from the
    environment; docs/perf-notes.md v25). Every PE must use the same settings.
    """
    global _engine
    ops.refuse_tracing("setup_send_recv")
    _require_init("setup_send_recv")
    refuse_capture("setup_send_recv")
    config = SendRecvConfig.from_environment(chunk_bytes, num_chunks, blocks)
    teardown_send_recv()
    engine = _C.SendRecvEngine()
    engine.init(config.chunk_bytes, config.num_chunks, config.blocks)
    _engine = engine
    _C.set_current_engine(engine)  # the torch.distributed backend's launches use it (torch_backend_api.h)


def check_send_recv_refusals() -> None:
    """A size mismatch a receiver found after this PE's send had completed (check_errors())."""
    engine = _engine
    if engine is not None:
        engine.check_refusals()


def teardown_send_recv() -> None:
    """Collective: release the send/recv staging (finalize() calls it)."""
    global _engine
    if _engine is not None:
        engine, _engine = _engine, None
        _C.set_current_engine(None)
        engine.cleanup()


def service_zero_copy() -> None:
    """Serve the peers' zero-copy mapping requests without waiting (check_errors() calls it;
    every send/recv call does it for its own peers)."""
    if _engine is not None:
        _engine.service_zero_copy()


def stats() -> dict[int, dict[str, int]]:
    """What this PE's send/recv calls did with each other PE since the engine was set up (init()
    or setup_send_recv()), by peer: ops finished by the path their bytes took
    (``send_one_copy``/``recv_one_copy``: zero-copy, from the sender's tensor straight into the
    receiver's; ``send_copy_engine``: those of ``send_one_copy`` the copy engine moved, see
    docs/zero-copy.md; ``*_staged``: through the receiver's staging, two copies; ``*_low_latency``:
    small messages, data and flags in the same stores), and the zero-copy bookkeeping with that peer:
    ``map_requests`` (receive allocations, or chunks of torch's expandable segments, this PE asked
    the peer to map), ``not_exportable`` (receive allocations whose memory cannot be exported,
    e.g. a cudaMallocAsync pool's: staged on purpose), ``refused`` (mappings the peer could not
    open), ``mapped_here`` (the peer's allocations or chunks this process mapped to send into).
    Ops are counted on the GPU when they end: synchronise first. Reads a few words from the GPU
    on a stream of the engine's own; not for a hot loop."""
    engine = _require_engine("stats")
    refuse_capture("stats")
    me = _C.my_pe()
    return {row.pop("peer"): row for row in engine.stats() if row["peer"] != me}


def zero_copy_min_bytes() -> int:
    """Messages of at least this many bytes between PEs that reach each other by load/store move
    once, from the sender's tensor into the receiver's (PYDATACOPY_ZERO_COPY_MIN_BYTES, default
    _C.DEFAULT_ZERO_COPY_MIN_BYTES, 16 MiB; 0: never). Needs the send/recv engine (init())."""
    return _require_engine("zero_copy_min_bytes").zero_copy_min_bytes


def set_zero_copy_min_bytes(nbytes: int) -> None:
    """Collective and blocking: every PE calls it with the same value, between its send/recv
    calls (the benchmark and tests use it; 0 turns zero-copy off). Raises on every PE alike when
    the values differ, changing nothing."""
    check_int("nbytes", nbytes, 0, 2**63 - 1, call="pydatacopy.set_zero_copy_min_bytes")
    refuse_capture("set_zero_copy_min_bytes")
    _require_engine("set_zero_copy_min_bytes").set_zero_copy_min_bytes(nbytes)


def copy_engine_min_bytes() -> int:
    """Zero-copy sends of at least this many bytes that do not fit the staging may be moved by
    the copy engine (PYDATACOPY_COPY_ENGINE_MIN_BYTES, default ``_C.DEFAULT_COPY_ENGINE_MIN_BYTES``;
    0: never): docs/zero-copy.md, "The copy engine". Needs the send/recv engine (init())."""
    return _require_engine("copy_engine_min_bytes").copy_engine_min_bytes


def set_copy_engine_min_bytes(nbytes: int) -> None:
    """Local, between this PE's calls (only a sender decides, so its peers need not call it; 0
    turns the copy engine off). A capture never takes the copy engine."""
    check_int("nbytes", nbytes, 0, 2**63 - 1, call="pydatacopy.set_copy_engine_min_bytes")
    refuse_capture("set_copy_engine_min_bytes")
    _require_engine("set_copy_engine_min_bytes").set_copy_engine_min_bytes(nbytes)


def copy_engine_status() -> str:
    """'on from N bytes', or 'off: ' and why (the setting, zero-copy off, or what CUDA refused
    when the copy engine's graph was built, set or launched: then those sends take the SM kernel)."""
    return _require_engine("copy_engine_status").copy_engine_status()


def low_latency_max_bytes() -> int:
    """Messages of at most this many bytes between PEs that reach each other by load/store (and
    not moving zero-copy) travel by the low-latency protocol: data and flags in the same stores,
    no handshake per message (PYDATACOPY_LOW_LATENCY_MAX_BYTES, default
    ``_C.DEFAULT_LOW_LATENCY_MAX_BYTES``, at most ``_C.LOW_LATENCY_CAPACITY_BYTES``; 0: never).
    Needs the send/recv engine (init())."""
    return _require_engine("low_latency_max_bytes").low_latency_max_bytes


def set_low_latency_max_bytes(nbytes: int) -> None:
    """Collective and blocking, as set_zero_copy_min_bytes: every PE calls it with the same value
    (at most ``_C.LOW_LATENCY_CAPACITY_BYTES``; 0 turns the protocol off), between its send/recv
    calls. A CUDA graph captured before keeps the path it was captured with: replaying it
    against calls issued after a change is refused as a mismatch. Raises on every PE alike when
    the values differ or one is out of range, changing nothing."""
    check_int("nbytes", nbytes, 0, 2**63 - 1, call="pydatacopy.set_low_latency_max_bytes")
    refuse_capture("set_low_latency_max_bytes")
    _require_engine("set_low_latency_max_bytes").set_low_latency_max_bytes(nbytes)


def _require_engine(what: str) -> "_C.SendRecvEngine":
    _require_init(what)
    if _engine is None:
        raise Error("send/recv staging is not set up: pydatacopy.init()/init_nvshmem() do it, "
                    "or call pydatacopy.setup_send_recv() on every PE")
    return _engine


def _submit(engine, is_send: bool, tensor: torch.Tensor, peer: int, stream, seconds: float) -> None:
    pending = _state.pending
    if pending is None:
        # The engine's send/recv are a batch of one; their scalar arguments cross for a fraction
        # of a list of tuples' conversion (0.6 us against 2 us where measured).
        handle = _stream(stream)
        _launch_distributed_batch()
        try:
            (engine.send if is_send else engine.recv)(tensor.data_ptr(), tensor.nbytes, peer, handle, seconds)
        finally:  # also when it raised: the core may have launched before refusing (a batch's others)
            _keep_alive(stream, tensor)
        return
    _queue(pending, is_send, tensor, _nbytes(tensor), peer, stream, _C.cuda_device() if _device is None else _device,
           seconds)


def _queue(pending: dict, is_send: bool, tensor: torch.Tensor, nbytes: int, peer: int, stream, device: int,
           seconds: float) -> None:
    """A send or recv inside group(), its arguments checked: queued for the group's launch."""
    # The stream is resolved here, where the call is made (torch.cuda.stream() inside the group
    # counts), not at the group's exit: that is where the caller ordered the tensor's producers.
    if stream is None:
        stream = pending["stream"]
    handle = stream_handle(stream, device)
    if pending["handle"] is None:
        pending["handle"] = handle
    elif pending["handle"] != handle:
        raise Error("pydatacopy.send/recv inside pydatacopy.group(): the group's operations run as "
                    f"one launch on one stream, but this call resolves to stream {handle:#x} and an "
                    f"earlier one to {pending['handle']:#x}; issue them on one stream (pass stream= "
                    "to group(), or make the calls under one torch.cuda.stream())")
    if stream is not None:
        pending["explicit"] = True  # _keep_alive's rule: tensors on a stream given explicitly
    pending["ops"].append((is_send, tensor.data_ptr(), nbytes, peer))
    pending["tensors"].append(tensor)
    pending["timeout"] = max(pending["timeout"], seconds)


@contextlib.contextmanager
def group(*, stream=None) -> Iterator[None]:
    """Issue the send()/recv() calls inside together, as one kernel launch, so that they run at
    the same time: a PE that sends and receives at once must group them (as with NCCL's group
    calls). Up to ``_C.MAX_GROUP_OPS`` (64) operations, any peers. The launch goes on the stream the calls were made
    on: ``stream=`` of group(), else each call's ``stream=``, else torch's current stream at the
    call; all of a group's calls must come to the same stream. Not traceable (torch.compile):
    use sendrecv there."""
    if _dynamo_compiling() or _dispatch_modes():
        ops.refuse_group()
    if _state.pending is not None:
        raise Error("pydatacopy.group() cannot be nested: issue all the sends and recvs in one "
                    "group() block")
    # What torch.distributed's backend queued before the group goes first (a dist.isend inside
    # the group stays after the group's earlier calls).
    _launch_distributed_batch()
    _C.flush_torch_backend_queue()
    _state.pending = {"stream": stream, "handle": None, "explicit": stream is not None, "ops": [],
                      "tensors": [], "timeout": 0.0}
    try:
        for hook in group_hooks:
            hook(True)
        yield
        pending = _state.pending
    finally:
        _state.pending = None
        for hook in group_hooks:
            hook(False)
    if not pending["ops"]:
        return
    handle = pending["handle"]
    try:
        _require_engine("group").batch(pending["ops"], handle, pending["timeout"])
    finally:
        # The launch may be on a stream that is no longer torch's current one (the calls were made
        # under torch.cuda.stream(s)): keep the tensors allocated until that stream is done with
        # them; also when batch() raised, as it launches the healthy ops before it reports a
        # refused one.
        if pending["explicit"] or handle != _stream(None):
            _keep_alive(handle, *pending["tensors"])


def send(tensor: torch.Tensor, dst_pe: int, *, stream=None, timeout: float | None = None) -> None:
    """Send a contiguous CUDA tensor of any dtype and size to `dst_pe`, which calls recv() with a
    tensor of the same number of bytes. Stream-ordered; no symmetric memory needed on either side.
    To send and receive at once, issue both inside ``with pydatacopy.group():`` (or sendrecv).

    Host cost (outside group(), default timeout): as put's, each tensor fact read once and one
    crossing into the core; anything else takes the checked path, with its errors."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.send(tensor, dst_pe, stream=stream, timeout=timeout)
    _one_way(True, tensor, dst_pe, stream, timeout)


def recv(tensor: torch.Tensor, src_pe: int, *, stream=None, timeout: float | None = None) -> None:
    """Receive into a contiguous CUDA tensor what `src_pe` sends with send() (same byte count).
    Host cost as send's."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.recv(tensor, src_pe, stream=stream, timeout=timeout)
    _one_way(False, tensor, src_pe, stream, timeout)


def _one_way(is_send: bool, tensor, peer, stream, timeout) -> None:
    """send's and recv's eager body: the fast path, else the checked one."""
    engine, device, seconds = _engine, _device, _torch_utils.default_timeout  # (read together: finalize)
    if (engine is not None and timeout is None and seconds is not None and type(peer) is int
            and 0 <= peer < _n_pes and isinstance(tensor, Tensor) and tensor.get_device() == device
            and tensor.is_contiguous() and _state.distributed_batch is None):
        pending = _state.pending
        if pending is not None:  # inside group(): queued as the checked path's _submit does, its checks passed here
            _queue(pending, is_send, tensor, tensor.nbytes, peer, stream, device, seconds)
            return
        handle = _raw_stream(device) if stream is None else stream_handle(stream, device)
        try:
            (_C.send_fast if is_send else _C.recv_fast)(engine, tensor.data_ptr(), tensor.nbytes, peer,
                                                        handle, seconds)
        finally:  # also when it raised after its launch (a timed-out peer, a byte-count mismatch)
            if stream is not None:
                _keep_alive(stream, tensor)
        return
    # The checked path: whatever the fast one did not take, with the error that says what to do.
    engine = _require_engine("send" if is_send else "recv")
    check_int("dst_pe" if is_send else "src_pe", peer, None, _PE_MAX)  # the core checks the range too
    _check_tensor(tensor, "tensor")
    _submit(engine, is_send, tensor, peer, stream, timeout_seconds(timeout))


def sendrecv(send_tensor: torch.Tensor, dst_pe: int, recv_tensor: torch.Tensor, src_pe: int, *,
             stream=None, timeout: float | None = None) -> None:
    """send() and recv() at the same time, in one kernel launch. Host cost as send's."""
    if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
        return ops.sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, stream=stream,
                             timeout=timeout)
    engine, device, n_pes, seconds = _engine, _device, _n_pes, _torch_utils.default_timeout
    if (engine is not None and timeout is None and seconds is not None and type(dst_pe) is int and 0 <= dst_pe < n_pes
            and type(src_pe) is int and 0 <= src_pe < n_pes
            and isinstance(send_tensor, Tensor) and isinstance(recv_tensor, Tensor)
            and send_tensor.get_device() == device and recv_tensor.get_device() == device
            and send_tensor.is_contiguous() and recv_tensor.is_contiguous()
            and _state.pending is None and _state.distributed_batch is None):
        handle = _raw_stream(device) if stream is None else stream_handle(stream, device)
        try:
            _C.sendrecv_fast(engine, send_tensor.data_ptr(), send_tensor.nbytes, dst_pe,
                             recv_tensor.data_ptr(), recv_tensor.nbytes, src_pe, handle, seconds)
        finally:  # also when it raised after its launch (one direction refused, the other launched)
            if stream is not None:
                _keep_alive(stream, send_tensor, recv_tensor)
        return
    engine = _require_engine("sendrecv")
    if _state.pending is not None:
        raise Error("pydatacopy.sendrecv() runs its pair itself: call it outside group(), or use "
                    "send() and recv() inside the group")
    check_int("dst_pe", dst_pe, None, _PE_MAX)  # the core checks the ranges, with the same words
    check_int("src_pe", src_pe, None, _PE_MAX)
    _check_tensor(send_tensor, "send_tensor")
    _check_tensor(recv_tensor, "recv_tensor")
    send_bytes, recv_bytes = _nbytes(send_tensor), _nbytes(recv_tensor)
    handle, seconds = _stream(stream), timeout_seconds(timeout)
    _launch_distributed_batch()
    try:
        engine.sendrecv(send_tensor.data_ptr(), send_bytes, dst_pe, recv_tensor.data_ptr(), recv_bytes,
                        src_pe, handle, seconds)
    finally:
        _keep_alive(stream, send_tensor, recv_tensor)


# The ops' real kernels run these, read from this module when they run (so a function swapped
# here is the one run); ops imports no feature, so the feature names itself.
ops.implement(sys.modules[__name__], "send", "recv", "sendrecv")
