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
import sys
import time

import torch
import torch.distributed as dist

from .. import _C

Error = _C.Error

INSTALL_HINT = 'pip install "pydatacopy[nixl]" (the nixl-cu13 wheel)'
_serial = itertools.count()  # agent names stay unique while an old agent awaits collection
_kept_alive: list = []  # transfers that could not be released: their memory must stay registered


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

    Collective: both ranks construct it, measure with write(), then call agreed_failure() and
    close(). Every failure is agreed on by all ranks, so that none waits for a peer that gave
    up: a failed set-up raises Error on every rank; a failed write is recorded on rank 0 (later
    writes do nothing) and agreed_failure() reports it on every rank.
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, *, timeout_s: float = 60.0,
                 group: dist.ProcessGroup | None = None):
        if src.nbytes != dst.nbytes:
            raise Error(f"NixlWrite: src has {src.nbytes} bytes and dst {dst.nbytes}: give both "
                        "the same size")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise Error("NixlWrite: src and dst must be contiguous")
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.agent = self.registration = self.handle = self.remote_name = None
        self.failure: str | None = None
        # Local set-up first; whatever happened travels with the metadata, so all ranks agree.
        mine = (None, None, None)
        try:
            api = _api()
            self.agent = api.nixl_agent(f"pydatacopy-bench-{self.rank}-{next(_serial)}",
                                        api.nixl_agent_config(backends=["UCX"]))
            self.registration = self.agent.register_memory([src if self.rank == 0 else dst])
            serialized = (self.agent.get_serialized_descs(self.agent.get_xfer_descs([dst]))
                          if self.rank == 1 else None)
            mine = (None, self.agent.get_agent_metadata(), serialized)
        except Exception as error:
            mine = (f"rank {self.rank}: {type(error).__name__}: {error}", None, None)
        peers: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, mine, group=group)
        if self.rank == 0 and all(p[0] is None for p in peers):
            try:
                self.remote_name = self.agent.add_remote_agent(peers[1][1])
                self.handle = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs([src]),
                    self.agent.deserialize_descs(peers[1][2]), self.remote_name, b"")
            except Exception as error:
                self.failure = f"rank 0: {type(error).__name__}: {error}"
        problem = self.agreed_failure()
        if problem or any(p[0] for p in peers):
            self.close()
            raise Error("NIXL set-up failed: " + "; ".join(p[0] for p in peers if p[0])
                        + (problem or ""))

    def write(self) -> None:
        """One WRITE, returning once NIXL reports it DONE (rank 0); nothing on other ranks, nor
        after a failure (NIXL's error, or not DONE within timeout_s), which is recorded."""
        if self.rank != 0 or self.failure is not None:
            return
        if self.handle is None:
            raise Error("NixlWrite.write() after close()")
        deadline = time.monotonic() + self.timeout_s
        try:
            state = self.agent.transfer(self.handle)
            while state != "DONE":
                if state == "ERR":
                    self.failure = "NIXL reported the WRITE failed (state ERR)"
                    return
                if time.monotonic() > deadline:
                    self.failure = (f"NIXL's WRITE was not done after {self.timeout_s:g} s (state "
                                    f"{state}): is rank 1 alive, and does UCX reach it?")
                    return
                state = self.agent.check_xfer_state(self.handle)
        except Exception as error:  # NIXL's bindings raise their own types
            self.failure = f"NIXL raised {type(error).__name__}: {error}"

    def agreed_failure(self) -> str | None:
        """Collective: the failure any rank recorded, with NIXL's logging hint, else None."""
        failures: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(failures, self.failure, group=self.group)
        found = [f for f in failures if f]
        if not found:
            return None
        return ("; ".join(found) + ". Rerun with NIXL_LOG_LEVEL=DEBUG UCX_LOG_LEVEL=info for "
                "NIXL's and UCX's account")

    def close(self) -> None:
        """Releases the handle, the peer and the registration (local; no peer takes part). If
        the handle cannot be released (a transfer still in flight after a timeout), the
        registration and the agent are deliberately kept: NIXL may still be using that memory."""
        if self.agent is None:
            return
        if self.handle is not None:
            try:
                self.agent.release_xfer_handle(self.handle)
            except Exception as error:
                print(f"NixlWrite.close: the transfer handle could not be released ({error}); "
                      "its memory stays registered", file=sys.stderr)
                _kept_alive.append(self)
                return
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
