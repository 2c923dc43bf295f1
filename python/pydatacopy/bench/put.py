"""put: the size sweep's puts, the host time of one 4 KiB put, and a 4 KiB put replayed in a graph."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import against, agree, fill, human, make_row, reduce_device, time_op


def put(sweep, path: str):
    def make_run(symmetric):
        def run():
            if sweep.sends:
                pydatacopy.put(symmetric, sweep.src, sweep.peer, path=path)
                pydatacopy.quiet()
        return run

    return sweep._into_symmetric(make_run)


def bench_host_overhead(args, calls: int = 2000) -> list[dict]:
    """Host time of one 4 KiB put from Python (no synchronisation inside the loop), beside a bare
    cudaMemcpyAsync call of 4 KiB on this GPU."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    symmetric = pydatacopy.empty(4096, dtype=torch.uint8)
    src = fill(torch.empty(4096, dtype=torch.uint8, device="cuda"), 5)
    local = torch.empty_like(src)
    stream = torch.cuda.current_stream().cuda_stream

    def host_us(call) -> float:
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            call()
        spent = (time.perf_counter() - begin) / calls * 1e6
        torch.cuda.synchronize()
        seconds = torch.tensor([spent], dtype=torch.float64, device=reduce_device())
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds.item())

    def row(path: str, us: float, ok: bool) -> dict:
        return {"op": "host_per_call", "path": path, "direction": "both", "bytes": 4096,
                "size": "4K", "us": us, "issue_us": us, "gbps": 4096 / us / 1e3, "ok": ok}

    rows = []
    try:
        us = host_us(lambda: pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), 4096, stream))
        fill(src, 6 + me)
        local.zero_()
        pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), 4096, stream)
        torch.cuda.synchronize()
        base = row("cudaMemcpyAsync 4K", us, agree(torch.equal(local, src)))
        rows.append(base)
        for number, path in enumerate(("auto", "copy_engine")):
            us = host_us(lambda: pydatacopy.put(symmetric, src, peer, path=path))
            # Checked: fresh data, the destination cleared first, one put.
            seed = 100 * (number + 1)
            torch.cuda.synchronize()
            pydatacopy.barrier()
            fill(src, seed + me)
            symmetric.zero_()
            torch.cuda.synchronize()
            pydatacopy.barrier()
            pydatacopy.put(symmetric, src, peer, path=path)
            pydatacopy.quiet()
            torch.cuda.synchronize()
            pydatacopy.barrier()
            torch.cuda.synchronize()
            ok = agree(torch.equal(symmetric, fill(torch.empty_like(src), seed + peer)))
            rows.append(against(row(f"put 4K ({path})", us, ok), base))
    finally:
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
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
        copies, transfers = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        failure = ""
        try:
            with torch.cuda.graph(copies):
                stream = torch.cuda.current_stream().cuda_stream
                for _ in range(puts):
                    pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), nbytes, stream)
            if me == 0:
                with torch.cuda.graph(transfers):
                    for _ in range(puts):
                        pydatacopy.put(symmetric, src, peer)
                    pydatacopy.quiet()
        except RuntimeError as error:  # pydatacopy.Error too; agreed, so both PEs go on alike
            failure = f"{type(error).__name__}: {error}"
        if not agree(not failure):
            print(f"  graph rows skipped: {failure or 'the capture failed on the peer'}",
                  file=sys.stderr, flush=True)
            return []
        for name, graph in (("copies", copies), ("puts", transfers)):
            def run():
                if me == 0:  # one way, as the puts
                    graph.replay()

            timed = tuple(t / puts for t in time_op(run, args.iters, args.warmup, args.repeats))
            # Checked: fresh data from a new seed, the destination cleared, one replay.
            seed = 500 if name == "copies" else 600
            torch.cuda.synchronize()
            dist.barrier()
            fill(src, seed + me)
            (local if name == "copies" else symmetric).zero_()
            torch.cuda.synchronize()
            dist.barrier()
            run()
            torch.cuda.synchronize()
            dist.barrier()
            if name == "copies":
                ok = me != 0 or torch.equal(local, src)
                rows.append(make_row("baseline", f"graph copy {human(nbytes)}", "one", nbytes, timed, agree(ok)))
            else:
                ok = me == 0 or torch.equal(symmetric, fill(torch.empty_like(src), seed + peer))
                rows.append(against(make_row("put", f"graph {human(nbytes)}", "one", nbytes, timed,
                                          agree(ok)), rows[0]))
        del copies, transfers
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
    return rows
