"""The send/recv protocol's own guarantees (issue 19, items 3-5 of its review): both sides of a
message agree on its size or both raise, with nothing delivered wrong; the timeout is a watchdog
on progress, not a deadline; messages cut differently (small ones signalling only the pages they
fill) follow each other byte-exact on the direct and on the RMA path. Two PEs; peer = 1 - rank.
Every data check compares bytes against fresh data generated for that round."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pe_outcome import Outcome

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    """Random bytes PE `pe` sends under `tag`; the receiver regenerates them to compare."""
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 9_000_011 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        differ = got != want  # no nonzero(): its index list would be 8 bytes a byte of a GiB buffer
        raise AssertionError(f"{what}: {int(differ.sum())} of {want.numel()} bytes differ, first at "
                             f"{int(differ.to(torch.uint8).argmax())}")


_Outcome = Outcome  # tests/gpu/pe_outcome.py


def _refusal(specific: str, other_bytes: int, this_bytes: int) -> str:
    """A mismatch's message: the specific one (the side that met the mismatch recorded first), or
    the channel's refusal naming the same two sizes (a block of the same launch that started after
    the peer had already refused this message recorded first: with every SM of an MPS share in
    use, blocks of one launch start at different times). Either names both sizes."""
    return rf"{specific}|the other side's: {other_bytes} bytes; this call: {this_bytes} bytes"


@pytest.fixture
def fresh_channels(world):
    """Every channel rebuilt with the default settings after the test, on every PE, whatever it
    left behind (the tests keep every PE in step until here, see _Outcome)."""
    yield
    try:
        torch.cuda.synchronize()
    finally:
        pydatacopy.setup_send_recv()


def _exchange_is_exact(outcome: _Outcome, rank: int, peer: int, tag: int, sizes) -> None:
    """sendrecv of each size; a wrong result is recorded and the next size still runs (the peer
    runs it too)."""
    for n, nbytes in enumerate(sizes):
        with outcome.check(f"sendrecv of {nbytes} bytes"):
            recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            pydatacopy.sendrecv(_bytes(rank, tag + n, nbytes), peer, recv, peer)
            _assert_bytes(recv, _bytes(peer, tag + n, nbytes), f"sendrecv of {nbytes} bytes")
    with outcome.check("after the exchanges"):
        torch.cuda.synchronize()
        pydatacopy.check_errors()


# ---- the byte-count handshake ---------------------------------------------------------------
# Old code: each side advanced its chunk counter by its own byte count, so the 4 KiB sendrecv
# after group(send 16 MiB, recv 8 MiB) delivered the leftover chunk and nothing raised: the
# expect_error checks below fail there (on both PEs, through agree()).

def test_size_mismatch_raises_on_both_pes_and_nothing_wrong_is_delivered(world, peer, path,
                                                                         fresh_channels):
    rank = world[0]
    outcome = _Outcome(world)
    short = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with outcome.check("group(send 16 MiB, recv 8 MiB)"):
        with pydatacopy.group():
            pydatacopy.send(_bytes(rank, 1, 16 * MiB), peer)
            pydatacopy.recv(short, peer)  # the peer sends 16 MiB: a mismatch on both PEs' recv
        torch.cuda.synchronize()
    outcome.agree("the mismatched group")
    nines = torch.full((4 * KiB,), 9, dtype=torch.uint8, device="cuda")
    out = torch.zeros(4 * KiB, dtype=torch.uint8, device="cuda")
    # Found by this PE's recv, or (at or above the zero-copy threshold, between load/store
    # peers) by its send reading the peer's rendezvous descriptor: whichever came first.
    with outcome.expect_error("the sendrecv after the mismatch",
                              r"16777216 bytes but this recv expected 8388608|"
                              r"the receiver expected 8388608 bytes .*this call: 16777216 bytes|"
                              r"the other side's: 16777216 bytes; this call: 8388608 bytes|"
                              r"the other side's: 8388608 bytes; this call: 16777216 bytes"):
        pydatacopy.sendrecv(nines, peer, out, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    with outcome.check("nothing delivered"):
        torch.cuda.synchronize()
        assert torch.count_nonzero(short).item() == 0, "the mismatched recv copied data out"
        assert torch.count_nonzero(out).item() == 0, "a refused channel delivered data"
    # The channel stays refused until it is rebuilt: every later call raises again.
    outcome.agree("the first refusal")
    with outcome.expect_error("a later sendrecv on the refused channel", "refused.*setup_send_recv"):
        pydatacopy.sendrecv(nines, peer, out, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    with outcome.check("nothing delivered later"):
        torch.cuda.synchronize()
        assert torch.count_nonzero(out).item() == 0, "a refused channel delivered data"
    # The documented way back: rebuild every channel on every PE.
    pydatacopy.setup_send_recv()
    _exchange_is_exact(outcome, rank, peer, 10, [4 * KiB, 3 * MiB + 5, 4 * KiB])
    outcome.agree("the exchanges after setup_send_recv")


def test_size_mismatch_reaches_the_sender(world, peer, path, fresh_channels):
    rank = world[0]
    outcome = _Outcome(world)
    got = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    with outcome.check("the mismatched send/recv"):
        if rank == 0:
            pydatacopy.send(_bytes(rank, 2, 4 * MiB + 1), peer)  # fits in the staging: done at once
        else:
            pydatacopy.recv(got, peer)
        torch.cuda.synchronize()
    if rank == 1:
        with outcome.expect_error("the receiver's check_errors",
                                  r"4194305 bytes but this recv expected 4194304"):
            pydatacopy.check_errors()
        with outcome.check("nothing delivered"):
            assert torch.count_nonzero(got).item() == 0, "the mismatched recv copied data out"
    outcome.agree("the receiver's refusal")  # the receiver told the sender before this
    later = torch.zeros(4 * KiB, dtype=torch.uint8, device="cuda")
    # The sender hears of it at its next send on the channel (the receiver's size in the text).
    expected = r"4194304 bytes.*setup_send_recv" if rank == 0 else "refused.*setup_send_recv"
    with outcome.expect_error("the next call on the channel", expected):
        if rank == 0:
            pydatacopy.send(_bytes(rank, 3, 4 * KiB), peer)
        else:
            pydatacopy.recv(later, peer)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    with outcome.check("nothing delivered later"):
        torch.cuda.synchronize()
        assert torch.count_nonzero(later).item() == 0, "a refused channel delivered data"
    outcome.agree("the sender's refusal")
    pydatacopy.setup_send_recv()
    _exchange_is_exact(outcome, rank, peer, 20, [4 * MiB, 4 * KiB])
    outcome.agree("the exchanges after setup_send_recv")


# ---- a mismatch either way is an Error on both PEs at once, never a timeout (issue 23) -------
# Old code: a recv larger than the send it met (4 MiB into 8 MiB, default 8 MiB chunks) waited
# for the pages of its first chunk that the sender never fills before reading any header: a
# TimeoutError after the full timeout, the peer marked dead, the pair refused for good (also
# after setup_send_recv()). And a sender whose send had completed heard nothing at check_errors().

MISMATCH_TIMEOUT_S = 60.0


@pytest.mark.parametrize("form", ["send_recv", "sendrecv", "group"])
@pytest.mark.parametrize("larger", ["recv", "send"])
def test_a_size_mismatch_either_way_raises_on_both_pes_before_the_timeout(world, peer, path, form,
                                                                          larger, fresh_channels):
    """PE 0 sends, PE 1 receives, one of them with twice the bytes of the other; in the sendrecv
    and group forms the other direction (PE 1 -> PE 0, 1 MiB + 3) is healthy and must arrive."""
    rank = world[0]
    outcome = _Outcome(world)
    send_bytes, recv_bytes = (4 * MiB, 8 * MiB) if larger == "recv" else (8 * MiB, 4 * MiB)
    healthy = MiB + 3
    got = torch.zeros(recv_bytes, dtype=torch.uint8, device="cuda")
    back = torch.zeros(healthy, dtype=torch.uint8, device="cuda")
    outgoing = _bytes(rank, 30, send_bytes if rank == 0 else healthy)
    torch.cuda.synchronize()
    begin = time.monotonic()
    with outcome.check(f"the mismatched {form}"):
        if form == "send_recv":
            if rank == 0:
                pydatacopy.send(outgoing, peer, timeout=MISMATCH_TIMEOUT_S)
            else:
                pydatacopy.recv(got, peer, timeout=MISMATCH_TIMEOUT_S)
        elif form == "sendrecv":
            if rank == 0:
                pydatacopy.sendrecv(outgoing, peer, back, peer, timeout=MISMATCH_TIMEOUT_S)
            else:
                pydatacopy.sendrecv(outgoing, peer, got, peer, timeout=MISMATCH_TIMEOUT_S)
        else:
            with pydatacopy.group():
                if rank == 0:
                    pydatacopy.recv(back, peer, timeout=MISMATCH_TIMEOUT_S)
                    pydatacopy.send(outgoing, peer, timeout=MISMATCH_TIMEOUT_S)
                else:
                    pydatacopy.send(outgoing, peer, timeout=MISMATCH_TIMEOUT_S)
                    pydatacopy.recv(got, peer, timeout=MISMATCH_TIMEOUT_S)
        torch.cuda.synchronize()
    elapsed = time.monotonic() - begin
    with outcome.check("the calls' duration"):
        assert elapsed < MISMATCH_TIMEOUT_S, (f"the mismatched calls took {elapsed:.1f} s, the "
                                              f"whole {MISMATCH_TIMEOUT_S:.0f} s timeout")
    if rank == 1:
        with outcome.expect_error("the receiver's check_errors",
                                  _refusal(rf"sender's message is {send_bytes} bytes but this recv expected {recv_bytes}",
                                           send_bytes, recv_bytes)):
            pydatacopy.check_errors()
        with outcome.check("nothing delivered"):
            assert torch.count_nonzero(got).item() == 0, "the mismatched recv copied data out"
    outcome.agree("the receiver's refusal")  # the receiver told the sender before this
    if rank == 0:
        with outcome.expect_error("the sender's check_errors",
                                  _refusal(rf"receiver expected {recv_bytes} bytes", recv_bytes, send_bytes)):
            pydatacopy.check_errors()
        with outcome.check("check_errors says it once"):
            pydatacopy.check_errors()
        if form != "send_recv":
            with outcome.check("the healthy direction"):
                _assert_bytes(back, _bytes(peer, 30, healthy), "the healthy direction")
    with outcome.check("no peer marked dead"):
        assert not pydatacopy._C.peer_timed_out(peer), "a size mismatch marked the peer as timed out"
    outcome.agree("the sender's refusal")
    pydatacopy.setup_send_recv()
    _exchange_is_exact(outcome, rank, peer, 40, [8 * MiB, 4 * MiB, 4 * KiB])
    outcome.agree("the exchanges after setup_send_recv")


# Other cuts: the receiver has more slices than the sender filled pages (4 KiB into 64 KiB), an
# empty message against a non-empty one, one byte over a page, and sends larger than the 32 MiB
# staging (the sender waits for credits and reads the refusal word on the device). 64M-into-1M: a
# zero-copy send too large for the staging (it waits for its descriptor, with no staged fallback)
# into a recv below the threshold, which posts its descriptor only after settings::kLatePostNs
# without progress: without that late post both would wait for the timeout.
@pytest.mark.parametrize("send_bytes, recv_bytes", [(4 * KiB, 64 * KiB), (64 * KiB, 4 * KiB), (0, 4 * KiB),
                                                    (4 * KiB, 0), (32 * KiB, 32 * KiB + 1),
                                                    (64 * MiB, 128 * MiB), (128 * MiB, 64 * MiB), (64 * MiB, MiB)],
                         ids=["4K-into-64K", "64K-into-4K", "0-into-4K", "4K-into-0", "32K-into-32K+1",
                              "64M-into-128M", "128M-into-64M", "64M-into-1M"])
def test_a_size_mismatch_of_any_cut_raises_on_both_pes_once(world, peer, path, send_bytes, recv_bytes,
                                                            fresh_channels):
    rank = world[0]
    outcome = _Outcome(world)
    got = torch.zeros(recv_bytes, dtype=torch.uint8, device="cuda")
    outgoing = _bytes(rank, 50, send_bytes)
    torch.cuda.synchronize()
    begin = time.monotonic()
    with outcome.check("the mismatched send/recv"):
        if rank == 0:
            pydatacopy.send(outgoing, peer, timeout=MISMATCH_TIMEOUT_S)
        else:
            pydatacopy.recv(got, peer, timeout=MISMATCH_TIMEOUT_S)
        torch.cuda.synchronize()
    with outcome.check("the calls' duration"):
        assert time.monotonic() - begin < MISMATCH_TIMEOUT_S, "the mismatched calls took the whole timeout"
    if rank == 1:
        with outcome.expect_error("the receiver's check_errors",
                                  _refusal(rf"sender's message is {send_bytes} bytes but this recv expected {recv_bytes}",
                                           send_bytes, recv_bytes)):
            pydatacopy.check_errors()
        with outcome.check("nothing delivered"):
            assert torch.count_nonzero(got).item() == 0, "the mismatched recv copied data out"
    outcome.agree("the receiver's refusal")
    if rank == 0:
        with outcome.expect_error("the sender's check_errors",
                                  _refusal(rf"receiver expected {recv_bytes} bytes", recv_bytes, send_bytes)):
            pydatacopy.check_errors()
    with outcome.check("reported once"):
        pydatacopy.check_errors()
        assert not pydatacopy._C.peer_timed_out(peer), "a size mismatch marked the peer as timed out"
    outcome.agree("the sender's refusal")
    pydatacopy.setup_send_recv()
    _exchange_is_exact(outcome, rank, peer, 60, [recv_bytes, send_bytes, 4 * KiB])
    outcome.agree("the exchanges after setup_send_recv")


def test_a_sendrecv_mismatched_both_ways_reports_each_direction_once(world, peer, path, fresh_channels):
    """Each PE sends 4 MiB and expects 8 MiB: each is the receiver of one mismatch and the sender
    of the other, and hears of both, once each."""
    rank = world[0]
    outcome = _Outcome(world)
    got = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with outcome.check("the sendrecv"):
        pydatacopy.sendrecv(_bytes(rank, 70, 4 * MiB), peer, got, peer, timeout=MISMATCH_TIMEOUT_S)
        torch.cuda.synchronize()
    outcome.agree("the sendrecv")
    heard = []
    for attempt in range(3):
        try:
            pydatacopy.check_errors()
        except pydatacopy.Error as error:
            heard.append(str(error))
    with outcome.check("both directions, once each"):
        assert len(heard) == 2, f"heard {len(heard)} errors: {heard}"
        assert any(re.search(_refusal("sender's message is 4194304 bytes but this recv expected 8388608",
                                      4194304, 8388608), h) for h in heard), heard
        assert any(re.search(_refusal("receiver expected 8388608 bytes", 8388608, 4194304), h) for h in heard), heard
    outcome.agree("the reports")
    pydatacopy.setup_send_recv()
    _exchange_is_exact(outcome, rank, peer, 80, [8 * MiB, 4 * KiB])
    outcome.agree("the exchanges after setup_send_recv")


# ---- messages cut differently, small ones signalling only the pages they fill -----------------
# Small chunks signal only the pages (32 KiB) they fill, and the sender waits for the credit of
# the last chunk that filled each page. test_mixed_sizes_after_small_messages runs many cuts with
# both PEs at the same pace; old code signalled every page, so it passed there too: it guards the
# scheme. test_a_slow_receiver_keeps_a_small_message_page_by_page is the case that can fail on it.

@pytest.mark.parametrize("chunking", [None, (1 * MiB, 2)], ids=["default", "1MiB-x2"])
def test_mixed_sizes_after_small_messages(world, peer, path, chunking, fresh_channels):
    rank = world[0]
    outcome = _Outcome(world)
    if chunking is not None:
        pydatacopy.setup_send_recv(chunk_bytes=chunking[0], num_chunks=chunking[1])
    sizes = [4 * KiB, 3 * MiB + 5, 4 * KiB, 5, 64 * KiB + 3, 3 * MiB + 5, 17 * MiB + 1, 4 * KiB,
             32 * KiB, 32 * KiB + 1, 4 * KiB]
    _exchange_is_exact(outcome, rank, peer, 100, sizes)
    # One way too, each direction in turn (a send alone, no recv beside it in its launch).
    for tag, nbytes in enumerate([4 * KiB, 3 * MiB + 5, 4 * KiB]):
        with outcome.check(f"one way, {nbytes} bytes"):
            recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            if rank == 0:
                pydatacopy.send(_bytes(rank, 200 + tag, nbytes), peer)
                pydatacopy.recv(recv, peer)
            else:
                pydatacopy.recv(recv, peer)
                pydatacopy.send(_bytes(rank, 200 + tag, nbytes), peer)
            _assert_bytes(recv, _bytes(peer, 200 + tag, nbytes), f"one way, {nbytes} bytes")
    with outcome.check("after the one-way messages"):
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    outcome.agree("the end of the test")  # then fresh_channels restores the default engine


# About 50-100 ms of GPU time (the SM clock is 1.5-2 GHz): long enough that the sender's kernels
# run far ahead of the receiver's, short against any timeout.
_RECEIVER_DELAY_CYCLES = 100_000_000


@pytest.mark.parametrize("sender", [0, 1])
def test_a_slow_receiver_keeps_a_small_message_page_by_page(world, peer, path, sender,
                                                            fresh_channels):
    """Two 1 MiB slots of 32 pages. A large message fills every page of both slots, a small one
    then fills only the first page(s) of one slot, and the next large message laps onto that
    slot. The receiver sleeps on its stream before each recv, so the sender's kernels run ahead
    and reach the small message's slot while the small message is still unread there. The sender
    must wait for the small message's credit on the pages it filled; a sender that takes the
    credit the earlier large message left on that slot (stale: the receiver had read the large
    message, not the small one) overwrites the small message, which then arrives with the next
    message's bytes, or the receiver fails or times out. Old code signalled every page and
    passed; a page-signalling sender with stale credits fails here."""
    rank = world[0]
    outcome = _Outcome(world)
    pydatacopy.setup_send_recv(chunk_bytes=1 * MiB, num_chunks=2)
    # (large, small, large); the small message fills one page, two pages, two pages after a
    # large message whose last chunk (7 bytes) filled one page, all but one page.
    rounds = [(2 * MiB, 5, 3 * MiB + 5), (2 * MiB, 32 * KiB + 1, 4 * MiB),
              (1 * MiB + 7, 40 * KiB, 3 * MiB + 5), (2 * MiB, 1 * MiB - 32 * KiB, 2 * MiB + 1)]
    tag = 400 + 100 * sender
    with outcome.check(f"PE {sender} sending to a slow PE {1 - sender}"):
        for round_, sizes in enumerate(rounds):
            received = []
            for n, nbytes in enumerate(sizes):
                if rank == sender:
                    pydatacopy.send(_bytes(rank, tag + 10 * round_ + n, nbytes), peer)
                else:
                    recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
                    torch.cuda._sleep(_RECEIVER_DELAY_CYCLES)  # on the stream recv is queued on
                    pydatacopy.recv(recv, peer)
                    received.append(recv)
            torch.cuda.synchronize()
            for n, recv in enumerate(received):
                _assert_bytes(recv, _bytes(peer, tag + 10 * round_ + n, recv.numel()),
                              f"round {round_}: message {n} of sizes {sizes}")
        pydatacopy.check_errors()
    outcome.agree(f"PE {sender} sending to a slow receiver")  # then the default engine returns


# ---- the timeout is a watchdog on progress --------------------------------------------------
# A transfer made slow on purpose (one block, 1 KiB chunks, two slots: many short steps), sized
# from measurements in this run so that it takes at least four times its timeout, runs with that
# timeout; the timeout is never under 0.5 s, so that a GPU shared with other processes (MPS)
# cannot stall a live transfer that long. Old code took the timeout as a deadline from the
# kernel's start, so that run timed out there. LAST IN THE MODULE ON PURPOSE: a timeout marks the
# peer for the rest of the process, and every later send/recv test would fail with it.

_TIMEOUT_FLOOR_S = 0.5
_TRANSFER_OVER_TIMEOUT = 4  # the transfer takes at least this many times its timeout
_MAX_TRANSFER_BYTES = 4 * GiB  # send + recv + the expected copy: 12 GiB a PE


def _timed_sendrecv(world, peer, send, recv, nbytes) -> float:
    """Seconds the fastest PE's sendrecv of `nbytes` took: every PE gets the same value, so that
    every PE takes the same next step; a failure on any PE fails every PE."""
    outcome = _Outcome(world)
    seconds = math.inf
    torch.cuda.synchronize()
    dist.barrier()
    with outcome.check(f"the sendrecv of {nbytes} bytes without a short timeout"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pydatacopy.sendrecv(send[:nbytes], peer, recv[:nbytes], peer)
        end.record()
        torch.cuda.synchronize()
        pydatacopy.check_errors()
        seconds = start.elapsed_time(end) / 1e3
    outcome.agree(f"timing {nbytes} bytes")
    elapsed = [None] * world[1]
    dist.all_gather_object(elapsed, seconds)
    return min(elapsed)


def test_a_transfer_still_moving_outlives_a_short_timeout(world, peer, fresh_channels):
    rank = world[0]
    outcome = _Outcome(world)
    pydatacopy.setup_send_recv(chunk_bytes=1 * KiB, num_chunks=2, blocks=1)
    send = _bytes(rank, 300, _MAX_TRANSFER_BYTES)
    recv = torch.zeros(_MAX_TRANSFER_BYTES, dtype=torch.uint8, device="cuda")
    pydatacopy.sendrecv(send[:MiB], peer, recv[:MiB], peer)  # warm-up
    # Grow the transfer until it takes the wanted time (every PE sees the same minimum elapsed
    # time, so every PE picks the same size), within the buffers.
    wanted_s = _TRANSFER_OVER_TIMEOUT * _TIMEOUT_FLOOR_S * 1.25
    nbytes = 64 * MiB
    elapsed = _timed_sendrecv(world, peer, send, recv, nbytes)
    while elapsed < wanted_s and nbytes < _MAX_TRANSFER_BYTES:
        grow = max(2.0, 1.25 * wanted_s / max(elapsed, 1e-6))
        nbytes = min(_MAX_TRANSFER_BYTES, int(math.ceil(nbytes * grow / MiB)) * MiB)
        elapsed = _timed_sendrecv(world, peer, send, recv, nbytes)
    timeout = max(_TIMEOUT_FLOOR_S, elapsed / _TRANSFER_OVER_TIMEOUT)
    if elapsed < _TRANSFER_OVER_TIMEOUT * timeout * 0.75:
        pytest.skip(f"{nbytes} bytes at 1 KiB chunks on one block took only {elapsed:.3f} s: "
                    f"too fast to outlast {_TRANSFER_OVER_TIMEOUT} timeouts of {timeout} s, so "
                    "this test could not fail")  # the same decision on every PE (same elapsed)
    recv.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    what = f"{nbytes} bytes in about {elapsed:.3f} s with timeout={timeout:.3f} s"
    with outcome.check(what):
        pydatacopy.sendrecv(send[:nbytes], peer, recv[:nbytes], peer, timeout=timeout)
        torch.cuda.synchronize()
        pydatacopy.check_errors()
        _assert_bytes(recv[:nbytes], _bytes(peer, 300, _MAX_TRANSFER_BYTES)[:nbytes], what)
    outcome.agree("the transfer with a short timeout")
