"""torch.compile of pydatacopy's calls (issue 25): a function that computes, sends, receives and
computes again, compiled with fullgraph=True, gives the bytes eager gives, also under
mode="reduce-overhead" (CUDA graphs) replayed 100 times with fresh data; put, barrier and the
signal calls compiled; the token exchange compiled. Dynamo's "eager" backend proves the tracing
alone; inductor (the default backend, what users run) proves the compiled code.

Two-PE module (peer = 1 - rank), except the ring tests, marked any_pes (2 or 4 PEs). Every PE
runs the same compiled functions the same number of times, so the transfers inside line up.
Failures are recorded, not raised, and `in_step` fails every PE together after the test: a PE
that raised alone would leave the others in a transfer or barrier until their timeout.

What can go wrong first on the GPU (not run before this was written): a graph that inductor
would not keep in CUDA graphs (cudagraph_skips, checked: a mutated input that is not static, or
a CPU tensor); a compile that fails on one PE only (the other then times out in its first
transfer, TIMEOUT_S); inductor needing a C compiler and Triton on the machine."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import pydatacopy

TIMEOUT_S = 60.0  # a watchdog on progress: covers one PE compiling a little longer than the other
N = 4099  # elements: not a multiple of a block or a page
REPLAYS = 100

_FAILURES: list[str] = []


@contextlib.contextmanager
def _recorded(what: str):
    try:
        yield
    except Exception as error:  # pydatacopy.Error, Dynamo's and inductor's errors, assertions
        _FAILURES.append(f"{what}: {type(error).__name__}: {str(error)[:2000]}")


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got_bytes, want_bytes = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    if got.dtype != want.dtype or got_bytes.numel() != want_bytes.numel():
        _FAILURES.append(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                         f"{tuple(want.shape)}")
    elif not torch.equal(got_bytes, want_bytes):
        differ = got_bytes != want_bytes
        _FAILURES.append(f"{what}: {int(differ.sum())} of {want_bytes.numel()} bytes differ, first "
                         f"at {int(differ.to(torch.uint8).argmax())}")


@pytest.fixture(scope="module")
def inductor_ready(world):
    """Inductor's first compile in a process loads Triton and starts its workers (tens of seconds,
    more on one PE than on another): done here, with no transfer waiting on the peer."""
    with _recorded("warming inductor up"):
        torch.compile(lambda x: x * 3 + 1, fullgraph=True)(torch.ones(8, device="cuda"))
        torch.cuda.synchronize()
    dist.barrier()


@pytest.fixture(autouse=True)
def in_step(world, inductor_ready):
    """Fresh compile caches and counters; after the test, every PE's failures on every PE."""
    _FAILURES.clear()
    torch._dynamo.reset()
    yield
    with _recorded("after the test"):
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    every = [None] * world[1]
    dist.all_gather_object(every, list(_FAILURES))
    torch._dynamo.reset()
    bad = [f"PE {pe}: {failure}" for pe, failures in enumerate(every) for failure in failures]
    if bad:
        pytest.fail("; ".join(bad), pytrace=False)


def _data(src_pe: int, dst_pe: int, tag: int, n: int = N) -> torch.Tensor:
    """int32 values PE `src_pe` starts from in round `tag` toward `dst_pe`; any PE regenerates
    them. Integers: the compute around the transfers is exact in eager and in Triton alike."""
    seed = ((src_pe + 1) * 1_000_003 + dst_pe + 1) * (2**32 + 15) + tag
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-(2**20), 2**20, (n,), dtype=torch.int32, device="cuda", generator=generator)


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


# ---- compute, send, receive, compute again (two PEs) ----------------------------------------------

def _step(x: torch.Tensor, sym: torch.Tensor, peer: int) -> torch.Tensor:
    y = x * 3 + 1
    got = torch.empty_like(y)
    pydatacopy.sendrecv(y, peer, got, peer, timeout=TIMEOUT_S)
    pydatacopy.put(sym, y, peer)
    pydatacopy.quiet()
    pydatacopy.barrier(received=[sym], timeout=TIMEOUT_S)  # sym holds the peer's y after it
    # The peer's next put into sym comes after its next sendrecv, which needs this PE's next
    # sendrecv, which the stream runs after this read: one barrier a step is enough.
    return got * 2 - sym + x  # = the peer's y + x


def _want(me: int, peer: int, tag: int) -> torch.Tensor:
    return _data(peer, me, tag) * 3 + 1 + _data(me, peer, tag)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_step_is_byte_exact(world, peer, backend):
    me = world[0]
    sym = pydatacopy.empty(N, dtype=torch.int32)
    try:
        compiled = torch.compile(_step, backend=backend, fullgraph=True)
        for tag in range(4):
            with _recorded(f"round {tag}, eager"):
                sym.zero_()
                eager = _step(_data(me, peer, tag), sym, peer)
                _check(eager, _want(me, peer, tag), f"round {tag}, eager")
            with _recorded(f"round {tag}, compiled ({backend})"):
                sym.zero_()
                got = compiled(_data(me, peer, tag), sym, peer)
                _check(got, eager, f"round {tag}, compiled ({backend}) against eager")
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        pydatacopy.free(sym)


def test_reduce_overhead_replays_are_byte_exact(world, peer):
    """CUDA graphs (inductor's cudagraph trees): a warm-up run, a recorded run, then replays, each
    with fresh data; every output checked before the next call."""
    me = world[0]
    sym = pydatacopy.empty(N, dtype=torch.int32)
    try:
        skips = _cudagraph_skips()
        compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True)
        for tag in range(REPLAYS + 2):
            with _recorded(f"call {tag}"):
                torch.compiler.cudagraph_mark_step_begin()
                got = compiled(_data(me, peer, 1000 + tag), sym, peer)
                _check(got, _want(me, peer, 1000 + tag), f"call {tag} (reduce-overhead)")
            if len(_FAILURES) > 3:
                break  # the peer goes on alone only until its timeout: say what failed
        if _cudagraph_skips() != skips:
            _FAILURES.append("inductor skipped CUDA graphs for the step (see its "
                             "'skipping cudagraphs due to' warning): replays were not tested")
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        pydatacopy.free(sym)


# ---- put, signals, barrier (two PEs) ---------------------------------------------------------------

def _signals_step(x, sym, sym2, signal, signal2, value: int, peer: int):
    y = x + 7
    pydatacopy.put(sym, y, peer)
    pydatacopy.quiet()
    pydatacopy.signal_set(signal, value, peer)  # after the put is visible at the peer
    pydatacopy.put_signal(sym2, y * 2, peer, signal2, value)
    pydatacopy.signal_wait(signal, value, received=[sym], timeout=TIMEOUT_S)
    pydatacopy.signal_wait(signal2, value, received=[sym2], timeout=TIMEOUT_S)
    out = sym * 2 + sym2
    pydatacopy.barrier(received=[sym, sym2], timeout=TIMEOUT_S)  # both read before the next round
    return out


def test_put_signals_and_barrier_compiled(world, peer):
    """Signal values grow each round (signal_wait waits for >= value): the round's value is an
    argument, which Dynamo makes symbolic after the second value (one recompile). Not under CUDA
    graphs: a replay would wait for the value captured."""
    me = world[0]
    sym, sym2 = pydatacopy.empty(N, dtype=torch.int32), pydatacopy.empty(N, dtype=torch.int32)
    signal, signal2 = pydatacopy.empty(1, dtype=torch.uint64), pydatacopy.empty(1, dtype=torch.uint64)
    try:
        signal.zero_()
        signal2.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        compiled = torch.compile(_signals_step, fullgraph=True)
        for value in range(1, 5):
            with _recorded(f"round {value}"):
                got = compiled(_data(me, peer, value), sym, sym2, signal, signal2, value, peer)
                theirs = _data(peer, me, value) + 7
                _check(got, theirs * 2 + theirs * 2, f"round {value} (put + signal_set, put_signal)")
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        for tensor in (sym, sym2, signal, signal2):
            pydatacopy.free(tensor)


# ---- the token exchange (two PEs) ----------------------------------------------------------------

def test_token_exchange_compiled(world, peer):
    """exchange() and wait() traced: the round and buffer set come from the manager when the
    compiled code runs (the sets alternate), wait() returns a copy of the round's buffer."""
    me = world[0]
    n_tokens, token_size = 8, 96
    manager = pydatacopy.DoubleBufferManager()
    manager.init(n_tokens, token_size)
    try:
        def step(manager):
            manager.exchange(timeout=TIMEOUT_S)
            return manager.wait(timeout=TIMEOUT_S) + 0  # compute on what arrived

        compiled = torch.compile(step, fullgraph=True)
        for round_ in range(5):
            with _recorded(f"round {round_}"):
                mine = _data(me, peer, 500 + round_, n_tokens * token_size // 4)
                manager.send_buffer_of(round_).copy_(mine.view(torch.uint8).view(n_tokens, token_size))
                got = compiled(manager)
                theirs = _data(peer, me, 500 + round_, n_tokens * token_size // 4)
                _check(got, theirs.view(torch.uint8).view(n_tokens, token_size), f"round {round_}")
        with _recorded("rounds counted"):
            assert manager.round == 5, f"the manager counted {manager.round} rounds, not 5"
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        manager.cleanup()


# ---- a ring, any number of PEs --------------------------------------------------------------------

def _ring_step(x: torch.Tensor, next_pe: int, prev_pe: int) -> torch.Tensor:
    y = x * 5 + 2
    got = torch.empty_like(y)
    pydatacopy.sendrecv(y, next_pe, got, prev_pe, timeout=TIMEOUT_S)
    return got - 2 + x  # = 5 x_prev + x


def _ring(world):
    me, n = world[0], world[1]
    return me, (me + 1) % n, (me - 1) % n


@pytest.mark.any_pes
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_ring_compiled(world, mode):
    me, next_pe, prev_pe = _ring(world)
    skips = _cudagraph_skips()
    compiled = torch.compile(_ring_step, mode=mode, fullgraph=True)
    calls = REPLAYS + 2 if mode == "reduce-overhead" else 4
    for tag in range(calls):
        with _recorded(f"call {tag} ({mode})"):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            x = _data(me, next_pe, 2000 + tag)
            got = compiled(x, next_pe, prev_pe)
            want = _data(prev_pe, me, 2000 + tag) * 5 + x
            _check(got, want, f"call {tag} ({mode})")
            if tag == 0:
                _check(got, _ring_step(x, next_pe, prev_pe), "call 0 against eager")
        if len(_FAILURES) > 3:
            break
    if mode == "reduce-overhead" and _cudagraph_skips() != skips:
        _FAILURES.append("inductor skipped CUDA graphs for the ring step: replays were not tested")
