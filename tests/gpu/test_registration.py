"""Registered memory for the remote path: register/unregister/is_registered, the automatic
registration of RMA-path buffers (with torch's allocator freeing and reusing segments), the
checking mode's verification, and refusal where registration cannot happen (see conftest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy import _C


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
