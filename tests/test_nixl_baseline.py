"""The bench's NIXL baseline (pydatacopy._nixl) without a GPU: NIXL's WRITE between two
processes in host memory, byte-exact, with fresh data each repetition; and the message when
NIXL is missing. The GPU run (VRAM, UCX cuda_ipc) is the bench's `nixl` op."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
from pydatacopy import _nixl, bench

HAVE_NIXL = _nixl.nixl_problem() == ""


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
        try:
            _nixl.NixlWrite(torch.empty(8, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8))
            outcome.append(("size mismatch", "not raised"))
        except pydatacopy.Error as error:
            outcome.append(("size mismatch", str(error)))
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not HAVE_NIXL, reason=_nixl.nixl_problem() or "NIXL installed")
def test_nixl_write_is_byte_exact_between_two_processes(tmp_path):
    sizes = [4096, 1 << 20, 3 * (1 << 20) + 5]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), sizes, results), nprocs=2, join=True)
    checks = [entry for entry in results[1] if entry[0] != "size mismatch"]
    assert checks == [(n, r, True) for n in sizes for r in range(3)]
    for rank in (0, 1):
        assert "give both the same size" in dict(e for e in results[rank] if e[0] == "size mismatch")["size mismatch"]
