"""Symmetric tensors between two PEs (on two GPUs, or sharing one): empty() of every dtype,
is_symmetric(), peer_view() and free() (see conftest.py for how to run)."""

from __future__ import annotations

import torch

import pydatacopy
from byte_patterns import DTYPES, _as, _bytes, _direct, _raw


def test_symmetric_tensors_every_dtype_and_peer_view(world, peer):
    rank, _, _ = world
    for tag, dtype in enumerate(DTYPES):
        tensor = pydatacopy.empty((33, 5), dtype=dtype)
        assert tensor.dtype == dtype and tensor.shape == (33, 5) and pydatacopy.is_symmetric(tensor)
        source = _as(_bytes(rank, 100 + tag, 33 * 5 * tensor.element_size()), dtype).view(33, 5)
        pydatacopy.put(tensor, source, peer)
        pydatacopy.barrier()
        expected = _as(_bytes(peer, 100 + tag, 33 * 5 * tensor.element_size()), dtype).view(33, 5)
        assert torch.equal(_raw(tensor), _raw(expected))
        view = pydatacopy.peer_view(tensor, peer)
        if _direct():
            assert view is not None and view.shape == tensor.shape
        else:
            assert view is None
        pydatacopy.barrier()
        pydatacopy.free(tensor)
    assert not pydatacopy.is_symmetric(torch.zeros(4, device="cuda"))
