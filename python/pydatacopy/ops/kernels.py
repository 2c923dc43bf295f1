"""The torch.library ops: schemas, real kernels (the eager public calls) and fake kernels, and the
objects (DoubleBufferManager, PreparedPutMany) that the ops name by number."""

from __future__ import annotations

import itertools
import weakref
from types import ModuleType

import torch

from .. import _C
from .guards import dispatch_modes

Error = _C.Error
_U64 = 1 << 64

# ---- the ops: schema, real kernel (the eager public call), fake kernel --------------------------
# The real kernels look the public functions up in their modules at call time (tests swap in a
# loopback on the CPU). A dispatch mode active around a real kernel (a user's mode handing the op
# on) would send the public call back here; the modes are set aside for it.
# The feature modules (rma.transfer, send_recv) name their module here with implement(): this
# package imports no feature, so the feature modules can import it without a circle.

_implementations: dict[str, ModuleType] = {}


def implement(module: ModuleType, *names: str) -> None:
    """The ops `names` run `module`'s function of the same name (looked up when they run)."""
    for name in names:
        _implementations[name] = module


def public(name: str):
    """The eager public function op `name` runs, read from its module now."""
    module = _implementations.get(name)
    if module is None:  # only when a feature module was not imported (import pydatacopy does)
        raise Error(f"pydatacopy::{name}: no eager implementation registered; import pydatacopy")
    return getattr(module, name)


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
    _eager(public("put"), dst, src, pe, stream=stream, path=path)


@_op("get")
def _get(dst, src, pe, stream, path, order) -> None:
    _eager(public("get"), dst, src, pe, stream=stream, path=path)


@_op("put_signal")
def _put_signal(dst, src, pe, signal, value, stream, order) -> None:
    _eager(public("put_signal"), dst, src, pe, signal, value % _U64, stream=stream)


@_op("signal_set")
def _signal_set(signal, value, pe, stream, order) -> None:
    _eager(public("signal_set"), signal, value % _U64, pe, stream=stream)


@_op("signal_wait")
def _signal_wait(signal, value, received, stream, timeout, order) -> None:
    _eager(public("signal_wait"), signal, value % _U64, stream=stream, timeout=timeout)


@_op("quiet")
def _quiet(stream, order) -> None:
    _eager(public("quiet"), stream=stream)


@_op("barrier")
def _barrier(received, stream, timeout, order) -> None:
    _eager(public("barrier"), stream=stream, timeout=timeout)


@_op("put_many")
def _put_many(dsts, srcs, pe, stream, path, order) -> None:
    _eager(public("put_many"), dsts, srcs, pe, stream=stream, path=path)


@_op("put_blocks")
def _put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, stream, path, order) -> None:
    _eager(public("put_blocks"), dst_pool, src_pool, dst_indices, src_indices, pe, stream=stream,
           path=path)


@_op("send")
def _send(tensor, dst_pe, stream, timeout, order) -> None:
    _eager(public("send"), tensor, dst_pe, stream=stream, timeout=timeout)


@_op("recv")
def _recv(tensor, src_pe, stream, timeout, order) -> None:
    _eager(public("recv"), tensor, src_pe, stream=stream, timeout=timeout)


@_op("sendrecv")
def _sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, stream, timeout, order) -> None:
    _eager(public("sendrecv"), send_tensor, dst_pe, recv_tensor, src_pe, stream=stream,
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
