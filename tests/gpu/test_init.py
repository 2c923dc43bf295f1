"""The init paths between two PEs (on two GPUs, or sharing one): init() and init_nvshmem() agree,
again is harmless, and the device rule holds (see conftest.py for how to run)."""

from __future__ import annotations

import pytest
import torch

import pydatacopy


def test_init_paths_agree(world, local_device):
    rank, world_size, unique_id = world
    assert pydatacopy.is_initialized()
    assert (pydatacopy.my_pe(), pydatacopy.n_pes()) == (rank, world_size)
    # A second init of either kind is harmless and returns the same PE.
    assert pydatacopy.init() == rank
    assert pydatacopy.init_nvshmem(bytes(unique_id), rank, world_size) == rank
    with pytest.raises(pydatacopy.Error, match="another unique ID"):
        pydatacopy.init_nvshmem(pydatacopy.get_unique_id(), rank, world_size)
    # The device rule: local rank // PYDATACOPY_RANKS_PER_GPU (the rank itself on one GPU per rank).
    assert torch.cuda.current_device() == local_device
    assert pydatacopy.choose_device(rank) == local_device
