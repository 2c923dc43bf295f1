"""The native torch.distributed backend (src/torch_backend/backend.cpp, issue 38) without a GPU: it
builds against this torch, a group made on the backend is it (CPU tensors on torch's gloo), what it
does not move itself reaches the Python group, and the queue's rules (work.py's, which the Python
group keeps) hold. The module's FakeDevice stands for CUDA: CPU tensors for CUDA ones, streams as
numbers the test sets, launches recorded. The CUDA paths are tests/gpu/test_distributed.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
import pydatacopy.distributed
from pydatacopy.distributed import backend as _backend, native as _native
from pydatacopy.runtime import settings as _settings


@pytest.fixture(scope="module")
def native():
    # Asked for through the environment, so that the processes the tests spawn ask for it too.
    with _native.requested_as(True):
        module = _native.load()
        # Not a skip: CI's machine has a compiler and ninja, and a backend that does not build
        # there would not build for users either.
        assert module is not None, f"the native backend did not build: {_native.failure()}"
        yield module


class _Delegate:
    """Stands for the Python group: records what the backend hands it."""

    _timeout_s = 30.0

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_timeout(self, timeout: timedelta) -> None:
        self.calls.append(("set_timeout", timeout))
        self._timeout_s = timeout.total_seconds()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *[a if isinstance(a, (int, str, timedelta)) else type(a).__name__
                                      for a in args]))

        return call


@pytest.fixture
def device(native):
    fake = native.FakeDevice()
    fake.stream = 11
    yield fake
    fake.capturing = False
    native.Queue.flush()  # this thread's queue empty for the next test


def _make(native, device, delegate=None, size: int = 3, rank: int = 0):
    return native.Backend(rank, size, list(range(size)), 30.0, device, delegate or _Delegate())


def _op(backend, is_send: bool, peer: int, nbytes: int = 16):
    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    return (backend.send if is_send else backend.recv)([tensor], peer, 0)


def _launches(device) -> list[tuple[int, list[tuple[bool, int]]]]:
    return [(stream, [(is_send, peer) for is_send, _, _, peer in ops]) for ops, stream, _ in device.launches]


def test_the_backend_builds_and_is_what_a_group_gets(native, device, tmp_path, monkeypatch):
    monkeypatch.setattr(_backend, "_start_runtime", lambda *a: None)
    monkeypatch.setattr(_backend, "_this_pe", lambda: (0, 1))
    monkeypatch.setattr(_backend, "_native_device", lambda module: device)
    options = type("Options", (), {"store": dist.FileStore(str(tmp_path / "store"), 1), "group_rank": 0,
                                    "group_size": 1, "timeout": timedelta(seconds=5),
                                    "global_ranks_in_group": []})
    group = _backend.create_process_group(options)
    assert isinstance(group, native.Backend) and isinstance(group, torch._C._distributed_c10d.Backend)
    assert group.name() == "pydatacopy" and group.supports_coalescing
    assert group.pes == [0] and group.timeout_s == 5.0


def test_queued_operations_launch_together_at_the_first_wait(native, device):
    backend = _make(native, device)
    send, recv = _op(backend, True, 1), _op(backend, False, 2)
    assert device.launches == []  # nothing runs before a result is asked for
    recv.wait()
    send.wait()  # the same launch: not launched again
    assert _launches(device) == [(11, [(True, 1), (False, 2)])]
    assert recv.result()[0].numel() == 16
    assert device.blocked == []  # waited on the stream of the launch: nothing to order


def test_a_wait_on_another_stream_orders_that_stream_after_the_launch(native, device):
    backend = _make(native, device)
    work = _op(backend, True, 1)
    device.stream = 22
    work.wait()
    assert _launches(device) == [(11, [(True, 1)])] and device.blocked == [22]
    assert device.kept_alive == [(1, 11)]  # its tensor kept for the launch's stream


def test_another_stream_launches_what_was_queued_on_the_first(native, device):
    backend = _make(native, device)
    first = _op(backend, True, 1)
    device.stream = 22
    second = _op(backend, False, 2)
    assert _launches(device) == [(11, [(True, 1)])]  # the first stream's batch, on its stream
    second.wait()
    first.wait()
    assert _launches(device) == [(11, [(True, 1)]), (22, [(False, 2)])]


def test_a_batch_waited_on_another_thread_takes_no_more_operations(native, device):
    backend = _make(native, device)
    first = _op(backend, True, 1)
    waiter = threading.Thread(target=first.wait)
    waiter.start()
    waiter.join(10)
    assert _launches(device) == [(11, [(True, 1)])]
    late = _op(backend, False, 1)
    late.wait()
    assert _launches(device) == [(11, [(True, 1)]), (11, [(False, 1)])]


def test_a_batch_another_thread_launched_lets_its_memory_go(native, device):
    """This thread's queue still names its batch after another thread's wait launched it (until
    it queues again, which may be never): the batch must not keep the tensors' memory past the
    launch (recorded on the launch's stream by then), or a long-lived thread pins it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    backend = _make(native, device)
    tensor = torch.zeros(16, dtype=torch.uint8)
    memory = StorageWeakRef(tensor.untyped_storage())
    work = backend.send([tensor], 1, 0)
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    waiter.join(10)
    assert _launches(device) == [(11, [(True, 1)])] and device.kept_alive == [(1, 11)]
    del work, tensor
    assert memory.expired()


def test_an_operation_inside_a_pydatacopy_group_is_refused(native, device):
    """group() launches its calls at its end: a dist.isend queued inside would reach the peer
    before them (or, waited inside, before them too): refused, and the group goes on."""
    backend = _make(native, device)
    with pydatacopy.group():
        with pytest.raises(pydatacopy.Error, match=r"inside pydatacopy.group\(\)"):
            _op(backend, True, 1)
    _op(backend, True, 1).wait()  # after the group: as ever
    assert _launches(device) == [(11, [(True, 1)])]


def test_a_tensor_freed_in_place_before_the_launch_refuses_its_batch(native, device):
    """FSDP frees a parameter's memory in place (storage.resize_(0)): queued before that, its
    send would read memory the allocator gave out again. The batch is refused whole, unlaunched."""
    backend = _make(native, device)
    freed, kept = torch.arange(64, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    first = backend.send([freed], 1, 0)
    second = backend.recv([kept], 2, 0)
    freed.untyped_storage().resize_(0)
    for work in (second, first):
        with pytest.raises(pydatacopy.Error, match="freed or resized in place"):
            work.wait()
    assert device.launches == []


def test_a_launched_eager_work_waited_inside_a_capture_on_another_stream_is_refused(native, device):
    """Its event would be waited on by the capturing stream: refused before any CUDA call, so the
    capture stays valid."""
    backend = _make(native, device)
    work = _op(backend, True, 1)
    work.wait()
    device.stream = 12
    device.capturing = True
    with pytest.raises(pydatacopy.Error, match="launched before the CUDA graph capture began"):
        work.wait()
    with pytest.raises(pydatacopy.Error, match="launched before the CUDA graph capture began"):
        work.get_future()
    device.capturing = False
    assert device.blocked == []
    work.wait()  # after the capture: ordered as ever
    assert device.blocked == [12]


def test_a_coalesced_batch_with_no_cuda_operation_takes_no_batch_another_thread_launched(native, device):
    """This thread's batch, launched by another thread's wait, is no longer this thread's queue:
    a later coalesced batch with no CUDA operation (CPU tensors only: gloo) gets no Work of it,
    and so does not raise that batch's refusal."""
    backend = _make(native, device)
    device.fail_next_launch = "the first batch's refusal"
    first = _op(backend, True, 1)
    refusals = []

    def waiter():
        try:
            first.wait()
        except pydatacopy.Error as error:
            refusals.append(str(error))

    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(10)
    assert refusals and "the first batch's refusal" in refusals[0]
    backend._start_coalescing()
    work = backend._end_coalescing()
    work.wait()
    assert work.result() == [] and _launches(device) == [(11, [(True, 1)])]


def test_more_than_a_group_queued_without_a_wait_is_refused_whole(native, device):
    """The batch's first part sent alone would pair with the wrong operations of the peers'."""
    backend = _make(native, device)
    limit = pydatacopy._C.MAX_GROUP_OPS
    works = [_op(backend, i % 2 == 0, 1) for i in range(limit)]
    with pytest.raises(pydatacopy.Error, match=f"more than {limit} operations queued without a wait"):
        _op(backend, True, 1)
    with pytest.raises(pydatacopy.Error, match="dropped whole"):
        works[-1].wait()
    assert device.launches == []
    _op(backend, True, 1).wait()  # the next batch goes
    assert _launches(device) == [(11, [(True, 1)])]


def test_a_batch_that_raised_before_its_end_sends_nothing_and_its_retry_goes_alone(native, device):
    """torch's coalescing manager does not end a batch_isend_irecv that raised: the user's retry
    (split in two, as the refusal says) must not send the failed batch's operations first."""
    backend = _make(native, device, size=2)
    limit = pydatacopy._C.MAX_GROUP_OPS
    backend._start_coalescing()
    with pytest.raises(pydatacopy.Error, match="operations queued without a wait"):
        for _ in range(limit + 6):
            _op(backend, True, 1)
    for half in (35, 35):
        backend._start_coalescing()
        for _ in range(half):
            _op(backend, True, 1)
        backend._end_coalescing().wait()
    assert [len(ops) for ops, _, _ in device.launches] == [35, 35]


def test_a_batch_refused_by_the_python_group_midway_drops_what_it_queued(native, device):
    """A refusal raised inside a batch (here a CPU tensor the delegate refuses) ends it: its
    queued CUDA operations are dropped, not sent with the next batch; a batch never begun by
    torch's manager (this start) launches only its own."""

    class Refusing(_Delegate):
        def send_in_batch(self, *args):
            raise pydatacopy.Error("refused by the Python group")

    backend = _make(native, device, Refusing(), size=2)
    backend._start_coalescing()
    first = _op(backend, False, 1)
    with pytest.raises(pydatacopy.Error, match="refused by the Python group"):
        backend.send([torch.zeros(4), torch.zeros(4)], 1, 0)  # two tensors: the delegate's
    with pytest.raises(pydatacopy.Error, match="raised before its end"):
        first.wait()
    backend._start_coalescing()
    _op(backend, True, 1)
    backend._end_coalescing().wait()
    assert _launches(device) == [(11, [(True, 1)])]


@pytest.mark.parametrize("flush", ["direct call", "collective", "start of a batch"])
def test_a_batch_left_open_by_an_error_torch_raised_is_dropped_by_whatever_flushes_next(native, device, flush):
    """torch may raise inside batch_isend_irecv before the backend sees the op (a CPU tensor on
    a "cuda:pydatacopy" group), and then never ends the batch: the next flush drops it."""
    backend = _make(native, device)
    backend._start_coalescing()
    first = _op(backend, True, 1)
    _op(backend, False, 2)  # ... and torch raises here, never calling _end_coalescing
    if flush == "direct call":
        pydatacopy._C.flush_torch_backend_queue()
    elif flush == "collective":
        backend.barrier(dist.BarrierOptions())
    else:
        backend._start_coalescing()
        backend._end_coalescing()
    assert device.launches == []
    with pytest.raises(pydatacopy.Error, match="raised before its end"):
        first.wait()
    _op(backend, True, 1).wait()  # not in a batch any more: its own launch
    assert _launches(device) == [(11, [(True, 1)])]


def test_an_eager_batch_is_not_launched_from_a_capture_on_another_stream(native, device):
    """torch.cuda.graph captures on a side stream: an eager isend left on the default stream and
    flushed by a call inside the capture is refused, not launched (a capture in global mode
    forbids what an eager launch may do, an event query)."""
    backend = _make(native, device)
    eager = _op(backend, True, 1)
    device.stream = 12
    device.capturing = True  # stream 12 captures; 11, the batch's, does not
    native.Queue.flush()
    device.capturing = False
    assert device.launches == []
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()


@pytest.mark.parametrize("flush", ["start of a batch", "another call of the backend"])
def test_eager_operations_flushed_inside_a_capture_are_refused_not_recorded(native, device, flush):
    """Launched by whatever call comes after a capture began on their stream, eager operations
    would be recorded into the graph instead of running now."""
    backend = _make(native, device)
    eager = _op(backend, True, 1)
    device.capturing = True
    if flush == "start of a batch":
        backend._start_coalescing()
        backend._end_coalescing()
    else:
        native.Queue.flush()  # what all_to_all_single, barrier and the collectives do first
    device.capturing = False
    assert device.launches == []
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()


def test_a_direct_call_launches_what_the_backend_queued_on_its_thread_first(native, device):
    """pydatacopy.send/recv/sendrecv/group call the core's flush first (_C's direct calls run
    the same function before their launch): an isend queued before them goes first."""
    backend = _make(native, device)
    _op(backend, True, 1)
    pydatacopy._C.flush_torch_backend_queue()
    assert _launches(device) == [(11, [(True, 1)])]
    pydatacopy._C.flush_torch_backend_queue()  # nothing queued: nothing launched
    assert len(device.launches) == 1


def test_the_sequence_number_counts_collectives_not_point_to_point(native, device):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL compares it across ranks before each collective."""
    backend = _make(native, device)
    assert backend._get_sequence_number_for_group() == 0
    _op(backend, True, 1).wait()
    backend.barrier(dist.BarrierOptions())
    backend.alltoall_base(torch.zeros(4), torch.zeros(4), [], [], dist.AllToAllOptions())
    assert backend._get_sequence_number_for_group() == 2


def test_operations_queued_in_a_capture_and_waited_after_it_are_refused_not_launched(native, device):
    backend = _make(native, device)
    device.capturing = True
    work = _op(backend, False, 1)
    device.capturing = False
    with pytest.raises(pydatacopy.Error, match="capture"):
        work.wait()
    assert device.launches == []


def test_an_eager_operation_after_a_capture_ended_unwaited_starts_a_batch_of_its_own(native, device):
    backend = _make(native, device)
    device.capturing = True
    captured = _op(backend, True, 1)
    device.capturing = False
    eager = _op(backend, False, 1)  # same stream: not appended to the captured batch
    eager.wait()
    assert _launches(device) == [(11, [(False, 1)])]
    with pytest.raises(pydatacopy.Error, match="capture"):
        captured.wait()


def test_operations_pending_when_a_capture_begins_on_their_stream_are_refused(native, device):
    backend = _make(native, device)
    eager = _op(backend, True, 1)
    device.capturing = True
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        _op(backend, False, 1)
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()
    assert device.launches == []
    inside = _op(backend, False, 1)  # the capture's own operations go on
    inside.wait()
    assert _launches(device) == [(11, [(False, 1)])]
    with pytest.raises(pydatacopy.Error, match="cannot be asked during a CUDA graph capture"):
        inside.is_completed()


def test_a_refused_launch_reaches_every_work_of_the_batch(native, device):
    backend = _make(native, device)
    device.fail_next_launch = "PE 1 timed out earlier"
    send, recv = _op(backend, True, 1), _op(backend, False, 1)
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        send.wait()
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        recv.wait()
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        recv.result()
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        send.get_future().wait()  # the same exception type through torch's future
    later = _op(backend, True, 1)  # the next batch is launched again
    later.wait()
    assert len(device.launches) == 2


def test_an_operation_queued_while_another_thread_launches_is_never_lost(native, device):
    """One thread queues while another waits on (so launches) the batch being filled: every
    operation is in exactly one launch, or its queueing went to a new batch."""
    backend = _make(native, device)
    works: list = []
    done = threading.Event()

    def waiter():
        while not done.is_set():
            if works:
                works[-1].wait()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        for i in range(3000):
            works.append(_op(backend, i % 2 == 0, 1 + i % 2))
            if i % 32 == 31:  # under the 64 a batch takes, whether or not the waiter keeps up
                works[-1].wait()
    finally:
        done.set()
        thread.join(30)
    works[-1].wait()
    launched = sum(len(ops) for ops, _, _ in device.launches)
    assert launched == len(works), (launched, len(works), len(device.launches))


def test_set_timeout_is_clamped_as_the_python_group_clamps_it(native, device, monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *a: None)  # the delegate's CPU side: unused
    delegate = _backend.ProcessGroupPydatacopy(dist.HashStore(), 0, 2, timedelta(seconds=5), [],
                                               queue=native.Queue(device))
    backend = _make(native, device, delegate, size=2)
    backend.set_timeout(timedelta(seconds=0))
    assert backend.timeout_s == pydatacopy._C.default_timeout_seconds()
    backend.set_timeout(timedelta(days=10**6))
    assert backend.timeout_s == pydatacopy._C.MAX_TIMEOUT_S
    backend.set_timeout(timedelta(seconds=9))
    _op(backend, True, 1).wait()
    assert backend.timeout_s == 9.0 and device.launches[-1][2] == 9.0


def test_completion_and_a_bounded_wait_follow_the_device(native, device):
    backend = _make(native, device)
    work = _op(backend, True, 1)
    device.done = False
    assert work.is_completed() is False  # launched, not finished
    with pytest.raises(pydatacopy.TimeoutError, match="did not finish within"):
        work.wait(timedelta(milliseconds=20))
    device.done = True
    assert work.is_completed() and work.is_success()
    assert work.wait(timedelta(seconds=1))
    assert work.get_future().wait()[0].numel() == 16


@pytest.mark.parametrize("ask", ["is_completed", "result", "get_future"])
def test_a_launch_from_a_work_asked_with_the_gil_lets_other_threads_run(native, device, ask):
    """torch binds these without releasing the GIL; a launch may wait on the host for a peer."""
    backend = _make(native, device)
    getattr(_op(backend, True, 1), ask)()
    assert device.gil_at_launch == [False]


def test_destroying_a_group_launches_what_was_queued(native, device):
    backend = _make(native, device)
    _op(backend, True, 1)
    backend.shutdown()
    assert _launches(device) == [(11, [(True, 1)])]


def test_a_coalesced_batch_is_launched_at_its_end(native, device):
    """batch_isend_irecv (torch's coalescing manager): what was queued before is launched at the
    start; the batch's operations in one launch at its end, whose Work has their tensors."""
    backend = _make(native, device)
    before = _op(backend, True, 2)
    backend._start_coalescing()
    assert _launches(device) == [(11, [(True, 2)])]
    _op(backend, True, 1), _op(backend, False, 1, nbytes=8)
    work = backend._end_coalescing()
    assert _launches(device)[1] == (11, [(True, 1), (False, 1)])
    assert [t.numel() for t in work.result()] == [16, 8]
    before.wait()
    backend._start_coalescing()
    assert backend._end_coalescing().wait()  # an empty batch: a finished Work, no launch
    assert len(device.launches) == 2


def test_a_coalesced_batch_covers_what_the_python_group_ran_in_it(native, device):
    """CPU tensors in a batch_isend_irecv on a plain "pydatacopy" group go to the Python group
    (gloo): the batch's Work covers those Works and the launch."""
    delegate = _Delegate()
    backend = _make(native, device, delegate)
    backend._start_coalescing()
    backend.send([torch.zeros(4)], 7, 0)  # the delegate's (here: recorded, a finished Work)
    _op(backend, False, 1, nbytes=8)
    work = backend._end_coalescing()
    # ("send_in_batch": the Python group does not launch the queue for it, as its "send" would.)
    assert delegate.calls == [("send_in_batch", "list", 7, 0)] and _launches(device) == [(11, [(False, 1)])]
    assert work.wait() and work.is_completed() and [t.numel() for t in work.result()] == [8]
    backend.send([torch.zeros(4)], 7, 0)  # after the batch: not kept for the next one
    backend._start_coalescing()
    assert backend._end_coalescing().result() == []


def test_what_is_not_the_hot_path_goes_to_the_python_group(native, device):
    delegate = _Delegate()
    backend = _make(native, device, delegate)
    t = torch.zeros(4)
    backend.send([t], 7, 0)  # not a rank of the group
    backend.recv([t], 0, 0)  # this rank
    backend.send([t, t], 1, 0)  # two tensors
    backend.send([torch.zeros(4, 2).t()], 1, 0)  # not contiguous
    backend.recv_anysource([t], 0)
    backend.alltoall_base(t, t, [], [], dist.AllToAllOptions())
    backend.barrier(dist.BarrierOptions())
    backend.set_timeout(timedelta(seconds=7))
    backend.allreduce([t], dist.AllreduceOptions())
    backend.monitored_barrier(timedelta(seconds=3), True)
    assert delegate.calls == [("send", "list", 7, 0), ("recv", "list", 0, 0), ("send", "list", 1, 0),
                              ("send", "list", 1, 0), ("recv_anysource", "list", 0),
                              ("alltoall_base", "Tensor", "Tensor", "list", "list", "AllToAllOptions"),
                              ("barrier", "BarrierOptions"), ("set_timeout", timedelta(seconds=7)),
                              ("allreduce", "list", "AllreduceOptions"),
                              ("monitored_barrier", timedelta(seconds=3), True)]
    if hasattr(backend, "gather_single"):  # torch 2.14 on: its single-tensor gather
        backend.gather_single(t, t, dist.GatherOptions())
        assert delegate.calls[-1] == ("gather_into_tensor", "Tensor", "Tensor", "GatherOptions")
    assert device.launches == []
    _op(backend, True, 1).wait()
    assert device.launches[0][2] == 7.0  # the new timeout reaches the launches


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA in Python: the Python group's refusals, without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize("call, args", [
    ("allreduce", lambda t: ([t], dist.AllreduceOptions())),
    ("broadcast", lambda t: ([t], dist.BroadcastOptions())),
    ("allgather", lambda t: ([[t]], [t])),
    ("_allgather_base", lambda t: (t, t)),
    ("reduce_scatter", lambda t: ([t], [[t]], dist.ReduceScatterOptions())),
])
def test_collectives_it_does_not_move_are_refused_with_the_python_groups_text(native, device, monkeypatch,
                                                                             call, args):
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *a: None)  # the delegate's CPU side: unused
    delegate = _backend.ProcessGroupPydatacopy(dist.HashStore(), 0, 2, timedelta(seconds=5), [],
                                               queue=native.Queue(device))
    backend = _make(native, device, delegate, size=2)
    queued = _op(backend, True, 1)
    with pytest.raises(pydatacopy.Error, match=f"torch.distributed {call} on CUDA tensors") as error:
        getattr(backend, call)(*args(torch.zeros(2).as_subclass(_CudaLooking)))
    assert "send, recv, isend, irecv, batch_isend_irecv, all_to_all_single and barrier" in str(error.value)
    assert _launches(device) == [(11, [(True, 1)])]  # what was queued went first
    queued.wait()


def _default_group_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401 - registers, as a user's import does
    from pydatacopy.distributed import backend, native

    backend._start_runtime = lambda *a: None
    backend._this_pe = lambda: (rank, 2)
    backend._native_device = lambda module: module.FakeDevice()
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=45))
    group = dist.distributed_c10d._get_default_group()
    cuda = group._get_backend(torch.device("cuda"))
    out = {"backend": dist.get_backend(), "native": isinstance(cuda, native.load().Backend),
           "pes": cuda.pes, "timeout_s": cuda.timeout_s}
    from test_distributed_cpu import cpu_send_recv_and_all_reduce  # the Python group's test, reused

    cpu_send_recv_and_all_reduce(rank, out)
    dist.barrier()
    sub = dist.new_group([0, 1], backend="pydatacopy")
    out["sub_pes"] = sub._get_backend(torch.device("cuda")).pes
    if hasattr(dist, "set_timeout"):  # torch 2.12+
        dist.set_timeout(timedelta(seconds=33))
        out["after_set_timeout"] = cuda.timeout_s
    dist.destroy_process_group()
    results[rank] = out


def test_a_default_group_on_the_backend_is_native_for_cuda_and_gloo_for_cpu(tmp_path):
    """init_process_group("cpu:gloo,cuda:pydatacopy") by two processes: the group's CUDA backend
    is the native one, with the group's PEs and timeout; CPU tensors take torch's gloo."""
    results = mp.Manager().dict()
    mp.spawn(_default_group_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    for rank in (0, 1):
        out = results[rank]
        assert out["backend"] == "cpu:gloo,cuda:pydatacopy" and out["native"]
        assert out["pes"] == [0, 1] and out["timeout_s"] == 45.0
        assert out["recv"] == [0.0, 1.0, 2.0, 3.0]
        assert out["all_reduce"] == [3.0, 3.0]
        assert out["sub_pes"] == [0, 1]
        if "after_set_timeout" in out:
            assert out["after_set_timeout"] == 33.0


def _mixed_worker(rank: int, store_file: str, results) -> None:
    import os
    import warnings

    import pydatacopy.distributed  # noqa: F401
    from pydatacopy.distributed import backend, native

    # Rank 1 without the native backend (its build failed, or it asked for the Python group).
    os.environ[native.NATIVE_VARIABLE] = "1" if rank == 0 else "0"
    backend._start_runtime = lambda *a: None
    backend._this_pe = lambda: (rank, 2)
    backend._native_device = lambda module: module.FakeDevice()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=45))
    group = dist.distributed_c10d._get_default_group()
    cuda = group._get_backend(torch.device("cuda"))
    # A later group, rank 1 now with the native backend too: still Python on both (one kind of
    # queue per process).
    os.environ[native.NATIVE_VARIABLE] = "1"
    later = dist.new_group([0, 1], backend="pydatacopy")
    results[rank] = {"python": isinstance(cuda, backend.ProcessGroupPydatacopy),
                     "later_python": isinstance(later, backend.ProcessGroupPydatacopy),
                     "warned": [str(w.message) for w in caught if "Python process group" in str(w.message)]}
    dist.destroy_process_group()


def test_ranks_agree_on_the_implementation(native, tmp_path):
    """The native backend and the Python group batch differently, so a group where one rank could
    not build the native backend is the Python group on every rank, said on the others."""
    results = mp.Manager().dict()
    mp.spawn(_mixed_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    assert results[0]["python"] and results[1]["python"]
    assert results[0]["later_python"] and results[1]["later_python"]
    assert any("rank(s) [1]" in text for text in results[0]["warned"]), results[0]["warned"]


def _subgroup_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401
    from pydatacopy.distributed import backend, native

    started = []
    backend._start_runtime = lambda *a: started.append(True)
    backend._runtime_running = lambda: bool(started)  # as after the default group's start
    backend._this_pe = lambda: (rank, 3)

    def cpu_device(module):
        device = module.FakeDevice()
        device.cpu_is_cuda = False  # CPU tensors are CPU ones here: the path under test is gloo's
        return device

    backend._native_device = cpu_device
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                            world_size=3, timeout=timedelta(seconds=45))
    group = dist.new_group([1, 2], backend="pydatacopy")  # every rank calls it, as torch asks
    out = {}
    if rank in (1, 2):
        cuda = group._get_backend(torch.device("cuda"))
        out["native"] = isinstance(cuda, native.load().Backend)
        out["pes"] = cuda.pes
        t = torch.full((2,), float(rank))
        if rank == 1:
            dist.send(t, 2, group=group)  # global rank 2: group rank 1 (CPU: the delegate's gloo)
        else:
            dist.recv(t, 1, group=group)
        out["cpu"] = t.tolist()
        # CPU tensors in a batch_isend_irecv: the delegate's gloo inside the native batch.
        mine, theirs = torch.full((3,), float(rank)), torch.zeros(3)
        peer = 3 - rank
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                            dist.P2POp(dist.irecv, theirs, peer, group)]):
            work.wait()
        out["batch"] = theirs.tolist()
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = out


def test_a_subgroup_maps_its_ranks_to_the_jobs_pes_on_the_native_backend(tmp_path, monkeypatch):
    """new_group([1, 2], backend="pydatacopy") in a job of 3, native: group ranks 0 and 1 are PEs
    1 and 2; CPU tensors between them (alone and in a batch) through the Python group's gloo."""
    monkeypatch.setenv(_native.NATIVE_VARIABLE, "1")
    results = mp.Manager().dict()
    mp.spawn(_subgroup_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=3, join=True)
    assert results[0] == {}
    for rank in (1, 2):
        assert results[rank]["native"] and results[rank]["pes"] == [1, 2]
        assert results[rank]["batch"] == [float(3 - rank)] * 3
    assert results[2]["cpu"] == [1.0, 1.0]


def _detail_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401
    from pydatacopy.distributed import backend

    backend._start_runtime = lambda *a: None
    backend._this_pe = lambda: (rank, 2)
    backend._native_device = lambda module: module.FakeDevice()
    dist.init_process_group("pydatacopy", init_method=f"file://{store_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=45))
    dist.barrier()
    tensor = torch.full((2,), float(rank))
    dist.all_reduce(tensor)  # CPU: the Python group's gloo, through torch's checking wrapper
    results[rank] = tensor.tolist()
    dist.destroy_process_group()


def test_the_native_backend_runs_under_torch_distributed_debug_detail(tmp_path, monkeypatch):
    """DETAIL wraps a C++ backend in torch's ProcessGroupWrapper, which asks its sequence number
    at init (torch 2.11) and before each collective."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv(_native.NATIVE_VARIABLE, "1")
    results = mp.Manager().dict()
    mp.spawn(_detail_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    assert results[0] == results[1] == [1.0, 1.0]


def test_native_by_default_python_group_on_request(native, monkeypatch):
    monkeypatch.delenv(_native.NATIVE_VARIABLE, raising=False)
    assert _native.load() is native  # the default since its GPU tests passed
    for text in ("", "1"):
        monkeypatch.setenv(_native.NATIVE_VARIABLE, text)
        assert _native.load() is native
    monkeypatch.setenv(_native.NATIVE_VARIABLE, "0")
    assert _native.load() is None
    for text in ("yes", " 0", "false"):
        monkeypatch.setenv(_native.NATIVE_VARIABLE, text)
        with pytest.raises(_settings.SettingError, match=f"{_native.NATIVE_VARIABLE}.*0 \\(the Python"):
            _native.load()


def test_a_finished_build_is_imported_without_the_lock_or_a_write(native, monkeypatch):
    """A build made ahead (an image's read-only cache) serves as it is: no lock file is opened
    and nothing is written where it lies."""
    where = _native.cache_dir()
    assert (where / _native._BUILT).exists() and (where / f"{_native._name()}.so").exists()

    def no_lock(where):
        raise PermissionError(f"read-only: {where}")

    monkeypatch.setattr(_native, "_build_lock", no_lock)
    assert hasattr(_native._build(), "Backend")
    # A library other than the one the mark names (rewritten in place since, or half linked by a
    # build that was killed) is not imported without the lock: importing it could kill the process.
    built = where / _native._BUILT
    marked = built.read_text()
    try:
        built.write_text(marked + "0")
        with pytest.raises(PermissionError, match="read-only"):
            _native._build()
    finally:
        built.write_text(marked)


def test_a_failed_build_is_not_tried_again_at_once(tmp_path, monkeypatch):
    """The ranks of a node wait for one another's build: the one that failed says so to the next,
    which falls back at once instead of failing the same build in turn; a failure from before
    the process began (another job's) is tried again (a compiler installed since)."""
    import os

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []

    def failing_build(*args, **kwargs):
        builds.append(args[0])
        raise RuntimeError("Error building extension: no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", failing_build)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _native._build()
    with pytest.raises(RuntimeError, match="failed in another process while this one waited.*no C\\+\\+ compiler"):
        _native._build()
    assert len(builds) == 1
    failed = _native.cache_dir() / _native._FAILED
    before = _native._STARTED - 1  # another job's failure, from before this process began
    os.utime(failed, (before, before))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _native._build()
    assert len(builds) == 2


def test_a_build_lock_held_too_long_is_given_up_with_what_to_do(tmp_path, monkeypatch):
    """A builder that hangs (a stalled filesystem) does not stall every later group's creation:
    the wait is bounded, and the error names the lock file."""
    import fcntl

    monkeypatch.setattr(_native, "BUILD_LOCK_WAIT_S", 0.2)
    outcome = []

    def take():
        try:
            with _native._build_lock(tmp_path):
                outcome.append("taken")
        except TimeoutError as error:
            outcome.append(str(error))

    with open(tmp_path / "pydatacopy.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: conflicts as another process would
        taker = threading.Thread(target=take, daemon=True)  # (an unbounded wait would never end)
        taker.start()
        taker.join(30)
    assert len(outcome) == 1 and "pydatacopy.lock" in outcome[0], outcome
    with _native._build_lock(tmp_path):  # released: taken at once
        pass
