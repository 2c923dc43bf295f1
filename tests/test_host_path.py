"""The one-sided calls' fast path, on the CPU against a fake core: what it hands the core, that
anything unexpected goes to the checked path (same errors as ever), and that finalize() turns it
off. CPU tensors stand in for CUDA ones: the fake core's device is -1, what get_device() gives
a CPU tensor."""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy import _C, _torch_utils
from pydatacopy.send_recv import send_recv as _send_recv
from pydatacopy.rma import transfer as _transfer


class FakeCore:
    """An initialised PE 0 of 2 on "device -1" that records the calls reaching the core."""

    Error = _C.Error
    TimeoutError = _C.TimeoutError

    def __init__(self):
        self.calls: list[tuple] = []
        self.initialized = True

    def _record(name):
        def call(self, *args):
            self.calls.append((name, *args))
        return call

    put_fast = put = _record("put")  # the fast path's entry and the checked path's
    get_fast = get = _record("get")
    # send/recv/sendrecv's fast entries: the engine first, then what its method takes.
    send_fast = _record("send_fast")
    recv_fast = _record("recv_fast")
    sendrecv_fast = _record("sendrecv_fast")
    put_signal = _record("put_signal")
    signal_set = _record("signal_set")
    signal_wait = _record("signal_wait")
    quiet = _record("quiet")
    barrier = _record("barrier")
    put_blocks = _record("put_blocks")

    def is_initialized(self):
        return self.initialized

    def flush_torch_backend_queue(self):  # group()'s start: no torch.distributed queue here
        pass

    device = -1  # what get_device() gives the CPU tensors standing in for CUDA ones

    def cuda_device(self):
        if not self.initialized:
            raise _C.Error("cuda_device() needs NVSHMEM")
        return self.device

    def n_pes(self):
        return 2

    def default_timeout_seconds(self):
        return 60.0

    def is_symmetric(self, address, nbytes):
        return False

    def is_capturing(self, handle):
        return False


@pytest.fixture
def core(monkeypatch):
    fake = FakeCore()
    monkeypatch.setattr(_transfer, "_C", fake)
    monkeypatch.setattr(_send_recv, "_C", fake)
    monkeypatch.setattr(_transfer, "_raw_stream", lambda device: 0x5EED)
    monkeypatch.setattr(_send_recv, "_raw_stream", lambda device: 0x5EED)
    monkeypatch.setattr(_torch_utils, "current_raw_stream", lambda device: 0x5EED)
    monkeypatch.setattr(_torch_utils, "_C", fake)
    # A CPU build of torch has no streams to record: what would be kept alive is recorded instead.
    for module in (_transfer, _send_recv):
        monkeypatch.setattr(module, "_keep_alive",
                            lambda stream, *tensors: fake.calls.append(("keep_alive", stream, len(tensors))))
    for module in (_transfer, _send_recv, _torch_utils):
        monkeypatch.setattr(module, "_device", None)
        monkeypatch.setattr(module, "_n_pes", 0)
    monkeypatch.setattr(_torch_utils, "default_timeout", None)
    yield fake
    _torch_utils.unbind()


def _u8(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.uint8)


def test_the_first_call_binds_and_later_calls_take_the_fast_path(core):
    dst, src = _u8(4096), _u8(4096)
    pydatacopy.put(dst, src, 1)  # checked path: binds device, PE count, timeout
    assert (_transfer._device, _transfer._n_pes, _torch_utils.default_timeout) == (-1, 2, 60.0)
    core.calls.clear()
    pydatacopy.put(dst, src, 1, path="copy_engine")
    pydatacopy.get(src, dst, 0)
    assert core.calls == [("put", dst.data_ptr(), src.data_ptr(), 4096, 1, 0x5EED, 1),
                          ("get", src.data_ptr(), dst.data_ptr(), 4096, 0, 0x5EED, 0)]


def test_fast_path_hands_the_core_what_the_checked_path_did(core):
    _torch_utils.bind()
    dst, src = _u8(64), _u8(64)
    signal = torch.zeros(1, dtype=torch.uint64)
    pool, spool = torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8)
    index = torch.zeros(3, dtype=torch.int64)
    pydatacopy.put_signal(dst, src, 1, signal, 7, stream=0x77)
    pydatacopy.signal_set(signal, 2**64 - 1, 0)
    pydatacopy.signal_wait(signal, 3)
    pydatacopy.quiet()
    pydatacopy.barrier()
    pydatacopy.put_blocks(pool, spool, index, index, 1, path="sm")
    assert core.calls == [
        ("put_signal", dst.data_ptr(), src.data_ptr(), 64, signal.data_ptr(), 7, 1, 0x77),
        ("keep_alive", 0x77, 1),  # src only: dst and the signal are symmetric
        ("signal_set", signal.data_ptr(), 2**64 - 1, 0, 0x5EED),
        ("signal_wait", signal.data_ptr(), 3, 0x5EED, 60.0),
        ("quiet", 0x5EED),
        ("barrier", 0x5EED, 60.0),
        ("put_blocks", pool.data_ptr(), 8, spool.data_ptr(), 4, 16, index.data_ptr(), index.data_ptr(), 3, 1,
         0x5EED, 2),
    ]


@pytest.mark.parametrize("call, words", [
    (lambda d, s: pydatacopy.put(d, s.view(torch.int8), 1), "pydatacopy.put: dtype mismatch"),
    (lambda d, s: pydatacopy.put(d, s[:10], 1), "pydatacopy.put: size mismatch: dst has 64 elements, src has 10"),
    (lambda d, s: pydatacopy.put(d, s.view(8, 8).t(), 1), "src must be contiguous"),
    (lambda d, s: pydatacopy.put(d, "src", 1), "src must be a torch.Tensor, got str"),
    (lambda d, s: pydatacopy.put(d, s, True), "pe must be an int, got bool"),
    (lambda d, s: pydatacopy.put(d, s, 2**31), "pe must be at most 2147483647"),
    (lambda d, s: pydatacopy.put(d, s, 0, path="warp"), "path must be one of"),
    (lambda d, s: pydatacopy.get(d.view(8, 8).t(), s, 1), "dst must be contiguous"),
    (lambda d, s: pydatacopy.put_signal(d, s, 1, torch.zeros(2, dtype=torch.uint64), 1),
     "signal must be a one-element uint64"),
    (lambda d, s: pydatacopy.put_signal(d, s, 5, torch.zeros(1, dtype=torch.uint64), 1),
     "pydatacopy.put_signal: PE 5 is out of range: there are 2 PEs"),
    (lambda d, s: pydatacopy.signal_set(torch.zeros(1, dtype=torch.uint64), -1, 0), "value must be at least 0"),
    (lambda d, s: pydatacopy.signal_wait(torch.zeros(1, dtype=torch.float64), 1), "signal must be a one-element"),
    (lambda d, s: pydatacopy.put_blocks(d.view(4, 16), s.view(8, 8), torch.zeros(1, dtype=torch.int64),
                                        torch.zeros(1, dtype=torch.int64), 1), "size mismatch: dst_pool blocks"),
    (lambda d, s: pydatacopy.put_blocks(d.view(4, 16), s.view(4, 16), torch.zeros(1, dtype=torch.int32),
                                        torch.zeros(1, dtype=torch.int64), 1), "dst_indices must be a 1-D int64"),
    (lambda d, s: pydatacopy.put_blocks(d.view(4, 16), s.view(4, 16), torch.zeros(1, dtype=torch.int64),
                                        torch.zeros(1, dtype=torch.int64), 1, path="copy_engine"),
     "path must be auto, sm or rma"),
])
def test_anything_unexpected_takes_the_checked_path(core, call, words):
    _torch_utils.bind()
    with pytest.raises(pydatacopy.Error, match=words):
        call(_u8(64), _u8(64))
    assert core.calls == [], "a refused call reached the core"


def test_a_pe_out_of_range_is_the_cores_to_refuse(core):
    # As before: put checks only that pe fits a C int; the core names the range.
    _torch_utils.bind()
    pydatacopy.put(_u8(8), _u8(8), 7)
    pydatacopy.put(_u8(8), _u8(8), -1)
    assert [c[4] for c in core.calls if c[0] == "put"] == [7, -1], core.calls


def test_finalize_turns_the_fast_path_off(core, monkeypatch):
    _torch_utils.bind()
    core.initialized = False
    monkeypatch.setattr(pydatacopy.runtime.startup, "_C", core)
    core.finalize = lambda end_nvshmem: None
    pydatacopy.finalize()
    assert _transfer._device is None and _torch_utils.default_timeout is None
    for call in (lambda: pydatacopy.put(_u8(8), _u8(8), 1), lambda: pydatacopy.quiet(),
                 lambda: pydatacopy.barrier(), lambda: pydatacopy.signal_wait(torch.zeros(1, dtype=torch.int64), 1)):
        with pytest.raises(pydatacopy.Error, match="needs NVSHMEM: call pydatacopy.init"):
            call()
    assert core.calls == []


def test_the_fast_entry_points_check_their_arguments():
    # Plain CPython functions: a wrong count or type is Python's TypeError/OverflowError, as
    # pybind11's were; the core's refusals are pydatacopy.Error (before init here).
    with pytest.raises(TypeError, match="takes 6 positional arguments"):
        _C.put_fast(0, 0, 16, 0, 0)
    with pytest.raises(TypeError):
        _C.get_fast(0, "0", 16, 0, 0, 0)
    with pytest.raises(OverflowError):
        _C.put_fast(0, 0, 16, 2**40, 0, 0)
    with pytest.raises(OverflowError):
        _C.put_fast(-1, 0, 16, 0, 0, 0)
    with pytest.raises(pydatacopy.Error, match="needs NVSHMEM"):
        _C.put_fast(0, 0, 16, 0, 0, 0)
    _C._host_path_probe(0, 0, 16, 0, 0, 0)


class FakeEngine:
    def __init__(self, calls):
        self.calls = calls

    def send(self, *args):
        self.calls.append(("send", *args))

    def recv(self, *args):
        self.calls.append(("recv", *args))

    def sendrecv(self, *args):
        self.calls.append(("sendrecv", *args))

    def batch(self, ops, stream, timeout):
        self.calls.append(("batch", ops, stream, timeout))


def test_send_and_recv_hand_the_engine_one_op_each_and_a_group_one_batch(core, monkeypatch):
    monkeypatch.setattr(_send_recv, "_engine", FakeEngine(core.calls))
    a, b = _u8(100), _u8(7)
    pydatacopy.send(a, 1)
    pydatacopy.recv(b, 0, timeout=2.5)
    with pydatacopy.group():
        pydatacopy.send(a, 1)
        pydatacopy.recv(b, 0)
    assert core.calls == [
        ("send", a.data_ptr(), 100, 1, 0x5EED, 60.0), ("keep_alive", None, 1),
        ("recv", b.data_ptr(), 7, 0, 0x5EED, 2.5), ("keep_alive", None, 1),
        ("batch", [(True, a.data_ptr(), 100, 1), (False, b.data_ptr(), 7, 0)], 0x5EED, 60.0),
    ]


def test_path_choice():
    assert _C.resolve_path(0, True, 1 << 30) == "copy_engine"
    assert _C.resolve_path(0, True, 4096) == "copy_engine"
    assert _C.resolve_path(0, False, 1 << 30) == "rma"
    assert _C.resolve_path(2, True, 1 << 30) == "sm"
    with pytest.raises(pydatacopy.Error, match="directly reachable"):
        _C.resolve_path(1, False, 4096)


# ---- send, recv and sendrecv outside group(): the same fast path ------------------------------

@pytest.fixture
def engine(core, monkeypatch):
    """A bound PE 0 of 2 with a send/recv engine that records what reaches it."""
    fake = FakeEngine(core.calls)
    monkeypatch.setattr(_send_recv, "_engine", fake)
    _torch_utils.bind()
    return fake


def test_send_recv_fast_path_hands_the_core_what_the_checked_path_did(core, engine):
    a, b = _u8(100), _u8(7)
    # Fast: no timeout given. Checked: the same calls with the default timeout given (60 s).
    for timeout in (None, 60.0):
        pydatacopy.send(a, 1, timeout=timeout)
        pydatacopy.recv(b, 0, stream=0x77, timeout=timeout)
        pydatacopy.sendrecv(a, 1, b, 0, timeout=timeout)
        pydatacopy.sendrecv(a, 1, b, 0, stream=0x78, timeout=timeout)
    fast, checked = core.calls[:6], core.calls[6:]
    assert fast == [
        ("send_fast", engine, a.data_ptr(), 100, 1, 0x5EED, 60.0),
        ("recv_fast", engine, b.data_ptr(), 7, 0, 0x77, 60.0),
        ("keep_alive", 0x77, 1),  # on a stream given explicitly, as before
        ("sendrecv_fast", engine, a.data_ptr(), 100, 1, b.data_ptr(), 7, 0, 0x5EED, 60.0),
        ("sendrecv_fast", engine, a.data_ptr(), 100, 1, b.data_ptr(), 7, 0, 0x78, 60.0),
        ("keep_alive", 0x78, 2),
    ], fast
    # The checked path's engine methods got the same arguments (and kept nothing alive either
    # on torch's current stream: keep_alive(None, ...) returns at once).
    assert [c for c in checked if c[:2] != ("keep_alive", None)] == [
        ("send", a.data_ptr(), 100, 1, 0x5EED, 60.0),
        ("recv", b.data_ptr(), 7, 0, 0x77, 60.0),
        ("keep_alive", 0x77, 1),
        ("sendrecv", a.data_ptr(), 100, 1, b.data_ptr(), 7, 0, 0x5EED, 60.0),
        ("sendrecv", a.data_ptr(), 100, 1, b.data_ptr(), 7, 0, 0x78, 60.0),
        ("keep_alive", 0x78, 2),
    ], checked


def test_inside_a_group_send_and_recv_join_the_batch_and_sendrecv_is_refused(core, engine):
    a, b = _u8(16), _u8(16)
    with pydatacopy.group():
        pydatacopy.send(a, 1)
        pydatacopy.recv(b, 1)
        with pytest.raises(pydatacopy.Error, match="sendrecv\\(\\) runs its pair itself"):
            pydatacopy.sendrecv(a, 1, b, 1)
    assert core.calls == [("batch", [(True, a.data_ptr(), 16, 1), (False, b.data_ptr(), 16, 1)], 0x5EED, 60.0)]


def test_inside_a_group_the_fast_and_checked_calls_queue_the_same(core, engine, monkeypatch):
    """A send or recv inside group() whose arguments pass the fast path's checks is queued without
    the checked path (a group of 32 paid it 32 times, about 200 us on the GPU machine), and hands
    the batch what the checked path did, keeps the same tensors alive and refuses the same
    second stream."""
    checked_calls = []
    submit = _send_recv._submit
    monkeypatch.setattr(_send_recv, "_submit", lambda *args: (checked_calls.append(args[1]), submit(*args)))
    a, b = _u8(100), _u8(7)
    for timeout in (None, 60.0):  # fast, then checked
        with pydatacopy.group():
            pydatacopy.send(a, 1, timeout=timeout)
            pydatacopy.recv(b, 0, stream=0x5EED, timeout=timeout)
        with pytest.raises(pydatacopy.Error, match="this call resolves to stream 0x77 and an earlier one to 0x5eed"):
            with pydatacopy.group():
                pydatacopy.send(a, 1, timeout=timeout)
                pydatacopy.recv(b, 0, stream=0x77, timeout=timeout)
    assert checked_calls == [True, False] * 2, checked_calls  # the calls given a timeout only
    half = len(core.calls) // 2
    fast, checked = core.calls[:half], core.calls[half:]
    assert fast == [
        ("batch", [(True, a.data_ptr(), 100, 1), (False, b.data_ptr(), 7, 0)], 0x5EED, 60.0),
        ("keep_alive", 0x5EED, 2),  # a stream given explicitly keeps the group's tensors
    ], fast
    assert checked == fast, checked


_SEND_RECV_REFUSED = [
    (lambda t: pydatacopy.send(t, True), "dst_pe must be an int, got bool"),
    (lambda t: pydatacopy.send(t, 1.0), "dst_pe must be an int, got float"),
    (lambda t: pydatacopy.send(t, 2**31), "dst_pe must be at most 2147483647"),
    (lambda t: pydatacopy.send("t", 1), "tensor must be a torch.Tensor, got str"),
    (lambda t: pydatacopy.send(t.view(8, 8).t(), 1), "tensor must be contiguous"),
    (lambda t: pydatacopy.send(t, 1, timeout=0), "timeout must be a positive number of seconds"),
    (lambda t: pydatacopy.send(t, 1, stream="side"), "stream must be a torch.cuda.Stream"),
    (lambda t: pydatacopy.recv(t, "0"), "src_pe must be an int, got str"),
    (lambda t: pydatacopy.recv(t.view(8, 8).t(), 0), "tensor must be contiguous"),
    (lambda t: pydatacopy.recv(None, 0), "tensor must be a torch.Tensor, got NoneType"),
    (lambda t: pydatacopy.recv(t, 0, timeout=float("nan")), "timeout must be a positive number"),
    (lambda t: pydatacopy.sendrecv(t, 1, t, None), "src_pe must be an int, got NoneType"),
    (lambda t: pydatacopy.sendrecv(t, False, t, 0), "dst_pe must be an int, got bool"),
    (lambda t: pydatacopy.sendrecv(t, 1, "x", 0), "recv_tensor must be a torch.Tensor, got str"),
    (lambda t: pydatacopy.sendrecv(t.view(8, 8).t(), 1, t, 0), "send_tensor must be contiguous"),
    (lambda t: pydatacopy.sendrecv(t, 1, t.view(8, 8).t(), 0), "recv_tensor must be contiguous"),
    (lambda t: pydatacopy.sendrecv(t, 1, t, 0, timeout=-1), "timeout must be a positive number"),
    (lambda t: pydatacopy.sendrecv(t, 1, t, 0, stream=1.5), "stream must be a torch.cuda.Stream"),
]


@pytest.mark.parametrize("call, words", _SEND_RECV_REFUSED)
def test_send_recv_anything_unexpected_takes_the_checked_path(core, engine, call, words):
    with pytest.raises(pydatacopy.Error, match=words):
        call(_u8(64))
    assert core.calls == [], "a refused call reached the core"


def test_send_recv_tensors_off_the_device_are_refused_as_before(core, engine):
    core.device = 0  # the process runs on cuda:0; the CPU tensors are not there
    _torch_utils.bind()
    for call, name in ((lambda t: pydatacopy.send(t, 1), "tensor"), (lambda t: pydatacopy.recv(t, 1), "tensor"),
                       (lambda t: pydatacopy.sendrecv(t, 1, t, 1), "send_tensor")):
        with pytest.raises(pydatacopy.Error, match=f"{name} is on cpu; pydatacopy moves CUDA tensors"):
            call(_u8(8))
    assert core.calls == []


def test_send_recv_pe_out_of_range_is_the_cores_to_refuse(core, engine):
    # As before: the checked path checks only that the PE fits a C int; the core names the range.
    t = _u8(8)
    pydatacopy.send(t, 7)
    pydatacopy.recv(t, -1)
    pydatacopy.sendrecv(t, 1, t, 2)
    assert [(c[0], c[3]) for c in core.calls if c[0] != "keep_alive"] == [("send", 7), ("recv", -1), ("sendrecv", 1)]
    assert core.calls[-2][6] == 2, core.calls


def test_send_recv_without_staging_or_after_finalize(core, engine, monkeypatch):
    monkeypatch.setattr(_send_recv, "_engine", None)
    with pytest.raises(pydatacopy.Error, match="send/recv staging is not set up"):
        pydatacopy.send(_u8(8), 1)
    monkeypatch.setattr(_send_recv, "_engine", engine)
    core.initialized = False
    _torch_utils.unbind()  # what finalize() does
    assert _send_recv._device is None
    for call in (lambda: pydatacopy.send(_u8(8), 1), lambda: pydatacopy.recv(_u8(8), 1),
                 lambda: pydatacopy.sendrecv(_u8(8), 1, _u8(8), 1)):
        with pytest.raises(pydatacopy.Error, match="needs NVSHMEM: call pydatacopy.init"):
            call()
    assert core.calls == []


def test_the_send_recv_fast_entry_points_check_their_arguments():
    engine = _C.SendRecvEngine()  # not initialised: the core refuses it as the methods do
    with pytest.raises(TypeError, match="takes 6 positional arguments"):
        _C.send_fast(engine, 0, 16, 0, 0)
    with pytest.raises(TypeError, match="takes 9 positional arguments"):
        _C.sendrecv_fast(engine, 0, 16, 0, 0, 16, 0, 0)
    with pytest.raises(TypeError, match="must be a SendRecvEngine, got NoneType"):
        _C.recv_fast(None, 0, 16, 0, 0, 1.0)
    with pytest.raises(TypeError, match="must be a SendRecvEngine, got object"):
        _C.sendrecv_fast(object(), 0, 16, 0, 0, 16, 0, 0, 1.0)
    with pytest.raises(OverflowError):
        _C.recv_fast(engine, 0, 16, 2**40, 0, 1.0)
    with pytest.raises(OverflowError):
        _C.send_fast(engine, -1, 16, 0, 0, 1.0)
    with pytest.raises(TypeError):
        _C.send_fast(engine, 0, 16, 0, 0, "1.0")
    for fast, method, args in ((_C.send_fast, engine.send, (0, 16, 0, 0, 1.0)),
                               (_C.recv_fast, engine.recv, (0, 16, 0, 0, 1.0)),
                               (_C.sendrecv_fast, engine.sendrecv, (0, 16, 0, 0, 16, 0, 0, 1.0))):
        with pytest.raises(pydatacopy.Error) as by_method:
            method(*args)
        with pytest.raises(pydatacopy.Error) as by_fast:
            fast(engine, *args)
        assert "call pydatacopy.init" in str(by_fast.value) and str(by_fast.value) == str(by_method.value)


def test_tensors_on_a_given_stream_are_kept_alive_also_when_the_core_raises_after_its_launch(
        core, engine, monkeypatch):
    """The engine launches a batch's healthy ops, then reports a refused one (a timed-out peer, a
    byte-count mismatch): the tensors of a call on a stream given explicitly must stay allocated
    until that stream is done, raise or not (else the caching allocator could hand a buffer the
    kernel still writes to the next allocation)."""
    def launch_then_refuse(name):
        def call(*args):
            core.calls.append((name,) + args[:1])
            raise _C.Error(f"{name}: refused after the launch")
        return call

    for name in ("send_fast", "recv_fast", "sendrecv_fast"):
        monkeypatch.setattr(core, name, launch_then_refuse(name))
    for name in ("send", "recv", "sendrecv", "batch"):
        monkeypatch.setattr(engine, name, launch_then_refuse(name))
    a, b = _u8(100), _u8(7)
    for timeout in (None, 60.0):  # the fast path, then the checked one
        for call in (lambda: pydatacopy.send(a, 1, stream=0x77, timeout=timeout),
                     lambda: pydatacopy.recv(b, 0, stream=0x77, timeout=timeout),
                     lambda: pydatacopy.sendrecv(a, 1, b, 0, stream=0x78, timeout=timeout)):
            with pytest.raises(_C.Error, match="refused after the launch"):
                call()
    with pytest.raises(_C.Error, match="refused after the launch"):
        with pydatacopy.group(stream=0x79):
            pydatacopy.send(a, 1)
            pydatacopy.recv(b, 0)
    kept = [c for c in core.calls if c[0] == "keep_alive"]
    assert kept == [("keep_alive", 0x77, 1), ("keep_alive", 0x77, 1), ("keep_alive", 0x78, 2)] * 2 + [
        ("keep_alive", 0x79, 2)], core.calls


def test_keep_alive_records_every_tensor_after_one_the_allocator_refuses(monkeypatch):
    """cudaMallocAsync's allocator raises on memory not its own (DLPack, from_blob): that one
    needs no record, and the tensors after it still get theirs (a foreign first tensor must not
    leave the others to be handed out again while the launch still reads them)."""

    class FakeStream:
        pass

    class Tensor:
        def __init__(self, address, foreign=False):
            self.address, self.foreign, self.recorded = address, foreign, []

        def data_ptr(self):
            return self.address

        def record_stream(self, stream):
            if self.foreign:
                raise RuntimeError("ptr not represented in usage_streams")
            self.recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(_torch_utils._C, "is_symmetric", lambda address, size: address == 0x30)
    stream = FakeStream()
    foreign, mine, symmetric, also_mine = Tensor(0x10, True), Tensor(0x20), Tensor(0x30), Tensor(0x40)
    _torch_utils.keep_alive(stream, foreign, mine, symmetric, also_mine)
    assert (mine.recorded, symmetric.recorded, also_mine.recorded) == ([stream], [], [stream])


def test_the_engines_host_phases_hook_names_each_phase_and_clears_on_read():
    """SendRecvEngine's host-phase hook (the bench's host phase rows), without NVSHMEM: a name per
    phase, the calls and every phase at 0 when nothing ran, and a read clears them."""
    names = _C.SendRecvEngine.host_phase_names()
    assert names == ["mailboxes", "stream", "prepare", "channels", "order", "launch", "record"]
    engine = _C.SendRecvEngine()
    engine.set_host_phases(True)
    with pytest.raises(pydatacopy.Error, match="NVSHMEM"):  # refused before any phase: not counted
        engine.send(0, 16, 1, 0, 60.0)
    assert engine.host_phases() == {"calls": 0, **{name: 0 for name in names}}
    engine.set_host_phases(False)
