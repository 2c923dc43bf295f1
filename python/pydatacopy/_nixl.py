"""NIXL as a benchmark baseline: what vLLM and Dynamo move KV caches with.

One NIXL agent per rank on the UCX backend; rank 0 WRITEs its source tensor into rank 1's
destination tensor and polls until NIXL reports the transfer DONE. Both tensors are registered
once, the agents' metadata and the destination's descriptors travel through torch.distributed,
and the transfer handle is prepared once and posted again for every write, as a serving
engine does. Works on any device NIXL registers (VRAM on the GPU machine; DRAM in the CPU tests).
NIXL is optional: ``pip install "pydatacopy[nixl]"`` (the wheel ``nixl-cu13``).
"""

from __future__ import annotations

import importlib
import itertools
import time

import torch
import torch.distributed as dist

from . import _C

Error = _C.Error

INSTALL_HINT = 'pip install "pydatacopy[nixl]" (the nixl-cu13 wheel)'
_serial = itertools.count()  # agent names stay unique while an old agent awaits collection


def _api():
    """NIXL's Python API: the `nixl` package picks the wheel of the CUDA found; without it the
    CUDA 13 wheel's own module, which is what travels to the GPU machine."""
    errors = []
    for name in ("nixl._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except Exception as error:  # a wheel that fails to load is as absent as a missing one
            errors.append(f"{name}: {type(error).__name__}: {error}")
    raise ImportError("; ".join(errors))


def nixl_problem() -> str:
    """Why NIXL cannot be used here, or "" when it can."""
    try:
        _api()
    except ImportError as error:
        return f"NIXL not installed ({error}): {INSTALL_HINT}"
    return ""


class NixlWrite:
    """rank 0's `src` written into rank 1's `dst` (same number of bytes) with NIXL's WRITE.

    Collective: both ranks construct it and call close(); write() does the work on rank 0 and
    nothing on rank 1. Use as a context manager.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, *, timeout_s: float = 60.0,
                 group: dist.ProcessGroup | None = None):
        if src.nbytes != dst.nbytes:
            raise Error(f"NixlWrite: src has {src.nbytes} bytes and dst {dst.nbytes}: give both "
                        "the same size")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise Error("NixlWrite: src and dst must be contiguous")
        api = _api()
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.agent = api.nixl_agent(f"pydatacopy-bench-{self.rank}-{next(_serial)}",
                                    api.nixl_agent_config(backends=["UCX"]))
        self.local = src if self.rank == 0 else dst
        self.registration = self.agent.register_memory([self.local])
        self.handle = None
        self.remote_name = None
        try:
            serialized = None
            if self.rank == 1:
                serialized = self.agent.get_serialized_descs(self.agent.get_xfer_descs([dst]))
            peers: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(peers, (self.agent.get_agent_metadata(), serialized), group=group)
            if self.rank == 0:
                metadata, remote_descs = peers[1]
                self.remote_name = self.agent.add_remote_agent(metadata)
                self.handle = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs([src]),
                    self.agent.deserialize_descs(remote_descs), self.remote_name, b"")
        except Exception:
            self.close()
            raise

    def write(self) -> None:
        """One WRITE, returning once NIXL reports it DONE (rank 0); nothing on other ranks.
        Raises Error when NIXL reports a failure or the transfer is not done in timeout_s."""
        if self.rank != 0:
            return
        if self.handle is None:
            raise Error("NixlWrite.write() after close()")
            return
        deadline = time.monotonic() + self.timeout_s
        state = self.agent.transfer(self.handle)
        while state != "DONE":
            if state == "ERR":
                raise Error("NIXL reported the WRITE failed (state ERR): rerun with "
                            "NIXL_LOG_LEVEL=DEBUG and UCX_LOG_LEVEL=info for its account")
            if time.monotonic() > deadline:
                raise Error(f"NIXL's WRITE was not done after {self.timeout_s:g} s (state "
                            f"{state}): is rank 1 alive, and does UCX reach it?")
            state = self.agent.check_xfer_state(self.handle)

    def close(self) -> None:
        """Releases the handle, the peer and the registration (local; no peer takes part)."""
        if self.handle is not None:
            self.agent.release_xfer_handle(self.handle)
            self.handle = None
        if self.remote_name is not None:
            self.agent.remove_remote_agent(self.remote_name)
            self.remote_name = None
        if self.registration is not None:
            self.agent.deregister_memory(self.registration)
            self.registration = None
        self.agent = None  # its UCX worker goes with it

    def __enter__(self) -> "NixlWrite":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
