"""DoubleBufferManager's core without a GPU: sizes checked after the init check, and the
default peers (the GPU's token exchange is tests/gpu/test_double_buffer.py)."""

from __future__ import annotations

import pytest

import pydatacopy
from pydatacopy import _C


def test_core_double_buffer_checks_sizes_after_init_check():
    with pytest.raises(pydatacopy.Error, match="call pydatacopy.init"):
        _C.DoubleBufferManager().init(0, 0)


def test_default_peers():
    assert [_C.DoubleBufferManager.default_dst_pe(p, 2) for p in range(2)] == [1, 0]
    assert [_C.DoubleBufferManager.default_dst_pe(p, 4) for p in range(4)] == [1, 0, 3, 2]
    assert [_C.DoubleBufferManager.default_dst_pe(p, 3) for p in range(3)] == [1, 2, 0]
    assert [_C.DoubleBufferManager.default_src_pe(p, 3) for p in range(3)] == [2, 0, 1]
    assert _C.DoubleBufferManager.default_dst_pe(0, 1) == 0
