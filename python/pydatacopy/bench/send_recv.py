"""send/recv: one way (send on rank 0, recv on rank 1) or both ways (sendrecv), one row per path
the engine can take. `default`: no setting touched, the engine's cuts as init() left them (what a
user gets). The forced rows set the engine's two cuts for the row and put back the ones before:
`staged` (zero-copy and low-latency off: every message through the staging, two copies),
`zero-copy` (PYDATACOPY_ZERO_COPY_MIN_BYTES at 1 byte, low-latency off: messages between
load/store peers move once) and `low-latency` (PYDATACOPY_LOW_LATENCY_MAX_BYTES at the engine's
capacity, zero-copy off: data and flags in the same stores; only sizes up to the capacity).
Where the forced rows cross is where the defaults belong."""

from __future__ import annotations

import contextlib
import sys

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv


@contextlib.contextmanager
def engine_cuts(zero_copy_min_bytes: int, low_latency_max_bytes: int):
    """The engine's two cuts for one row, on both PEs (collective), then the ones before."""
    before = _send_recv.zero_copy_min_bytes(), _send_recv.low_latency_max_bytes()
    _send_recv.set_zero_copy_min_bytes(zero_copy_min_bytes)
    _send_recv.set_low_latency_max_bytes(low_latency_max_bytes)
    try:
        yield
    finally:
        _send_recv.set_zero_copy_min_bytes(before[0])
        _send_recv.set_low_latency_max_bytes(before[1])


def _run(sweep):
    def run():
        if sweep.both:
            pydatacopy.sendrecv(sweep.src, sweep.peer, sweep.out, sweep.peer)
        elif sweep.sends:
            pydatacopy.send(sweep.src, sweep.peer)
        else:
            pydatacopy.recv(sweep.out, sweep.peer)

    return run


def _measure_counted(sweep, counter: str, path: str, why: str):
    """Time and check the row, then say so on a receiving PE when the engine's `counter` did not
    move: the row's figures are then another path's (`why` names the likely causes)."""
    engine = _send_recv._require_engine("bench")
    before = engine.zero_copy_counters()[counter]
    result = sweep.measure(_run(sweep), sweep.out)
    moved = engine.zero_copy_counters()[counter] - before  # after measure's synchronize
    if sweep.receives and moved == 0:
        print(f"  rank {sweep.me}: the {path} row of {sweep.nbytes} bytes moved nothing {path} ({why}): "
              "its figures are the staged path's", file=sys.stderr, flush=True)
    return result


def sendrecv_default(sweep):
    """No setting touched: the path each size takes as a user's call does."""
    return sweep.measure(_run(sweep), sweep.out)


def sendrecv(sweep):
    """Zero-copy at every size (the threshold at 1 byte, low-latency off; the warm-up makes the
    handshake, as a user's repeated calls into one buffer do)."""
    with engine_cuts(zero_copy_min_bytes=1, low_latency_max_bytes=0):
        return _measure_counted(sweep, "recv_zero_copy", "zero-copy", "peer not load/store reachable, "
                                "PYDATACOPY_FORCE_RMA, or memory CUDA IPC cannot export")


def sendrecv_staged(sweep):
    """Every message staged (zero-copy and low-latency off): two copies."""
    with engine_cuts(zero_copy_min_bytes=0, low_latency_max_bytes=0):
        return sweep.measure(_run(sweep), sweep.out)


def low_latency_fits(nbytes: int) -> bool:
    """Whether a message of `nbytes` can take the low-latency path at all."""
    return nbytes <= pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES


def sendrecv_ll(sweep):
    """Every message by the low-latency protocol (its cut at the engine's capacity, zero-copy off);
    only for sizes low_latency_fits."""
    with engine_cuts(zero_copy_min_bytes=0, low_latency_max_bytes=pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES):
        return _measure_counted(sweep, "recv_low_latency", "low-latency",
                                "peer not load/store reachable, or PYDATACOPY_FORCE_RMA")
