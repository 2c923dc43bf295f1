"""send/recv in groups (--ops group): where the low-latency cut belongs for a group of messages,
as an all-to-all issues, beside a single sendrecv's (send_recv.py's rows)."""

from __future__ import annotations

import contextlib

import pydatacopy

from . import baselines
from ._harness import Sweep, against, human, make_row
from .send_recv import engine_cuts, low_latency_fits

#: Messages each way in one group, and their sizes. Every low-latency
#: op of a launch moves on one block (send_recv.cu), where staged messages spread over many: these
#: rows say where the low-latency cut belongs for a group, as an all-to-all issues (docs/perf-notes.md v30).
GROUP_MESSAGES = 16
GROUP_MESSAGE_BYTES = (4 << 10, 16 << 10, 64 << 10)


def _group_run(sweep, messages: int):
    """One group (both ways): `messages` sends of consecutive pieces of sweep.src to the peer and
    as many recvs into the pieces of sweep.out from it."""
    piece = sweep.nbytes // messages
    sends = [sweep.src[m * piece:(m + 1) * piece] for m in range(messages)]
    recvs = [sweep.out[m * piece:(m + 1) * piece] for m in range(messages)]

    def run():
        with pydatacopy.group():
            for send, recv in zip(sends, recvs):
                pydatacopy.send(send, sweep.peer)
                pydatacopy.recv(recv, sweep.peer)

    return run


def bench_group(args, messages: int = GROUP_MESSAGES, sizes=GROUP_MESSAGE_BYTES) -> list[dict]:
    """Groups of `messages` sends and recvs of each size in `sizes` with the peer, both ways: the
    default path, every message staged, and every message by the low-latency protocol (where the
    size fits it), each over a local copy of the group's bytes in the same run, checked as every
    row is (the group's whole receive buffer holds the peer's fresh data)."""
    rows = []
    for size in sizes:
        nbytes = messages * size
        sweep = Sweep(nbytes, True, args)
        # (Named apart from the sweep's local copy of the same bytes: a row is found by its path.)
        base = make_row("baseline", f"group {messages} x {human(size)}, local copy", "both", nbytes,
                        *baselines.local_copy(sweep))
        rows.append(base)
        paths = [("default", None), ("staged", (0, 0))]
        if low_latency_fits(size):
            paths.append(("low-latency", (0, pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES)))
        for path, cuts in paths:
            with contextlib.nullcontext() if cuts is None else engine_cuts(*cuts):
                timed, ok = sweep.measure(_group_run(sweep, messages), sweep.out)
            rows.append(against(make_row("send/recv", f"group {messages} x {human(size)}, {path}", "both", nbytes,
                                         timed, ok), base))
        del sweep
    return rows
