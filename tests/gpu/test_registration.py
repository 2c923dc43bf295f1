"""Registered memory for the remote path: register/unregister/is_registered, the automatic
registration of RMA-path buffers (with torch's allocator freeing and reusing segments), the
checking mode's verification, and refusal where registration cannot happen (see conftest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import re

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy import _C
from pydatacopy._torch_utils import tensor_from_address


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 7_000_003 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _fresh(nbytes: int) -> torch.Tensor:
    """A tensor in a new CUDA allocation of its own: cached segments (maybe registered by
    earlier tests) go back to the driver first, and 64 MiB or more is a segment of its own in
    torch's caching allocator (smaller tensors share 2 or 20 MiB segments)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.zeros(max(nbytes, 64 << 20), dtype=torch.uint8, device="cuda")[:nbytes]


@contextlib.contextmanager
def _rma_options(check: bool, auto_register: bool):
    before = (_C.rma_check_enabled(), _C.auto_register_enabled())
    _C.set_rma_options(check, auto_register)
    try:
        yield
    finally:
        _C.set_rma_options(*before)


def _put_and_check(world, src: torch.Tensor, tag: int, nbytes: int) -> None:
    rank = world[0]
    dst = pydatacopy.empty(nbytes, dtype=torch.uint8)
    dst.zero_()
    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True)
    pydatacopy.put(dst, src, pe=1 - rank, path="rma")
    pydatacopy.barrier()
    torch.cuda.synchronize()
    wrong = int((dst != _bytes(1 - rank, tag, nbytes)).sum())
    pydatacopy.free(dst)
    assert wrong == 0, f"{wrong} of {nbytes} bytes wrong"


@pytest.mark.registers_torch_memory
def test_checker_catches_an_unregistered_address(world):
    x = _fresh(3 << 20)
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA.*neither in the symmetric heap nor"):
        _C._verify_rma_local(x.data_ptr(), x.numel())
    assert not pydatacopy.is_registered(x)
    pydatacopy.register(x)
    _C._verify_rma_local(x.data_ptr() + 4096, 4096)  # any part of the registered allocation
    assert pydatacopy.is_registered(x[5:])
    pydatacopy.unregister(x)
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA"):
        _C._verify_rma_local(x.data_ptr(), x.numel())
    symmetric = pydatacopy.empty(4096, dtype=torch.uint8)
    _C._verify_rma_local(symmetric.data_ptr(), 4096)  # the heap needs no registration
    assert pydatacopy.is_registered(symmetric)
    pydatacopy.register(symmetric)  # a no-op
    pydatacopy.unregister(symmetric)
    pydatacopy.free(symmetric)


@pytest.mark.registers_torch_memory
def test_register_is_counted(world):
    x = _fresh(1 << 20)
    pydatacopy.register(x)
    pydatacopy.register(x[100:])  # the same allocation
    pydatacopy.unregister(x)
    assert pydatacopy.is_registered(x)
    pydatacopy.unregister(x)
    assert not pydatacopy.is_registered(x)
    with pytest.raises(pydatacopy.Error, match="was not registered with pydatacopy.register"):
        pydatacopy.unregister(x)


def test_explicit_unregister_keeps_what_a_transfer_used(world, force_rma):
    """A captured graph may replay a transfer from a buffer: unregister() drops only its own count."""
    rank = world[0]
    nbytes = 4096
    src = _fresh(nbytes)
    src.copy_(_bytes(rank, 12, nbytes))
    pydatacopy.register(src)
    _put_and_check(world, src, 12, nbytes)
    pydatacopy.unregister(src)
    assert pydatacopy.is_registered(src)


EXPANDABLE = r"""
import torch, pydatacopy
torch.cuda.set_device(0)
pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), 0, 1)
dst = pydatacopy.empty(4096, dtype=torch.uint8)
src = torch.ones(4096, dtype=torch.uint8, device="cuda")
try:
    pydatacopy.put(dst, src, pe=0, path="rma")
except pydatacopy.Error as error:
    print("REFUSED", error)
else:
    print("ACCEPTED")
pydatacopy.finalize()
"""


def test_expandable_segments_are_refused_on_the_remote_path(world):
    """torch's expandable segments map memory through CUDA's VMM API: the driver reports the
    whole reservation as one range, so it cannot be registered as an allocation (one process
    of its own: the allocator setting is per process)."""
    if world[0] != 0:
        return
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", CUDA_VISIBLE_DEVICES="0")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "REFUSED" in out.stdout and "expandable_segments" in out.stdout, out.stdout + out.stderr


def test_auto_register_off_refuses_then_register_works(world, force_rma):
    rank = world[0]
    nbytes = (1 << 20) + 3
    src = _fresh(nbytes)
    src.copy_(_bytes(rank, 1, nbytes))
    dst = pydatacopy.empty(nbytes, dtype=torch.uint8)
    with _rma_options(check=True, auto_register=False):
        with pytest.raises(pydatacopy.Error, match=r"PYDATACOPY_AUTO_REGISTER=0.*pydatacopy.register\(tensor\)"):
            pydatacopy.put(dst, src, pe=1 - rank, path="rma")
        with pytest.raises(pydatacopy.Error, match="PYDATACOPY_AUTO_REGISTER=0"):
            pydatacopy.send(src, 1 - rank)  # refused before anything was enqueued
        pydatacopy.free(dst)
        pydatacopy.register(src)
        _put_and_check(world, src, 1, nbytes)
        pydatacopy.unregister(src)


def test_auto_registration_follows_the_allocator(world, force_rma):
    """A segment freed by empty_cache() and a new one at the same address are told apart: the
    stale registration is dropped and the new segment registered; the data stays byte-exact."""
    rank = world[0]
    nbytes = 5 << 20
    with _rma_options(check=True, auto_register=True):
        first = _fresh(nbytes)
        first.copy_(_bytes(rank, 2, nbytes))
        before = _C.registration_stats()
        _put_and_check(world, first, 2, nbytes)
        assert pydatacopy.is_registered(first)
        middle = _C.registration_stats()
        assert middle["registrations"] == before["registrations"] + 1
        _put_and_check(world, first, 2, nbytes)  # cached: no new registration
        assert _C.registration_stats()["registrations"] == middle["registrations"]
        address = first.data_ptr()
        del first
        second = _fresh(nbytes)
        second.copy_(_bytes(rank, 3, nbytes))
        assert not pydatacopy.is_registered(second)  # new allocation, whatever its address
        _put_and_check(world, second, 3, nbytes)
        after = _C.registration_stats()
        assert after["registrations"] == middle["registrations"] + 1
        if second.data_ptr() == address:
            assert after["stale_dropped"] >= middle["stale_dropped"] + 1


def test_sendrecv_from_registered_and_fresh_buffers(world, force_rma):
    rank, peer = world[0], 1 - world[0]
    with _rma_options(check=True, auto_register=True):
        for tag, nbytes in ((4, 4096), (5, (3 << 20) + 5), (6, 64 << 20)):
            src = _fresh(nbytes)
            src.copy_(_bytes(rank, tag, nbytes))
            out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            pydatacopy.sendrecv(src, peer, out, peer)
            torch.cuda.synchronize()
            assert pydatacopy.is_registered(src)
            assert int((out != _bytes(peer, tag, nbytes)).sum()) == 0


def test_capture_registers_a_new_buffer(world, force_rma):
    """A source first used inside a capture (as a tensor of the graph's own pool would be) is
    registered at capture time; every replay then moves fresh data byte-exact."""
    rank = world[0]
    nbytes = (1 << 20) + 3
    src = _fresh(nbytes)
    dst = pydatacopy.empty(nbytes, dtype=torch.uint8)
    assert not pydatacopy.is_registered(src)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with _rma_options(check=True, auto_register=True):
        with torch.cuda.graph(graph, stream=stream):
            pydatacopy.put(dst, src, pe=1 - rank, path="rma")
        assert pydatacopy.is_registered(src)
        for replay in range(3):
            src.copy_(_bytes(rank, 8 + replay, nbytes))
            dst.zero_()
            torch.cuda.synchronize()
            pydatacopy.barrier(blocking=True)
            graph.replay()
            pydatacopy.barrier()
            torch.cuda.synchronize()
            assert int((dst != _bytes(1 - rank, 8 + replay, nbytes)).sum()) == 0
            dist.barrier()
    pydatacopy.free(dst)


# ---- the checking mode covers every address handed to NVSHMEM ----------------------------------

def _violations() -> int:
    return _C.registration_stats()["check_violations"]


@contextlib.contextmanager
def _refusing(label: str):
    """The checking mode refuses the checks labelled `label` (as if their address were wrong)."""
    _C._refuse_rma_checks(label)
    try:
        yield
    finally:
        _C._refuse_rma_checks("")


def test_remote_side_check_refuses_memory_off_the_heap(world):
    """check_rma_remote asks NVSHMEM (nvshmem_ptr to this PE): symmetric memory passes, a plain
    CUDA allocation is refused, counted; with the mode off it checks nothing."""
    local = _fresh(4096)
    symmetric = pydatacopy.empty(4096, dtype=torch.uint8)
    try:
        with _rma_options(check=True, auto_register=True):
            _C._check_rma_remote(symmetric.data_ptr(), 4096)
            _C._check_rma_remote(symmetric.data_ptr() + 4000, 96)
            before = _violations()
            with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA: test: 4096 bytes at .* symmetric heap"):
                _C._check_rma_remote(local.data_ptr(), 4096)
            assert _violations() == before + 1
        with _rma_options(check=False, auto_register=True):
            _C._check_rma_remote(local.data_ptr(), 4096)
    finally:
        pydatacopy.free(symmetric)


def _put_cases(peer: int, dst: torch.Tensor, src: torch.Tensor, signal: torch.Tensor):
    pool = dst.view(16, -1)
    rows = torch.arange(16, device="cuda")
    return {
        "put: dst": lambda: pydatacopy.put(dst, src, peer, path="rma"),
        "put: src": lambda: pydatacopy.put(dst, src, peer, path="rma"),
        "get: src": lambda: pydatacopy.get(src, dst, peer, path="rma"),
        "get: dst": lambda: pydatacopy.get(src, dst, peer, path="rma"),
        "put_signal: dst": lambda: pydatacopy.put_signal(dst, src, peer, signal, 1),
        "put_signal: signal": lambda: pydatacopy.put_signal(dst, src, peer, signal, 1),
        "put_signal: src": lambda: pydatacopy.put_signal(dst, src, peer, signal, 1),
        "signal_set: signal": lambda: pydatacopy.signal_set(signal, 1, peer),
        "put_many: every dst": lambda: pydatacopy.put_many(list(pool), list(src.view(16, -1)), peer),
        "put_many: every src": lambda: pydatacopy.put_many(list(pool), list(src.view(16, -1)), peer),
        # Prepared: the sources are checked when prepared (registered then), the rows before a run.
        "put_many (prepared): every dst": lambda: pydatacopy.prepare_put_many(list(pool), list(src.view(16, -1)), peer).run(),
        "put_many (prepared): every src": lambda: pydatacopy.prepare_put_many(list(pool), list(src.view(16, -1)), peer).run(),
        "put_blocks: dst_pool": lambda: pydatacopy.put_blocks(pool, src.view(16, -1), rows, rows, peer),
        "put_blocks: src_pool": lambda: pydatacopy.put_blocks(pool, src.view(16, -1), rows, rows, peer),
    }


# Under forced RMA every one-sided call hands NVSHMEM both sides; put_signal and signal_set hand
# it the peer's side on every path. Each label is refused in turn (real addresses cannot be made
# wrong through the API): the call must raise before NVSHMEM is called, naming it, counted.
FORCED_LABELS = ["put: dst", "put: src", "get: src", "get: dst", "put_signal: dst", "put_signal: signal",
                 "put_signal: src", "signal_set: signal", "put_many: every dst", "put_many: every src",
                 "put_many (prepared): every dst", "put_many (prepared): every src",
                 "put_blocks: dst_pool", "put_blocks: src_pool"]
DIRECT_LABELS = ["put_signal: dst", "put_signal: signal", "signal_set: signal"]


def _refused_call_is_caught(world, label: str) -> None:
    rank, peer = world[0], 1 - world[0]
    nbytes = 16 * 4096
    dst = pydatacopy.empty(nbytes, dtype=torch.uint8)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    src = _fresh(nbytes)
    src.copy_(_bytes(rank, 30, nbytes))
    try:
        dst.zero_()
        signal.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        call = _put_cases(peer, dst, src, signal)[label]
        before = _violations()
        with _rma_options(check=True, auto_register=True), _refusing(label):
            with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA: " + re.escape(label)):
                call()
        assert _violations() == before + 1
        pydatacopy.barrier(blocking=True)
        # Refused before NVSHMEM was called: nothing arrived.
        assert int(dst.count_nonzero()) == 0 and int(signal.item()) == 0
        assert int((src != _bytes(rank, 30, nbytes)).sum()) == 0  # nor did a get write
        # Every PE has looked before any PE calls again (the full suite on one GPU caught the
        # peer's second, accepted put_signal landing before this PE read its signal).
        pydatacopy.barrier(blocking=True)
        with _rma_options(check=True, auto_register=True):
            call()  # the same call, checked and passed
        pydatacopy.barrier(blocking=True)
    finally:
        pydatacopy.free(signal)
        pydatacopy.free(dst)


@pytest.mark.parametrize("label", FORCED_LABELS)
def test_forced_rma_checks_every_address(world, force_rma, label):
    _refused_call_is_caught(world, label)


@pytest.mark.parametrize("label", DIRECT_LABELS)
def test_signals_are_checked_on_the_direct_path_too(world, label):
    if _C.rma_forced():
        pytest.skip("the direct path: PYDATACOPY_FORCE_RMA is set for the whole run")
    _refused_call_is_caught(world, label)


@pytest.mark.parametrize("label", ["send: the tensor sent", "send: the receiver's staging slots",
                                   "send: the receiver's arrival signals", "recv: the sender's credit signals"])
def test_forced_rma_checks_send_recv_staging(world, force_rma, label):
    rank, peer = world[0], 1 - world[0]
    nbytes = (3 << 20) + 5
    src = _fresh(nbytes)
    src.copy_(_bytes(rank, 31, nbytes))
    out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    before = _violations()
    with _rma_options(check=True, auto_register=True):
        with _refusing(label):
            with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA: " + re.escape(label)):
                pydatacopy.sendrecv(src, peer, out, peer)
        assert _violations() == before + 1
        # Nothing was launched: the channel is where it was, and the next message is right.
        pydatacopy.sendrecv(src, peer, out, peer)
        torch.cuda.synchronize()
    assert int((out != _bytes(peer, 31, nbytes)).sum()) == 0


@pytest.mark.parametrize("label", ["DoubleBufferManager.exchange: credit",
                                   "DoubleBufferManager.exchange: send set",
                                   "DoubleBufferManager.exchange: receive set",
                                   "DoubleBufferManager.exchange: token signals"])
def test_forced_rma_checks_the_token_exchange(world, force_rma, label):
    rank, peer = world[0], 1 - world[0]
    n_tokens, token_size = 64, 1000
    manager = _C.DoubleBufferManager()
    manager.init(n_tokens, token_size)
    try:
        stream = torch.cuda.current_stream().cuda_stream
        send = tensor_from_address(manager.send_buffer(0), (n_tokens * token_size,),
                                                           torch.uint8, _C.cuda_device())
        recv = tensor_from_address(manager.recv_buffer(0), (n_tokens * token_size,),
                                                           torch.uint8, _C.cuda_device())
        send.copy_(_bytes(rank, 32, n_tokens * token_size))
        before = _violations()
        with _rma_options(check=True, auto_register=True):
            with _refusing(label):
                with pytest.raises(pydatacopy.Error, match="PYDATACOPY_CHECK_RMA: " + re.escape(label)):
                    manager.exchange(peer, peer, stream, 30.0)
            assert _violations() == before + 1
            assert manager.round == 0  # refused before the launch: no round was used
            round_ = manager.exchange(peer, peer, stream, 30.0)
            manager.wait(round_, peer, stream, 30.0)
        torch.cuda.synchronize()
        _C.check_device_errors()
        assert int((recv != _bytes(peer, 32, n_tokens * token_size)).sum()) == 0
    finally:
        torch.cuda.synchronize()
        manager.cleanup()


def test_put_signal_source_is_registered_under_forced_rma(world, force_rma):
    """Forced RMA treats put_signal's local side as a remote peer's: registered, then checked."""
    rank, peer = world[0], 1 - world[0]
    nbytes = (1 << 20) + 3
    src = _fresh(nbytes)
    src.copy_(_bytes(rank, 33, nbytes))
    dst = pydatacopy.empty(nbytes, dtype=torch.uint8)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    try:
        dst.zero_()
        signal.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        assert not pydatacopy.is_registered(src)
        with _rma_options(check=True, auto_register=True):
            pydatacopy.put_signal(dst, src, peer, signal, 5)
        assert pydatacopy.is_registered(src)
        pydatacopy.signal_wait(signal, 5, blocking=True)
        assert int((dst != _bytes(peer, 33, nbytes)).sum()) == 0
        pydatacopy.barrier(blocking=True)
    finally:
        pydatacopy.free(signal)
        pydatacopy.free(dst)
