"""The bench's NIXL baseline (pydatacopy.bench.nixl) without a GPU: NIXL's WRITE between two
processes in host memory, byte-exact, with fresh data each repetition; and the message when
NIXL is missing. The GPU run (VRAM, UCX cuda_ipc) is the bench's `nixl` op."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
from pydatacopy import bench
from pydatacopy.bench import nixl as _nixl

HAVE_NIXL = _nixl.nixl_problem() == ""
# CI installs the [nixl] extra and sets PYDATACOPY_REQUIRE_NIXL=1: there a missing NIXL fails.
needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL and os.environ.get("PYDATACOPY_REQUIRE_NIXL") != "1",
    reason=_nixl.nixl_problem() or "NIXL installed")


def test_missing_nixl_says_how_to_install(monkeypatch):
    real_import = importlib.import_module

    def no_nixl(name, *args):
        if name.startswith("nixl"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_nixl)
    problem = _nixl.nixl_problem()
    assert problem.startswith("NIXL not installed") and "pydatacopy[nixl]" in problem


def test_bench_takes_the_nixl_op():
    assert bench.parse_args(["--ops", "nixl,sendrecv"]).ops == {"nixl", "sendrecv"}


def _worker(rank: int, store_file: str, sizes: list[int], results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        outcome = []
        for nbytes in sizes:
            src = torch.empty(nbytes, dtype=torch.uint8)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            with _nixl.NixlWrite(src, dst, timeout_s=60) as transfer:
                for repetition in range(3):
                    # Fresh data on the writer, the destination cleared, then one write.
                    expected = torch.randint(1, 256, (nbytes,), dtype=torch.uint8,
                                             generator=torch.Generator().manual_seed(nbytes + repetition))
                    if rank == 0:
                        src.copy_(expected)
                    dst.zero_()
                    dist.barrier()
                    transfer.write()
                    dist.barrier()
                    if rank == 1:
                        outcome.append((nbytes, repetition, torch.equal(dst, expected)))
                outcome.append(("failure", transfer.agreed_failure()))
        try:
            _nixl.NixlWrite(torch.empty(8, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8))
            outcome.append(("size mismatch", "not raised"))
        except pydatacopy.Error as error:
            outcome.append(("size mismatch", str(error)))
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


@needs_nixl
def test_nixl_write_is_byte_exact_between_two_processes(tmp_path):
    sizes = [4096, 1 << 20, 3 * (1 << 20) + 5]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), sizes, results), nprocs=2, join=True)
    checks = [entry for entry in results[1] if entry[0] not in ("size mismatch", "failure")]
    assert checks == [(n, r, True) for n in sizes for r in range(3)]
    assert [e for e in results[0] + results[1] if e[0] == "failure"] == [("failure", None)] * 6
    for rank in (0, 1):
        assert "give both the same size" in dict(e for e in results[rank] if e[0] == "size mismatch")["size mismatch"]


def _failing_worker(rank: int, store_file: str, where: str, results) -> None:
    """A failure on one rank, which every rank must learn of instead of waiting for the other."""
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        src = torch.ones(4096, dtype=torch.uint8)
        dst = torch.zeros(4096, dtype=torch.uint8)
        if where == "set-up on rank 1" and rank == 1:
            def no_nixl():
                raise ImportError("no NIXL on this rank")
            _nixl._api = no_nixl
        try:
            with _nixl.NixlWrite(src, dst, timeout_s=60) as transfer:
                if rank == 0:
                    def broken(handle, *args):
                        raise RuntimeError("NIXL_ERR_BACKEND")
                    transfer.agent.transfer = broken
                transfer.write()
                transfer.write()  # after a failure: nothing, no second error
                results[rank] = ("write", transfer.agreed_failure(), torch.count_nonzero(dst).item())
        except pydatacopy.Error as error:
            results[rank] = ("set-up", str(error), None)
    finally:
        dist.destroy_process_group()


@needs_nixl
@pytest.mark.parametrize("where", ["set-up on rank 1", "write on rank 0"])
def test_a_failure_on_one_rank_is_agreed_by_all(tmp_path, where):
    results = mp.Manager().dict()
    mp.spawn(_failing_worker, args=(str(tmp_path / "rendezvous"), where, results), nprocs=2, join=True)
    if where == "set-up on rank 1":
        for rank in (0, 1):
            kind, text, _ = results[rank]
            assert kind == "set-up" and "NIXL set-up failed: rank 1: ImportError: no NIXL on this rank" in text
    else:
        for rank in (0, 1):
            kind, text, _ = results[rank]
            assert kind == "write" and "NIXL raised RuntimeError: NIXL_ERR_BACKEND" in text
            assert "NIXL_LOG_LEVEL=DEBUG" in text
        assert results[1][2] == 0, "nothing was written"


def test_the_table_compares_with_nixl_by_host_time(tmp_path, capsys):
    rows = [
        {"op": "send/recv", "path": "pipeline", "direction": "one", "bytes": 1 << 20, "size": "1M",
         "us": 10.0, "host_us": 20.0, "gbps": 104.9, "ok": True},
        {"op": "baseline", "path": "NIXL", "direction": "one", "bytes": 1 << 20, "size": "1M",
         "us": 50.0, "host_us": 50.0, "gbps": 21.0, "ok": True},
        {"op": "send/recv", "path": "pipeline", "direction": "both", "bytes": 1 << 20, "size": "1M",
         "us": 10.0, "host_us": 20.0, "gbps": 104.9, "ok": True},
        {"op": "latency", "path": "signal", "direction": "one", "bytes": 8, "size": "8",
         "us": 1.0, "gbps": 0.0, "ok": True},  # rows of older runs have no host_us
    ]
    markdown, csv_file = tmp_path / "t.md", tmp_path / "t.csv"
    bench.report(rows, bench.parse_args(["--markdown", str(markdown), "--csv", str(csv_file)]))
    table = markdown.read_text().splitlines()
    assert "| x NIXL |" in table[0]
    assert table[2].split("|")[10].strip() == "2.50", "NIXL's 50 us over this row's 20 us on the host"
    assert table[3].split("|")[10].strip() == "1.00"
    assert table[4].split("|")[10].strip() == "-", "no NIXL row for both directions"
    assert table[5].split("|")[10].strip() == "-"
    assert csv_file.read_text().splitlines()[0].split(",")[6:8] == ["p99_us", "host_us"]
