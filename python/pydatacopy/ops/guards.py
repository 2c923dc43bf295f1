"""Tracing and capture guards shared by every stream-ordered call: whether torch.compile, make_fx
or a CUDA graph capture is active, and the refusals of calls that cannot be traced or captured."""

from __future__ import annotations

import sys

import torch
from torch._C import _len_torch_dispatch_stack as dispatch_modes
from torch.compiler import is_dynamo_compiling as dynamo_compiling

from .. import _C

Error = _C.Error

# ---- tracing ---------------------------------------------------------------------------------


class TracedCallError(Error, AssertionError):
    """A pydatacopy.Error raised while torch.compile traces. It is also an AssertionError only
    because Dynamo passes that type on unchanged (any other exception raised while it traces
    comes out wrapped as InternalTorchDynamoError, or, raised from traced code, becomes a graph
    break that fullgraph=False would run eagerly without a word)."""


def _raise_while_tracing(message: str) -> None:
    raise TracedCallError(message)


# What torch._dynamo.assume_constant_result does (importing torch._dynamo here would add about
# 2 s to `import pydatacopy`): Dynamo calls the function for real while it traces, rather than
# tracing its body, so the error leaves torch.compile as it is, fullgraph or not.
_raise_while_tracing._dynamo_marked_constant = True  # type: ignore[attr-defined]


def mark_static(tensor: torch.Tensor) -> torch.Tensor:
    """torch._dynamo.mark_static_address(tensor): CUDA graphs (reduce-overhead) then use the tensor
    in place rather than a copy, which would not be symmetric. Its attribute is set directly when
    torch._dynamo is not loaded yet (loading it costs about 2 s)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.mark_static_address(tensor)
    else:
        tensor._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    return tensor


_get_callback = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_get_callback = getattr(_get_callback, "get_eval_frame_callback", None)


def _inside_compiled_call() -> bool:
    """Eager code running inside a torch.compile'd function (after a graph break): Dynamo's
    frame callback stays set for the whole call (torch.compiler.disable clears it)."""
    return _get_callback is not None and _get_callback() not in (None, False)


def _tracing_modes() -> bool:
    """make_fx / FakeTensorMode / functionalization active (a user's logging mode is not)."""
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(getattr(keys, name)) is not None
               for name in ("FAKE", "PROXY", "FUNCTIONAL") if hasattr(keys, name))


def refuse_group() -> None:
    """group() collects calls in thread-local state and launches them at its exit: not traceable."""
    message = ("pydatacopy.group() cannot be traced (torch.compile, make_fx): use "
               "pydatacopy.sendrecv() for a send and a receive at once")
    if dynamo_compiling():
        _raise_while_tracing(message)
    if _tracing_modes():
        raise Error(message)


def refusal(what: str) -> str:
    return (f"pydatacopy.{what} blocks or allocates on every PE, so it cannot be part of a traced "
            "or compiled graph (torch.compile, make_fx, torch.export): call it before or after "
            "the compiled function (or inside torch.compiler.disable)")


def refuse_tracing(what: str) -> None:
    """At the top of every call that blocks or allocates collectively: a clear error when traced,
    never a silent graph break (a graph break would run it eagerly mid-graph, and one PE could
    block alone)."""
    if dynamo_compiling():
        _raise_while_tracing(refusal(what))
    if (dispatch_modes() and _tracing_modes()) or _inside_compiled_call():
        raise Error(refusal(what))


def _capturing(handle: int | None = None) -> bool:
    """Whether torch's current stream, or the stream `handle`, is being captured into a graph."""
    if not torch.cuda.is_available():  # no GPU, no graph (and CPU builds of torch cannot tell)
        return False
    return torch.cuda.is_current_stream_capturing() or (handle is not None and _C.is_capturing(handle))


def refuse_capture(what: str, handle: int | None = None) -> None:
    """Calls that block (they wait for every PE, or for the GPU) cannot be part of a CUDA graph,
    nor of a traced one."""
    refuse_tracing(what)
    if _capturing(handle):
        raise Error(f"pydatacopy.{what} blocks (it waits for every PE or synchronises the GPU), so it "
                    "cannot be captured in a CUDA graph: call it before or after the capture")
