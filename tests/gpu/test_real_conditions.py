"""Real conditions, not the happy path (issue 12): CUDA graphs replayed many times, temporaries
sent on side streams while the allocator reuses their memory, any block count and a GPU whose SMs
are mostly taken, a symmetric allocation the GPU cannot hold, a bad call among good ones, barriers
behind busy streams, and the token exchange split over two streams. Every data check compares
bytes against fresh data generated for that round, with the destination cleared first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy import _C

MiB = 1 << 20


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    """Random bytes PE `pe` sends under `tag`; the receiver regenerates them to compare."""
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 7_000_003 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got.view(torch.uint8).reshape(-1) != want.view(torch.uint8).reshape(-1)).nonzero()
    return f"{bad.numel()} of {want.numel()} bytes differ, first at {bad[0].item() if bad.numel() else None}"


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got.view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1)):
        raise AssertionError(f"{what}: {_mismatch(got, want)}")


# ---- CUDA graphs -----------------------------------------------------------------------------

REPLAYS = 100


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 5, 64 * MiB], ids=["4K", "3M+5", "64M"])
def test_graph_sendrecv_every_replay_is_a_fresh_round(world, peer, nbytes):
    rank = world[0]
    send = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    recv = torch.empty_like(send)
    eager_send, eager_recv = torch.empty_like(send), torch.empty_like(send)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pydatacopy.sendrecv(send, peer, recv, peer)
    for replay in range(REPLAYS):
        send.copy_(_bytes(rank, replay, nbytes))
        recv.zero_()
        if rank == 1:
            torch.cuda._sleep(200_000)  # the peer runs late: a stale wait would be seen
        graph.replay()
        _assert_bytes(recv, _bytes(peer, replay, nbytes), f"replay {replay}")
        if replay % 10 == 3:  # eager calls on the same channel between replays
            eager_send.copy_(_bytes(rank, 10_000 + replay, nbytes))
            eager_recv.zero_()
            pydatacopy.sendrecv(eager_send, peer, eager_recv, peer)
            _assert_bytes(eager_recv, _bytes(peer, 10_000 + replay, nbytes), f"eager after {replay}")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


def test_graph_group_and_one_way_send_recv(world, peer):
    """group() of a send and a recv, then a one-way send (rank 0) / recv (rank 1), in one graph."""
    rank = world[0]
    nbytes = 3 * MiB + 5
    send = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    recv = torch.empty_like(send)
    one_way = torch.empty(4096 + 1, dtype=torch.uint8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pydatacopy.group():
            pydatacopy.send(send, peer)
            pydatacopy.recv(recv, peer)
        if rank == 0:
            pydatacopy.send(one_way, peer)
        else:
            pydatacopy.recv(one_way, peer)
    for replay in range(REPLAYS):
        send.copy_(_bytes(rank, replay, nbytes))
        recv.zero_()
        if rank == 0:
            one_way.copy_(_bytes(rank, 50_000 + replay, one_way.numel()))
        else:
            one_way.zero_()
            torch.cuda._sleep(200_000)
        graph.replay()
        _assert_bytes(recv, _bytes(peer, replay, nbytes), f"group, replay {replay}")
        if rank == 1:
            _assert_bytes(one_way, _bytes(peer, 50_000 + replay, one_way.numel()), f"one way, replay {replay}")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


def test_graph_token_exchange_every_replay_is_a_fresh_round(world, peer):
    rank = world[0]
    n_tokens, token_size = 512, 7168
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        # One eager round first, so that the graph starts on the second buffer set.
        dbm.send_buffer.copy_(_bytes(rank, 999, n_tokens * token_size).view(n_tokens, token_size))
        dbm.wait(dbm.exchange())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            round_ = dbm.exchange()
            received = dbm.wait(round_)
        sent = dbm.send_buffer_of(round_)
        for replay in range(REPLAYS):
            sent.copy_(_bytes(rank, replay, n_tokens * token_size).view(n_tokens, token_size))
            received.zero_()
            if rank == 1:
                torch.cuda._sleep(200_000)
            graph.replay()
            _assert_bytes(received, _bytes(peer, replay, n_tokens * token_size), f"replay {replay}")
            if replay % 10 == 3:  # an eager round (the other buffer set) between replays
                dbm.send_buffer.copy_(_bytes(rank, 5000 + replay, n_tokens * token_size).view(n_tokens, token_size))
                got = dbm.wait(dbm.exchange())
                _assert_bytes(got, _bytes(peer, 5000 + replay, n_tokens * token_size), f"eager after {replay}")
                # Back to the graph's set: the next eager exchange would use it, so round
                # numbers stay in step with the graph's set.
                dbm.send_buffer.copy_(_bytes(rank, 6000 + replay, n_tokens * token_size).view(n_tokens, token_size))
                got = dbm.wait(dbm.exchange())
                _assert_bytes(got, _bytes(peer, 6000 + replay, n_tokens * token_size), f"eager 2 after {replay}")
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        dbm.cleanup()


def test_graph_put_blocks_and_barrier(world, peer):
    rank = world[0]
    blocks, block_bytes = 256, 4096
    pool = pydatacopy.empty((blocks, block_bytes), dtype=torch.uint8)
    try:
        src = torch.empty((blocks, block_bytes), dtype=torch.uint8, device="cuda")
        dst_idx = torch.empty(64, dtype=torch.int64, device="cuda")
        src_idx = torch.empty(64, dtype=torch.int64, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pydatacopy.barrier()  # the peer has cleared its pool
            pydatacopy.put_blocks(pool, src, dst_idx, src_idx, peer)
            pydatacopy.quiet()
            pydatacopy.barrier()  # both puts landed
        for replay in range(REPLAYS):
            generator = torch.Generator(device="cuda").manual_seed(replay)
            perm = torch.randperm(blocks, device="cuda", generator=generator)[:64]
            # Both PEs draw the same indices; each sends its own rows.
            dst_idx.copy_(perm)
            src_idx.copy_(torch.randperm(blocks, device="cuda", generator=generator)[:64])
            src.copy_(_bytes(rank, replay, blocks * block_bytes).view(blocks, block_bytes))
            pool.zero_()
            graph.replay()
            want = _bytes(peer, replay, blocks * block_bytes).view(blocks, block_bytes)[src_idx]
            _assert_bytes(pool[dst_idx], want, f"replay {replay}")
            untouched = torch.ones(blocks, dtype=torch.bool, device="cuda")
            untouched[dst_idx] = False
            assert int(pool[untouched].count_nonzero()) == 0, f"replay {replay}: stray writes"
            pydatacopy.barrier()  # nobody clears its pool before the peer has read its result
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        pydatacopy.free(pool)


def test_graph_put_signal_wait(world, peer):
    rank = world[0]
    nbytes = 1 * MiB
    data = pydatacopy.empty(nbytes, dtype=torch.uint8)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    try:
        signal.zero_()
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pydatacopy.barrier(blocking=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pydatacopy.barrier()  # the peer cleared its copy of data
            pydatacopy.put_signal(data, src, peer, signal, 1)
            pydatacopy.signal_wait(signal, 1)
            signal.zero_()  # ready for the next replay (the peer's next put comes after a barrier)
        for replay in range(REPLAYS):
            src.copy_(_bytes(rank, replay, nbytes))
            data.zero_()
            if rank == 1:
                torch.cuda._sleep(200_000)
            graph.replay()
            _assert_bytes(data, _bytes(peer, replay, nbytes), f"replay {replay}")
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(signal)
        pydatacopy.free(data)


@pytest.mark.parametrize("call", ["empty", "free", "setup_send_recv", "barrier_blocking",
                                  "wait_blocking", "signal_wait_blocking", "dbm_init",
                                  "dbm_cleanup", "test_bandwidth", "init", "finalize"])
def test_calls_that_block_refuse_capture(world, peer, call):
    x = pydatacopy.empty(16, dtype=torch.uint8)
    dbm = pydatacopy.DoubleBufferManager()
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    if call in ("wait_blocking", "test_bandwidth", "dbm_cleanup"):
        dbm.init(4, 64)
        dbm.wait(dbm.exchange())
    calls = {
        "empty": lambda: pydatacopy.empty(16),
        "free": lambda: pydatacopy.free(x),
        "setup_send_recv": lambda: pydatacopy.setup_send_recv(),
        "barrier_blocking": lambda: pydatacopy.barrier(blocking=True),
        "wait_blocking": lambda: dbm.wait(blocking=True),
        "dbm_init": lambda: pydatacopy.DoubleBufferManager().init(4, 64),
        "test_bandwidth": lambda: dbm.test_bandwidth(world[0], world[1]),
        "signal_wait_blocking": lambda: pydatacopy.signal_wait(signal, 0, blocking=True),
        "dbm_cleanup": lambda: dbm.cleanup(),
        "init": lambda: pydatacopy.init(),
        "finalize": lambda: pydatacopy.finalize(),
    }
    graph = torch.cuda.CUDAGraph()
    try:
        with pytest.raises(pydatacopy.Error, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                calls[call]()
    finally:
        torch.cuda.synchronize()
        dbm.cleanup()
        pydatacopy.free(signal)
        pydatacopy.free(x)


# ---- lifetimes -----------------------------------------------------------------------------

def test_temporaries_on_a_side_stream_survive_allocator_churn(world, peer):
    rank = world[0]
    side = torch.cuda.Stream()
    nbytes = 4 * MiB
    received = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")  # nbytes / 4 floats
    for round_ in range(200):
        source = _bytes(rank, round_, nbytes).view(torch.float32)
        received.zero_()
        temporary = source.to(torch.bfloat16)  # made on the current stream
        side.wait_stream(torch.cuda.current_stream())
        if rank == 1:
            with torch.cuda.stream(side):
                torch.cuda._sleep(100_000)
        # The temporary is dropped at once; the allocator may hand its block to the next
        # allocation on the current stream while the side stream still reads it.
        pydatacopy.sendrecv(temporary, peer, received, peer, stream=side)
        del temporary
        for _ in range(4):  # churn: reuse freed blocks of that size on the current stream
            torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda").fill_(7)
        torch.cuda.current_stream().wait_stream(side)
        want = _bytes(peer, round_, nbytes).view(torch.float32).to(torch.bfloat16)
        _assert_bytes(received, want, f"round {round_}")
    torch.cuda.synchronize()


# ---- block counts and SMs held by another kernel -------------------------------------------

@pytest.mark.parametrize("blocks", [1, 7, 64, 256, 1024])
def test_send_recv_any_block_count(world, peer, blocks):
    rank = world[0]
    pydatacopy.setup_send_recv(blocks=blocks)
    try:
        for tag, nbytes in enumerate([5, 4096, 1 * MiB + 3, 64 * MiB]):
            recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            if rank == 0:  # one way, then back
                pydatacopy.send(_bytes(rank, tag, nbytes), peer)
                pydatacopy.recv(recv, peer)
            else:
                pydatacopy.recv(recv, peer)
                pydatacopy.send(_bytes(rank, tag, nbytes), peer)
            _assert_bytes(recv, _bytes(peer, tag, nbytes), f"blocks={blocks} bytes={nbytes}")
            recv.zero_()
            pydatacopy.sendrecv(_bytes(rank, 100 + tag, nbytes), peer, recv, peer)
            _assert_bytes(recv, _bytes(peer, 100 + tag, nbytes), f"sendrecv blocks={blocks} bytes={nbytes}")
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    finally:
        pydatacopy.setup_send_recv()


@pytest.mark.parametrize("free_sms", [4, 1])
@pytest.mark.parametrize("what", ["sendrecv", "exchange"])
def test_progress_while_another_kernel_holds_all_but_a_few_sms(world, peer, sm_share, what, free_sms):
    """`sm_share`: the SMs this process may use (its MPS client's share when PEs share a GPU;
    a kernel sized to the whole GPU would queue blocks behind itself and hold every SM)."""
    rank = world[0]
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    shared = properties.shared_memory_per_block_optin if hasattr(properties, "shared_memory_per_block_optin") \
        else 227 * 1024
    release = torch.zeros(1, dtype=torch.int32, device="cuda")
    by_flag = torch.ones(1, dtype=torch.int32, device="cuda")
    nbytes = 64 * MiB
    send = _bytes(rank, 1, nbytes)
    recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(1024, 7168)
    dbm.send_buffer.copy_(_bytes(rank, 2, 1024 * 7168).view(1024, 7168))
    # Two side streams: work on the legacy default stream would wait for the hog's kernel
    # whenever the hog's stream is a blocking one, whatever the SMs.
    hog, work = torch.cuda.Stream(), torch.cuda.Stream()
    # Every kernel this test launches while the hog runs is loaded first: with CUDA's lazy
    # loading, a kernel's first launch can wait for the running kernels (the hog) to end.
    torch.cuda._sleep(1)
    release.fill_(1)
    release.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    # One block per SM (all of its shared memory), on all but `free_sms` of this process's SMs,
    # for at most 20 s: the transfer must finish on the SMs left and release it, not wait for
    # its deadline.
    assert sm_share > free_sms, f"this process may use {sm_share} SMs, too few to leave {free_sms} free"
    _C._test_occupy_sms(sm_share - free_sms, 1024, shared, release.data_ptr(),
                        by_flag.data_ptr(), 20.0, hog.cuda_stream)
    with torch.cuda.stream(work):
        torch.cuda._sleep(1_000_000)  # let the hog reach the SMs first
        if what == "sendrecv":
            pydatacopy.sendrecv(send, peer, recv, peer, stream=work)
        else:
            round_ = dbm.exchange(stream=work)
            dbm.wait(round_, stream=work)
        release.fill_(1)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    try:
        assert by_flag.item() == 1, "the transfer only finished after the SM-holding kernel gave up"
        if what == "sendrecv":
            _assert_bytes(recv, _bytes(peer, 1, nbytes), f"sendrecv on {free_sms} SMs")
        else:
            _assert_bytes(dbm.recv_buffer(round_), _bytes(peer, 2, 1024 * 7168), f"exchange on {free_sms} SMs")
    finally:
        dbm.cleanup()


def test_group_of_two_sizes_to_one_peer(world, peer):
    """Two sends and two recvs on one channel pair in one group(): they follow each other in the
    channel's sequence and share its pages."""
    rank = world[0]
    sizes = [5, 20 * MiB + 3, 4096, 3 * MiB]
    for round_ in range(20):
        outs = [_bytes(rank, 100 * round_ + i, n) for i, n in enumerate(sizes)]
        ins = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
        with pydatacopy.group():
            for i in range(len(sizes)):
                pydatacopy.send(outs[i], peer)
                pydatacopy.recv(ins[i], peer)
        for i, n in enumerate(sizes):
            _assert_bytes(ins[i], _bytes(peer, 100 * round_ + i, n), f"round {round_}, message {i}")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


def test_one_channel_from_two_streams(world, peer):
    """Sends to one peer issued on two streams, receives on two others: the engine orders the
    launches of a channel, so messages neither overlap nor swap."""
    rank = world[0]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for round_ in range(50):
        a = _bytes(rank, 2 * round_, 9 * MiB + 1)
        b = _bytes(rank, 2 * round_ + 1, 1 * MiB)
        ra = torch.zeros(9 * MiB + 1, dtype=torch.uint8, device="cuda")
        rb = torch.zeros(1 * MiB, dtype=torch.uint8, device="cuda")
        for s in (s1, s2):
            s.wait_stream(torch.cuda.current_stream())
        if rank == 0:
            pydatacopy.send(a, peer, stream=s1)
            pydatacopy.send(b, peer, stream=s2)
            pydatacopy.recv(ra, peer, stream=s1)
            pydatacopy.recv(rb, peer, stream=s2)
        else:
            pydatacopy.recv(ra, peer, stream=s2)
            pydatacopy.recv(rb, peer, stream=s1)
            pydatacopy.send(a, peer, stream=s2)
            pydatacopy.send(b, peer, stream=s1)
        for s in (s1, s2):
            torch.cuda.current_stream().wait_stream(s)
        _assert_bytes(ra, _bytes(peer, 2 * round_, 9 * MiB + 1), f"round {round_}, first")
        _assert_bytes(rb, _bytes(peer, 2 * round_ + 1, 1 * MiB), f"round {round_}, second")
    torch.cuda.synchronize()
    pydatacopy.check_errors()


# ---- the symmetric heap --------------------------------------------------------------------

@pytest.mark.parametrize("what", ["1 TiB", "2x free"])
def test_allocation_too_large_is_an_error_on_every_pe(world, peer, what):
    rank = world[0]
    free_bytes, _ = torch.cuda.mem_get_info()
    every_free = [None] * world[1]
    dist.all_gather_object(every_free, free_bytes)  # on gloo and nccl alike
    nbytes = (1 << 40) if what == "1 TiB" else 2 * max(every_free)  # every PE asks the same size
    with pytest.raises(pydatacopy.Error, match="Nothing was allocated on any PE") as info:
        pydatacopy.empty((nbytes,), dtype=torch.uint8)
    assert str(nbytes) in str(info.value)
    print(f"rank {rank}: {info.value}")  # shown by scripts/gpu-hostile.sh (-rP)
    # The process goes on working.
    x = pydatacopy.empty(1 * MiB, dtype=torch.uint8)
    try:
        x.zero_()
        pydatacopy.barrier(blocking=True)
        pydatacopy.put(x, _bytes(rank, 3, 1 * MiB), peer)
        pydatacopy.quiet()
        pydatacopy.barrier(blocking=True)
        _assert_bytes(x, _bytes(peer, 3, 1 * MiB), "put after the failed allocation")
        recv = torch.zeros(3 * MiB, dtype=torch.uint8, device="cuda")
        pydatacopy.sendrecv(_bytes(rank, 4, 3 * MiB), peer, recv, peer)
        _assert_bytes(recv, _bytes(peer, 4, 3 * MiB), "sendrecv after the failed allocation")
    finally:
        pydatacopy.free(x)


# ---- a bad call among good ones ------------------------------------------------------------

def test_bad_block_index_does_not_cancel_a_token_wait_on_another_stream(world, peer):
    rank = world[0]
    n_tokens, token_size = 256, 4096
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    pool = pydatacopy.empty((8, 256), dtype=torch.uint8)
    try:
        waiting, bad = torch.cuda.Stream(), torch.cuda.Stream()
        dbm.send_buffer.copy_(_bytes(rank, 7, n_tokens * token_size).view(n_tokens, token_size))
        received = dbm.recv_buffer(0)
        received.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        # A put_blocks with an index out of range, on its own stream, found on the device first.
        src = torch.zeros((8, 256), dtype=torch.uint8, device="cuda")
        idx = torch.tensor([0, 99], dtype=torch.int64, device="cuda")
        ok = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
        pydatacopy.put_blocks(pool, src, idx, ok, peer, stream=bad)
        bad.synchronize()
        if rank == 1:
            torch.cuda._sleep(50_000_000)  # the peer's tokens come late (tens of ms)
        # Unrelated calls go on: the exchange, and a wait on another stream that must last until
        # the tokens are there, not end at the other call's error.
        round_ = dbm.exchange()
        dbm.wait(round_, stream=waiting)
        copy = torch.empty_like(received)
        with torch.cuda.stream(waiting):
            copy.copy_(received)  # what a consumer after wait() reads
        waiting.synchronize()
        _assert_bytes(copy, _bytes(peer, 7, n_tokens * token_size), "token round beside a bad put_blocks")
        with pytest.raises(pydatacopy.Error, match="put_blocks on PE .*block index 99"):
            pydatacopy.check_errors()
        pydatacopy.check_errors()  # reported once
    finally:
        torch.cuda.synchronize()
        pydatacopy.free(pool)
        dbm.cleanup()


def test_bad_block_index_on_one_pe_does_not_split_collectives(world, peer):
    """A bad index found on PE 0 only: blocking barriers and collective allocation go on alike on
    both PEs; only check_errors() on PE 0 reports it."""
    rank = world[0]
    pool = pydatacopy.empty((4, 64), dtype=torch.uint8)
    try:
        if rank == 0:
            src = torch.zeros((4, 64), dtype=torch.uint8, device="cuda")
            pydatacopy.put_blocks(pool, src, torch.tensor([7], device="cuda"),
                                  torch.tensor([0], device="cuda"), peer)
            torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        extra = pydatacopy.empty(1024, dtype=torch.uint8)
        pydatacopy.free(extra)
        pydatacopy.barrier(blocking=True)
        if rank == 0:
            with pytest.raises(pydatacopy.Error, match="put_blocks on PE 0: block index 7"):
                pydatacopy.check_errors()
        pydatacopy.check_errors()
    finally:
        pydatacopy.free(pool)


# ---- barriers ------------------------------------------------------------------------------

def test_put_barrier_empty_on_a_busy_stream(world, peer):
    rank = world[0]
    x = pydatacopy.empty(64 * 1024, dtype=torch.uint8)
    try:
        for round_ in range(1000):
            x.zero_()
            pydatacopy.barrier()  # both cleared
            torch.cuda._sleep(20_000 if (round_ + rank) % 2 else 0)  # one side's stream is busy
            pydatacopy.put(x, _bytes(rank, round_, 64 * 1024), peer)
            pydatacopy.barrier()
            y = pydatacopy.empty(4096, dtype=torch.uint8)  # a blocking collective meanwhile
            pydatacopy.free(y)
            _assert_bytes(x, _bytes(peer, round_, 64 * 1024), f"round {round_}")
            pydatacopy.barrier()  # read before the peer's next put
        torch.cuda.synchronize()
        pydatacopy.check_errors()
    finally:
        pydatacopy.free(x)


# ---- the token exchange over two streams ---------------------------------------------------

def test_exchange_on_one_stream_wait_on_another(world, peer):
    rank = world[0]
    n_tokens, token_size = 1024, 4096
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        copies = []
        for round_ in range(60):
            with torch.cuda.stream(b):
                dbm.send_buffer.copy_(_bytes(rank, round_, n_tokens * token_size).view(n_tokens, token_size))
                r = dbm.exchange(stream=b)
            with torch.cuda.stream(a):
                got = dbm.wait(r, stream=a)
                torch.cuda._sleep(300_000)  # a slow consumer on stream a
                copies.append(got.clone())
        torch.cuda.synchronize()
        for round_, got in enumerate(copies):
            _assert_bytes(got, _bytes(peer, round_, n_tokens * token_size), f"round {round_}")
        pydatacopy.check_errors()
    finally:
        torch.cuda.synchronize()
        dbm.cleanup()
