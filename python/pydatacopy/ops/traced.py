"""The traced forms of the public calls (what they run under torch.compile, make_fx or a dispatch
mode: the ops), and the ordering tensor every op writes."""

from __future__ import annotations

import torch

from .. import _C
from .._torch_utils import stream_argument
from .guards import _raise_while_tracing, dynamo_compiling, mark_static, refuse_tracing
from .kernels import _U64, _eager, public

Error = _C.Error
_I64_MAX = (1 << 63) - 1

# ---- the ordering tensor ----------------------------------------------------------------------

_order: torch.Tensor | None = None


def make_order_token(device: int | str | torch.device) -> torch.Tensor:
    """The one tensor every op writes (see pydatacopy.ops' docstring); pydatacopy.init() calls it.
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


def _signal_value(value: int) -> int:
    """uint64 -> int64 with the same bits (the schema's int is signed)."""
    return value - _U64 if value > _I64_MAX else value


def _timeout(timeout) -> float | None:
    return None if timeout is None else float(timeout)


# ---- the traced forms of the public calls ---------------------------------------------------------
# Same arguments as the public calls; the checks that need the runtime (init, symmetric memory,
# PE range) run in the real kernel, when the compiled code runs.

_ops = torch.ops.pydatacopy


def put(dst, src, pe, *, stream=None, path="auto") -> None:
    _ops.put(dst, src, pe, stream_argument(stream), path, _token("put"))


def get(dst, src, pe, *, stream=None, path="auto") -> None:
    _ops.get(dst, src, pe, stream_argument(stream), path, _token("get"))


def put_signal(dst, src, pe, signal, value, *, stream=None) -> None:
    _ops.put_signal(dst, src, pe, signal, _signal_value(value), stream_argument(stream), _token("put_signal"))


def signal_set(signal, value, pe, *, stream=None) -> None:
    _ops.signal_set(signal, _signal_value(value), pe, stream_argument(stream), _token("signal_set"))


def signal_wait(signal, value, *, stream=None, timeout=None, blocking=False, received=()) -> None:
    if blocking:  # not traced (refused then): a user's dispatch mode only, so run it as eager
        refuse_tracing("signal_wait(blocking=True)")
        return _eager(public("signal_wait"), signal, value, stream=stream, timeout=timeout,
                      blocking=True)
    _ops.signal_wait(signal, _signal_value(value), list(received), stream_argument(stream), _timeout(timeout),
                     _token("signal_wait"))


def quiet(*, stream=None) -> None:
    _ops.quiet(stream_argument(stream), _token("quiet"))


def barrier(*, stream=None, timeout=None, blocking=False, received=()) -> None:
    if blocking:  # as in signal_wait
        refuse_tracing("barrier(blocking=True)")
        return _eager(public("barrier"), stream=stream, timeout=timeout, blocking=True)
    _ops.barrier(list(received), stream_argument(stream), _timeout(timeout), _token("barrier"))


def put_many(dsts, srcs, pe, *, stream=None, path="auto") -> None:
    _ops.put_many(list(dsts), list(srcs), pe, stream_argument(stream), path, _token("put_many"))


def put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, *, stream=None, path="auto") -> None:
    _ops.put_blocks(dst_pool, src_pool, dst_indices, src_indices, pe, stream_argument(stream), path,
                    _token("put_blocks"))


def send(tensor, dst_pe, *, stream=None, timeout=None) -> None:
    _ops.send(tensor, dst_pe, stream_argument(stream), _timeout(timeout), _token("send"))


def recv(tensor, src_pe, *, stream=None, timeout=None) -> None:
    _ops.recv(tensor, src_pe, stream_argument(stream), _timeout(timeout), _token("recv"))


def sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, *, stream=None, timeout=None) -> None:
    _ops.sendrecv(send_tensor, dst_pe, recv_tensor, src_pe, stream_argument(stream), _timeout(timeout),
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
    _ops.exchange(number, list(send_buffers), list(recv_buffers), dst_pe, src_pe, stream_argument(stream),
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
    return _ops.wait(number, list(recv_buffers), stream_argument(stream), _timeout(timeout),
                     _token("DoubleBufferManager.wait"))


def put_many_prepared(prepared, number: int, dsts, srcs, *, stream=None) -> None:
    """PreparedPutMany.run, traced: `dsts`, `srcs` the tensors the table was prepared from (empty
    for one made from addresses: then only the ordering tensor orders it). The class takes it
    with a number from register_object(self) kept on the object, and one branch at the top of
    run(), as put() has: ``return _ops.put_many_prepared(self, number, dsts, srcs, stream=...)``."""
    _ops.put_many_prepared(number, list(dsts), list(srcs), stream_argument(stream),
                           _token("PreparedPutMany.run"))
