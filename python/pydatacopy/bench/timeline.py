"""Kernel timelines of send/recv messages queued back to back (issue 35: where a small message's
GPU time goes), from torch.profiler's CUDA activity (CUPTI):

    torchrun --nproc_per_node=2 -m pydatacopy.bench.timeline [--sizes 4K,1M] [--calls 64] [--json F]

(on one GPU add PYDATACOPY_RANKS_PER_GPU=2 and run under CUDA MPS, as the bench.) Rank 0 sends,
rank 1 receives: `calls` messages of each size are queued behind a sleeping kernel on both ranks,
so that the kernels run back to back with the host out of the way, once per path (default,
low-latency, staged, zero-copy) and beside bare copy kernels of the same bytes. Per rank and row: the median
kernel duration, the median gap from one kernel's end to the next one's start, and the median
start-to-start period (the GPU's time per message). A message's cost beyond the bare kernel's
period is the protocol's; duration against gap says whether it is inside the kernel or between
kernels, except where a programmatic (PDL) launch starts a kernel before the one ahead ends: there
the gap reads negative or zero and only the period counts. Then, inside the send/recv kernel, the
median span between its phases (the engine's phase-stamp test hook: %globaltimer read by thread 0
of block 0 at entry, after the grid wait, after the prologue, at op 0's rendezvous and end, after
the loop, the counters and finish_slice), and from one launch's end to the next one's start. Checked: the last message's bytes, fresh data into a cleared destination.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

import pydatacopy

from ._cli import _placement, _size
from ._harness import agree, fill, human, start
from .send_recv import engine_cuts

#: Kernels whose names contain one of these are the rows' own (the sleep and torch's fills are not).
KERNEL_NAMES = ("chunk_batch_kernel", "low_latency_batch_kernel", "copy_kernel")


def kernel_spans(trace: dict, names=KERNEL_NAMES) -> list[tuple[float, float]]:
    """(start, end) in microseconds of each kernel of a Chrome trace (torch.profiler's
    export_chrome_trace) whose name contains one of `names`, in start order."""
    spans = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or event.get("ph") != "X":
            continue
        if not any(name in event.get("name", "") for name in names):
            continue
        begin = float(event["ts"])
        spans.append((begin, begin + float(event.get("dur", 0.0))))
    spans.sort()
    return spans


def summarize(spans: list[tuple[float, float]]) -> dict:
    """Median duration, end-to-next-start gap and start-to-start period of kernels back to back
    (microseconds); counts of each. Fewer than two kernels: no gap or period (None)."""
    durations = [end - begin for begin, end in spans]
    gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)]
    periods = [spans[i + 1][0] - spans[i][0] for i in range(len(spans) - 1)]
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return {"kernels": len(spans), "duration_us": median(durations), "gap_us": median(gaps),
            "period_us": median(periods)}


#: The send/recv kernel's phase stamps, in the order the engine's test hook gives them
#: (SendRecvEngine.phase_stamps, kernels/api.cuh), then the spans reported between them.
PHASES = tuple(pydatacopy._C.SendRecvEngine.phase_stamp_names())
#: (name, from, to): a span is reported where both of its stamps were reached. `rendezvous` is 0
#: where the op had none (a low-latency or staged message below the zero-copy cut).
SPANS = (("grid_wait", "entered", "grid_waited"), ("prologue", "grid_waited", "prologue_done"),
         ("to_rendezvous", "prologue_done", "rendezvous"), ("rendezvous_to_done", "rendezvous", "op_done"),
         ("to_copy", "rendezvous", "copy_begun"), ("copy", "copy_begun", "copied"), ("final", "copied", "op_done"),
         ("prologue_to_done", "prologue_done", "op_done"), ("loop_tail", "op_done", "loop_left"),
         ("counters", "loop_left", "counters_done"), ("finish", "counters_done", "ended"),
         ("entered_to_ended", "entered", "ended"),
         # A recv's descriptor stored, then its verdict; a zero-copy send's parts on every block: the
         # last part begun after block 0's, the last final store after block 0's copy.
         ("to_post", "prologue_done", "posted"), ("verdict", "posted", "rendezvous"),
         ("parts_begun_spread", "copy_begun", "parts_last_begun"), ("parts_final_after_block0", "copied", "parts_last_final"))


#: The record's mode field (kernels/api.cuh PhaseStampRecord): the path op 0 took.
MODES = {0: "no descriptor", 1: "staged", 2: "zero-copy", 3: "low-latency", 4: "copy-engine"}


def phase_summary(records: list[list[int]]) -> dict:
    """Median microseconds of each span of SPANS over the launches' stamp records (nanoseconds,
    0: not reached), and between launches back to back: `ended_to_next_entered` (the next
    launch's start after this one's end; negative where a programmatic launch started early)
    and `ended_to_next_waited` (the next launch past its grid wait after this one's end)."""
    stamps = [dict(zip(PHASES, record[:len(PHASES)])) for record in records]
    out = {}
    for name, begin, end in SPANS:
        values = [(s[end] - s[begin]) / 1e3 for s in stamps if s[begin] and s[end]]
        out[name] = statistics.median(values) if values else None
    for name, phase in (("ended_to_next_entered", "entered"), ("ended_to_next_waited", "grid_waited")):
        values = [(after[phase] - before["ended"]) / 1e3 for before, after in zip(stamps, stamps[1:])
                  if before["ended"] and after[phase]]
        out[name] = statistics.median(values) if values else None
    out["launches"] = len(stamps)
    # Which path op 0 took, launch by launch (the record's mode): a row's figures are its path's
    # only where every launch took it.
    out["modes"] = {name: sum(1 for record in records if len(record) > len(PHASES) and record[len(PHASES)] == code)
                    for code, name in MODES.items()}
    return out


#: The steps of one zero-copy message across the two ranks (their stamps share the GPU's clock),
#: in order: the receiver's descriptor stored -> taken by the sender's block 0 -> block 0's part
#: copied -> the sender's last part final -> the receiver has seen every part -> its next
#: descriptor stored; and the period between two stores. Each: (name, from, to), a stamp as
#: (rank's side, phase, 0 for message k's launch or 1 for the next one's).
HANDOFF_STEPS = (
    ("post_to_take", ("recv", "posted", 0), ("send", "rendezvous", 0)),
    ("take_to_block0_copied", ("send", "rendezvous", 0), ("send", "copied", 0)),
    ("block0_copied_to_last_final", ("send", "copied", 0), ("send", "parts_last_final", 0)),
    ("last_final_to_seen", ("send", "parts_last_final", 0), ("recv", "op_done", 0)),
    ("seen_to_next_post", ("recv", "op_done", 0), ("recv", "posted", 1)),
    ("post_period", ("recv", "posted", 0), ("recv", "posted", 1)),
)


def handoff_summary(sender_records: list[list[int]], receiver_records: list[list[int]]) -> dict:
    """Median microseconds of each step of HANDOFF_STEPS over messages one way (launch k of the
    sender and of the receiver move message k; both ranks' records as _profile gives them). Only
    messages whose sender stamped its parts (zero-copy) count; a step with no message gives None."""
    launches = {side: [dict(zip(PHASES, record[:len(PHASES)])) for record in records]
                for side, records in (("send", sender_records), ("recv", receiver_records))}
    n = min(len(launches["send"]), len(launches["recv"]))
    moved = [k for k in range(n) if launches["send"][k]["parts_last_final"]]

    def at(k: int, stamp: tuple[str, str, int]) -> int:  # 0: not reached, or no such launch
        side, phase, later = stamp
        return launches[side][k + later][phase] if k + later < n else 0

    out = {}
    for name, begin, end in HANDOFF_STEPS:
        values = [(at(k, end) - at(k, begin)) / 1e3 for k in moved if at(k, begin) and at(k, end)]
        out[name] = statistics.median(values) if values else None
    out["messages"] = len(moved)
    return out


def _profile(call, calls: int) -> dict:
    """`calls` calls queued behind a sleeping kernel, profiled; this rank's kernel summary."""
    torch.cuda.synchronize()
    dist.barrier()
    pydatacopy._C.SendRecvEngine.set_phase_stamps(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        torch.cuda._sleep(4_000_000)  # about 2 ms: every call below is queued before any runs
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    pydatacopy._C.SendRecvEngine.set_phase_stamps(False)
    # The first launch waits out the sleep on the other rank: left out, as in the spans below.
    records = pydatacopy._C.SendRecvEngine.phase_stamps()[1:]
    phases = {**phase_summary(records), "records": records}  # raw: both ranks' stamps share the GPU's clock
    pydatacopy.check_errors()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    # The first message's kernel waits out the sleep on the other rank: left out.
    return {**summarize(kernel_spans(trace)[1:]), "phases": phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.bench.timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,16K,1M", help="comma-separated message sizes (default 4K,16K,1M)")
    parser.add_argument("--calls", type=int, default=64, help="messages queued per row (default 64)")
    parser.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    sizes = [_size(text) for text in args.sizes.split(",") if text.strip()]
    device, per_gpu = _placement()
    start(device, per_gpu)
    if pydatacopy.n_pes() != 2:
        print("the timeline runs on exactly 2 PEs", file=sys.stderr)
        pydatacopy.finalize()
        dist.destroy_process_group()
        return 2
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    cuts = {"default": None,
            "low-latency": (0, pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES),
            "staged": (0, 0),
            "zero-copy": (1, 0)}
    rows = []
    try:
        for nbytes in sizes:
            src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 11 + me)
            dst = torch.zeros_like(src)
            stream = torch.cuda.current_stream().cuda_stream
            def copy():
                pydatacopy._C.bench_kernel_copy(dst.data_ptr(), src.data_ptr(), nbytes, stream)
            bare = _profile(copy, args.calls)
            fill(src, 400 + me)
            dst.zero_()
            copy()
            torch.cuda.synchronize()
            ok = agree(torch.equal(dst, fill(torch.empty_like(dst), 400 + me))) and bare["kernels"] > 0
            rows.append({"path": "bare kernel copy", "bytes": nbytes, "rank": me, "ok": ok, **bare})
            for path, cut in cuts.items():
                if path == "low-latency" and nbytes > pydatacopy._C.LOW_LATENCY_CAPACITY_BYTES:
                    continue
                call = (lambda: pydatacopy.send(src, peer)) if me == 0 else (lambda: pydatacopy.recv(dst, peer))
                with engine_cuts(*cut) if cut is not None else contextlib.nullcontext():
                    # Warm-up, one message at a time: a receive buffer's first zero-copy recv asks
                    # the sender to map it and moves staged (docs/zero-copy.md); a queue issued
                    # before the answer would time the staged path under the zero-copy row.
                    for _ in range(3):
                        call()
                        torch.cuda.synchronize()
                        dist.barrier()
                    summary = _profile(call, args.calls)
                    # The check, on the row's path: one more message, fresh bytes, the destination
                    # cleared first.
                    fill(src, 500 + nbytes % 97)
                    dst.zero_()
                    torch.cuda.synchronize()
                    dist.barrier()
                    call()
                    torch.cuda.synchronize()
                    ok = agree(me == 0 or torch.equal(dst, fill(torch.empty_like(dst), 500 + nbytes % 97)))
                # No kernel of the row's name in the trace: nothing was measured, so not ok.
                ok = ok and summary["kernels"] > 0
                rows.append({"path": path, "bytes": nbytes, "rank": me, "ok": ok, **summary})
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if me == 0:
            every = [row for part in gathered for row in part]
            print(f"{'path':<18} {'size':>6} {'rank':>4} {'kernels':>7} {'duration us':>11} {'gap us':>8} "
                  f"{'period us':>9}  ok")
            fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
            for row in every:
                print(f"{row['path']:<18} {human(row['bytes']):>6} {row['rank']:>4} {row['kernels']:>7} "
                      f"{fmt(row['duration_us']):>11} {fmt(row['gap_us']):>8} {fmt(row['period_us']):>9}  "
                      f"{'yes' if row.get('ok', True) else 'NO'}")
            names = [name for name, _, _ in SPANS] + ["ended_to_next_entered", "ended_to_next_waited"]
            print("\nphases of the send/recv kernel (median us; thread 0 of block 0, op 0):")
            print(f"{'path':<18} {'size':>6} {'rank':>4} " + " ".join(f"{n[:12]:>12}" for n in names))
            for row in every:
                if not row.get("phases", {}).get("launches"):
                    continue
                modes = ", ".join(f"{count} {name}" for name, count in row["phases"].get("modes", {}).items() if count)
                print(f"{row['path']:<18} {human(row['bytes']):>6} {row['rank']:>4} "
                      + " ".join(f"{fmt(row['phases'].get(n)):>12}" for n in names) + f"  ({modes})")
            # Across the ranks (rank 0 sends, rank 1 receives): where a zero-copy message's period goes.
            handoffs = []
            for row in every:
                if row["rank"] != 0 or not row.get("phases", {}).get("records"):
                    continue
                peer = next((other for other in every if other["rank"] == 1 and other["path"] == row["path"]
                             and other["bytes"] == row["bytes"]), None)
                if peer is None or not peer.get("phases", {}).get("records"):
                    continue
                handoff = handoff_summary(row["phases"]["records"], peer["phases"]["records"])
                if handoff["messages"]:
                    row["handoff"] = handoff
                    handoffs.append((row, handoff))
            if handoffs:
                print("\nzero-copy messages across the ranks (median us; sender's parts on every block):")
                steps = [name for name, _, _ in HANDOFF_STEPS]
                print(f"{'path':<18} {'size':>6} " + " ".join(f"{n[:14]:>14}" for n in steps) + "  messages")
                for row, handoff in handoffs:
                    print(f"{row['path']:<18} {human(row['bytes']):>6} "
                          + " ".join(f"{fmt(handoff[n]):>14}" for n in steps) + f"  {handoff['messages']}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(every, f, indent=1)
        ok = all(row.get("ok", True) for row in rows)
    finally:
        pydatacopy.finalize()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
