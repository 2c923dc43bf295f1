"""Streams the caller chooses, and streams the caller destroys (issue 19, review items 1 and 2).

group() launches on the stream its calls were made on; all calls of a group must come to one
stream. The engines keep no stream of the caller's: after a user's stream is destroyed, later
calls on the same channel from other streams work. One channel's launches stay in call order
whatever streams they come on (the engine's event wait, skipped only on the stream of the
channel's last launch, by cudaStreamGetId). Two PEs; every data check compares bytes against
fresh data for that round, with the destination cleared first.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

import pydatacopy

MiB = 1 << 20


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    """Random bytes PE `pe` sends under `tag`; the receiver regenerates them to compare."""
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 9_000_011 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} bytes differ, first at {bad[0].item()}")


# ---- a stream the caller creates and destroys (the CUDA runtime through ctypes) ---------------

def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (torch's own streams are pooled and never destroyed)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return ctypes.CDLL(path)
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    pytest.skip("no libcudart to create and destroy a stream with")


class _UserStream:
    """A cudaStream_t made and destroyed by the caller, as a CuPy stream or ExternalStream is."""

    def __init__(self) -> None:
        self._cudart = _cudart()
        handle = ctypes.c_void_p()
        code = self._cudart.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1))  # non-blocking
        assert code == 0, f"cudaStreamCreateWithFlags returned {code}"
        self.handle = handle.value
        self.torch = torch.cuda.ExternalStream(self.handle)

    def destroy(self, wait: bool = True) -> None:
        # cudaStreamDestroy returns at once and lets the queued work finish on its own: wait for
        # it here (unless told not to), so that what the caller reads next is the work's result.
        if wait:
            self.torch.synchronize()
        code = self._cudart.cudaStreamDestroy(ctypes.c_void_p(self.handle))
        assert code == 0, f"cudaStreamDestroy returned {code}"


def _stream_wait(handle: int, event: torch.cuda.Event) -> None:
    """cudaStreamWaitEvent on a raw handle (a destroyed stream's successor, a per-thread stream)."""
    code = _cudart().cudaStreamWaitEvent(ctypes.c_void_p(handle), ctypes.c_void_p(event.cuda_event),
                                         ctypes.c_uint(0))
    assert code == 0, f"cudaStreamWaitEvent returned {code}"


# ---- group(): the stream where the calls are made ---------------------------------------------

def test_group_launches_on_the_stream_of_its_calls(world, peer):
    """Old code launched at the group's exit on the then current (default) stream, which does not
    wait for the fill on the side stream: the peer received zeros. Launched on `side` without
    record_stream, the allocator gives x's memory to `reuse` at once and the 99s land in it
    after the fill, before the send reads it."""
    rank = world[0]
    n = MiB // 4
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    received = torch.zeros(n, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    with pydatacopy.group():
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # a launch elsewhere runs before the fill
            x.fill_(7 + rank)
            filled = torch.cuda.Event()
            filled.record(side)
            torch.cuda._sleep(20_000_000)  # the 99s below land here, when x is not kept alive
            pydatacopy.send(x, peer)
            pydatacopy.recv(received, peer)
    del x
    torch.cuda.current_stream().wait_event(filled)
    reuse = torch.empty(n, dtype=torch.int32, device="cuda")
    reuse.fill_(99)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    assert torch.equal(received, torch.full_like(received, 7 + peer)), (
        f"received {received[:4].tolist()}..., want {7 + peer}")
    del reuse


def test_group_calls_on_two_streams_are_refused_before_anything_launches(world, peer):
    """Old code compared the calls' unresolved stream= (None both times) and launched both."""
    rank = world[0]
    nbytes = 64 << 10
    x = _bytes(rank, 1, nbytes)
    received = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with pytest.raises(pydatacopy.Error, match="one stream"):
        with pydatacopy.group():
            with torch.cuda.stream(first):
                pydatacopy.send(x, peer)
            with torch.cuda.stream(second):
                pydatacopy.recv(received, peer)
    # Nothing moved: the channel is where it was, and a fresh exchange is byte-exact.
    torch.cuda.synchronize()
    x = _bytes(rank, 2, nbytes)
    pydatacopy.sendrecv(x, peer, received, peer)
    torch.cuda.synchronize()
    _assert_bytes(received, _bytes(peer, 2, nbytes), "after the refused group")
    pydatacopy.check_errors()


def test_group_stream_applies_to_calls_without_one(world, peer):
    """group(stream=s) with calls that give no stream: they run on s (old code raised)."""
    rank = world[0]
    nbytes = 3 * MiB + 5
    side = torch.cuda.Stream()
    x = _bytes(rank, 3, nbytes)
    received = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with pydatacopy.group(stream=side):
        pydatacopy.send(x, peer)
        pydatacopy.recv(received, peer)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    _assert_bytes(received, _bytes(peer, 3, nbytes), "group(stream=side)")
    pydatacopy.check_errors()


# ---- a destroyed user stream ------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [4096, 9 * MiB + 3], ids=["4K", "9M+3"])
def test_send_recv_after_the_last_stream_of_the_channel_was_destroyed(world, peer, nbytes):
    """Old code kept the channel's last raw stream and queried it at the next call on another
    stream: cudaStreamGetCaptureInfo on the destroyed stream failed until setup_send_recv()."""
    rank = world[0]
    # Symmetric buffers: torch's allocator would record_stream on the user's stream and touch it
    # again when they are freed, after it is gone (a hazard of record_stream, not of ours).
    send, received = pydatacopy.empty(nbytes, torch.uint8), pydatacopy.empty(nbytes, torch.uint8)
    # Made first: a stream created after the destroy could take the destroyed one's handle.
    other = torch.cuda.Stream()
    try:
        user = _UserStream()
        send.copy_(_bytes(rank, 10, nbytes))
        received.zero_()
        user.torch.wait_stream(torch.cuda.current_stream())
        pydatacopy.sendrecv(send, peer, received, peer, stream=user.torch)
        with pydatacopy.group(stream=user.handle):  # a raw handle too
            pydatacopy.send(send, peer, stream=user.handle)
            pydatacopy.recv(received, peer, stream=user.handle)
        # `received` is read on the current stream, which does not wait for the user's: the host
        # waits for the user stream before it goes (cudaStreamDestroy itself does not wait).
        user.torch.synchronize()
        user.destroy()
        _assert_bytes(received, _bytes(peer, 10, nbytes), "on the user's stream")
        for round_ in range(3):
            with torch.cuda.stream(other):
                send.copy_(_bytes(rank, 11 + round_, nbytes))
                received.zero_()
                if round_ == 0:
                    pydatacopy.sendrecv(send, peer, received, peer)
                elif round_ == 1:
                    with pydatacopy.group():
                        pydatacopy.send(send, peer)
                        pydatacopy.recv(received, peer)
                else:  # one way at a time, separate launches
                    if rank == 0:
                        pydatacopy.send(send, peer)
                        pydatacopy.recv(received, peer)
                    else:
                        pydatacopy.recv(received, peer)
                        pydatacopy.send(send, peer)
            other.synchronize()
            _assert_bytes(received, _bytes(peer, 11 + round_, nbytes), f"round {round_} after destroy")
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        pydatacopy.free(send)
        pydatacopy.free(received)


# ---- one channel's launches on several streams: in call order, whatever the streams ---------
# The engine skips the channel order's event wait when a launch comes on the stream (by
# cudaStreamGetId) of the channel's last one. Each case sends two messages on one channel: the
# first on a stream held back behind a delay, the second issued at once on the case's stream. Had
# the second launch not waited for the first, it would run first and take the channel's first
# sequence (counted on the device): the receiver, whose two recvs run in order on one stream,
# would find the messages swapped. Staged sizes: such a send completes without its receiver.

_DELAY_CYCLES = 20_000_000  # ~10 ms on the GPU: the first launch is still queued when the second comes
_PER_THREAD = 2  # cudaStreamPerThread: each thread's own default stream


def _send_two(case: str, messages: list[torch.Tensor], peer: int) -> list[_UserStream]:
    """messages[0], held back on a first stream, then messages[1] on the case's second stream;
    returns the user streams to destroy once the device is synchronised."""
    delay = torch.cuda.Stream()
    with torch.cuda.stream(delay):
        torch.cuda._sleep(_DELAY_CYCLES)
    delayed = torch.cuda.Event()
    delayed.record(delay)

    def first(handle: int) -> None:
        _stream_wait(handle, delayed)
        pydatacopy.send(messages[0], peer, stream=handle)

    if case == "same_stream":  # the skipped wait: stream order alone keeps them in order
        side = torch.cuda.Stream()
        first(side.cuda_stream)
        pydatacopy.send(messages[1], peer, stream=side)
    elif case == "two_streams":
        side, other = torch.cuda.Stream(), torch.cuda.Stream()
        first(side.cuda_stream)
        pydatacopy.send(messages[1], peer, stream=other)
    elif case == "then_default_stream":  # torch's streams do not block the legacy default stream
        side = torch.cuda.Stream()
        first(side.cuda_stream)
        pydatacopy.send(messages[1], peer)  # torch's current stream: the default stream, handle 0
    elif case == "destroyed_then_new":  # the new stream may take the destroyed one's handle
        user = _UserStream()
        first(user.handle)
        user.destroy(wait=False)  # its queued wait and send still run, later
        new = _UserStream()
        pydatacopy.send(messages[1], peer, stream=new.handle)
        return [new]
    elif case == "per_thread_streams":  # one handle, a stream per thread (always ordered by the event)
        device = torch.cuda.current_device()
        errors: list[BaseException] = []
        first_issued, second_issued = threading.Event(), threading.Event()

        def thread_a() -> None:  # alive until the second send is issued: its stream lives on
            try:
                torch.cuda.set_device(device)
                first(_PER_THREAD)
            except BaseException as error:  # noqa: BLE001 (raised in the main thread below)
                errors.append(error)
            finally:
                first_issued.set()
            second_issued.wait(60)

        def thread_b() -> None:
            first_issued.wait(60)
            try:
                torch.cuda.set_device(device)
                pydatacopy.send(messages[1], peer, stream=_PER_THREAD)
            except BaseException as error:  # noqa: BLE001
                errors.append(error)
            finally:
                second_issued.set()

        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    else:
        raise AssertionError(f"unknown case {case}")
    return []


@pytest.mark.parametrize("nbytes", [4096, MiB + 3], ids=["4K", "1M+3"])
@pytest.mark.parametrize("case", ["same_stream", "two_streams", "then_default_stream", "destroyed_then_new",
                                  "per_thread_streams"])
def test_one_channel_on_several_streams_stays_in_call_order(world, peer, case, nbytes):
    rank = world[0]
    # Symmetric: a tensor on a destroyed or per-thread stream is not given to record_stream.
    messages = [pydatacopy.empty(nbytes, torch.uint8) for _ in range(2)]
    received = [pydatacopy.empty(nbytes, torch.uint8) for _ in range(2)]
    streams: list[_UserStream] = []
    try:
        for sender in (0, 1):
            tags = [40 + 2 * sender, 41 + 2 * sender]
            for message, tag in zip(messages, tags):
                message.copy_(_bytes(rank, tag, nbytes))
            for buffer in received:
                buffer.zero_()
            torch.cuda.synchronize()  # every stream below starts after the fills
            if rank == sender:
                streams += _send_two(case, messages, peer)
            else:
                for buffer in received:
                    pydatacopy.recv(buffer, peer)
            torch.cuda.synchronize()
            if rank != sender:
                for i, (buffer, tag) in enumerate(zip(received, tags)):
                    _assert_bytes(buffer, _bytes(peer, tag, nbytes), f"{case}: message {i} from PE {peer}")
            pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        for stream in streams:
            stream.destroy()
        for tensor in messages + received:
            pydatacopy.free(tensor)


def test_token_exchange_after_its_streams_were_destroyed(world, peer):
    """Old code recorded an event on the stream that waited for a set's last round when the set
    was exchanged again: on a destroyed stream, cudaStreamGetCaptureInfo failed."""
    rank = world[0]
    n_tokens, token_size = 256, 4096
    nbytes = n_tokens * token_size
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    other = torch.cuda.Stream()  # made first: it cannot take the destroyed stream's handle
    try:
        user = _UserStream()
        for round_ in range(2):  # both buffer sets last waited for on the user's stream
            # Torch memory is allocated on torch's current stream only, never under the user's
            # stream: under expandable segments torch ties a segment to the stream a block was
            # allocated on and synchronises that stream when it unmaps the segment
            # (torch.cuda.empty_cache(), a later test's), after the stream is destroyed here: a
            # SIGSEGV inside torch (issue 36's crash of the expandable-segments suite).
            data = _bytes(rank, 20 + round_, nbytes).view(n_tokens, token_size)
            user.torch.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(user.torch):
                dbm.send_buffer.copy_(data)
                if round_ == 0:  # given as stream=
                    r = dbm.exchange(stream=user.torch)
                    got = dbm.wait(r, stream=user.torch)
                else:  # torch's current stream
                    r = dbm.exchange()
                    got = dbm.wait(r)
            torch.cuda.current_stream().wait_stream(user.torch)
            _assert_bytes(got.clone(), _bytes(peer, 20 + round_, nbytes), f"round {round_} on the user's stream")
        user.torch.synchronize()  # cudaStreamDestroy does not wait for the work queued on it
        user.destroy()
        other.wait_stream(torch.cuda.current_stream())
        copies = []
        for round_ in range(2, 6):
            with torch.cuda.stream(other):
                dbm.send_buffer.copy_(_bytes(rank, 20 + round_, nbytes).view(n_tokens, token_size))
                r = dbm.exchange()
                copies.append(dbm.wait(r).clone())
        torch.cuda.synchronize()
        for i, got in enumerate(copies):
            _assert_bytes(got, _bytes(peer, 22 + i, nbytes), f"round {i + 2} after destroy")
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        dbm.cleanup()
