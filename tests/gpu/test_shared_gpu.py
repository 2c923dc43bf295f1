"""Several PEs on one GPU share its memory: symmetric_malloc's room vote counts what the PEs of a
GPU need together. Any number of PEs: `torchrun --nproc_per_node=N -m pytest tests/gpu -m any_pes`
(2 and 4 on one GPU under MPS, or one PE per GPU).

Before the vote counted GPUs, two PEs on one GPU each asking 0.6x its free memory both passed
(each saw the whole GPU free), and NVSHMEM then failed cuMemCreate, hit an illegal memory access
in its barrier and ended every process: test_each_pe_asking_most_of_a_shared_gpu_... died there."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import pydatacopy

pytestmark = pytest.mark.any_pes

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


def _gpus_and_free_memory() -> tuple[int, int]:
    """(the most PEs on one GPU, the least free memory a PE sees), agreed by every PE (through
    all_gather_object: gloo and nccl alike)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    free_bytes, _ = torch.cuda.mem_get_info()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (str(props.uuid), free_bytes))
    per_gpu: dict[str, int] = {}
    for uuid, _ in gathered:
        per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    return max(per_gpu.values()), min(free for _, free in gathered)


def _ring_still_works(rank: int, world_size: int, tag: int) -> None:
    """A put to the next PE and a sendrecv around the ring (send to the next PE, receive from
    the previous one), both byte-exact."""
    after, before = (rank + 1) % world_size, (rank - 1) % world_size
    landing = pydatacopy.empty(1 * MiB + 3, dtype=torch.uint8)
    try:
        landing.zero_()
        pydatacopy.barrier(blocking=True)
        pydatacopy.put(landing, _bytes(rank, tag, 1 * MiB + 3), after)
        pydatacopy.quiet()
        pydatacopy.barrier(blocking=True)
        _assert_bytes(landing, _bytes(before, tag, 1 * MiB + 3), f"PE {rank}: put from PE {before}")
    finally:
        pydatacopy.free(landing)
    received = torch.zeros(3 * MiB + 5, dtype=torch.uint8, device="cuda")
    pydatacopy.sendrecv(_bytes(rank, tag + 1, 3 * MiB + 5), after, received, before)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    _assert_bytes(received, _bytes(before, tag + 1, 3 * MiB + 5), f"PE {rank}: sendrecv from PE {before}")


def test_each_pe_asking_most_of_a_shared_gpu_is_refused_on_every_pe(world):
    rank, world_size, _ = world
    sharing, free_bytes = _gpus_and_free_memory()
    nbytes = int(0.6 * free_bytes)  # every PE asks the same
    if sharing > 1:
        # Together the PEs of one GPU ask 1.2x (2 PEs) or 2.4x (4 PEs) its free memory.
        with pytest.raises(pydatacopy.Error) as info:
            pydatacopy.empty((nbytes,), dtype=torch.uint8)
        message = str(info.value)
        print(f"rank {rank}: {message}")
        assert str(nbytes) in message and "cannot hold them together" in message, message
        assert re.search(rf"GPU of PEs [0-9, ]*\b{rank}\b[0-9, ]*:", message), "this PE's GPU is listed"
        assert "Nothing was allocated on any PE" in message and "PYDATACOPY_RANKS_PER_GPU" in message
    else:
        # One PE per GPU: 0.6x fits, and must be granted (the vote must not refuse what fits).
        big = pydatacopy.empty((nbytes,), dtype=torch.uint8)
        pydatacopy.free(big)
    _ring_still_works(rank, world_size, tag=10)


def test_what_the_pes_of_a_gpu_can_hold_together_is_granted(world):
    rank, world_size, _ = world
    sharing, free_bytes = _gpus_and_free_memory()
    nbytes = int(0.3 * free_bytes) // sharing // MiB * MiB  # 0.3x the free memory per GPU, together
    big = pydatacopy.empty((nbytes,), dtype=torch.uint8)
    try:
        # The heap really grew: the last MiB of the next PE's part takes a put.
        tail = big[nbytes - MiB:]
        tail.zero_()
        pydatacopy.barrier(blocking=True)
        after, before = (rank + 1) % world_size, (rank - 1) % world_size
        pydatacopy.put(tail, _bytes(rank, 20, MiB), after)
        pydatacopy.quiet()
        pydatacopy.barrier(blocking=True)
        _assert_bytes(tail, _bytes(before, 20, MiB), f"PE {rank}: put into the end of a grown heap")
    finally:
        pydatacopy.free(big)
    _ring_still_works(rank, world_size, tag=30)


def test_pes_asking_different_sizes_are_refused_on_every_pe(world):
    """Each PE asks its own size (a user bug). nvshmem_malloc needs one size on every PE; the old
    vote never compared them, so every PE went on into nvshmem_malloc with its own size (or, with
    sizes near the room, some refused while the rest waited there with no deadline). Now a
    barrier compares the sizes first and every PE raises, naming them."""
    rank, world_size, _ = world
    nbytes = 4096 * (rank + 1)
    with pytest.raises(pydatacopy.Error) as info:
        pydatacopy.empty((nbytes,), dtype=torch.uint8)
    message = str(info.value)
    assert f"the PEs asked {world_size} different sizes" in message, message
    for pe in range(world_size):
        assert f"{4096 * (pe + 1)} bytes on PE {pe}" in message, message
    assert "Nothing was allocated on any PE" in message
    _ring_still_works(rank, world_size, tag=40)
