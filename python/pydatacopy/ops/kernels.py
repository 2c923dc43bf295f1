"""pydatacopy's stream-ordered calls as torch.library custom ops (``torch.ops.pydatacopy.*``), so
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

import itertools
import sys
import weakref

import torch
from torch._C import _len_torch_dispatch_stack as dispatch_modes
from torch.compiler import is_dynamo_compiling as dynamo_compiling

from . import _C

Error = _C.Error
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1

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


# ---- the ordering tensor ----------------------------------------------------------------------

_order: torch.Tensor | None = None


def make_order_token(device: int | str | torch.device) -> torch.Tensor:
    """The one tensor every op writes (see the module's docstring); pydatacopy.init() calls it.
    A static address: CUDA graphs (reduce-overhead) keep it in place instead of copying it."""
    global _order
    _order = mark_static(torch.zeros(1, dtype=torch.uint8, device=device))
    return _order


def drop_order_token() -> None:
    global _order
    _order = None


def _token(what: str) -> torch.Tensor:
    token = _order
    if token is None:
        message = (f"pydatacopy.{what} is traced before pydatacopy.init(): initialise pydatacopy "
                   "first, then compile")
        if dynamo_compiling():
            _raise_while_tracing(message)
        raise Error(message)
    return token


def _stream(stream) -> int | None:
    if stream is None or isinstance(stream, int):
        return stream
    return stream.cuda_stream  # a torch.cuda.Stream (its raw handle)


def _signal_value(value: int) -> int:
    """uint64 -> int64 with the same bits (the schema's int is signed)."""
    return value - _U64 if value > _I64_MAX else value


def _timeout(timeout) -> float | None:
    return None if timeout is None else float(timeout)


# ---- the ops: schema, real kernel (the eager public call), fake kernel --------------------------
# The real kernels look the public functions up in their modules at call time (tests swap in a
# loopback on the CPU). A dispatch mode active around a real kernel (a user's mode handing the op
# on) would send the public call back here; the modes are set aside for it.

_transfer_module = None
_send_recv_module = None


def _transfer():
    """pydatacopy._transfer (it imports this module: imported here when first needed)."""
    global _transfer_module
    if _transfer_module is None:
        from . import _transfer as module
        _transfer_module = module
    return _transfer_module


def _send_recv():
    """pydatacopy._send_recv (it imports this module: imported here when first needed)."""
    global _send_recv_module
    if _send_recv_module is None:
        from . import _send_recv as module
        _send_recv_module = module
    return _send_recv_module


def _eager(function, *args, **kwargs):
    if dispatch_modes():
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            return function(*args, **kwargs)
    return function(*args, **kwargs)


# torch.library.define + impl rather than torch.library.custom_op: the same schema, fake kernel
# and functionalization, at a fifth of the host time per call (custom_op adds Python autograd and
# version-counter kernels: about 20 us a call against 3-6 us, measured on a 2-core CPU), which a
# compiled step without CUDA graphs pays on every call.
_LIBRARY = torch.library.Library("pydatacopy", "DEF")


def _op(name: str):
    """Defines pydatacopy::`name` (SCHEMAS) with `real` as its kernel on every device."""
    def register(real):
        _LIBRARY.define(name + SCHEMAS[name])
        _LIBRARY.impl(name, real, "CompositeExplicitAutograd")
        torch.library.register_fake(f"pydatacopy::{name}", _FAKES.get(name, _no_output), lib=_LIBRARY)
        return real
    return register


def _no_output(*args, **kwargs) -> None:
    return None


def _wait_fake(manager, recv_buffers, stream, timeout, order) -> torch.Tensor:
    return torch.empty_like(recv_buffers[0])


_FAKES = {"wait": _wait_fake}

SCHEMAS = {
    "put": "(Tensor(a!) dst, Tensor src, int pe, int? stream, str path, Tensor(b!) order) -> ()",
    "get": "(Tensor(a!) dst, Tensor src, int pe, int? stream, str path, Tensor(b!) order) -> ()",
    "put_signal": ("(Tensor(a!) dst, Tensor src, int pe, Tensor(b!) signal, SymInt value, int? stream, "
                   "Tensor(c!) order) -> ()"),
    "signal_set": "(Tensor(a!) signal, SymInt value, int pe, int? stream, Tensor(b!) order) -> ()",
    "signal_wait": ("(Tensor(a!) signal, SymInt value, Tensor(b!)[] received, int? stream, "
                    "float? timeout, Tensor(c!) order) -> ()"),
    "quiet": "(int? stream, Tensor(a!) order) -> ()",
    "barrier": "(Tensor(a!)[] received, int? stream, float? timeout, Tensor(b!) order) -> ()",
    "put_many": ("(Tensor(a!)[] dsts, Tensor[] srcs, int pe, int? stream, str path, "
                 "Tensor(b!) order) -> ()"),
    "put_blocks": ("(Tensor(a!) dst_pool, Tensor src_pool, Tensor dst_indices, Tensor src_indices, "
                   "int pe, int? stream, str path, Tensor(b!) order) -> ()"),
    "send": "(Tensor tensor, int dst_pe, int? stream, float? timeout, Tensor(a!) order) -> ()",
    "recv": "(Tensor(a!) tensor, int src_pe, int? stream, float? timeout, Tensor(b!) order) -> ()",
    "sendrecv": ("(Tensor send_tensor, int dst_pe, Tensor(a!) recv_tensor, int src_pe, int? stream, "
                 "float? timeout, Tensor(b!) order) -> ()"),
    "exchange": ("(int manager, Tensor[] send_buffers, Tensor(a!)[] recv_buffers, int? dst_pe, "
                 "int? src_pe, int? stream, float? timeout, Tensor(b!) order) -> ()"),
    "wait": ("(int manager, Tensor(a!)[] recv_buffers, int? stream, float? timeout, "
             "Tensor(b!) order) -> Tensor"),
    # PreparedPutMany.run: the table by number; its tensors (none when made from addresses) for
    # the compiler's ordering, the destinations declared written.
    "put_many_prepared": ("(int table, Tensor(a!)[] dsts, Tensor[] srcs, int? stream, "
                          "Tensor(b!) order) -> ()"),
}


@_op("put")
def _put(dst, src, pe, stream, path, order) -> None:
    _eager(_transfer().put, dst, src, pe, stream=stream, path=path)


@_op("get")
def _get(dst, src, pe, stream, path, order) -> None:
    _eager(_transfer().get, dst, src, pe, stream=stream, path=path)


@_op("put_signal")
def _put_signal(dst, src, pe, signal, value, stream, order) -> None:
    _eager(_transfer().put_signal, dst, src, pe, signal, value % _U64, stream=stream)


@_op("signal_set")
def _signal_set(signal, value, pe, stream, order) -> None:
    _eager(_transfer().signal_set, signal, value % _U64, pe, stream=stream)


@_op("signal_wait")
def _signal_wait(signal, value, received, stream, timeout, order) -> None:
    _eager(_transfer().signal_wait, signal, value % _U64, stream=stream, timeout=timeout)


@_op("quiet")
def _quiet(stream, order) -> None:
    _eager(_transfer().quiet, stream=stream)


@_op("barrier")
def _barrier(received, stream, timeout, order) -> None:
    _eager(_transfer().barrier, stream=stream, timeout=timeout)


@_op("put_many")
def _put_many(dsts, srcs, pe, stream, path, order) -> None:
    _eager(_transfer().put_many, dsts, srcs, pe, stream=stream, path=path)


@_op("put_blocks")
def _put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, stream, path, order) -> None:
    _eager(_transfer().put_blocks, dst_pool, src_pool, dst_indices, src_indices, pe, stream=stream,
           path=path)


@_op("send")
def _send(tensor, dst_pe, stream, timeout, order) -> None:
    _eager(_send_recv().send, tensor, dst_pe, stream=stream, timeout=timeout)


@_op("recv")
def _recv(tensor, src_pe, stream, timeout, order) -> None:
    _eager(_send_recv().recv, tensor, src_pe, stream=stream, timeout=timeout)


@_op("sendrecv")
def _sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, stream, timeout, order) -> None:
    _eager(_send_recv().sendrecv, send_tensor, dst_pe, recv_tensor, src_pe, stream=stream,
           timeout=timeout)


# Objects with state (a DoubleBufferManager, a prepared put_many): the op names the object by a
# number (ops take no Python objects) and runs its eager method, whose state (round, buffer set,
# table) is read when it runs.
_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_object_numbers = itertools.count(1)


def register_object(obj) -> int:
    """The number the traced calls name `obj` by (held weakly)."""
    number = next(_object_numbers)
    _objects[number] = obj
    return number


def _object(number: int, what: str):
    obj = _objects.get(number)
    if obj is None:
        raise Error(f"pydatacopy.{what}: the object this compiled call was traced with no longer "
                    "exists; compile again with the live one")
    return obj


def _manager(number: int):
    return _object(number, "DoubleBufferManager")


@_op("put_many_prepared")
def _put_many_prepared(table, dsts, srcs, stream, order) -> None:
    _eager(_object(table, "PreparedPutMany").run, stream=stream)


@_op("exchange")
def _exchange(manager, send_buffers, recv_buffers, dst_pe, src_pe, stream, timeout, order) -> None:
    _eager(_manager(manager).exchange, dst_pe=dst_pe, src_pe=src_pe, stream=stream, timeout=timeout)


@_op("wait")
def _wait(manager, recv_buffers, stream, timeout, order) -> torch.Tensor:
    # The round's buffer set is known only when this runs, and an op's output may not alias an
    # input: the traced wait returns a copy, made on the same stream after the wait.
    received = _eager(_manager(manager).wait, stream=stream, timeout=timeout)
    copy = torch.empty_like(received)
    if stream is None:
        copy.copy_(received)
    else:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            copy.copy_(received)
    return copy


OPS = {name: getattr(torch.ops.pydatacopy, name).default for name in SCHEMAS}

# ---- the traced forms of the public calls ---------------------------------------------------------
# Same arguments as the public calls; the checks that need the runtime (init, symmetric memory,
# PE range) run in the real kernel, when the compiled code runs.

_ops = torch.ops.pydatacopy


def put(dst, src, pe, *, stream=None, path="auto") -> None:
    _ops.put(dst, src, pe, _stream(stream), path, _token("put"))


def get(dst, src, pe, *, stream=None, path="auto") -> None:
    _ops.get(dst, src, pe, _stream(stream), path, _token("get"))


def put_signal(dst, src, pe, signal, value, *, stream=None) -> None:
    _ops.put_signal(dst, src, pe, signal, _signal_value(value), _stream(stream), _token("put_signal"))


def signal_set(signal, value, pe, *, stream=None) -> None:
    _ops.signal_set(signal, _signal_value(value), pe, _stream(stream), _token("signal_set"))


def signal_wait(signal, value, *, stream=None, timeout=None, blocking=False, received=()) -> None:
    if blocking:  # not traced (refused then): a user's dispatch mode only, so run it as eager
        refuse_tracing("signal_wait(blocking=True)")
        return _eager(_transfer().signal_wait, signal, value, stream=stream, timeout=timeout,
                      blocking=True)
    _ops.signal_wait(signal, _signal_value(value), list(received), _stream(stream), _timeout(timeout),
                     _token("signal_wait"))


def quiet(*, stream=None) -> None:
    _ops.quiet(_stream(stream), _token("quiet"))


def barrier(*, stream=None, timeout=None, blocking=False, received=()) -> None:
    if blocking:  # as in signal_wait
        refuse_tracing("barrier(blocking=True)")
        return _eager(_transfer().barrier, stream=stream, timeout=timeout, blocking=True)
    _ops.barrier(list(received), _stream(stream), _timeout(timeout), _token("barrier"))


def put_many(dsts, srcs, pe, *, stream=None, path="auto") -> None:
    _ops.put_many(list(dsts), list(srcs), pe, _stream(stream), path, _token("put_many"))


def put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, *, stream=None, path="auto") -> None:
    _ops.put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, _stream(stream), path,
                    _token("put_blocks"))


def send(tensor, dst_pe, *, stream=None, timeout=None) -> None:
    _ops.send(tensor, dst_pe, _stream(stream), _timeout(timeout), _token("send"))


def recv(tensor, src_pe, *, stream=None, timeout=None) -> None:
    _ops.recv(tensor, src_pe, _stream(stream), _timeout(timeout), _token("recv"))


def sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, *, stream=None, timeout=None) -> None:
    _ops.sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, _stream(stream), _timeout(timeout),
                  _token("sendrecv"))


def _require_buffers(buffers, what: str) -> None:
    if not buffers:
        message = f"pydatacopy.DoubleBufferManager.{what}: call init(n_tokens, token_size) first"
        if dynamo_compiling():
            _raise_while_tracing(message)
        raise Error(message)


def exchange(manager, number: int, send_buffers, recv_buffers, peer=None, *, dst_pe=None,
             src_pe=None, stream=None, timeout=None) -> None:
    """DoubleBufferManager.exchange, traced. Returns None: the round is counted when the compiled
    code runs, so wait() is called without one (the last exchanged)."""
    _require_buffers(send_buffers, "exchange")
    if peer is not None:
        if dst_pe is not None or src_pe is not None:
            _raise_while_tracing("pydatacopy.DoubleBufferManager.exchange: give either peer= or "
                                 "dst_pe=/src_pe=, not both")
        dst_pe = src_pe = peer
    _ops.exchange(number, list(send_buffers), list(recv_buffers), dst_pe, src_pe, _stream(stream),
                  _timeout(timeout), _token("DoubleBufferManager.exchange"))


def wait(manager, number: int, recv_buffers, round_=None, *, stream=None, timeout=None,
         blocking=False) -> torch.Tensor:
    """DoubleBufferManager.wait, traced: the last exchanged round, returned as a copy."""
    if blocking:  # as in signal_wait
        refuse_tracing("DoubleBufferManager.wait(blocking=True)")
        return _eager(manager.wait, round_, stream=stream, timeout=timeout, blocking=True)
    _require_buffers(recv_buffers, "wait")
    if round_ is not None:
        _raise_while_tracing("pydatacopy.DoubleBufferManager.wait under torch.compile waits for the "
                             "last exchanged round: call wait() without a round (a round number "
                             "fixed when tracing would be wrong when the compiled code runs again)")
    return _ops.wait(number, list(recv_buffers), _stream(stream), _timeout(timeout),
                     _token("DoubleBufferManager.wait"))


def put_many_prepared(prepared, number: int, dsts, srcs, *, stream=None) -> None:
    """PreparedPutMany.run, traced: `dsts`, `srcs` the tensors the table was prepared from (empty
    for one made from addresses: then only the ordering tensor orders it). The class takes it
    with a number from register_object(self) kept on the object, and one branch at the top of
    run(), as put() has: ``return _ops.put_many_prepared(self, number, dsts, srcs, stream=...)``."""
    _ops.put_many_prepared(number, list(dsts), list(srcs), _stream(stream),
                           _token("PreparedPutMany.run"))
