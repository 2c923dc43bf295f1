"""pydatacopy.compat: other libraries' Python APIs over pydatacopy's kernels, for code written
against them.

``pydatacopy.compat.deep_ep``: DeepEP v1's ``deep_ep`` module (``Buffer``, ``Config``,
``EventOverlap``, ``topk_idx_t``) over ``pydatacopy.moe``: ``import pydatacopy.compat.deep_ep as
deep_ep``. May import torch and the features (``moe``, ``runtime``); no feature imports it, and
``import pydatacopy`` does not load it.
"""

from __future__ import annotations

__all__ = ["deep_ep"]


def __getattr__(name: str):
    if name == "deep_ep":  # loaded when asked for, as the package says
        import importlib

        return importlib.import_module(f"{__name__}.deep_ep")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
