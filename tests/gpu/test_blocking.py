"""Calls documented as blocking return only once their wait is over on the GPU (issue 23).

PE 1 arrives late (it sleeps on the host before its call); PE 0 calls at once. When PE 0's
blocking call returns, the stream it used must have no pending work and the late peer's data
must be there. No timing threshold: the check is the state after return. Each case runs on
torch's default stream, a side stream, a raw handle of a side stream, and the per-thread default
stream (cudaStreamPerThread, handle 2).

Old code: the three Python-side waits synchronised torch.cuda.ExternalStream(handle), which
returned at once for torch's default stream, so stream_idle() read False on PE 0 there."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

import pydatacopy
from pe_outcome import Outcome
from pydatacopy import _C

LATE_S = 1.0            # how late PE 1 is
STREAMS = ["default", "side", "raw", "per_thread"]
PER_THREAD_STREAM = 2   # cudaStreamPerThread


_Failures = Outcome  # tests/gpu/pe_outcome.py (check and agree)


def _stream(kind: str):
    """(stream argument for the call, its raw handle, the torch stream object if any)."""
    if kind == "default":
        return None, torch.cuda.current_stream().cuda_stream, torch.cuda.current_stream()
    if kind == "per_thread":
        return PER_THREAD_STREAM, PER_THREAD_STREAM, None
    side = torch.cuda.Stream()
    return (side if kind == "side" else side.cuda_stream), side.cuda_stream, side


_driver = None


def _stream_idle(handle: int) -> bool:
    """cuStreamQuery on the raw handle, through the driver (not the build under test): 0 and
    CU_STREAM_PER_THREAD (2) mean what they mean to the runtime."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuStreamQuery.argtypes = [ctypes.c_void_p]
    status = _driver.cuStreamQuery(ctypes.c_void_p(handle))
    assert status in (0, 600), f"cuStreamQuery({handle}) failed with CUresult {status}"
    return status == 0  # 600: CUDA_ERROR_NOT_READY


def _assert_idle(handle: int, torch_stream, what: str) -> None:
    assert _stream_idle(handle), f"{what}: the stream still had work pending when the blocking call returned"
    if torch_stream is not None:
        assert torch_stream.query(), f"{what}: torch's query() saw work pending after the blocking call"


def _late(rank: int) -> None:
    if rank == 1:
        time.sleep(LATE_S)


@pytest.fixture
def warmed(world):
    """One blocking barrier first: the old code waited on the process's first such call only."""
    pydatacopy.barrier(blocking=True)
    yield world


@pytest.mark.parametrize("kind", STREAMS)
def test_blocking_barrier_returns_after_a_late_peer(warmed, peer, kind):
    rank = warmed[0]
    failures = _Failures(warmed)
    marker = pydatacopy.empty(1024, dtype=torch.int32)
    marker.zero_()
    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True)
    stream, handle, torch_stream = _stream(kind)
    sevens = torch.full((1024,), 77, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # the source is ready for a put on any stream
    with failures.check(f"barrier(blocking=True) on the {kind} stream"):
        _late(rank)
        if rank == 1:  # the late PE's data, put before its barrier (which quiets first)
            pydatacopy.put(marker, sevens, peer, stream=stream)
        pydatacopy.barrier(stream=stream, blocking=True)
        _assert_idle(handle, torch_stream, f"PE {rank}")
        if rank == 0:
            assert torch.equal(marker.cpu(), torch.full((1024,), 77, dtype=torch.int32)), \
                "the late peer's put was not there after the blocking barrier"
    torch.cuda.synchronize()
    failures.agree(f"the {kind} barrier")
    pydatacopy.barrier(blocking=True)
    pydatacopy.free(marker)


@pytest.mark.parametrize("kind", STREAMS)
def test_blocking_signal_wait_returns_after_a_late_put_signal(warmed, peer, kind):
    rank = warmed[0]
    failures = _Failures(warmed)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    data = pydatacopy.empty(4096, dtype=torch.uint8)
    signal.zero_()
    data.zero_()
    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True)
    stream, handle, torch_stream = _stream(kind)
    payload = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1234))
    torch.cuda.synchronize()
    with failures.check(f"signal_wait(blocking=True) on the {kind} stream"):
        if rank == 1:
            _late(rank)
            pydatacopy.put_signal(data, payload, peer, signal, 5)
            torch.cuda.synchronize()
        else:
            pydatacopy.signal_wait(signal, 5, stream=stream, blocking=True)
            _assert_idle(handle, torch_stream, "PE 0")
            assert torch.equal(data.cpu(), payload.cpu()), "the late put_signal's data was not there"
    torch.cuda.synchronize()
    failures.agree(f"the {kind} signal_wait")
    pydatacopy.barrier(blocking=True)
    pydatacopy.free(data)
    pydatacopy.free(signal)


@pytest.mark.parametrize("kind", STREAMS)
def test_blocking_token_wait_returns_after_a_late_exchange(warmed, peer, kind):
    rank = warmed[0]
    failures = _Failures(warmed)
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(64, 1000)
    try:
        stream, handle, torch_stream = _stream(kind)
        mine = torch.randint(0, 256, (64, 1000), dtype=torch.uint8, device="cuda",
                             generator=torch.Generator(device="cuda").manual_seed(rank + 10))
        theirs = torch.randint(0, 256, (64, 1000), dtype=torch.uint8, device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(peer + 10))
        dbm.send_buffer.copy_(mine)
        torch.cuda.synchronize()
        with failures.check(f"DoubleBufferManager.wait(blocking=True) on the {kind} stream"):
            _late(rank)
            round_ = dbm.exchange(stream=stream)
            received = dbm.wait(round_, stream=stream, blocking=True)
            _assert_idle(handle, torch_stream, f"PE {rank}")
            assert torch.equal(received.cpu(), theirs.cpu()), "the late peer's tokens were not there"
        torch.cuda.synchronize()
        failures.agree(f"the {kind} token wait")
    finally:
        dbm.cleanup()


@pytest.mark.parametrize("call", ["barrier", "signal_wait"])
def test_a_blocking_call_cannot_be_captured(warmed, call):
    """The core refuses too (C++ users), before anything is enqueued into the capture."""
    side = torch.cuda.Stream()
    work = torch.zeros(16, device="cuda")
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    signal.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            work.add_(1)  # the capture holds something
            with pytest.raises(pydatacopy.Error, match="cannot be captured"):
                if call == "barrier":
                    _C.barrier(side.cuda_stream, 5.0, True)
                else:
                    _C.signal_wait(signal.data_ptr(), 1, side.cuda_stream, 5.0, True)
        finally:
            graph.capture_end()
    pydatacopy.barrier(blocking=True)
    pydatacopy.free(signal)


def test_a_blocking_wait_releases_the_gil(warmed):
    """A Python thread keeps running while PE 0 waits for a late PE 1 in a blocking barrier."""
    rank = warmed[0]
    failures = _Failures(warmed)
    ticks = [0]
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        _late(rank)
        before = ticks[0]
        pydatacopy.barrier(blocking=True)
        during = ticks[0] - before
    finally:
        stop.set()
        ticker.join()
    with failures.check("the GIL during the wait"):
        if rank == 0:
            assert during > 0, "no other Python thread ran while the blocking barrier waited"
    failures.agree("the GIL check")
