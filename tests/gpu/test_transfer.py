"""Byte-exact one-sided transfers between two PEs (on two GPUs, or sharing one): put/get on every
path, signals, barriers, batched puts and blocks, the forced RMA path, and argument errors (see
conftest.py for how to run; symmetric tensors are in test_symmetric.py, send/recv in
test_send_recv.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from byte_patterns import _as, _bytes, _direct, _raw, _torch_memory_registers


def _direct_paths(*paths: str) -> tuple[str, ...]:
    return paths if _direct() else tuple(p for p in paths if p not in ("copy_engine", "sm"))


SIZES = [1, 3, 4096, 65537, 1 << 20, (64 << 20) + 5]


@pytest.mark.parametrize("path", ["auto", "copy_engine", "sm", pytest.param("rma", marks=pytest.mark.registers_torch_memory)])
def test_put_and_get_byte_exact_every_path(world, peer, path):
    rank, _, _ = world
    symmetric = pydatacopy.empty((64 << 20) + 64, dtype=torch.uint8)
    if path not in _direct_paths(path):
        try:  # forced RMA: the direct-only paths must refuse, not misbehave
            with pytest.raises(pydatacopy.Error, match="directly reachable"):
                pydatacopy.put(symmetric[:16], _bytes(rank, 0, 16), peer, path=path)
        finally:
            pydatacopy.free(symmetric)
        return
    try:
        for tag, nbytes in enumerate(SIZES):
            offset = tag % 7  # odd offsets into the symmetric tensor
            dst = symmetric[offset:offset + nbytes]
            src = _bytes(rank, tag, nbytes)
            pydatacopy.put(dst, src, peer, path=path)  # both PEs put at once
            pydatacopy.barrier()
            torch.testing.assert_close(dst, _bytes(peer, tag, nbytes), rtol=0, atol=0)
            # get: read back what we wrote into the peer's copy
            fetched = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            pydatacopy.get(fetched, dst, peer, path=path)
            torch.testing.assert_close(fetched, src, rtol=0, atol=0)
            pydatacopy.barrier()
    finally:
        pydatacopy.free(symmetric)


def test_put_signal_and_signal_wait(world, peer):
    rank, _, _ = world
    data = pydatacopy.empty(1 << 20, dtype=torch.uint8)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    signal.zero_()
    pydatacopy.barrier()
    torch.cuda.synchronize()
    try:
        for value in range(1, 6):
            pydatacopy.put_signal(data, _bytes(rank, 200 + value, 1 << 20), peer, signal, value)
            pydatacopy.signal_wait(signal, value, blocking=True, timeout=20)
            torch.testing.assert_close(data, _bytes(peer, 200 + value, 1 << 20), rtol=0, atol=0)
            pydatacopy.barrier()  # the peer has read before we overwrite
        pydatacopy.signal_set(signal, 99, peer)
        pydatacopy.signal_wait(signal, 99, blocking=True, timeout=20)
    finally:
        pydatacopy.barrier()
        pydatacopy.free(signal)
        pydatacopy.free(data)


def test_barrier_with_deadline_orders_puts(world, peer):
    """The bounded barrier (quiet + epoch signals) must make every earlier put visible."""
    rank, _, _ = world
    box = pydatacopy.empty(4096, dtype=torch.int64)
    try:
        for i in range(200):
            src = torch.full((4096,), 2 * i + rank, dtype=torch.int64, device="cuda")
            paths = _direct_paths("auto", "sm", *(("rma",) if _torch_memory_registers() else ()))
            pydatacopy.put(box, src, peer, path=paths[i % len(paths)])
            pydatacopy.barrier(timeout=30, blocking=i % 4 == 0)
            assert torch.equal(box, torch.full_like(box, 2 * i + peer)), f"round {i}"
            pydatacopy.barrier(timeout=30)  # the peer has checked before we overwrite
    finally:
        pydatacopy.free(box)


def test_1000_random_rounds_mixing_sizes_and_paths(world, peer):
    rank, _, _ = world
    rng = random.Random(2026)  # same sequence on both PEs
    symmetric = pydatacopy.empty(4 << 20, dtype=torch.uint8)
    checked = 0
    try:
        for round_ in range(1000):
            nbytes = rng.choice([1, 2, 3, 15, 16, 17, 255, 4096, 12345, 1 << 16, 777777, 3 << 20])
            offset = rng.randrange(0, 64)
            kind = rng.choice(["sendrecv", "put", "put_sm", "put_rma"])
            outgoing = _bytes(rank, 10_000 + round_, nbytes)
            if kind == "sendrecv":
                base = torch.empty(nbytes + offset, dtype=torch.uint8, device="cuda")
                received = base[offset:]
                pydatacopy.sendrecv(outgoing[: nbytes], peer, received, peer)
            else:
                received = symmetric[offset:offset + nbytes]
                path = {"put": "auto", "put_sm": "sm" if _direct() else "auto", "put_rma": "rma" if _torch_memory_registers() else "auto"}[kind]
                pydatacopy.put(received, outgoing, peer, path=path)
                pydatacopy.barrier()
            assert torch.equal(received, _bytes(peer, 10_000 + round_, nbytes)), (round_, kind, nbytes)
            if kind != "sendrecv":
                pydatacopy.barrier()
            checked += 1
    finally:
        pydatacopy.free(symmetric)
    assert checked == 1000


@pytest.mark.parametrize("count", [1, 17, 1024, 4096])
@pytest.mark.parametrize("path", ["auto", pytest.param("rma", marks=pytest.mark.registers_torch_memory)])
def test_put_many_batched(world, peer, count, path):
    rank, _, _ = world
    rng = random.Random(count)
    sizes = [rng.randrange(1, 4097) for _ in range(count)]
    pool = pydatacopy.empty(sum(sizes) + 16 * count, dtype=torch.uint8)
    try:
        dsts, srcs, offset = [], [], 0
        for i, size in enumerate(sizes):
            dsts.append(pool[offset:offset + size])
            srcs.append(_bytes(rank, 50_000 + i, size))
            offset += size + (i % 16)
        pydatacopy.put_many(dsts, srcs, peer, path=path)
        pydatacopy.barrier()
        for i, size in enumerate(sizes):
            assert torch.equal(dsts[i], _bytes(peer, 50_000 + i, size)), i
        pydatacopy.barrier()
    finally:
        pydatacopy.free(pool)


def test_forced_rma_path_runs_everything(world, peer, force_rma):
    rank, _, _ = world
    symmetric = pydatacopy.empty(1 << 20, dtype=torch.uint8)
    try:
        assert pydatacopy.peer_view(symmetric, peer) is None
        with pytest.raises(pydatacopy.Error, match="directly reachable"):
            pydatacopy.put(symmetric, symmetric, peer, path="copy_engine")
        pydatacopy.put(symmetric, _bytes(rank, 600, 1 << 20), peer)
        pydatacopy.barrier()
        assert torch.equal(symmetric, _bytes(peer, 600, 1 << 20))
        for nbytes in [5, 4 << 20, (9 << 20) + 3]:
            received = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            pydatacopy.sendrecv(_bytes(rank, 601, nbytes), peer, received, peer)
            assert torch.equal(received, _bytes(peer, 601, nbytes))
        dbm = pydatacopy.DoubleBufferManager()
        dbm.init(300, 1001)
        for round_ in range(6):
            dbm.send_buffer.copy_(_bytes(rank, 700 + round_, 300 * 1001).view(300, 1001))
            received = dbm.wait(dbm.exchange())
            assert torch.equal(received, _bytes(peer, 700 + round_, 300 * 1001).view(300, 1001))
        dbm.cleanup()
        pydatacopy.barrier()
    finally:
        pydatacopy.free(symmetric)


def test_bad_inputs_raise_the_project_error(world, peer):
    rank, world_size, unique_id = world
    symmetric = pydatacopy.empty(1024, dtype=torch.float32)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    local = torch.zeros(1024, dtype=torch.float32, device="cuda")
    cases = [
        (lambda: pydatacopy.put(symmetric, local.cpu(), peer), "use .cuda"),
        (lambda: pydatacopy.put(symmetric, local[:10], peer), "size mismatch"),
        (lambda: pydatacopy.put(symmetric, local.int(), peer), "dtype mismatch"),
        (lambda: pydatacopy.put(symmetric.view(32, 32).t(), local.view(32, 32), peer), "contiguous"),
        (lambda: pydatacopy.put(local, symmetric, peer), "symmetric"),
        (lambda: pydatacopy.get(local, local, peer), "symmetric"),
        (lambda: pydatacopy.put(symmetric, local, 2), "out of range"),
        (lambda: pydatacopy.put(symmetric, local, -1), "out of range"),
        (lambda: pydatacopy.put(symmetric, local, peer, path="warp"), "path must be"),
        (lambda: pydatacopy.send(local.cpu(), peer), "use .cuda"),
        (lambda: pydatacopy.recv(local.view(32, 32).t(), peer), "contiguous"),
        (lambda: pydatacopy.send(local, 5), "out of range"),
        (lambda: pydatacopy.free(local), "returned by pydatacopy.empty"),
        (lambda: pydatacopy.signal_wait(symmetric, 1), "uint64"),
        (lambda: pydatacopy.put_many([symmetric], [], peer), "destinations"),
        (lambda: pydatacopy.put_many([local], [local], peer), "symmetric"),
        (lambda: pydatacopy.empty((4, -1)), "at least 0"),
        (lambda: pydatacopy.empty(4, dtype="float"), "torch.dtype"),
        (lambda: pydatacopy.barrier(timeout=0), "positive number of seconds"),
        (lambda: pydatacopy.barrier(timeout=-1.0), "positive number of seconds"),
        (lambda: pydatacopy.barrier(stream="main"), "torch.cuda.Stream"),
        (lambda: pydatacopy.signal_wait(signal, 1, timeout=0), "positive number of seconds"),
        (lambda: pydatacopy.send(local, peer, timeout=0), "positive number of seconds"),
        (lambda: pydatacopy.recv(local, peer, timeout="5"), "positive number of seconds"),
        (lambda: pydatacopy.peer_view(local, peer), "symmetric"),
        (lambda: pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), rank, world_size), "another unique ID"),
        (lambda: pydatacopy.init_nvshmem(unique_id, peer, world_size), "already initialised as rank"),
        (lambda: pydatacopy.DoubleBufferManager().init(1 << 30, 1 << 20), "1 TiB per buffer"),
    ]
    try:
        for call, words in cases:
            with pytest.raises(pydatacopy.Error) as info:
                call()
            assert words in str(info.value), (words, str(info.value))
        # Nothing moved: the send/recv channel is still in step (a refused call took no sequence).
        received = torch.empty(4097, dtype=torch.uint8, device="cuda")
        pydatacopy.sendrecv(_bytes(rank, 4242, 4097), peer, received, peer)
        assert torch.equal(received, _bytes(peer, 4242, 4097))
    finally:
        pydatacopy.barrier()
        pydatacopy.free(signal)
        pydatacopy.free(symmetric)


def test_tensor_on_another_device_raises_the_project_error(world, peer, local_device):
    """A source on a CUDA device other than this PE's is refused. Needs a second visible device:
    the ranks agree first, so that all of them run the case or all skip it (a rank raising alone
    would put the channel out of step)."""
    rank = world[0]
    count = torch.cuda.device_count()
    counts = [None] * world[1]
    dist.all_gather_object(counts, count)
    if min(counts) < 2:
        pytest.skip(f"needs a second CUDA device beside this PE's: the ranks see {counts} device(s)")
    # Not the peer's device: with ranks sharing a GPU that is this PE's own.
    other = (local_device + 1) % count
    symmetric = pydatacopy.empty(1024, dtype=torch.float32)
    try:
        with pytest.raises(pydatacopy.Error) as info:
            pydatacopy.put(symmetric, torch.zeros(1024, dtype=torch.float32, device=f"cuda:{other}"), peer)
        assert "move it there" in str(info.value), str(info.value)
        with pytest.raises(pydatacopy.Error) as info:
            pydatacopy.send(torch.zeros(64, dtype=torch.uint8, device=f"cuda:{other}"), peer)
        assert "move it there" in str(info.value), str(info.value)
        # Nothing moved: the send/recv channel is still in step.
        received = torch.empty(4097, dtype=torch.uint8, device="cuda")
        pydatacopy.sendrecv(_bytes(rank, 4343, 4097), peer, received, peer)
        assert torch.equal(received, _bytes(peer, 4343, 4097))
    finally:
        pydatacopy.barrier()
        pydatacopy.free(symmetric)


@pytest.mark.parametrize("count", [1, 300, 4096])
@pytest.mark.parametrize("path", ["auto", pytest.param("rma", marks=pytest.mark.registers_torch_memory)])
def test_put_blocks_kv_cache_style(world, peer, count, path):
    rank, _, _ = world
    block = (3, 37)  # 111 float32 = 444 bytes per block
    dst_pool = pydatacopy.empty((count + 5, *block), dtype=torch.float32)
    dst_pool.zero_()
    src_pool = _as(_bytes(rank, 8000 + count, (count + 2) * 444), torch.float32).view(count + 2, *block)
    generator = torch.Generator(device="cuda").manual_seed(count)
    dst_indices = torch.randperm(count + 5, device="cuda", generator=generator)[:count]
    src_indices = torch.randint(0, count + 2, (count,), device="cuda", generator=generator)
    pydatacopy.barrier()
    try:
        pydatacopy.put_blocks(dst_pool, src_pool, dst_indices, src_indices, peer, path=path)
        pydatacopy.barrier()
        peer_pool = _as(_bytes(peer, 8000 + count, (count + 2) * 444), torch.float32).view(count + 2, *block)
        expected = torch.zeros_like(dst_pool)
        expected[dst_indices] = peer_pool[src_indices]
        assert torch.equal(_raw(dst_pool), _raw(expected))
        pydatacopy.check_errors()
    finally:
        pydatacopy.barrier()
        pydatacopy.free(dst_pool)


def test_put_blocks_bad_index_is_reported(world, peer):
    dst_pool = pydatacopy.empty((8, 64), dtype=torch.uint8)
    src_pool = torch.zeros((8, 64), dtype=torch.uint8, device="cuda")
    try:
        bad = torch.tensor([0, 9], dtype=torch.int64, device="cuda")
        pydatacopy.put_blocks(dst_pool, src_pool, bad, torch.tensor([0, 1], device="cuda"), peer)
        torch.cuda.synchronize()
        with pytest.raises(pydatacopy.Error, match="out of range"):
            pydatacopy.check_errors()
        pydatacopy.check_errors()  # reported once; NVSHMEM stays usable
        with pytest.raises(pydatacopy.Error, match="int64"):
            pydatacopy.put_blocks(dst_pool, src_pool, bad.int(), bad, peer)
    finally:
        pydatacopy.barrier()
        pydatacopy.free(dst_pool)
