"""The send/recv protocol's own guarantees (issue 19, items 3-5 of its review): both sides of a
message agree on its size or both raise, with nothing delivered wrong; the timeout is a watchdog
on progress, not a deadline; messages cut differently (small ones signalling only the pages they
fill) follow each other byte-exact on the direct and on the RMA path. Two PEs; peer = 1 - rank.
Every data check compares bytes against fresh data generated for that round."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pydatacopy

KiB = 1 << 10
MiB = 1 << 20


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    """Random bytes PE `pe` sends under `tag`; the receiver regenerates them to compare."""
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 9_000_011 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} bytes differ, first at "
                             f"{bad[0].item() if bad.numel() else None}")


@pytest.fixture
def peer(world):
    return 1 - world[0]


@pytest.fixture(params=["direct", "rma"])
def path(request):
    """Both paths: the direct stores PEs on one node use, and NVSHMEM RMA (another server)."""
    if request.param == "rma":
        request.getfixturevalue("force_rma")
    return request.param


@pytest.fixture
def fresh_channels(world):
    """Every channel rebuilt after the test, whatever it left behind."""
    yield
    torch.cuda.synchronize()
    pydatacopy.setup_send_recv()


def _exchange_is_exact(rank: int, peer: int, tag: int, sizes) -> None:
    for n, nbytes in enumerate(sizes):
        recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        pydatacopy.sendrecv(_bytes(rank, tag + n, nbytes), peer, recv, peer)
        _assert_bytes(recv, _bytes(peer, tag + n, nbytes), f"sendrecv of {nbytes} bytes")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


# ---- the byte-count handshake ---------------------------------------------------------------
# Old code: each side advanced its chunk counter by its own byte count, so the 4 KiB sendrecv
# after group(send 16 MiB, recv 8 MiB) delivered the leftover chunk and nothing raised: the
# pytest.raises below fail there.

def test_size_mismatch_raises_on_both_pes_and_nothing_wrong_is_delivered(world, peer, path,
                                                                         fresh_channels):
    rank = world[0]
    short = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with pydatacopy.group():
        pydatacopy.send(_bytes(rank, 1, 16 * MiB), peer)
        pydatacopy.recv(short, peer)  # the peer sends 16 MiB: a mismatch on both PEs' recv
    torch.cuda.synchronize()
    dist.barrier()
    nines = torch.full((4 * KiB,), 9, dtype=torch.uint8, device="cuda")
    out = torch.zeros(4 * KiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(pydatacopy.Error, match=r"16777216 bytes but this recv expected 8388608"):
        pydatacopy.sendrecv(nines, peer, out, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    torch.cuda.synchronize()
    assert torch.count_nonzero(short).item() == 0, "the mismatched recv copied data out"
    assert torch.count_nonzero(out).item() == 0, "a refused channel delivered data"
    # The channel stays refused until it is rebuilt: every later call raises again.
    dist.barrier()
    with pytest.raises(pydatacopy.Error, match="refused.*setup_send_recv"):
        pydatacopy.sendrecv(nines, peer, out, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    torch.cuda.synchronize()
    assert torch.count_nonzero(out).item() == 0, "a refused channel delivered data"
    # The documented way back: rebuild every channel on every PE.
    pydatacopy.setup_send_recv()
    _exchange_is_exact(rank, peer, 10, [4 * KiB, 3 * MiB + 5, 4 * KiB])


def test_size_mismatch_reaches_the_sender(world, peer, path, fresh_channels):
    rank = world[0]
    got = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    if rank == 0:
        pydatacopy.send(_bytes(rank, 2, 4 * MiB + 1), peer)  # fits in the staging: done at once
    else:
        pydatacopy.recv(got, peer)
    torch.cuda.synchronize()
    if rank == 1:
        with pytest.raises(pydatacopy.Error, match=r"4194305 bytes but this recv expected 4194304"):
            pydatacopy.check_errors()
        assert torch.count_nonzero(got).item() == 0, "the mismatched recv copied data out"
    dist.barrier()  # the receiver told the sender before this
    later = torch.zeros(4 * KiB, dtype=torch.uint8, device="cuda")
    # The sender hears of it at its next send on the channel (the receiver's size in the text).
    expected = r"4194304 bytes.*setup_send_recv" if rank == 0 else "refused.*setup_send_recv"
    with pytest.raises(pydatacopy.Error, match=expected):
        if rank == 0:
            pydatacopy.send(_bytes(rank, 3, 4 * KiB), peer)
        else:
            pydatacopy.recv(later, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    torch.cuda.synchronize()
    assert torch.count_nonzero(later).item() == 0, "a refused channel delivered data"
    pydatacopy.setup_send_recv()
    _exchange_is_exact(rank, peer, 20, [4 * MiB, 4 * KiB])


# ---- messages cut differently, small ones signalling only the pages they fill -----------------
# Small chunks now signal only the pages they fill, and the sender waits for the credit of the
# last chunk that filled each page: a wrong page state shows as wrong bytes (a stale page read
# as new) or a timeout here. Old code signalled every page, so this passed there too: it guards
# the new scheme rather than failing first.

@pytest.mark.parametrize("chunking", [None, (1 * MiB, 2)], ids=["default", "1MiB-x2"])
def test_mixed_sizes_after_small_messages(world, peer, path, chunking, fresh_channels):
    rank = world[0]
    if chunking is not None:
        pydatacopy.setup_send_recv(chunk_bytes=chunking[0], num_chunks=chunking[1])
    sizes = [4 * KiB, 3 * MiB + 5, 4 * KiB, 5, 64 * KiB + 3, 3 * MiB + 5, 17 * MiB + 1, 4 * KiB,
             32 * KiB, 32 * KiB + 1, 4 * KiB]
    _exchange_is_exact(rank, peer, 100, sizes)
    # One way too, each direction in turn (a send alone, no recv beside it in its launch).
    for tag, nbytes in enumerate([4 * KiB, 3 * MiB + 5, 4 * KiB]):
        recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        if rank == 0:
            pydatacopy.send(_bytes(rank, 200 + tag, nbytes), peer)
            pydatacopy.recv(recv, peer)
        else:
            pydatacopy.recv(recv, peer)
            pydatacopy.send(_bytes(rank, 200 + tag, nbytes), peer)
        _assert_bytes(recv, _bytes(peer, 200 + tag, nbytes), f"one way, {nbytes} bytes")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


# ---- the timeout is a watchdog on progress --------------------------------------------------
# A transfer made slow on purpose (one slice, 32 KiB chunks, two slots: many short steps) is
# timed first; then the same transfer runs with a timeout of a quarter of that time, thousands of
# chunks long. Old code took the timeout as a deadline from the kernel's start, so the second
# run timed out there. Last in the module: a timeout marks the peer for the rest of the process.

def test_a_transfer_still_moving_outlives_a_short_timeout(world, peer, fresh_channels):
    rank = world[0]
    nbytes = 1 << 30
    pydatacopy.setup_send_recv(chunk_bytes=32 * KiB, num_chunks=2, blocks=1)
    send = _bytes(rank, 300, nbytes)
    recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    pydatacopy.sendrecv(send[:MiB], peer, recv[:MiB], peer)  # warm-up
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pydatacopy.sendrecv(send, peer, recv, peer)
    end.record()
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    elapsed = [None] * world[1]
    dist.all_gather_object(elapsed, start.elapsed_time(end) / 1e3)
    # A quarter of the transfer: about 8192 chunks' time, so only a stall, never the length of
    # the transfer, can reach it.
    timeout = min(elapsed) / 4
    recv.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    pydatacopy.sendrecv(send, peer, recv, peer, timeout=timeout)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    _assert_bytes(recv, _bytes(peer, 300, nbytes), f"1 GiB with timeout={timeout:.4f} s")
