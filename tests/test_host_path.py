"""The one-sided calls' fast path, on the CPU against a fake core: what it hands the core, that
anything unexpected goes to the checked path (same errors as ever), and that finalize() turns it
off. CPU tensors stand in for CUDA ones: the fake core's device is -1, what get_device() gives
a CPU tensor."""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy import _C, _send_recv, _torch_utils, _transfer


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
    put_signal = _record("put_signal")
    signal_set = _record("signal_set")
    signal_wait = _record("signal_wait")
    quiet = _record("quiet")
    barrier = _record("barrier")
    put_blocks = _record("put_blocks")

    def is_initialized(self):
        return self.initialized

    def cuda_device(self):
        if not self.initialized:
            raise _C.Error("cuda_device() needs NVSHMEM")
        return -1

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
    monkeypatch.setattr(_transfer, "_raw_stream", lambda device: 0x5EED)
    monkeypatch.setattr(_torch_utils, "current_raw_stream", lambda device: 0x5EED)
    monkeypatch.setattr(_torch_utils, "_C", fake)
    # A CPU build of torch has no streams to record: what would be kept alive is recorded instead.
    for module in (_transfer, _send_recv):
        monkeypatch.setattr(module, "_keep_alive",
                            lambda stream, *tensors: fake.calls.append(("keep_alive", stream, len(tensors))))
    for module in (_transfer, _torch_utils):
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
    monkeypatch.setattr(pydatacopy._runtime, "_C", core)
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
