"""The torch.distributed backend's Python group without a GPU (issue 38): its registration, a default group on
"cpu:gloo,cuda:pydatacopy" made by two real processes (NVSHMEM's start stubbed: no GPU here) whose
CPU tensors go to gloo, the refusals and their texts, and the store-based agreement that starts
NVSHMEM for the backend. The CUDA paths are tests/gpu/test_distributed.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
import pydatacopy.distributed
from pydatacopy.distributed import backend as _backend
from pydatacopy.distributed import native as _native
from pydatacopy.runtime import agreement as _agreement


@pytest.fixture(autouse=True)
def _python_groups(monkeypatch):
    """This module tests the Python group (work.py's queue; PYDATACOPY_DISTRIBUTED_NATIVE=0);
    tests/test_distributed_native_cpu.py tests the native one, the default. The variable reaches
    the processes the tests spawn."""
    monkeypatch.setenv(_native.NATIVE_VARIABLE, "0")


def test_import_registers_the_backend():
    assert dist.Backend.PYDATACOPY == "pydatacopy"
    assert "pydatacopy" in dist.Backend.backend_list
    # CPU too: a group made as plain "pydatacopy" sends CPU tensors through its own gloo group.
    assert dist.Backend.backend_capability["pydatacopy"] == ["cpu", "cuda"]
    pydatacopy.distributed.register()  # again: harmless
    assert dist.Backend.backend_list.count("pydatacopy") == 1


def cpu_send_recv_and_all_reduce(rank: int, out: dict) -> None:
    """CPU tensors on a default group of two ranks: rank 0 sends 0..3 to rank 1 (out["recv"]),
    then an all_reduce of each rank's rank + 1 (out["all_reduce"]: [3.0, 3.0])."""
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    out["recv"] = t.tolist()
    x = torch.ones(2) * (rank + 1)
    dist.all_reduce(x)
    out["all_reduce"] = x.tolist()


def _default_group_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401 - registers, as a user's import does
    from pydatacopy.distributed import backend

    started = []
    backend._start_runtime = lambda store, r, size, timeout_s: started.append((r, size, timeout_s))
    backend._this_pe = lambda: (rank, 2)  # what the stubbed start would have made
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=45))
    out = {"started": started, "backend": dist.get_backend(),
           "type": type(dist.distributed_c10d._get_default_group()).__name__}
    cpu_send_recv_and_all_reduce(rank, out)
    y = torch.zeros(3)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), 1 - rank),
                                        dist.P2POp(dist.irecv, y, 1 - rank)]):
        work.wait()
    out["batch"] = y.tolist()
    a2a = torch.zeros(4)
    dist.all_to_all_single(a2a, torch.arange(4.0) + 10 * rank)
    out["all_to_all"] = a2a.tolist()
    dist.barrier()
    group = dist.new_group([0, 1], backend="pydatacopy")
    out["subgroup"] = dist.get_backend(group)
    out["pg_timeout"] = dist.distributed_c10d._get_default_group()._timeout_s
    if hasattr(dist, "set_timeout"):  # torch 2.12+
        dist.set_timeout(timedelta(seconds=33))
        out["after_set_timeout"] = dist.distributed_c10d._get_default_group()._timeout_s
    dist.destroy_process_group()
    results[rank] = out


def test_default_group_on_the_backend_keeps_gloo_for_cpu_tensors(tmp_path):
    """init_process_group("cpu:gloo,cuda:pydatacopy") by two processes: the group is the
    backend's, NVSHMEM's start is asked on every rank with the group's timeout, and CPU tensors
    take gloo's send/recv, all_reduce, batch_isend_irecv, all_to_all_single and barrier."""
    results = mp.Manager().dict()
    mp.spawn(_default_group_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    for rank in (0, 1):
        out = results[rank]
        assert out["type"] == "ProcessGroupPydatacopy"
        assert out["backend"] == "cpu:gloo,cuda:pydatacopy"
        # The default group's timeout; then new_group's (30 minutes: torch gives a new group its own
        # default, not the default group's), asked again only because the stub started nothing.
        assert out["started"] == [(rank, 2, 45.0), (rank, 2, 1800.0)]
        assert out["recv"] == [0.0, 1.0, 2.0, 3.0]
        assert out["all_reduce"] == [3.0, 3.0]
        assert out["batch"] == [float(1 - rank)] * 3
        assert out["all_to_all"] == ([0.0, 1.0, 10.0, 11.0] if rank == 0 else [2.0, 3.0, 12.0, 13.0])
        assert out["subgroup"] == "pydatacopy"
        assert out["pg_timeout"] == 45.0
        if hasattr(dist, "set_timeout"):
            assert out["after_set_timeout"] == 33.0


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the refusals' texts, without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def _one_rank_group(tmp_path) -> _backend.ProcessGroupPydatacopy:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    return _backend.ProcessGroupPydatacopy(store, 0, 1, timedelta(seconds=30), [])


@pytest.mark.parametrize("call, args, words", [
    ("allreduce", lambda t: ([t], dist.AllreduceOptions()), "reductions need NCCL"),
    ("reduce_scatter", lambda t: ([t], [[t]], dist.ReduceScatterOptions()), "reductions need NCCL"),
    ("broadcast", lambda t: ([t], dist.BroadcastOptions()), "send/recv or all_to_all_single"),
    ("allgather", lambda t: ([[t]], [t], None), "send/recv or all_to_all_single"),
])
def test_cuda_collectives_it_does_not_move_raise_naming_the_alternative(tmp_path, call, args, words):
    group = _one_rank_group(tmp_path)
    fake = torch.zeros(2).as_subclass(_CudaLooking)
    with pytest.raises(pydatacopy.Error, match=words) as error:
        getattr(group, call)(*args(fake))
    assert f"torch.distributed {call} on CUDA tensors" in str(error.value)
    assert "send, recv, isend, irecv, batch_isend_irecv, all_to_all_single and barrier" in str(error.value)


def test_recv_from_any_source_of_a_cuda_tensor_is_refused(tmp_path):
    group = _one_rank_group(tmp_path)
    with pytest.raises(pydatacopy.Error, match="named rank only"):
        group.recv_anysource([torch.zeros(2).as_subclass(_CudaLooking)], 0)


def test_backend_names_and_coalescing(tmp_path):
    group = _one_rank_group(tmp_path)
    assert group.getBackendName() == group.name() == "pydatacopy"
    assert group._get_backend(torch.device("cuda")).supports_coalescing is False  # it batches itself
    assert (group.rank(), group.size()) == (0, 1)


class _Options:
    def __init__(self, store, rank, size, global_ranks):
        self.store, self.group_rank, self.group_size = store, rank, size
        self.timeout, self.global_ranks_in_group = timedelta(seconds=5), global_ranks


def test_a_subgroup_cannot_start_nvshmem(tmp_path, monkeypatch):
    """A group of part of the job, with NVSHMEM not running: refused with what to do, and
    NVSHMEM's start is never asked."""
    monkeypatch.setattr(_backend, "_start_runtime", lambda *a: pytest.fail("must not start"))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(pydatacopy.Error, match=r"ranks \[1\].*default group on\s+this backend|pydatacopy.init\(\)"):
        _backend.create_process_group(_Options(store, 0, 1, [1]))


def test_a_group_whose_ranks_are_not_the_pes_is_refused(tmp_path, monkeypatch):
    """NVSHMEM running with another numbering (PE 1 where the group says global rank 0): refused
    with what to do, never a send to the wrong PE."""
    monkeypatch.setattr(_backend, "_start_runtime", lambda *a: None)
    monkeypatch.setattr(_backend, "_this_pe", lambda: (1, 2))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(pydatacopy.Error, match="rank 0 of this group is global rank 0 but runs NVSHMEM as PE 1 of 2"):
        _backend.create_process_group(_Options(store, 0, 1, []))
    monkeypatch.setattr(_backend, "_this_pe", lambda: (0, 2))
    assert isinstance(_backend.create_process_group(_Options(store, 0, 1, [])), _backend.ProcessGroupPydatacopy)


def test_set_timeout_changes_the_groups_later_calls(tmp_path):
    group = _one_rank_group(tmp_path)
    group.set_timeout(timedelta(seconds=7))
    assert group._timeout_s == 7.0


def test_timeouts_from_torch_become_the_calls(tmp_path):
    assert _backend._timeout_seconds(timedelta(minutes=30)) == 1800.0
    assert _backend._timeout_seconds(timedelta(seconds=0)) == pydatacopy._C.default_timeout_seconds()
    assert _backend._timeout_seconds(timedelta(days=10**6)) == pydatacopy._C.MAX_TIMEOUT_S


def test_store_exchange_gathers_every_rank_in_order():
    """Three ranks (threads here, each its own exchange on one store, as three processes would
    have): each gets every rank's part, in rank order."""
    store = dist.HashStore()
    other = dist.HashStore()  # another group's store, where rank 1 alone made an exchange
    _agreement.StoreExchange(other, 1, 2, 20.0, "test")
    exchanges = [_agreement.StoreExchange(store, rank, 3, 20.0, "test") for rank in range(3)]
    # Each rank's first exchange on this store: the same keys, whatever the rank did elsewhere.
    assert len({exchange.prefix for exchange in exchanges}) == 1, [exchange.prefix for exchange in exchanges]
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda e=e: got.__setitem__(e.rank, e.gather("facts", ("mine", e.rank))))
               for e in exchanges]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert got == {rank: [("mine", 0), ("mine", 1), ("mine", 2)] for rank in range(3)}


def test_store_exchange_names_the_ranks_that_did_not_come():
    store = dist.HashStore()
    exchange = _agreement.StoreExchange(store, 0, 3, 0.5, "pydatacopy.distributed")
    with pytest.raises(pydatacopy.TimeoutError, match=r"rank\(s\) 1, 2 did not come within 0.5 s"):
        exchange.gather("facts", None)


def test_a_refusal_on_one_rank_reaches_every_rank():
    """What one rank cannot start with is raised, with the same text, on every rank."""
    facts = [(None, 1, "GPU-a"), ("PYDATACOPY_TIMEOUT_S='x' is not a number", 1, "GPU-b")]
    with pytest.raises(pydatacopy.Error, match="on rank 1 of the group: PYDATACOPY_TIMEOUT_S"):
        _agreement._refuse_unless_all_can_start(facts, False, "pydatacopy.distributed")


# ---- the queue's rules (work.py), with the engine and CUDA's stream state faked ----------------

class _FakeCuda:
    """The stream each device call sees, whether it captures, and every launch made."""

    def __init__(self, monkeypatch) -> None:
        from pydatacopy.distributed import work

        self.stream, self.capturing, self.launches, self.fail_with = 11, False, [], None
        monkeypatch.setattr(work, "_current_stream", lambda device: self.stream)
        monkeypatch.setattr(work, "_capturing", lambda: self.capturing)
        # Only the current stream captures, when the test says so.
        monkeypatch.setattr(work, "_stream_capturing", lambda stream: self.capturing and stream == self.stream)
        monkeypatch.setattr(work, "_launch_on_engine", self._launch)
        self.kept_alive: list[tuple] = []  # (stream, addresses) per record after a launch
        monkeypatch.setattr(work, "_launch_stream", lambda handle, device: ("stream", handle))
        monkeypatch.setattr(work, "_keep_alive", lambda stream, *tensors: self.kept_alive.append(
            (stream, [t.data_ptr() for t in tensors])))
        monkeypatch.setattr(work, "_check_device_errors", lambda: None)
        monkeypatch.setattr(work._queue, "distributed_batch", None)

    def _launch(self, ops, stream, timeout_s) -> None:
        self.launches.append((stream, [(is_send, pe) for is_send, _, _, pe in ops]))
        if self.fail_with is not None:
            raise self.fail_with


@pytest.fixture
def fake_cuda(monkeypatch):
    return _FakeCuda(monkeypatch)


def _queue(is_send: bool, pe: int, nbytes: int = 16):
    from pydatacopy.distributed import work

    return work.queue(is_send, torch.zeros(nbytes, dtype=torch.uint8), pe, 30.0)


def test_queued_operations_launch_together_at_the_first_wait(fake_cuda):
    send, recv = _queue(True, 1), _queue(False, 1)
    assert fake_cuda.launches == []  # nothing runs before a result is asked for
    recv.wait()
    send.wait()  # the same launch: not launched again
    assert fake_cuda.launches == [(11, [(True, 1), (False, 1)])]
    assert recv.result()[0].numel() == 16


def test_another_stream_launches_what_was_queued_on_the_first(fake_cuda):
    first = _queue(True, 1)
    fake_cuda.stream = 22
    second = _queue(False, 2)
    assert fake_cuda.launches == [(11, [(True, 1)])]  # the first stream's batch, on its stream
    second.wait()
    fake_cuda.stream = 11  # (a wait from another stream orders it with an event: the GPU tests)
    first.wait()
    assert fake_cuda.launches == [(11, [(True, 1)]), (22, [(False, 2)])]


def test_a_batch_waited_on_another_thread_takes_no_more_operations(fake_cuda):
    """A Work waited on by another thread launches its batch; this thread's next operation goes
    to a new batch and is launched at its own wait (not appended to the launched one and lost)."""
    first = _queue(True, 1)
    waiter = threading.Thread(target=first.wait)
    waiter.start()
    waiter.join(10)
    assert fake_cuda.launches == [(11, [(True, 1)])]
    late = _queue(False, 1)
    late.wait()
    assert fake_cuda.launches == [(11, [(True, 1)]), (11, [(False, 1)])]


def test_a_batch_another_thread_launched_lets_its_memory_go(fake_cuda):
    """The queuing thread still names its batch after another thread's wait launched it (until it
    queues again, which may be never): the batch must not keep the tensors' memory past the
    launch (recorded on the launch's stream by then), or a long-lived thread pins it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    tensor = torch.zeros(16, dtype=torch.uint8)
    memory = StorageWeakRef(tensor.untyped_storage())
    work = _queue_tensor(True, tensor, 1)
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    waiter.join(10)
    assert fake_cuda.launches == [(11, [(True, 1)])]
    del work, tensor
    assert memory.expired()


def test_a_tensor_freed_in_place_before_the_launch_refuses_its_batch(fake_cuda):
    """FSDP frees a parameter's memory in place (storage.resize_(0)): queued before that, its
    send would read memory the allocator gave out again. The batch is refused whole, unlaunched."""
    freed, kept = torch.arange(64, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    first = _queue_tensor(True, freed, 1)
    second = _queue_tensor(False, kept, 2)
    freed.untyped_storage().resize_(0)
    for work in (second, first):
        with pytest.raises(pydatacopy.Error, match="freed or resized in place"):
            work.wait()
    assert fake_cuda.launches == []


def test_a_launched_eager_work_waited_inside_a_capture_on_another_stream_is_refused(fake_cuda, monkeypatch):
    """Its event would be waited on by the capturing stream: refused before any CUDA call, so the
    capture stays valid."""
    from pydatacopy.distributed import work as _work

    waited = []
    monkeypatch.setattr(_work._Batch, "completion", lambda self: waited.append(self) or None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"wait_event": lambda self, event: None})())
    work = _queue(True, 1)
    work.wait()
    fake_cuda.stream, fake_cuda.capturing = 12, True
    with pytest.raises(pydatacopy.Error, match="launched before the CUDA graph capture began"):
        work.wait()
    with pytest.raises(pydatacopy.Error, match="launched before the CUDA graph capture began"):
        work.get_future()
    fake_cuda.capturing = False
    assert waited == []
    work.wait()  # after the capture: ordered as ever
    assert len(waited) == 1


def test_an_operation_inside_a_pydatacopy_group_is_refused(fake_cuda):
    """group() launches its calls at its end: a dist.isend queued inside would reach the peer
    before them (or, waited inside, before them too): refused, and the group goes on."""
    with pydatacopy.group():
        with pytest.raises(pydatacopy.Error, match=r"inside pydatacopy.group\(\)"):
            _queue(True, 1)
    _queue(True, 1).wait()  # after the group: as ever
    assert fake_cuda.launches == [(11, [(True, 1)])]


def test_a_wait_on_another_thread_waits_for_the_launch_in_progress(fake_cuda, monkeypatch):
    """While one thread launches a batch, a Work of it waited on by another thread waits for that
    launch: it raises the launch's refusal (or orders its stream after the kernel), never returns
    before the launch decided."""
    from pydatacopy.distributed import work as _work

    entered, release = threading.Event(), threading.Event()

    def slow_refused_launch(ops, stream, timeout_s):
        entered.set()
        release.wait(10)
        raise pydatacopy.Error("refused by the core")

    monkeypatch.setattr(_work, "_launch_on_engine", slow_refused_launch)
    work = _queue(True, 1)
    launcher = threading.Thread(target=work._batch.launch)
    launcher.start()
    assert entered.wait(10)
    outcome = []

    def waiter():
        try:
            work.wait()
            outcome.append("returned")
        except pydatacopy.Error as error:
            outcome.append(str(error))

    other = threading.Thread(target=waiter)
    other.start()
    other.join(0.5)  # (a wait that does not wait for the launch has returned by now)
    release.set()
    launcher.join(10)
    other.join(10)
    assert outcome == ["refused by the core"]


def _queue_tensor(is_send: bool, tensor: torch.Tensor, pe: int):
    from pydatacopy.distributed import work

    return work.queue(is_send, tensor, pe, 30.0)


class _SlowPointer(torch.Tensor):
    """A tensor whose data_ptr() lets other threads run for a while (Python code that sleeps or
    does I/O releases the GIL): the window in which another thread may launch the batch."""

    def data_ptr(self) -> int:
        time.sleep(0.1)
        return super().data_ptr()


def test_an_operation_queued_while_another_thread_launches_is_never_lost(fake_cuda):
    """Another thread waits on (so launches) the batch while this one is queueing into it: the
    new operation goes to a batch of its own and is launched at its wait, never appended to the
    launched one and lost (its peer would wait for it until the timeout)."""
    from pydatacopy.distributed import work

    first = _queue(True, 1)
    waiter = threading.Timer(0.02, first.wait)
    waiter.start()
    second = work.queue(False, torch.zeros(16, dtype=torch.uint8).as_subclass(_SlowPointer), 2, 30.0)
    waiter.join(10)
    second.wait()
    assert fake_cuda.launches == [(11, [(True, 1)]), (11, [(False, 2)])]


def test_more_than_a_group_queued_without_a_wait_is_refused_whole(fake_cuda):
    """The batch's first part sent alone would pair with the wrong operations of the peers'."""
    limit = pydatacopy._C.MAX_GROUP_OPS
    works = [_queue(i % 2 == 0, 1) for i in range(limit)]
    with pytest.raises(pydatacopy.Error, match=f"more than {limit} operations queued without a wait"):
        _queue(True, 1)
    with pytest.raises(pydatacopy.Error, match="dropped whole"):
        works[-1].wait()
    assert fake_cuda.launches == []
    _queue(True, 1).wait()  # the next batch goes
    assert fake_cuda.launches == [(11, [(True, 1)])]


def test_a_direct_call_launches_what_the_python_group_queued_first(fake_cuda):
    """pydatacopy.send/recv/sendrecv/group launch this thread's queue first (their fast path
    steps aside while one is queued): an isend queued before them goes first."""
    from pydatacopy.send_recv import send_recv

    _queue(True, 1)
    assert send_recv._state.distributed_batch is not None  # the direct calls' fast path steps aside
    send_recv._launch_distributed_batch()
    assert fake_cuda.launches == [(11, [(True, 1)])] and send_recv._state.distributed_batch is None


def test_a_group_launches_what_the_python_group_queued_before_it(fake_cuda):
    """At its start: a dist.isend issued inside the group stays after the group's earlier calls."""
    from pydatacopy.send_recv import send_recv

    _queue(True, 1)
    with send_recv.group():
        assert fake_cuda.launches == [(11, [(True, 1)])]


def test_an_eager_batch_is_not_launched_from_a_capture_on_another_stream(fake_cuda):
    """torch.cuda.graph captures on a side stream: an eager isend left on the default stream and
    flushed by a call inside the capture is refused, not launched."""
    from pydatacopy.distributed import work

    eager = _queue(True, 1)
    fake_cuda.stream, fake_cuda.capturing = 22, True  # stream 22 captures; 11, the batch's, does not
    work.flush()
    fake_cuda.capturing = False
    assert fake_cuda.launches == []
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()


def test_eager_operations_a_flush_finds_inside_a_capture_are_refused_not_recorded(fake_cuda):
    """Flushed by another call of the backend (all_to_all_single, barrier) after a capture began
    on their stream, they would be recorded into the graph instead of running now."""
    from pydatacopy.distributed import work

    eager = _queue(True, 1)
    fake_cuda.capturing = True
    work.flush()
    fake_cuda.capturing = False
    assert fake_cuda.launches == []
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()


def test_operations_queued_in_a_capture_and_waited_after_it_are_refused_not_launched(fake_cuda):
    fake_cuda.capturing = True
    work = _queue(False, 1)
    fake_cuda.capturing = False
    with pytest.raises(pydatacopy.Error, match="capture"):
        work.wait()
    assert fake_cuda.launches == []


def test_destroying_a_group_launches_what_was_queued(fake_cuda, tmp_path):
    group = _one_rank_group(tmp_path)
    _queue(True, 1)
    group.shutdown()
    assert fake_cuda.launches == [(11, [(True, 1)])]


def test_an_eager_operation_after_a_capture_ended_unwaited_starts_a_batch_of_its_own(fake_cuda):
    fake_cuda.capturing = True
    captured = _queue(True, 1)
    fake_cuda.capturing = False
    eager = _queue(False, 1)  # same stream: not appended to the captured batch
    eager.wait()
    assert fake_cuda.launches == [(11, [(False, 1)])]
    with pytest.raises(pydatacopy.Error, match="capture"):
        captured.wait()


def test_operations_pending_when_a_capture_begins_on_their_stream_are_refused(fake_cuda):
    eager = _queue(True, 1)
    fake_cuda.capturing = True
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        _queue(False, 1)
    with pytest.raises(pydatacopy.Error, match="before a CUDA graph capture began"):
        eager.wait()
    assert fake_cuda.launches == []
    inside = _queue(False, 1)  # the capture's own operations go on
    inside.wait()
    assert fake_cuda.launches == [(11, [(False, 1)])]


def test_a_refused_launch_reaches_every_work_of_the_batch(fake_cuda):
    fake_cuda.fail_with = pydatacopy.Error("PE 1 timed out earlier")
    send, recv = _queue(True, 1), _queue(False, 1)
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        send.wait()
    with pytest.raises(pydatacopy.Error, match="timed out earlier"):
        recv.wait()
    assert recv.exception() is send.exception()


def test_a_queued_tensors_memory_stays_until_the_launch(fake_cuda):
    """Megatron frees an output after queueing its send (out.data = torch.empty(1)): the batch
    still holds the old storage, so its memory is not handed out before the send reads it."""
    from pydatacopy.distributed import work as _work

    out = torch.arange(64, dtype=torch.uint8)
    address = out.data_ptr()
    pending = _work.queue(True, out, 1, 30.0)
    out.data = torch.empty(1, dtype=torch.uint8)
    held = pending._batch.storages[0]
    assert held.data_ptr() == address and held.nbytes() == 64
    kept = torch.zeros(8, dtype=torch.uint8)
    _work.queue(False, kept, 1, 30.0)
    pending.wait()
    # Recorded on the launch's stream although the wait came on it too (the memory may have been
    # allocated on another): the swapped-out storage's memory, and the other tensor's.
    assert fake_cuda.kept_alive == [(("stream", 11), [address, kept.data_ptr()])]


def _subgroup_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401
    from pydatacopy.distributed import backend

    started = []
    backend._start_runtime = lambda *a: started.append(True)
    backend._runtime_running = lambda: bool(started)  # as after the default group's start
    backend._this_pe = lambda: (rank, 3)
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                            world_size=3, timeout=timedelta(seconds=45))
    group = dist.new_group([1, 2], backend="pydatacopy")  # every rank calls it, as torch asks
    out = {}
    if rank in (1, 2):
        out["pes"] = group._pes
        out["peer_of_group_rank"] = [group._peer(r, "send") if r != group.rank() else None for r in range(2)]
        t = torch.full((2,), float(rank))
        if rank == 1:
            dist.send(t, 2, group=group)  # global rank 2: group rank 1 (CPU: gloo)
        else:
            dist.recv(t, 1, group=group)
        out["cpu"] = t.tolist()
    # Then the pipeline's other neighbours: rank 0 made no group since the default one, rank 1 made
    # one more; the new group's ranks still meet on the same keys of its store.
    neighbours = dist.new_group([0, 1], backend="pydatacopy", timeout=timedelta(seconds=20))
    if rank in (0, 1):
        out["neighbour_pes"] = neighbours._pes
        t = torch.full((2,), float(10 + rank))
        if rank == 0:
            dist.send(t, 1, group=neighbours)
        else:
            dist.recv(t, 0, group=neighbours)
        out["neighbour_cpu"] = t.tolist()
    dist.barrier()
    dist.destroy_process_group()
    results[rank] = out


def test_a_subgroup_maps_its_ranks_to_the_jobs_pes(tmp_path):
    """new_group([1, 2], backend="pydatacopy") in a job of 3: group rank 0 is PE 1 and group rank
    1 is PE 2 (the PEs agreed through the group's store); CPU tensors between them through gloo.
    Then new_group([0, 1]), which rank 2 does not join and rank 0 joins with fewer groups made
    before it than rank 1 (a pipeline's neighbour groups)."""
    results = mp.Manager().dict()
    mp.spawn(_subgroup_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=3, join=True)
    assert set(results[0]) == {"neighbour_pes", "neighbour_cpu"}
    assert results[1]["pes"] == [1, 2] and results[2]["pes"] == [1, 2]
    assert results[1]["peer_of_group_rank"] == [None, 2]
    assert results[2]["peer_of_group_rank"] == [1, None]
    assert results[2]["cpu"] == [1.0, 1.0]
    assert results[0]["neighbour_pes"] == [0, 1] and results[1]["neighbour_pes"] == [0, 1]
    assert results[1]["neighbour_cpu"] == [10.0, 10.0]
    assert "neighbour_pes" not in results[2]


def _pipelining_worker(rank: int, store_file: str, results) -> None:
    import pydatacopy.distributed  # noqa: F401
    from pydatacopy.distributed import backend
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    backend._start_runtime = lambda *a: None
    backend._this_pe = lambda: (rank, 2)
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", init_method=f"file://{store_file}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=45))
    out = {"group_name": dist.distributed_c10d._get_default_group().group_name,
           "torch_name": dist.distributed_c10d._world.pg_names[dist.distributed_c10d._get_default_group()]}
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    stage = PipelineStage(full[0:2] if rank == 0 else full[2:3], rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x, target = torch.randn(8, 16), torch.randn(8, 8)
    if rank == 0:
        schedule.step(x)
    else:
        losses: list = []
        y = schedule.step(target=target, losses=losses)
        out["close"] = bool(torch.allclose(y, full(x), atol=1e-6))
        out["losses"] = len(losses)
    dist.destroy_process_group()
    results[rank] = out


def test_a_pipelining_schedule_runs_on_a_group_of_the_backend(tmp_path):
    """torch.distributed.pipelining's GPipe schedule of two stages over a default group on
    "cpu:gloo,cuda:pydatacopy" (its CPU tensors: gloo through the backend's group; the same on
    CUDA tensors is tests/gpu/test_distributed.py): the last stage's output equals the whole
    model's, and the group answers to its name as torch set it (2.14's schedules key by it)."""
    results = mp.Manager().dict()
    mp.spawn(_pipelining_worker, args=(str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    for rank in (0, 1):
        assert results[rank]["group_name"] == results[rank]["torch_name"] != ""
    assert results[1]["close"] and results[1]["losses"] == 4
