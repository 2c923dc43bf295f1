"""Programmatic launches (launch.cuh) must not let a waiting kernel's successor hold the SMs that
another stream of the same PE needs for the peer to make progress.

PE 0 queues on stream s1 a small recv (one block) and then a large staged recv (a full grid),
then on stream s2 a small send. PE 1 first receives that send, and only then sends what PE 0's
s1 waits for. With the next grid allowed to launch at the very start of a kernel, the large
recv's blocks became resident (waiting in griddepcontrol.wait) as soon as the small recv began,
and filled the PE's SM share (2 PEs at 50% under MPS): s2's send found no SM, PE 1 never got
it, and both PEs timed out. Two PEs; data compared byte for byte.
"""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT_S = 30.0  # a failure is a TimeoutError on both PEs, never a hang


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 7_000_003 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


@pytest.fixture(autouse=True)
def staged_only(world):
    """Zero-copy off, so that the large recv is staged and takes a full grid (a zero-copy recv
    waits on one block); fresh channels before and after."""
    pydatacopy.setup_send_recv()
    _send_recv.set_zero_copy_min_bytes(0)
    yield
    try:
        torch.cuda.synchronize()
    finally:
        pydatacopy.setup_send_recv()


def test_successor_grid_never_starves_another_stream(world, peer):
    rank = world[0]
    small, large = 4 * KiB, 16 * MiB
    if rank == 0:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        got_small = torch.zeros(small, dtype=torch.uint8, device="cuda")
        got_large = torch.zeros(large, dtype=torch.uint8, device="cuda")
        to_peer = _bytes(rank, 1, small)
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            pydatacopy.recv(got_small, peer, timeout=TIMEOUT_S)
            pydatacopy.recv(got_large, peer, timeout=TIMEOUT_S)
        with torch.cuda.stream(s2):
            pydatacopy.send(to_peer, peer, timeout=TIMEOUT_S)
        s1.synchronize()
        s2.synchronize()
        pydatacopy.check_errors()
        assert torch.equal(got_small, _bytes(peer, 2, small)), "the small recv's bytes differ"
        assert torch.equal(got_large, _bytes(peer, 3, large)), "the large recv's bytes differ"
    else:
        got = torch.zeros(small, dtype=torch.uint8, device="cuda")
        small_out, large_out = _bytes(rank, 2, small), _bytes(rank, 3, large)
        torch.cuda.synchronize()
        pydatacopy.recv(got, peer, timeout=TIMEOUT_S)
        pydatacopy.send(small_out, peer, timeout=TIMEOUT_S)
        pydatacopy.send(large_out, peer, timeout=TIMEOUT_S)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
        assert torch.equal(got, _bytes(peer, 1, small)), "PE 1's recv bytes differ"
