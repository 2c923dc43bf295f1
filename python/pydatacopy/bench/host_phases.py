"""Where a send/recv call's host time goes (--ops host, beside send_recv.bench_host_queued): the
core's phases of a call (SendRecvEngine.host_phase_names(): the peers' mailboxes, the stream's
state, each op's kernel arguments, the channels' totals, the channel order's waits, the launch,
the channels' records), summed by the core's hook over calls queued behind a sleeping kernel, for
send | recv, sendrecv and a group of 16 sends and 16 recvs of 4 KiB (issue 35, item 3: the host
path; a group of 32 ops issued in about 195 us on the GPU machine)."""

from __future__ import annotations

import statistics
import sys

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv

from ._harness import agree, fill, reduce_device
from .group import GROUP_MESSAGES  # the group rows' shape: a send and a recv per message


def bench_host_phases(args, nbytes: int = 4096, calls: int = 64, rounds: int = 9) -> list[dict]:
    """Per call and phase, the median over `rounds` rounds of `calls` calls of this PE's core time
    (ns summed by the hook over the round, over its calls), one way (rank 0 sends, rank 1
    receives: a row each) and both ways; then each call is checked with fresh data into cleared
    destinations."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    engine = _send_recv._require_engine("the host phases' rows")
    names = list(engine.host_phase_names())
    # About 2 ms a call's queue of one op takes less than to issue; a group's 32 ops issued in about
    # 195 us each on the GPU machine (2026-12-07): its queue sleeps 16 times as long.
    sleep_cycles = 4_000_000
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(GROUP_MESSAGES)]
    dst = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(GROUP_MESSAGES)]

    def group():
        with pydatacopy.group():
            for m in range(GROUP_MESSAGES):
                pydatacopy.send(src[m], peer)
                pydatacopy.recv(dst[m], peer)

    calls_by_name = {
        "send | recv": (lambda: pydatacopy.send(src[0], peer)) if me == 0 else (lambda: pydatacopy.recv(dst[0], peer)),
        "sendrecv": lambda: pydatacopy.sendrecv(src[0], peer, dst[0], peer),
        f"group of {GROUP_MESSAGES} sends and {GROUP_MESSAGES} recvs": group,
    }
    rows = []
    for number, (name, call) in enumerate(calls_by_name.items()):
        per_round = {phase: [] for phase in names}
        try:
            for _ in range(rounds):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(sleep_cycles * (16 if name.startswith("group") else 1))
                engine.set_host_phases(True)
                for _ in range(calls):
                    call()
                phases = engine.host_phases()
                engine.set_host_phases(False)
                for phase in names:
                    per_round[phase].append(phases[phase] / max(1, phases["calls"]))
        finally:
            engine.set_host_phases(False)
        torch.cuda.synchronize()
        dist.barrier()
        pydatacopy.check_errors()
        # The check: fresh data into cleared destinations, one call.
        seed = 300 + 10 * number
        for m in range(GROUP_MESSAGES):
            fill(src[m], seed + 2 * m + me)
            dst[m].zero_()
        torch.cuda.synchronize()
        dist.barrier()
        call()
        torch.cuda.synchronize()
        dist.barrier()
        pydatacopy.check_errors()
        moved = range(GROUP_MESSAGES) if name.startswith("group") else range(1)
        if name == "send | recv" and me == 0:
            ok = True  # rank 0 only sent: rank 1 checks what arrived
        else:
            ok = all(torch.equal(dst[m], fill(torch.empty_like(src[m]), seed + 2 * m + peer)) for m in moved)
        ok = agree(ok)
        both = torch.zeros(2 * len(names), dtype=torch.float64, device=reduce_device())
        both[me * len(names):(me + 1) * len(names)] = torch.tensor(
            [statistics.median(per_round[phase]) for phase in names], dtype=torch.float64)
        dist.all_reduce(both)
        for rank in (0, 1):
            label = name.split(" | ")[rank] if " | " in name else f"{name}, rank {rank}"
            total = 0.0
            for index, phase in enumerate(names):
                us = both[rank * len(names) + index].item() / 1e3
                total += us
                rows.append({"op": "host_phase", "path": f"{label} {nbytes // 1024}K: {phase}",
                             "direction": "one" if " | " in name else "both",
                             "bytes": nbytes, "size": f"{nbytes // 1024}K", "us": us, "issue_us": us, "gbps": 0.0,
                             "ok": ok})
            if me == 0:
                print(f"  host phases, {label} {nbytes // 1024}K: {total:.2f} us in the core a call (the phases'"
                      " medians summed: " +
                      ", ".join(f"{phase} {both[rank * len(names) + i].item() / 1e3:.2f}"
                                for i, phase in enumerate(names)) + ")", file=sys.stderr, flush=True)
    return rows
