"""put_many: many tensors to one PE in one launch per 1280 rows, the rows read and checked in
one native pass, the table of addresses carried in the launch itself; and put_many prepared once
(the table in device memory, one launch per run). Two PEs: peer = 1 - rank."""

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


@pytest.mark.parametrize("path", ["auto", pytest.param("rma", marks=pytest.mark.registers_torch_memory)])
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


# ---- put_many prepared once ------------------------------------------------------------------

def _bytes_of(rows) -> list[int]:
    return [size * torch.empty((), dtype=d).element_size() for d, size in rows]


def _fill(buffer: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, device="cuda", generator=generator))
    return buffer


class _Layout:
    """Rows of mixed dtypes and odd sizes at the same byte offsets in a local source buffer and
    a symmetric pool (with gaps between rows), so that the pool must end up equal to the peer's
    source buffer on the rows and untouched (0xEE) in the gaps."""

    def __init__(self, count: int, seed: int):
        self.rows = _rows(count, seed)
        self.offsets, self.total = _layout(self.rows)
        self.sizes = _bytes_of(self.rows)
        self.covered = torch.zeros(self.total, dtype=torch.bool, device="cuda")
        for o, n in zip(self.offsets, self.sizes):
            self.covered[o:o + n] = True

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return _views(buffer, self.rows, self.offsets)

    def check(self, pool: torch.Tensor, expected_source: torch.Tensor, what: str) -> None:
        wrong = [i for i, (o, n) in enumerate(zip(self.offsets, self.sizes))
                 if not torch.equal(pool[o:o + n], expected_source[o:o + n])]
        gaps = int((pool[~self.covered] != 0xEE).sum())
        assert not wrong, f"{what}: {len(wrong)} of {len(self.rows)} rows wrong, first {wrong[:5]}"
        assert gaps == 0, f"{what}: {gaps} bytes between rows written"


def _send_and_check(world, layout: _Layout, pool: torch.Tensor, source: torch.Tensor, seed: int,
                    send, what: str) -> None:
    """Both PEs: fresh source data (seed, rank), the pool cleared, `send()` (towards the peer),
    then the pool must hold the peer's data."""
    rank, peer = world[0], 1 - world[0]
    _fill(source, seed * 2 + rank)
    pool.fill_(0xEE)
    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True)
    send()
    pydatacopy.barrier(blocking=True)
    layout.check(pool, _fill(torch.empty_like(source), seed * 2 + peer), what)


@pytest.mark.parametrize("path", ["auto", pytest.param("rma", marks=pytest.mark.registers_torch_memory)])
def test_prepared_and_list_forms_deliver_the_same_bytes(world, path):
    """1024 rows of mixed dtypes and odd sizes: the list form and the prepared form, each checked
    byte for byte, three runs of the prepared table with fresh data each."""
    peer = 1 - world[0]
    layout = _Layout(1024, 41)
    pool = pydatacopy.empty(layout.total, dtype=torch.uint8)
    source = torch.empty(layout.total, dtype=torch.uint8, device="cuda")
    dsts, srcs = layout.views(pool), layout.views(source)
    try:
        _send_and_check(world, layout, pool, source, 1, lambda: pydatacopy.put_many(dsts, srcs, peer, path=path),
                        "list form")
        prepared = pydatacopy.prepare_put_many(dsts, srcs, peer, path=path)
        assert prepared.rows == 1024 and prepared.bytes == sum(layout.sizes)
        assert prepared.direct == (path == "auto" and not pydatacopy._C.rma_forced())
        for run in range(3):
            _send_and_check(world, layout, pool, source, 10 + run, prepared.run, f"prepared, run {run}")
        prepared.release()
        prepared.release()  # idempotent
        with pytest.raises(pydatacopy.Error, match="released; prepare another"):
            prepared.run()
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_rows_longer_than_a_piece(world):
    """Rows of 64 KiB +- a few bytes, 1 MiB + 3 and 1 byte, at odd offsets: cut into pieces on the
    device table, delivered whole."""
    peer = 1 - world[0]
    sizes = [65536, 65535, 65537, (1 << 20) + 3, 1, 200_001]
    offsets, offset = [], 5
    for n in sizes:
        offsets.append(offset)
        offset += n + 11
    pool = pydatacopy.empty(offset, dtype=torch.uint8)
    source = torch.empty(offset, dtype=torch.uint8, device="cuda")

    class Layout(_Layout):
        def __init__(self):
            self.offsets, self.sizes, self.total = offsets, sizes, offset
            self.rows = sizes
            self.covered = torch.zeros(offset, dtype=torch.bool, device="cuda")
            for o, n in zip(offsets, sizes):
                self.covered[o:o + n] = True

    layout = Layout()
    try:
        prepared = pydatacopy.prepare_put_many([pool[o:o + n] for o, n in zip(offsets, sizes)],
                                               [source[o:o + n] for o, n in zip(offsets, sizes)], peer)
        assert prepared.pieces > len(sizes)
        _send_and_check(world, layout, pool, source, 3, prepared.run, "long rows")
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_from_addresses(world):
    """The table from int64 CUDA tensors of addresses and sizes (written on the device just
    before: prepare reads them after the current stream's work)."""
    peer = 1 - world[0]
    layout = _Layout(300, 43)
    pool = pydatacopy.empty(layout.total, dtype=torch.uint8)
    source = torch.empty(layout.total, dtype=torch.uint8, device="cuda")
    try:
        offsets = torch.tensor(layout.offsets, dtype=torch.int64, device="cuda")
        sizes = torch.tensor(layout.sizes, dtype=torch.int64, device="cuda")
        prepared = pydatacopy.PreparedPutMany.from_addresses(pool.data_ptr() + offsets,
                                                             source.data_ptr() + offsets, sizes, peer)
        assert prepared.rows == 300 and prepared.bytes == sum(layout.sizes)
        for run in range(2):
            _send_and_check(world, layout, pool, source, 20 + run, prepared.run, f"from_addresses, run {run}")
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_refuses_bad_rows_at_prepare(world):
    """A destination out of the symmetric range (a local tensor, or a row one byte past the
    allocation's end), bad address tensors, a source on the host: refused when preparing, and
    nothing written."""
    peer = 1 - world[0]
    pool = pydatacopy.empty(64, dtype=torch.uint8)
    local = torch.zeros(64, dtype=torch.uint8, device="cuda")
    good = torch.ones(16, dtype=torch.uint8, device="cuda")
    host = torch.ones(16, dtype=torch.uint8).pin_memory()

    def addresses(*values):
        return torch.tensor(values, dtype=torch.int64, device="cuda")

    try:
        pool.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        for call, words in [
            (lambda: pydatacopy.prepare_put_many([pool[:16], local[:16]], [good, good], peer),
             r"row 1: the destination, 16 bytes at 0x[0-9a-f]+, does not lie in one symmetric allocation"),
            (lambda: pydatacopy.PreparedPutMany.from_addresses(
                addresses(pool.data_ptr() + 56), addresses(good.data_ptr()), addresses(16), peer),
             r"row 0: the destination, 16 bytes at 0x[0-9a-f]+, does not lie in one symmetric allocation"),
            (lambda: pydatacopy.PreparedPutMany.from_addresses(
                addresses(pool.data_ptr()), addresses(host.data_ptr()), addresses(16), peer),
             r"row 0: the source, 16 bytes at 0x[0-9a-f]+, does not lie in one allocation of device memory"),
            (lambda: pydatacopy.PreparedPutMany.from_addresses(
                addresses(pool.data_ptr()), addresses(good.data_ptr()), addresses(-1), peer),
             r"sizes\[0\] is -1; sizes must not be negative"),
            (lambda: pydatacopy.PreparedPutMany.from_addresses(
                addresses(pool.data_ptr()), addresses(good.data_ptr(), 0), addresses(16), peer),
             "must have one entry per row, got 1, 2 and 1"),
            (lambda: pydatacopy.PreparedPutMany.from_addresses(
                addresses(pool.data_ptr()).int(), addresses(good.data_ptr()), addresses(16), peer),
             "dst_addrs must be a 1-D int64 CUDA tensor"),
            (lambda: pydatacopy.prepare_put_many([pool[:16]], [good.cpu()], peer), r"srcs\[0\] is not on a CUDA device"),
            (lambda: pydatacopy.prepare_put_many([pool[:16]], [good], peer, path="copy_engine"),
             "path must be auto, sm or rma"),
            (lambda: pydatacopy.prepare_put_many([pool[:16]], [good], 2), "out of range"),
        ]:
            with pytest.raises(pydatacopy.Error, match=words):
                call()
        pydatacopy.barrier(blocking=True)
        assert int(pool.count_nonzero()) == 0, "a refused preparation wrote"
        empty = pydatacopy.prepare_put_many([], [], peer)
        empty.run()  # nothing to do
        assert empty.bytes == 0
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_in_a_cuda_graph_100_replays(world):
    """One run captured, replayed 100 times, each with fresh source data written in place: every
    replay delivers that replay's data."""
    rank, peer = world[0], 1 - world[0]
    layout = _Layout(257, 47)
    pool = pydatacopy.empty(layout.total, dtype=torch.uint8)
    source = torch.zeros(layout.total, dtype=torch.uint8, device="cuda")
    prepared = pydatacopy.prepare_put_many(layout.views(pool), layout.views(source), peer)
    try:
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            prepared.run()
        for replay in range(100):
            _send_and_check(world, layout, pool, source, 100 + replay, graph.replay, f"replay {replay}")
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_keeps_its_tensors_after_a_side_stream_run(world):
    """The only references to the sources are the table's; it runs on a side stream and is
    dropped at once, and scratch allocations follow: the data still arrives whole (the tensors
    and the table are freed after the stream's work)."""
    rank, peer = world[0], 1 - world[0]
    layout = _Layout(512, 53)
    pool = pydatacopy.empty(layout.total, dtype=torch.uint8)
    expected = _fill(torch.empty(layout.total, dtype=torch.uint8, device="cuda"), 7 * 2 + peer)
    try:
        pool.fill_(0xEE)
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        side = torch.cuda.Stream()
        source = _fill(torch.empty(layout.total, dtype=torch.uint8, device="cuda"), 7 * 2 + rank)
        side.wait_stream(torch.cuda.current_stream())
        # A long kernel first on the side stream, so that the run is still queued when dropped.
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
        prepared = pydatacopy.prepare_put_many(layout.views(pool), layout.views(source), peer)
        prepared.run(stream=side)
        del prepared, source
        scratch = [torch.full((layout.total,), 0x55, dtype=torch.uint8, device="cuda") for _ in range(4)]
        torch.cuda.current_stream().wait_stream(side)
        pydatacopy.barrier(blocking=True)
        del scratch
        layout.check(pool, expected, "side stream, object dropped")
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)


def test_prepared_direct_then_forced_rma(world, force_rma):
    """Prepared while the peer is reachable by load/store (force_rma comes after), run with
    PYDATACOPY_FORCE_RMA on: the rows go through NVSHMEM RMA, the sources registered first."""
    peer = 1 - world[0]
    layout = _Layout(128, 59)
    pool = pydatacopy.empty(layout.total, dtype=torch.uint8)
    source = torch.empty(layout.total, dtype=torch.uint8, device="cuda")
    pydatacopy._C.set_rma_forced(False)
    try:
        prepared = pydatacopy.prepare_put_many(layout.views(pool), layout.views(source), peer)
        pydatacopy._C.set_rma_forced(True)
        _send_and_check(world, layout, pool, source, 31, prepared.run, "direct table, forced RMA")
        assert pydatacopy.is_registered(source) or not pydatacopy._C.auto_register_enabled()
    finally:
        pydatacopy.barrier(blocking=True)
        pydatacopy.free(pool)
