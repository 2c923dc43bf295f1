"""Byte-exact send/recv between two PEs (on two GPUs, or sharing one): sendrecv both ways at
every size, beyond the heap, every dtype, one direction, and across the copy-engine threshold (see
conftest.py for how to run; the protocol's refusals are in test_send_recv_protocol.py, many peers
in test_send_recv_peers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from byte_patterns import DTYPES, _as, _bytes, _raw


SEND_SIZES = [1, 7, 4096, 1 << 20, 4 << 20, (4 << 20) + 1, (64 << 20) + 3]


@pytest.mark.parametrize("nbytes", SEND_SIZES)
def test_sendrecv_both_ways_byte_exact(world, peer, nbytes):
    rank, _, _ = world
    base = torch.empty(nbytes + 1, dtype=torch.uint8, device="cuda")
    received = base[1:]  # an odd offset on the receiving side
    outgoing = _bytes(rank, nbytes, nbytes)
    pydatacopy.sendrecv(outgoing, peer, received, peer)
    torch.testing.assert_close(received, _bytes(peer, nbytes, nbytes), rtol=0, atol=0)


def test_send_recv_beyond_one_gib_and_the_heap(world, peer):
    """1 GiB + 13 bytes: larger than the staging and than NVSHMEM's default 1 GiB heap."""
    rank, _, _ = world
    nbytes = (1 << 30) + 13
    outgoing = _bytes(rank, 7777, nbytes)
    received = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    with pydatacopy.group():
        pydatacopy.recv(received, peer)
        pydatacopy.send(outgoing, peer)
    assert torch.equal(received, _bytes(peer, 7777, nbytes))
    del outgoing, received
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
def test_send_recv_every_dtype(world, peer, dtype):
    rank, _, _ = world
    shape = (257, 3)
    element = torch.empty((), dtype=dtype).element_size()
    outgoing = _as(_bytes(rank, 300, 257 * 3 * element), dtype).view(shape)
    received = torch.empty(shape, dtype=dtype, device="cuda")
    pydatacopy.sendrecv(outgoing, peer, received, peer)
    expected = _as(_bytes(peer, 300, 257 * 3 * element), dtype).view(shape)
    # Compare bytes: random bit patterns include NaNs, which never compare equal as floats.
    assert torch.equal(_raw(received), _raw(expected))


def test_one_direction_send_recv(world, peer):
    rank, _, _ = world
    nbytes = (20 << 20) + 11
    if rank == 0:
        pydatacopy.send(_bytes(rank, 400, nbytes), peer)
    else:
        received = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pydatacopy.recv(received, peer)
        assert torch.equal(received, _bytes(peer, 400, nbytes))
    torch.cuda.synchronize()
    dist.barrier()


def test_send_recv_alternating_copy_engine_and_sm_paths(world, peer):
    """Messages above and below the copy-engine threshold share one channel's slots and signals."""
    rank, _, _ = world
    for tag, nbytes in enumerate([(20 << 20) + 1, 1 << 20, 3, (40 << 20) + 7, 5 << 20, (17 << 20)]):
        received = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pydatacopy.sendrecv(_bytes(rank, 900 + tag, nbytes), peer, received, peer)
        assert torch.equal(received, _bytes(peer, 900 + tag, nbytes)), nbytes
