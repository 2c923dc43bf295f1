"""put: the size sweep's puts, the host time of one 4 KiB put, and a 4 KiB put replayed in a graph."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import against, agree, capture_graphs, copies_to_capture, fill, gaps, human, make_row, percentile
from ._harness import reduce_device, refill, time_graph, time_op


def put(sweep, path: str):
    def make_run(symmetric):
        def run():
            if sweep.sends:
                pydatacopy.put(symmetric, sweep.src, sweep.peer, path=path)
                pydatacopy.quiet()
        return run

    return sweep._into_symmetric(make_run)


def bench_host_overhead(args, calls: int = 2000, rounds: int = 5) -> list[dict]:
    """Host time of one 4 KiB put from Python (no synchronisation inside the loop), beside a bare
    cudaMemcpyAsync call of 4 KiB on this GPU (the target: within 1 us of it) and one into the
    peer's memory (what the copy engine path of put issues, without pydatacopy's code). The calls
    are timed in interleaved rounds (each `calls` calls; the median round per call, the slower
    PE), so that a drift of the machine during the run affects them alike; `p99_us` is the 99th
    percentile of one call, from the host's timestamp at every call."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    symmetric = pydatacopy.empty(4096, dtype=torch.uint8)
    src = fill(torch.empty(4096, dtype=torch.uint8, device="cuda"), 5)
    local = torch.empty_like(src)
    stream = torch.cuda.current_stream().cuda_stream
    peer_memory = pydatacopy.peer_view(symmetric, peer)
    peer_address = None if peer_memory is None else peer_memory.data_ptr()

    def row(path: str, us: float, p99_us: float, ok: bool) -> dict:
        return {"op": "host_per_call", "path": path, "direction": "both", "bytes": 4096, "size": "4K",
                "us": us, "p99_us": p99_us, "issue_us": us, "gbps": 4096 / us / 1e3, "ok": ok}

    calls_by_name = {
        "cudaMemcpyAsync 4K": lambda: pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), 4096, stream),
        "put 4K (auto)": lambda: pydatacopy.put(symmetric, src, peer),
    }
    if peer_address is not None:  # the copy engine reaches the peer (not under PYDATACOPY_FORCE_RMA)
        calls_by_name["put 4K (copy_engine)"] = lambda: pydatacopy.put(symmetric, src, peer, path="copy_engine")
        calls_by_name["cudaMemcpyAsync 4K to the peer"] = lambda: pydatacopy._C.bench_memcpy(
            peer_address, src.data_ptr(), 4096, stream)
    samples: dict[str, list[float]] = {name: [] for name in calls_by_name}
    per_call: dict[str, list[float]] = {name: [] for name in calls_by_name}
    stamps = [0.0] * (calls + 1)  # made once: no list grows inside the timed loop
    rows = []
    try:
        for call in calls_by_name.values():  # warm-up: first-use work off the clock
            for _ in range(50):
                call()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for name, call in calls_by_name.items():
                torch.cuda.synchronize()
                for index in range(calls):
                    stamps[index] = time.perf_counter()
                    call()
                stamps[calls] = time.perf_counter()
                samples[name].append((stamps[calls] - stamps[0]) / calls * 1e6)
                per_call[name].extend(gaps(stamps, 1e6))
        torch.cuda.synchronize()
        figures = torch.tensor([statistics.median(samples[name]) for name in calls_by_name]
                               + [percentile(per_call[name], 99) for name in calls_by_name],
                               dtype=torch.float64, device=reduce_device())
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        us = dict(zip(calls_by_name, figures.tolist()))
        p99_us = dict(zip(calls_by_name, figures.tolist()[len(calls_by_name):]))
        # Checked, each: fresh data, the destination cleared first, one call.
        for number, name in enumerate(calls_by_name):
            seed = 100 * (number + 1)
            remote = name != "cudaMemcpyAsync 4K"
            torch.cuda.synchronize()
            pydatacopy.barrier()
            fill(src, seed + me)
            (symmetric if remote else local).zero_()
            torch.cuda.synchronize()
            pydatacopy.barrier(blocking=True)
            calls_by_name[name]()
            pydatacopy.quiet()
            torch.cuda.synchronize()
            pydatacopy.barrier(blocking=True)
            expected = fill(torch.empty_like(src), seed + (peer if remote else me))
            ok = agree(torch.equal(symmetric if remote else local, expected))
            rows.append(row(name, us[name], p99_us[name], ok))
        base = rows[0]
        for r in rows[1:]:
            against(r, base)
            r["over_base_us"] = r["us"] - base["us"]
        rows.extend(_host_call_costs(src, local, stream, calls, base))
        if me == 0:
            for r in rows[1:]:
                print(f"  host per call: {r['path']} {r['us']:.2f} us, {r['over_base_us']:+.2f} us over "
                      f"{base['path']} ({base['us']:.2f} us)", file=sys.stderr, flush=True)
    finally:
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
    return rows


def _host_call_costs(src, dst, stream: int, calls: int, base: dict) -> list[dict]:
    """Rows `host_call`: what each CUDA call a send/recv makes costs the host, timed in C++
    (_C.bench_host_call_costs: no Python between calls), the slower PE's figure; `over_base_us`
    against the Python-issued cudaMemcpyAsync (`base`). Checked: the destination, cleared here
    and again by the probe before its copy kernel runs, holds the fresh bytes that kernel moved."""
    me = pydatacopy.my_pe()
    fill(src, 900 + me)
    dst.zero_()
    torch.cuda.synchronize()
    costs = pydatacopy._C.bench_host_call_costs(dst.data_ptr(), src.data_ptr(), src.nbytes, stream, calls)
    torch.cuda.synchronize()
    ok = agree(torch.equal(dst, fill(torch.empty_like(src), 900 + me)))
    figures = torch.tensor([us for _, us in costs], dtype=torch.float64, device=reduce_device())
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    rows = []
    for (name, _), us in zip(costs, figures.tolist()):
        rows.append({"op": "host_call", "path": name, "direction": "both", "bytes": src.nbytes,
                     "size": human(src.nbytes), "us": us, "issue_us": us, "gbps": 0.0, "ok": ok,
                     "over_base_us": us - base["us"]})
        if me == 0:
            print(f"  host per call, from C++: {name} {us:.2f} us", file=sys.stderr, flush=True)
    return rows


def bench_graph_put(args, nbytes: int = 4096, puts: int = 100) -> list[dict]:
    """`puts` puts of `nbytes` (rank 0 -> rank 1, then one quiet) captured in a CUDA graph and
    replayed, per put; beside `puts` bare cudaMemcpyAsync calls on this GPU replayed alike."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    symmetric = pydatacopy.empty(nbytes, dtype=torch.uint8)
    src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 9 + me)
    local = torch.zeros_like(src)
    rows = []
    try:
        symmetric.zero_()
        if me == 0:
            pydatacopy.put(symmetric, src, peer)  # first use (a registration, if any) outside
            pydatacopy.quiet()
        torch.cuda.synchronize()

        def transfers():
            for _ in range(puts):
                pydatacopy.put(symmetric, src, peer)
            pydatacopy.quiet()

        graphs = capture_graphs({"copies": copies_to_capture(local, src, puts),
                                 "puts": transfers if me == 0 else None}, "graph")
        if graphs is None:
            return []
        for name, graph in graphs.items():
            def run(graph=graph):
                if me == 0:  # one way, as the puts
                    graph.replay()

            # Checked: fresh data from a new seed, the destination cleared, one replay.
            seed = 500 if name == "copies" else 600
            prepare = refill(src, seed + me, local if name == "copies" else symmetric)
            if name == "copies":
                timed, ok = time_graph(run, puts, args, prepare, lambda: me != 0 or torch.equal(local, src))
                rows.append(make_row("baseline", f"graph copy {human(nbytes)}", "one", nbytes, timed, ok))
            else:
                timed, ok = time_graph(run, puts, args, prepare, lambda seed=seed: me == 0 or torch.equal(
                    symmetric, fill(torch.empty_like(src), seed + peer)))
                rows.append(against(make_row("put", f"graph {human(nbytes)}", "one", nbytes, timed, ok), rows[0]))
        del graphs
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
    return rows
