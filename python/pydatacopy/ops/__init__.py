"""pydatacopy.ops: the stream-ordered calls as torch.library ops, and the tracing guards.

Owns the ``torch.ops.pydatacopy.*`` registrations of ``ops.kernels`` (schemas, real and fake
kernels), the traced forms of the public calls (``ops.traced``), the ordering tensor, and the
refusals of calls that cannot be traced or captured (``ops.guards``). May import torch, ``_C``
and the shared ``_torch_utils``/``_limits``, never a feature package: the features import it and
name their eager functions with ``implement()``; the real kernels read them at call time.

pydatacopy's stream-ordered calls as torch.library custom ops (``torch.ops.pydatacopy.*``), so
that torch.compile (fullgraph too), make_fx and CUDA graphs (mode="reduce-overhead") trace them.

Eager calls never come here: the public functions call ``_C`` directly, and turn to the traced
forms below only while tracing: Dynamo tracing (``is_dynamo_compiling()``, which Dynamo reads as
True), or a torch dispatch mode active (make_fx, FakeTensorMode, functionalization, or a user's
mode, which then sees the op). An op's real kernel calls the same public function eagerly, so a
compiled call runs exactly the eager code.

What each op declares, and why:
- every tensor it writes, here or at a peer (a put's destination, a signal, a receive buffer):
  compiled code then orders reads and writes of those tensors around the op;
- the tensors a wait completes (``received=`` of barrier and signal_wait): what peers wrote into
  them may only be read after the wait, and nothing else tells the compiler so;
- ``order``, one small tensor that every op writes: it keeps pydatacopy's calls in program order
  (a ``quiet`` after its puts, a ``barrier`` after its ``quiet``) and keeps calls that write no
  tensor of the caller's (``send``, ``quiet``, ``barrier``) from being dropped as dead code.
  pydatacopy.init() makes it, on the PE's device; nothing ever writes it.

Streams cross as ints: None is torch's current stream when the op runs (so a CUDA graph capture
records the calls on its capture stream), an int a raw cudaStream_t. Signal values (uint64) cross
as int64 with the same bits, typed SymInt so that a value that changes every call (a round
number) stays symbolic after Dynamo's first recompile instead of recompiling for each value.
"""

from __future__ import annotations

from .guards import (
    TracedCallError,
    dispatch_modes,
    dynamo_compiling,
    mark_static,
    refusal,
    refuse_capture,
    refuse_group,
    refuse_tracing,
)
from .kernels import OPS, SCHEMAS, implement, public, register_object
from .traced import (
    barrier,
    drop_order_token,
    exchange,
    get,
    make_order_token,
    put,
    put_blocks,
    put_many,
    put_many_prepared,
    put_signal,
    quiet,
    recv,
    send,
    sendrecv,
    signal_set,
    signal_wait,
    wait,
)

__all__ = [
    "OPS",
    "SCHEMAS",
    "TracedCallError",
    "barrier",
    "dispatch_modes",
    "drop_order_token",
    "dynamo_compiling",
    "exchange",
    "get",
    "implement",
    "make_order_token",
    "mark_static",
    "public",
    "put",
    "put_blocks",
    "put_many",
    "put_many_prepared",
    "put_signal",
    "quiet",
    "recv",
    "refusal",
    "refuse_capture",
    "refuse_group",
    "refuse_tracing",
    "register_object",
    "send",
    "sendrecv",
    "signal_set",
    "signal_wait",
    "wait",
]
