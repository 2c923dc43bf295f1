"""The backend's point-to-point operations: queued, then launched together as one group.

torch.distributed hands a Python process group one send()/recv() per operation, with no start or
end of a batch (batch_isend_irecv coalesces only for torch's own class). Launching each alone
would deadlock a batch whose sends wait for their receives (a zero-copy send, or one larger than
the staging): so the operations queue here and the queue is launched as one pydatacopy group (one
kernel) when its result is first asked for: a Work's wait(), is_completed(), result(),
get_future() or synchronize(); or when any other call of the backend comes (a collective, a
barrier), or an operation on another stream. More than MAX_GROUP_OPS (64) operations queued
without a wait are refused: split at the 64th, the two launches could wait on each other
across ranks until the timeout.

The queue is this thread's, shared by every group of the backend (their operations are one
process's, and its channels to each peer are shared). A launch goes on the stream that was current
when the first queued operation was called, as NCCL's Work is ordered after the caller's stream:
the kernel starts after what the caller had issued on that stream by the time of the launch.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _C
from .._torch_utils import current_raw_stream, keep_alive
from ..runtime import startup as _startup
from ..send_recv import send_recv as _send_recv

Error = _C.Error

_MAX_OPS = _C.MAX_GROUP_OPS

#: The queue's refusals, once: this module raises them, and the native backend
#: (src/torch_backend/backend.cpp) is given them when it is loaded (native.py).
MESSAGES = {
    "captured_not_waited": (
        "torch.distributed send/recv on the pydatacopy backend: operations queued during a CUDA graph "
        "capture were not waited for before the capture ended, so they are not in the graph: call wait() "
        "on each Work inside the capture (nothing was sent or received)"),
    "pending_at_capture": (
        "torch.distributed send/recv on the pydatacopy backend: these operations were queued and not "
        "waited for before a CUDA graph capture began, so they were not sent or received: wait() on "
        "each Work before the capture"),
    "too_many_queued": (
        f"torch.distributed send/recv on the pydatacopy backend: more than {_MAX_OPS} operations queued "
        f"without a wait (a batch launches as one group of at most {_MAX_OPS}), so the batch was dropped "
        "whole: nothing of it was sent or received. Wait on the Works of a batch_isend_irecv before "
        "issuing more, or split it (on every rank alike)"),
    "abandoned_batch": (
        "torch.distributed batch_isend_irecv on the pydatacopy backend: an earlier batch on this thread "
        "raised before its end, so the operations it had queued were dropped: nothing of them was sent "
        "or received"),
    "memory_freed_before_launch": (
        "torch.distributed send/recv on the pydatacopy backend: a queued tensor's memory was freed or "
        "resized in place (storage.resize_) before its batch was launched, so the batch was dropped "
        "whole: nothing of it was sent or received. Keep a tensor's memory until its Work is waited on"),
    "eager_waited_in_capture": (
        "torch.distributed Work.wait()/get_future() on the pydatacopy backend: this Work's operations were launched "
        "before the CUDA graph capture began, so waiting for them cannot be part of the graph: wait() "
        "on it before the capture"),
    "inside_group": (
        "torch.distributed send/recv on the pydatacopy backend cannot be issued inside pydatacopy.group(): "
        "the group launches at its end, so the two would reach a peer out of the program's order. Issue "
        "them before or after the group, or use pydatacopy.send/recv inside it"),
    "wait_timed_out": "torch.distributed Work.wait: the pydatacopy send/recv did not finish within the timeout",
    "completed_in_capture": (
        "torch.distributed Work.is_completed() on the pydatacopy backend cannot be asked during a CUDA "
        "graph capture (the work runs when the graph is replayed): call wait()"),
    "no_source_rank": (
        "torch.distributed Work.source_rank(): the pydatacopy backend receives from a named rank only "
        "(no recv from any source), so there is no source to report"),
}


class _Batch:
    """Operations queued on one stream, launched once as one group."""

    __slots__ = ("ops", "tensors", "storages", "stream", "device", "timeout_s", "launched", "error", "event",
                 "captured", "launching", "launcher")

    def __init__(self, stream: int, device: int, timeout_s: float, captured: bool) -> None:
        self.ops: list[tuple[bool, int, int, int]] = []  # (is_send, address, bytes, PE)
        self.tensors: list[torch.Tensor] = []
        # The memory itself, until the batch goes: a caller may swap a queued tensor's storage
        # out (Megatron's deallocate_output_tensor: out.data = torch.empty(1)) before the launch,
        # and the allocator would give the old memory to the next kernel on the stream.
        self.storages: list = []
        self.stream, self.device, self.timeout_s = stream, device, timeout_s
        self.launched = False
        self.error: BaseException | None = None
        self.event: torch.cuda.Event | None = None  # recorded after the launch, when asked for
        self.captured = captured  # queued during a CUDA graph capture: launched inside it, or refused
        # Held through the launch: a Work of the batch waited on by another thread meanwhile waits
        # for it (its refusal, or the kernel queued before its event), as the native batch's mutex.
        self.launching = threading.Lock()
        self.launcher: int | None = None  # the thread launching it

    def launch(self) -> None:
        """Launch the batch (once): one kernel for all its operations. A refusal raised by the
        core (a timed-out peer, an earlier size mismatch) is kept for the Works to raise: the
        core launched the healthy operations before it raised."""
        me = threading.get_ident()
        with _launch_lock:  # a Work may be waited on by another thread than the one that queued it
            launcher, first = self.launcher, not self.launched
            if first:
                self.launched, self.launcher = True, me
                self.launching.acquire()
        if _queue.distributed_batch is self:
            _queue.distributed_batch = None
        if not first:
            if launcher is not None and launcher != me:
                with self.launching:  # until that thread's launch (or refusal) is done
                    pass
            return
        try:
            # Whoever launches (a wait, another call's flush), the batch's own stream decides; an eager
            # batch is not launched from inside a capture either (on its stream it would be recorded,
            # not run; on another, a capture in global mode forbids what an eager launch may do).
            capturing = _stream_capturing(self.stream)
            if (not capturing) if self.captured else (capturing or _capturing()):
                self.error = Error(MESSAGES["captured_not_waited" if self.captured else "pending_at_capture"])
                return
            if not _memory_still_held(self.ops, self.storages):
                self.error = Error(MESSAGES["memory_freed_before_launch"])
                return
            try:
                _launch_on_engine(self.ops, self.stream, self.timeout_s)
            except BaseException as error:  # every Work of the batch reports it, not only this caller
                self.error = error
                if not isinstance(error, Exception):
                    raise
            finally:
                # As NCCL does: the allocator keeps the memory until the launch's stream is done with
                # it (a no-op for memory allocated on that stream). The memory queued: a caller may
                # have swapped a tensor's storage out since (why `storages`).
                try:
                    kept: dict[int, torch.Tensor] = {}  # one record per memory (all_to_all's slices share two)
                    for t, s in zip(self.tensors, self.storages):
                        if s.data_ptr() not in kept:
                            kept[s.data_ptr()] = (t if t.untyped_storage().data_ptr() == s.data_ptr()
                                                  else torch.empty(0, dtype=torch.uint8, device=s.device).set_(s))
                    _keep_alive(_launch_stream(self.stream, self.device), *kept.values())
                except Exception:  # noqa: BLE001 - after the launch: memory not the allocator's needs no record
                    pass
        finally:
            # What the batch holds of its tensors is not needed once it is launched or refused
            # (recorded on the launch's stream by then; each Work keeps its own tensor): let it go,
            # since the queuing thread may name the batch until it queues again, maybe never.
            self.tensors, self.storages = [], []
            self.launching.release()

    def completion(self) -> torch.cuda.Event:
        """An event after the launch on its stream (recorded when first asked for: later work on
        that stream, if any, then counts too)."""
        self.launch()
        if self.event is None:
            self.event = torch.cuda.Event()
            self.event.record(_launch_stream(self.stream, self.device))
        return self.event


_launch_lock = threading.RLock()  # reentrant: a direct send from a __del__ run under it launches


# What touches CUDA and the engine, in one place (tests/test_distributed_cpu.py replaces these
# with fakes to check the queue's rules without a GPU).
def _launch_on_engine(ops: list[tuple[bool, int, int, int]], stream: int, timeout_s: float) -> None:
    """One launch of `ops` on `stream`: the engine's one-op fast path, else its group."""
    engine = _send_recv._require_engine("torch.distributed send/recv on the pydatacopy backend")
    if len(ops) == 1:
        is_send, address, size, pe = ops[0]
        (_C.send_fast if is_send else _C.recv_fast)(engine, address, size, pe, stream, timeout_s)
    else:
        engine.batch(ops, stream, timeout_s)


_current_stream = current_raw_stream  # the current cudaStream_t of a device
_keep_alive = keep_alive
_check_device_errors = _C.check_device_errors


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _stream_capturing(stream: int) -> bool:
    return bool(_C.is_capturing(stream))


_streams: dict[int, torch.cuda.Stream] = {}


def _launch_stream(handle: int, device: int) -> torch.cuda.Stream:
    """A launch stream's torch object, made once per handle (what record_stream takes)."""
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = torch.cuda.ExternalStream(handle, device=device)
    return stream


# This thread's batch: send_recv.py's thread state, whose direct calls launch it first.
_queue = _send_recv._state


def flush() -> None:
    """Launch this thread's queued operations, if any (every call of the backend that is not a
    send or recv does, first)."""
    _send_recv._launch_distributed_batch()


def queue(is_send: bool, tensor: torch.Tensor, pe: int, timeout_s: float) -> "P2PWork":
    """Queue one send or recv of a checked, contiguous CUDA tensor on this process's device; the
    Work that launches it when asked."""
    if _queue.pending is not None:  # a pydatacopy.group() open on this thread
        raise Error(MESSAGES["inside_group"])
    device = tensor.get_device()
    stream = _current_stream(device)
    capturing = _capturing()
    # What the operation records, read before the lock (data_ptr may run Python: a subclass).
    op, storage = (is_send, tensor.data_ptr(), tensor.nbytes, pe), tensor.untyped_storage()
    batch = _queue.distributed_batch
    if batch is not None:
        refusal = None
        with _launch_lock:  # a Work of this batch waited on another thread may launch it meanwhile
            pending = not batch.launched and batch.stream == stream
            if pending and capturing and not batch.captured:
                # Launched now it would enter the capture; launched later, after it: never in order.
                refusal = _drop(batch, "pending_at_capture")
            elif pending and batch.captured == capturing:
                if len(batch.ops) >= _MAX_OPS:
                    # The whole batch, not the operations past the limit: its first part sent
                    # alone would pair with the wrong operations of the peers' batches.
                    refusal = _drop(batch, "too_many_queued")
                else:
                    _append(batch, op, tensor, storage, timeout_s)
                    return P2PWork(batch, tensor)
        if refusal is not None:
            raise refusal
        batch.launch()  # on its own stream (a captured one that its capture left is refused there)
    batch = _queue.distributed_batch = _Batch(stream, device, timeout_s, capturing)
    _append(batch, op, tensor, storage, timeout_s)
    return P2PWork(batch, tensor)


def _memory_still_held(ops: list[tuple[bool, int, int, int]], storages: list) -> bool:
    """Whether each operation's bytes still lie in the memory queued with it: a storage resized or
    freed in place since (FSDP's storage.resize_(0), an offload) gave that memory back to the
    allocator before the launch could record it, and another tensor may own it now."""
    for (_, address, nbytes, _), storage in zip(ops, storages):
        base = storage.data_ptr()
        if nbytes and not (base <= address and address + nbytes <= base + storage.nbytes()):
            return False
    return True


def _drop(batch: _Batch, why: str) -> Error:
    """Refuse a batch not launched yet, whole (called under _launch_lock): nothing of it is sent;
    its Works raise the refusal, returned."""
    batch.launched, batch.error = True, Error(MESSAGES[why])
    batch.tensors, batch.storages = [], []
    if _queue.distributed_batch is batch:
        _queue.distributed_batch = None
    return batch.error


def _append(batch: _Batch, op: tuple, tensor: torch.Tensor, storage, timeout_s: float) -> None:
    batch.ops.append(op)
    batch.tensors.append(tensor)
    batch.storages.append(storage)
    if timeout_s > batch.timeout_s:
        batch.timeout_s = timeout_s


class P2PWork(dist.Work):
    """NCCL's Work semantics for one queued send or recv: wait() launches the queue (if not yet)
    and makes the current stream wait for it, without blocking the host; is_completed() says
    whether the GPU has finished it. A refusal (a size mismatch, a timed-out peer) is raised by
    wait(), is_completed() and result(), and also any device-side error already reported."""

    def __init__(self, batch: _Batch, tensor: torch.Tensor) -> None:
        super().__init__()
        self._batch, self._tensor = batch, tensor

    def _raise_known(self) -> None:
        if self._batch.error is not None:
            raise self._batch.error

    def wait(self, timeout: timedelta | None = None) -> bool:
        batch = self._batch
        batch.launch()
        self._raise_known()
        _check_device_errors()  # what the GPU reported since (a peer that timed out): host memory
        if _current_stream(batch.device) != batch.stream:
            if _capturing() and not batch.captured:
                # An event of eager work waited on inside a capture: not something a graph can hold.
                raise Error(MESSAGES["eager_waited_in_capture"])
            torch.cuda.current_stream(batch.device).wait_event(batch.completion())
        if timeout is not None and timeout.total_seconds() > 0 and not _capturing():
            # A bounded wait asked for: the host waits for the GPU, at most `timeout`.
            event, deadline = batch.completion(), time.monotonic() + timeout.total_seconds()
            while not event.query():
                if time.monotonic() > deadline:
                    raise _C.TimeoutError(f"{MESSAGES['wait_timed_out']} ({timeout.total_seconds():g} s)")
                time.sleep(50e-6)
            _startup.check_errors()
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        batch = self._batch
        batch.launch()
        self._raise_known()
        if _capturing():
            raise Error(MESSAGES["completed_in_capture"])
        done = batch.completion().query()
        if done:
            _startup.check_errors()
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self._batch.error is None

    def exception(self):
        return self._batch.error

    def result(self) -> list[torch.Tensor]:
        self._batch.launch()
        self._raise_known()
        return [self._tensor]

    def source_rank(self) -> int:
        raise Error(MESSAGES["no_source_rank"])

    def get_future(self) -> torch.futures.Future:
        """A future completed once the GPU has run the work (torch's CUDA-aware future: waiting
        on it orders the current stream after the work)."""
        batch = self._batch
        batch.launch()
        if _capturing() and not batch.captured:  # an event of eager work: not for a capturing stream
            raise Error(MESSAGES["eager_waited_in_capture"])
        future = torch.futures.Future(devices=[torch.device("cuda", batch.device)])
        if batch.error is not None:
            future.set_exception(batch.error)
            return future
        with torch.cuda.stream(_launch_stream(batch.stream, batch.device)):
            future.set_result([self._tensor])
        return future


def batch_work(work: P2PWork, tensor: torch.Tensor) -> P2PWork:
    """A Work of the same batch as `work` whose result is `tensor` (all_to_all_single's output)."""
    return P2PWork(work._batch, tensor)


def done_work(result: list[torch.Tensor] | None = None) -> dist.Work:
    """A Work already complete (a barrier's, whose wait happened in the call)."""
    return _DoneWork(result or [])


class _DoneWork(dist.Work):
    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._result)
        return future
