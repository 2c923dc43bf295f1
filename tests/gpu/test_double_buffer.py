"""Byte-exact token exchange (DoubleBufferManager) between two PEs, on two GPUs or sharing one
(see conftest.py for how to run)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import pydatacopy


def _tokens(pe: int, round_: int, n_tokens: int, token_size: int, salt: int = 0) -> torch.Tensor:
    """The random tokens PE `pe` sends in `round_`: both sides can regenerate them."""
    generator = torch.Generator(device="cuda").manual_seed(1_000_003 * pe + 7919 * round_ + salt)
    return torch.randint(0, 256, (n_tokens, token_size), dtype=torch.uint8, device="cuda",
                         generator=generator)


SHAPES = [(1, 1), (3, 7), (5, 33), (128, 4096), (1000, 7168), (17, 12345), (4096, 7168), (257, 100)]


@pytest.mark.parametrize("n_tokens, token_size", SHAPES)
def test_token_exchange_byte_exact_both_ways(world, n_tokens, token_size):
    rank, world_size, _ = world
    peer = 1 - rank
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        assert dbm.send_buffer.shape == (n_tokens, token_size)
        assert dbm.send_buffer.dtype == torch.uint8
        for round_ in range(12):
            assert dbm.current_set == round_ % 2
            dbm.send_buffer.copy_(_tokens(rank, round_, n_tokens, token_size))
            assert dbm.exchange() == round_
            received = dbm.wait(round_)
            assert received.data_ptr() == dbm.recv_buffer(round_).data_ptr()
            torch.testing.assert_close(received, _tokens(peer, round_, n_tokens, token_size),
                                       rtol=0, atol=0)
    finally:
        dbm.cleanup()


@pytest.mark.parametrize("n_tokens, token_size", [(64, 1000), (2048, 7168)])
def test_token_exchange_pipelined_rounds(world, n_tokens, token_size):
    """Round r + 1 is filled and sent while round r is in flight; both sets in use."""
    rank, _, _ = world
    peer = 1 - rank
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    rounds = 40
    try:
        dbm.send_buffer.copy_(_tokens(rank, 0, n_tokens, token_size, salt=5))
        dbm.exchange()
        for round_ in range(1, rounds):
            dbm.send_buffer.copy_(_tokens(rank, round_, n_tokens, token_size, salt=5))
            dbm.exchange()
            received = dbm.wait(round_ - 1)
            torch.testing.assert_close(received, _tokens(peer, round_ - 1, n_tokens, token_size, salt=5),
                                       rtol=0, atol=0)
        received = dbm.wait(rounds - 1, blocking=True)
        torch.testing.assert_close(received, _tokens(peer, rounds - 1, n_tokens, token_size, salt=5),
                                   rtol=0, atol=0)
    finally:
        dbm.cleanup()


def test_exchange_guards_unwaited_rounds(world):
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(8, 64)
    try:
        dbm.exchange()
        dbm.exchange()
        with pytest.raises(pydatacopy.Error, match="never waited for"):
            dbm.exchange()
        with pytest.raises(pydatacopy.Error, match="has not been exchanged"):
            dbm.wait(5)
        with pytest.raises(pydatacopy.Error, match="out of range"):
            dbm.exchange(peer=2)
        with pytest.raises(pydatacopy.Error, match="already initialised"):
            dbm.init(8, 64)
        dbm.wait(0)
        dbm.wait(1, blocking=True)
    finally:
        dbm.cleanup()
    dbm.cleanup()  # twice is harmless
    with pytest.raises(pydatacopy.Error, match="init\\(n_tokens, token_size\\) first"):
        dbm.exchange()


@pytest.mark.parametrize("n_tokens, token_size", [(1024, 4096), (4096, 7168)])
def test_note_test_bandwidth_pattern(world, n_tokens, token_size):
    """The note's calling pattern: host timers around torch.cuda.synchronize()."""
    rank, world_size, _ = world
    peer = 1 - rank
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        for round_ in range(4):
            dbm.send_buffer.copy_(_tokens(rank, round_, n_tokens, token_size, salt=9))
            torch.cuda.synchronize()
            start = time.time()
            bandwidth = dbm.test_bandwidth(rank, world_size)
            torch.cuda.synchronize()
            elapsed = time.time() - start
            assert bandwidth > 0 and elapsed > 0
            # test_bandwidth returned only after this round landed on both sides.
            torch.testing.assert_close(dbm.recv_buffer(round_),
                                       _tokens(peer, round_, n_tokens, token_size, salt=9),
                                       rtol=0, atol=0)
        with pytest.raises(pydatacopy.Error, match="does not match this process"):
            dbm.test_bandwidth(1 - rank, world_size)
    finally:
        dbm.cleanup()
    dist.barrier()
