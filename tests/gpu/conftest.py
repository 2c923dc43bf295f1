"""Two-GPU tests: run under two processes, e.g. `torchrun --nproc_per_node=2 -m pytest tests/gpu`
(scripts/gpu-check.sh does). Every process runs the same tests in the same order, so the
collective calls inside them line up. Elsewhere they are skipped with the reason."""

from __future__ import annotations

import os

import pytest
import torch


def _why_not() -> str | None:
    if os.environ.get("WORLD_SIZE") != "2":
        return "needs two processes: torchrun --nproc_per_node=2 -m pytest tests/gpu (scripts/gpu-check.sh)"
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _why_not()
    if reason is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def world():
    """torch.distributed (nccl) and NVSHMEM through the design note's own path."""
    import torch.distributed as dist

    import pydatacopy

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    # The note's test: rank 0 makes the ID, all_gather_object shares it, every rank joins.
    unique_id = pydatacopy.get_unique_id() if rank == 0 else None
    gathered = [None] * world_size
    dist.all_gather_object(gathered, unique_id)
    pe = pydatacopy.init_nvshmem(gathered[0], rank, world_size)
    assert pe == rank
    yield rank, world_size, gathered[0]
    pydatacopy.finalize()
    dist.destroy_process_group()


@pytest.fixture
def force_rma():
    """PYDATACOPY_FORCE_RMA=1 for one test: the NVSHMEM RMA path a peer on another server takes."""
    before = os.environ.get("PYDATACOPY_FORCE_RMA")
    os.environ["PYDATACOPY_FORCE_RMA"] = "1"
    yield
    if before is None:
        del os.environ["PYDATACOPY_FORCE_RMA"]
    else:
        os.environ["PYDATACOPY_FORCE_RMA"] = before
