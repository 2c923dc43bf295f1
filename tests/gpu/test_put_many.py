"""put_many: many tensors to one PE in one launch per 1280 rows, the rows read and checked in
one native pass, the table of addresses carried in the launch itself (two PEs: peer = 1 - rank)."""

from __future__ import annotations

import random

import pytest
import torch

import pydatacopy

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn]


def _rows(count: int, seed: int) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) per row: mixed dtypes, odd sizes (1 to 1000 elements, 4 KiB rows among them)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        size = 4096 // torch.empty((), dtype=dtype).element_size() if i % 5 == 0 else rng.randrange(1, 1001)
        rows.append((dtype, size))
    return rows


def _layout(rows) -> tuple[list[int], int]:
    """Byte offsets of the rows in one symmetric pool: 8-aligned (a view as any dtype), with gaps."""
    offsets, offset = [], 0
    for i, (dtype, size) in enumerate(rows):
        offsets.append(offset)
        offset += size * torch.empty((), dtype=dtype).element_size() + 8 * (i % 3)
        offset = (offset + 7) // 8 * 8
    return offsets, offset


def _data(pe: int, tag: int, i: int, dtype: torch.dtype, size: int) -> torch.Tensor:
    """Row i's bytes as PE `pe` sends them in round `tag`, as `dtype` (any bit pattern: compared as bytes)."""
    nbytes = size * torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator(device="cuda").manual_seed(pe * 1_000_003 + tag * 10_007 + i)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)
    return raw.view(dtype)


def _views(pool: torch.Tensor, rows, offsets) -> list[torch.Tensor]:
    return [pool[o:o + size * torch.empty((), dtype=d).element_size()].view(d) for (d, size), o in zip(rows, offsets)]


def _round(world, rows, tag: int, path: str, stream=None) -> None:
    rank, peer = world[0], 1 - world[0]
    offsets, total = _layout(rows)
    pool = pydatacopy.empty(total, dtype=torch.uint8)
    try:
        pool.fill_(0xEE)
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        # The lists and the sources exist only for the call: dropped right after it, their memory
        # given out again at once (stream-ordered) and overwritten.
        srcs = [_data(rank, tag, i, d, size) for i, (d, size) in enumerate(rows)]
        dsts = _views(pool, rows, offsets)
        pydatacopy.put_many(dsts, srcs, peer, path=path, stream=stream)
        del dsts, srcs
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        scratch = [torch.full((4096,), 0x55, dtype=torch.uint8, device="cuda") for _ in range(len(rows))]
        pydatacopy.barrier(blocking=True)
        del scratch
        got = _views(pool, rows, offsets)
        wrong = [i for i, (d, size) in enumerate(rows)
                 if not torch.equal(got[i].view(torch.uint8), _data(peer, tag, i, d, size).view(torch.uint8))]
        # The gaps between rows stay untouched.
        covered = torch.zeros(total, dtype=torch.bool, device="cuda")
        for (d, size), o in zip(rows, offsets):
            covered[o:o + size * torch.empty((), dtype=d).element_size()] = True
        gaps_written = int((pool[~covered] != 0xEE).sum())
        pydatacopy.barrier(blocking=True)
    finally:
        pydatacopy.free(pool)
    assert not wrong, f"{len(wrong)} of {len(rows)} rows wrong, first {wrong[:5]}"
    assert gaps_written == 0, f"{gaps_written} bytes between rows written"


@pytest.mark.parametrize("path", ["auto", "rma"])
def test_put_many_1024_rows_mixed_dtypes_odd_sizes(world, path):
    rows = _rows(1024, 1)
    for tag in range(3):  # fresh data each round
        _round(world, rows, tag, path)


@pytest.mark.parametrize("count", [1, 32, 33, 256, 257, 1280, 1281, 3000])
def test_put_many_at_the_launch_sizes(world, count):
    """Tables of 32, 256 and 1280 rows per launch, and several launches past 1280."""
    _round(world, _rows(count, count), 7, "auto")


def test_put_many_forced_rma_with_a_side_stream(world, force_rma):
    _round(world, _rows(1024, 2), 11, "auto", stream=torch.cuda.Stream())


def test_put_many_in_a_cuda_graph(world):
    """The table is part of the launch, so a captured put_many replays with the sources' new data."""
    rank, peer = world[0], 1 - world[0]
    rows = _rows(300, 3)
    offsets, total = _layout(rows)
    pool = pydatacopy.empty(total, dtype=torch.uint8)
    srcs = [torch.zeros(size * torch.empty((), dtype=d).element_size(), dtype=torch.uint8, device="cuda").view(d)
            for d, size in rows]
    dsts = _views(pool, rows, offsets)
    try:
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            pydatacopy.put_many(dsts, srcs, peer)
        for replay in range(3):
            for i, (d, size) in enumerate(rows):
                srcs[i].view(torch.uint8).copy_(_data(rank, 20 + replay, i, d, size).view(torch.uint8))
            pool.zero_()
            torch.cuda.synchronize()
            pydatacopy.barrier(blocking=True)
            graph.replay()
            pydatacopy.barrier(blocking=True)
            wrong = [i for i, (d, size) in enumerate(rows)
                     if not torch.equal(dsts[i].view(torch.uint8), _data(peer, 20 + replay, i, d, size).view(torch.uint8))]
            assert not wrong, f"replay {replay}: rows {wrong[:5]} wrong"
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_put_many_refuses_bad_rows_before_any_launch(world):
    peer = 1 - world[0]
    pool = pydatacopy.empty(64, dtype=torch.uint8)
    local = torch.zeros(64, dtype=torch.uint8, device="cuda")
    try:
        pool.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        good = torch.ones(16, dtype=torch.uint8, device="cuda")
        for call, words in [
            (lambda: pydatacopy.put_many([pool[:16], pool[16:32]], [good, "x"], peer), r"srcs\[1\] must be a torch.Tensor"),
            (lambda: pydatacopy.put_many([pool[:16]], [good.cpu()], peer), r"srcs\[0\] is not on a CUDA device"),
            (lambda: pydatacopy.put_many([pool[:16]], [good.view(4, 4).t()], peer), r"srcs\[0\] must be contiguous"),
            (lambda: pydatacopy.put_many([pool[:16]], [good.view(torch.int8)], peer), "dtype mismatch in row 0"),
            (lambda: pydatacopy.put_many([pool[:16], pool[:16]], [good, good[:15]], peer), "size mismatch in row 1"),
            (lambda: pydatacopy.put_many([pool[:16], local[:16]], [good, good], peer), "symmetric"),
            (lambda: pydatacopy.put_many([pool[:16]], [good, good], peer), "destinations but 2 sources"),
        ]:
            with pytest.raises(pydatacopy.Error, match=words):
                call()
        pydatacopy.barrier(blocking=True)
        assert int(pool.count_nonzero()) == 0, "a refused put_many wrote"
        pydatacopy.put_many([], [], peer)  # nothing to do
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)
