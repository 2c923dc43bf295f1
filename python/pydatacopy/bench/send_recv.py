"""send/recv: one way (send on rank 0, recv on rank 1) or both ways (sendrecv); zero-copy (the
engine's threshold, PYDATACOPY_ZERO_COPY_MIN_BYTES: messages at or above it between load/store
peers move once) and staged (the threshold at 0 for the row: every message through the staging,
two copies)."""

from __future__ import annotations

import contextlib
import sys

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv


@contextlib.contextmanager
def zero_copy_min_bytes(nbytes: int):
    """The threshold for one row, on both PEs (collective), then the one before."""
    before = _send_recv.zero_copy_min_bytes()
    _send_recv.set_zero_copy_min_bytes(nbytes)
    try:
        yield
    finally:
        _send_recv.set_zero_copy_min_bytes(before)


def _run(sweep):
    def run():
        if sweep.both:
            pydatacopy.sendrecv(sweep.src, sweep.peer, sweep.out, sweep.peer)
        elif sweep.sends:
            pydatacopy.send(sweep.src, sweep.peer)
        else:
            pydatacopy.recv(sweep.out, sweep.peer)

    return run


def sendrecv(sweep):
    """Zero-copy at every size (the threshold at 1 byte for this row; the warm-up makes the
    handshake, as a user's repeated calls into one buffer do). The crossover with the staged
    row is where PYDATACOPY_ZERO_COPY_MIN_BYTES belongs."""
    engine = _send_recv._require_engine("bench")
    with zero_copy_min_bytes(1):
        before = engine.zero_copy_counters()["recv_zero_copy"]
        result = sweep.measure(_run(sweep), sweep.out)
        moved = engine.zero_copy_counters()["recv_zero_copy"] - before  # after measure's synchronize
    if sweep.receives and moved == 0:
        print(f"  rank {sweep.me}: the zero-copy row of {sweep.nbytes} bytes moved nothing zero-copy "
              "(peer not load/store reachable, PYDATACOPY_FORCE_RMA, or memory CUDA IPC cannot "
              "export): its figures are the staged path's", file=sys.stderr, flush=True)
    return result


def sendrecv_staged(sweep):
    """Every message staged (the threshold at 0 for this row): two copies."""
    with zero_copy_min_bytes(0):
        return sweep.measure(_run(sweep), sweep.out)
