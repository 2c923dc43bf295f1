"""pydatacopy benchmark: torchrun --nproc_per_node=2 -m pydatacopy.bench [options]

Sweeps message sizes like nccl-tests (-b/-e/-f, -n iterations, -w warm-up) for each pydatacopy
path and, in the same run, the baselines: the copy engine writing straight into the peer's
memory (torch's copy_ into the peer's mapping, a cudaMemcpyAsync: the practical limit), NCCL
send/recv through torch.distributed, torch symmetric memory's NVSHMEM put (one direction;
when this torch has it) and NIXL's WRITE on UCX (one direction; when NIXL is installed:
pip install "pydatacopy[nixl]"; host-timed, as its completion is polled from the host).
Beside every size, a bare copy of the same bytes on the same GPU (cudaMemcpyAsync, no
pydatacopy code; `local copy`) is timed the same way: `xbase` is a row's time over its baseline's
(device time; `xbaseH`: host time per call, issuing only), the ratio that matters on a GPU whose
memory is local (2 PEs sharing one GPU) as on two. Also: put_many against put_blocks, a 4 KiB
put replayed in a CUDA graph against bare copies replayed alike, and the token exchange against
a bare copy of its bytes.

Two PEs on two GPUs (nccl), or sharing one GPU (PYDATACOPY_RANKS_PER_GPU=2, or more ranks than
GPUs: torch.distributed on gloo, as NCCL refuses two ranks on one GPU; the NCCL and torch
symm_mem baselines are then skipped, and say so).
Times are CUDA events after warm-up, the median of repeats, the slower of the two PEs. Every row
is checked (`ok`) by one more run after the timings, with fresh data from a new seed and the
destination cleared first, so a stale, lost or replayed delivery fails. Ratios between rows of
one run decide: the GPUs are shared and absolute figures move.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy import _env


_SIZE = re.compile(r"\s*([0-9]+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
MAX_MESSAGE_BYTES = 1 << 40


def _size(text: str) -> int:
    """A message size: bytes, or a whole number with K, M, G or T (2^10 ... 2^40): 4K, 1M, 1G."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write bytes or a whole number "
                                         "with K, M, G or T, e.g. 4K, 64M or 1G")
    nbytes = int(match.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[match.group(2).lower()]
    if not 1 <= nbytes <= MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 1 byte and 1T")
    return nbytes


def _int_at_least(minimum: int, meaning: str):
    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*[0-9]+\s*", text) or not minimum <= int(text) <= _env.INT32_MAX:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {meaning}: give a whole number from {minimum} to {_env.INT32_MAX}")
        return int(text)
    return parse


OPS = ("memcpy", "put_ce", "put_sm", "put_rma", "torch_symm", "sendrecv", "nccl", "nixl", "tokens",
       "latency", "host", "put_many", "graph")


def _ops(text: str) -> set[str]:
    ops = {op.strip() for op in text.split(",") if op.strip()}
    unknown = sorted(ops - set(OPS))
    if not ops or unknown:
        raise argparse.ArgumentTypeError(
            (f"unknown {', '.join(unknown)}" if unknown else "no operation given")
            + f": choose a comma-separated subset of {','.join(OPS)}")
    return ops


def _tokens(text: str) -> tuple[int, int]:
    from .doctor import parse_tokens

    return parse_tokens(text)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in its help (options
    without one, such as the output files, say nothing)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (testable without GPUs: parse_args checks them all)."""
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.bench", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("-b", "--minbytes", type=_size, default="4K",
                        help="smallest message of the size sweep (bytes, or K/M/G/T)")
    parser.add_argument("-e", "--maxbytes", type=_size, default="1G",
                        help="largest message of the size sweep, at least --minbytes")
    parser.add_argument("-f", "--stepfactor", type=_int_at_least(2, "a step factor"), default=16,
                        help="each size of the sweep is this many times the one before (at least 2)")
    parser.add_argument("-n", "--iters", type=_int_at_least(1, "an iteration count"), default=20,
                        help="operations per timing")
    parser.add_argument("-w", "--warmup", type=_int_at_least(0, "a warm-up count"), default=5,
                        help="untimed operations before the timings")
    parser.add_argument("-r", "--repeats", type=_int_at_least(1, "a repeat count"), default=5,
                        help="timings per row; the row reports their median")
    parser.add_argument("-d", "--direction", choices=["one", "both", "all"], default="one",
                        help="one: rank 0 sends to rank 1; both: both send at once; all: both rows")
    parser.add_argument("--ops", type=_ops, default=",".join(OPS),
                        help="comma-separated subset of " + ",".join(OPS))
    parser.add_argument("--tokens", nargs="*", type=_tokens,
                        default=["1024x4096", "4096x7168", "16384x14336"],
                        help="token-exchange shapes, N_TOKENSxTOKEN_BYTES")
    parser.add_argument("--json", help="write all rows to this JSON file (rank 0)")
    parser.add_argument("--csv", help="write all rows to this CSV file (rank 0)")
    parser.add_argument("--plot", help="draw GB/s against size for every path to this PNG (rank 0; "
                                       "needs matplotlib)")
    parser.add_argument("--markdown", help="write the table as Markdown to this file (rank 0)")
    parser.add_argument("--from-json", help="no run: print the table (and write --csv/--plot) "
                                            "from an earlier --json file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options, checked; a bad one ends the process with argparse's one-line
    error and exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # argparse converts string defaults with type=, but not a list default of nargs="*".
    args.tokens = [_tokens(t) if isinstance(t, str) else t for t in args.tokens]
    if args.maxbytes < args.minbytes:
        parser.error(f"argument -e/--maxbytes: {args.maxbytes} bytes is less than -b/--minbytes "
                     f"{args.minbytes}: give -e at least -b")
    return args


def _human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=tensor.device).manual_seed(seed)
    flat = tensor.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(1, 256, flat.shape, dtype=torch.uint8, device=tensor.device,
                             generator=generator))
    return tensor


def _reduce_device() -> str:
    """Where torch.distributed reduces: NCCL takes CUDA tensors, gloo (ranks sharing a GPU) CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _time(run: Callable[[], None], iterations: int, warmup: int,
          repeats: int) -> tuple[float, float, float]:
    """Seconds per operation, median over repeats, the slower PE: by CUDA events; by the host's
    clock until the last operation is complete (what NIXL, whose completion is polled on the
    host, can only be timed by; its ratios use these); and the host's time to issue one call
    (the loop alone, before waiting for the GPU)."""
    for _ in range(warmup):
        run()
    samples, host_samples, issue_samples = [], [], []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        start.record()
        for _ in range(iterations):
            run()
        issued = time.perf_counter()
        stop.record()
        stop.synchronize()
        ended = time.perf_counter()
        pydatacopy.check_errors()
        samples.append(start.elapsed_time(stop) / 1e3 / iterations)
        host_samples.append((ended - began) / iterations)
        issue_samples.append((issued - began) / iterations)
    seconds = torch.tensor([statistics.median(samples), statistics.median(host_samples),
                            statistics.median(issue_samples)], dtype=torch.float64,
                           device=_reduce_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0].item()), float(seconds[1].item()), float(seconds[2].item())


def _agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], device=_reduce_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _row(op: str, path: str, direction: str, nbytes: int, timed: tuple[float, float, float],
         ok: bool, size: str | None = None) -> dict:
    seconds, host_seconds, issue_seconds = timed
    return {"op": op, "path": path, "direction": direction, "bytes": nbytes,
            "size": size or _human(nbytes), "us": seconds * 1e6, "host_us": host_seconds * 1e6,
            "issue_us": issue_seconds * 1e6, "gbps": nbytes / seconds / 1e9, "ok": ok}


def _against(row: dict, base: dict) -> dict:
    """Set row's ratios to `base`, a baseline measured in the same run: time over time."""
    row["base"] = f"{base['op']} ({base['path']})"
    row["xbase"] = row["us"] / base["us"]
    if row.get("issue_us") and base.get("issue_us"):
        row["xbase_host"] = row["issue_us"] / base["issue_us"]
    return row


class Sweep:
    """The one-directional (rank 0 -> rank 1) and bidirectional cases of one message size."""

    def __init__(self, nbytes: int, both: bool, args):
        self.nbytes, self.both, self.args = nbytes, both, args
        self.me = pydatacopy.my_pe()
        self.peer = 1 - self.me
        self.sends = both or self.me == 0
        self.receives = both or self.me == 1
        self.src = _fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 11 + self.me)
        self.out = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        self.checked_runs = 0

    def measure(self, run, dst: torch.Tensor, src: torch.Tensor | None = None,
                local: bool = False) -> tuple[tuple[float, float, float], bool]:
        """Times `run`, then checks one more run of it that must deliver fresh data: the sender
        refills `src` (default self.src) from a new seed, the receiver clears `dst`, and after
        that one run `dst` must hold exactly the sender's new data (a stale, lost or replayed
        delivery fails). `local`: a copy on the sender's own GPU, checked by the sender.
        Returns ((seconds by CUDA events, by the host's clock, to issue), check on all)."""
        timed = _time(run, self.args.iters, self.args.warmup, self.args.repeats)
        src = self.src if src is None else src
        self.checked_runs += 1
        seed = 1000 * self.checked_runs
        torch.cuda.synchronize()
        dist.barrier()  # the timed operations are over on both ranks
        checks = self.sends if local else self.receives
        if self.sends:
            _fill(src, seed + self.me)
        if checks:
            dst.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        run()
        torch.cuda.synchronize()
        dist.barrier()
        ok = True
        try:
            pydatacopy.check_errors()  # a device-side wait that timed out in the checked run
        except pydatacopy.Error as error:
            print(f"  rank {self.me}: {error}", file=sys.stderr, flush=True)
            ok = False
        if checks:
            ok = ok and torch.equal(dst, _fill(torch.empty_like(dst), seed + (self.me if local else self.peer)))
        return timed, _agree(ok)

    def local_copy(self):
        """The baseline of every row: a bare cudaMemcpyAsync of the same bytes on the sender's own
        GPU (both PEs at once when both send), no pydatacopy code on the path."""
        stream = torch.cuda.current_stream().cuda_stream
        src, dst, nbytes = self.src.data_ptr(), self.out.data_ptr(), self.nbytes

        def run():
            if self.sends:
                pydatacopy._C.bench_memcpy(dst, src, nbytes, stream)

        return self.measure(run, self.out, local=True)

    def _into_symmetric(self, make_run) -> tuple[tuple[float, float, float], bool]:
        """Time and check make_run(symmetric)'s operation into a fresh symmetric tensor."""
        symmetric = pydatacopy.empty(self.nbytes, dtype=torch.uint8)
        symmetric.zero_()
        pydatacopy.barrier()
        try:
            return self.measure(make_run(symmetric), symmetric)
        finally:
            pydatacopy.barrier()
            pydatacopy.free(symmetric)

    def put(self, path: str):
        def make_run(symmetric):
            def run():
                if self.sends:
                    pydatacopy.put(symmetric, self.src, self.peer, path=path)
                    pydatacopy.quiet()
            return run

        return self._into_symmetric(make_run)

    def memcpy_baseline(self):
        """A bare cudaMemcpyAsync into the peer's memory: no pydatacopy code on the path (torch's
        copy_ would add its own host cost: 1-2 ms per call into a peer mapping, measured)."""
        stream = torch.cuda.current_stream().cuda_stream

        def make_run(symmetric):
            peer_memory = pydatacopy.peer_view(symmetric, self.peer)
            if peer_memory is None:
                raise pydatacopy.Error("the memcpy baseline needs a peer reachable by load/store "
                                       "(NVLink/PCIe): leave memcpy out of --ops")
            peer_address = peer_memory.data_ptr()

            def run():
                if self.sends:
                    pydatacopy._C.bench_memcpy(peer_address, self.src.data_ptr(), self.nbytes, stream)
            return run

        return self._into_symmetric(make_run)

    def torch_symm_mem(self):
        """torch.ops.symm_mem.nvshmem_put: the tensor goes to the same tensor on the peer."""
        import torch.distributed._symmetric_memory as symm_mem

        tensor = symm_mem.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        symm_mem.rendezvous(tensor, dist.group.WORLD.group_name)
        tensor.copy_(self.src if self.sends else torch.zeros_like(self.src))
        torch.cuda.synchronize()
        dist.barrier()

        def run():
            if self.sends:
                torch.ops.symm_mem.nvshmem_put(tensor, self.peer)
                pydatacopy.quiet()  # one NVSHMEM in the process: this completes torch's put too

        try:
            return self.measure(run, tensor, src=tensor)  # one tensor: the sender's is the source
        finally:  # the tensor (and run, which holds it) go when this returns
            torch.cuda.synchronize()
            dist.barrier()

    def sendrecv(self):
        def run():
            if self.both:
                pydatacopy.sendrecv(self.src, self.peer, self.out, self.peer)
            elif self.sends:
                pydatacopy.send(self.src, self.peer)
            else:
                pydatacopy.recv(self.out, self.peer)

        return self.measure(run, self.out)

    def nccl(self):
        def run():
            ops = []
            if self.sends:
                ops.append(dist.P2POp(dist.isend, self.src, self.peer))
            if self.receives:
                ops.append(dist.P2POp(dist.irecv, self.out, self.peer))
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return self.measure(run, self.out)

    def nixl(self) -> tuple[tuple[float, float, float], bool]:
        """NIXL's WRITE (UCX) from rank 0's tensor into rank 1's: one direction only, timed by
        the host's clock. Raises pydatacopy.Error on every rank when NIXL failed on any."""
        from ._nixl import NixlWrite

        with NixlWrite(self.src, self.out, timeout_s=pydatacopy._C.default_timeout_seconds()) as transfer:
            (_, host_seconds, issue_seconds), ok = self.measure(transfer.write, self.out)
            failure = transfer.agreed_failure()
        if failure:
            raise pydatacopy.Error(f"NIXL's WRITE of {_human(self.nbytes)} bytes: {failure}")
        return (host_seconds, host_seconds, issue_seconds), ok


def _nixl_ready() -> bool:
    """Whether NIXL can be used on every rank; says why not on rank 0."""
    from ._nixl import nixl_problem

    reason = nixl_problem()
    ready = _agree(not reason)
    if not ready and pydatacopy.my_pe() == 0:
        print(f"  NIXL baseline skipped: {reason or 'not installed on every rank'}", file=sys.stderr, flush=True)
    return ready


def _torch_symm_mem_ready() -> bool:
    """Whether torch's symmetric memory runs on NVSHMEM here (decided on every rank alike)."""
    reason = ""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        if not symm_mem.is_nvshmem_available():
            reason = "torch reports NVSHMEM unavailable"
    except Exception as error:  # any torch without it: the baseline is skipped, not the run
        reason = f"{type(error).__name__}: {error}"
    ready = _agree(not reason)
    if not ready and pydatacopy.my_pe() == 0:
        print(f"  torch symm_mem baseline skipped: {reason or 'not available on every rank'}",
              file=sys.stderr, flush=True)
    return ready


def _bare_copy(nbytes: int, args, both: bool = True) -> dict:
    """A bare cudaMemcpyAsync of `nbytes` on this GPU, both PEs at once (or rank 0 alone),
    timed as the rows it is the baseline of; checked."""
    me = pydatacopy.my_pe()
    copies = both or me == 0
    src = _fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 31 + me)
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        if copies:
            pydatacopy._C.bench_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream)

    timed = _time(run, args.iters, args.warmup, args.repeats)
    _fill(src, 41 + me)
    dst.zero_()
    run()
    torch.cuda.synchronize()
    ok = _agree(not copies or torch.equal(dst, src))
    return _row("baseline", "local copy", "both" if both else "one", nbytes, timed, ok)


def bench_token_exchange(n_tokens: int, token_size: int, args) -> list[dict]:
    """DoubleBufferManager exchange, both directions at once, rounds back to back; beside a bare
    copy of the same bytes on this GPU."""
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    peer = pydatacopy._C.DoubleBufferManager.default_src_pe(me, n)
    nbytes = n_tokens * token_size
    size = f"{n_tokens}x{token_size}"
    base = _bare_copy(nbytes, args)
    base["size"] = size
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        for s in (0, 1):
            _fill(dbm.send_buffer_of(s), 1000 * me + s)

        def run():
            dbm.wait(dbm.exchange())

        timed = _time(run, args.iters, args.warmup, args.repeats)
        # The checked round: fresh data from a new seed, this round's receive buffer cleared
        # (free: its round two back was waited for).
        torch.cuda.synchronize()
        dist.barrier()
        round_ = dbm.round
        _fill(dbm.send_buffer_of(round_), 7000 + 10 * me + round_ % 2)
        dbm.recv_buffer(round_).zero_()
        torch.cuda.synchronize()
        dist.barrier()
        got = dbm.wait(dbm.exchange())
        torch.cuda.synchronize()
        ok = True
        try:
            pydatacopy.check_errors()
        except pydatacopy.Error as error:
            print(f"  rank {me}: {error}", file=sys.stderr, flush=True)
            ok = False
        expected = torch.empty((n_tokens, token_size), dtype=torch.uint8, device="cuda")
        ok = ok and torch.equal(got, _fill(expected, 7000 + 10 * peer + round_ % 2))
        row = _row("token_exchange", "DoubleBufferManager", "both", nbytes, timed, _agree(ok), size)
        return [base, _against(row, base)]
    finally:
        dbm.cleanup()


def bench_latency(args, iterations: int = 20000) -> dict:
    """8-byte ping-pong between the two GPUs, device side: one-way latency."""
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    try:
        signal.zero_()
        torch.cuda.synchronize()
        pydatacopy.barrier()
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pydatacopy._C.bench_pingpong(signal.data_ptr(), 1 - pydatacopy.my_pe(), iterations,
                                     pydatacopy.my_pe() == 0,
                                     torch.cuda.current_stream().cuda_stream, 60.0)
        stop.record()
        stop.synchronize()
        pydatacopy.check_errors()
        ok = _agree(int(signal.item()) == iterations)
        us = start.elapsed_time(stop) * 1e3 / iterations / 2
        return {"op": "latency", "path": "8B signal ping-pong", "direction": "one-way",
                "bytes": 8, "size": "8", "us": us, "gbps": 8 / us / 1e3, "ok": ok}
    finally:
        pydatacopy.barrier()
        pydatacopy.free(signal)


def bench_host_overhead(args, calls: int = 2000) -> list[dict]:
    """Host time of one 4 KiB put from Python (no synchronisation inside the loop), beside a bare
    cudaMemcpyAsync call of 4 KiB on this GPU."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    symmetric = pydatacopy.empty(4096, dtype=torch.uint8)
    src = _fill(torch.empty(4096, dtype=torch.uint8, device="cuda"), 5)
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
        seconds = torch.tensor([spent], dtype=torch.float64, device=_reduce_device())
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds.item())

    def row(path: str, us: float, ok: bool) -> dict:
        return {"op": "host_per_call", "path": path, "direction": "both", "bytes": 4096,
                "size": "4K", "us": us, "issue_us": us, "gbps": 4096 / us / 1e3, "ok": ok}

    rows = []
    try:
        us = host_us(lambda: pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), 4096, stream))
        _fill(src, 6 + me)
        local.zero_()
        pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), 4096, stream)
        torch.cuda.synchronize()
        base = row("cudaMemcpyAsync 4K", us, _agree(torch.equal(local, src)))
        rows.append(base)
        for number, path in enumerate(("auto", "copy_engine")):
            us = host_us(lambda: pydatacopy.put(symmetric, src, peer, path=path))
            # Checked: fresh data, the destination cleared first, one put.
            seed = 100 * (number + 1)
            torch.cuda.synchronize()
            pydatacopy.barrier()
            _fill(src, seed + me)
            symmetric.zero_()
            torch.cuda.synchronize()
            pydatacopy.barrier()
            pydatacopy.put(symmetric, src, peer, path=path)
            pydatacopy.quiet()
            torch.cuda.synchronize()
            pydatacopy.barrier()
            torch.cuda.synchronize()
            ok = _agree(torch.equal(symmetric, _fill(torch.empty_like(src), seed + peer)))
            rows.append(_against(row(f"put 4K ({path})", us, ok), base))
    finally:
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
    return rows


def bench_graph_put(args, nbytes: int = 4096, puts: int = 100) -> list[dict]:
    """`puts` puts of `nbytes` (rank 0 -> rank 1, then one quiet) captured in a CUDA graph and
    replayed, per put; beside `puts` bare cudaMemcpyAsync calls on this GPU replayed alike."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    symmetric = pydatacopy.empty(nbytes, dtype=torch.uint8)
    src = _fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 9 + me)
    local = torch.zeros_like(src)
    rows = []
    try:
        symmetric.zero_()
        if me == 0:
            pydatacopy.put(symmetric, src, peer)  # first use (a registration, if any) outside
            pydatacopy.quiet()
        torch.cuda.synchronize()
        copies, transfers = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(copies):
            stream = torch.cuda.current_stream().cuda_stream
            for _ in range(puts):
                pydatacopy._C.bench_memcpy(local.data_ptr(), src.data_ptr(), nbytes, stream)
        if me == 0:
            with torch.cuda.graph(transfers):
                for _ in range(puts):
                    pydatacopy.put(symmetric, src, peer)
                pydatacopy.quiet()
        for name, graph in (("copies", copies), ("puts", transfers)):
            def run():
                if me == 0:  # one way, as the puts
                    graph.replay()

            timed = tuple(t / puts for t in _time(run, args.iters, args.warmup, args.repeats))
            # Checked: fresh data from a new seed, the destination cleared, one replay.
            seed = 500 if name == "copies" else 600
            torch.cuda.synchronize()
            dist.barrier()
            _fill(src, seed + me)
            (local if name == "copies" else symmetric).zero_()
            torch.cuda.synchronize()
            dist.barrier()
            run()
            torch.cuda.synchronize()
            dist.barrier()
            if name == "copies":
                ok = me != 0 or torch.equal(local, src)
                rows.append(_row("baseline", f"graph copy {_human(nbytes)}", "one", nbytes, timed, _agree(ok)))
            else:
                ok = me == 0 or torch.equal(symmetric, _fill(torch.empty_like(src), seed + peer))
                rows.append(_against(_row("put", f"graph {_human(nbytes)}", "one", nbytes, timed,
                                          _agree(ok)), rows[0]))
        del copies, transfers
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier()
        pydatacopy.free(symmetric)
    return rows


def bench_batched(args, count: int = 1024, tensor_bytes: int = 4096) -> list[dict]:
    """`count` tensors of `tensor_bytes` in one call, rank 0 -> rank 1: put_many (a list of
    tensors, checked one by one on the host) against put_blocks (pools + device index tensors)."""
    me = pydatacopy.my_pe()
    pool = pydatacopy.empty((count, tensor_bytes), dtype=torch.uint8)
    source = _fill(torch.empty((count, tensor_bytes), dtype=torch.uint8, device="cuda"), 77)
    order = torch.randperm(count, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    identity = torch.arange(count, device="cuda")
    dsts, srcs = list(pool), list(source)
    rows: dict[str, dict] = {}
    try:
        for number, name in enumerate(("put_blocks", "put_many")):
            pool.zero_()
            pydatacopy.barrier()

            def run():
                if me != 0:
                    return
                if name == "put_many":
                    pydatacopy.put_many(dsts, srcs, 1)
                else:
                    pydatacopy.put_blocks(pool, source, order, identity, 1)
                pydatacopy.quiet()

            timed = _time(run, args.iters, args.warmup, args.repeats)
            # Checked: fresh rows from a new seed (in place: dsts/srcs view them), the pool
            # cleared, one call.
            torch.cuda.synchronize()
            dist.barrier()
            _fill(source, 800 + number)
            pool.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            run()
            torch.cuda.synchronize()
            dist.barrier()
            expected = source if name == "put_many" else torch.empty_like(source).index_copy_(0, order, source)
            ok = _agree(me == 0 or torch.equal(pool, expected))
            rows[name] = _row(name, f"{count} x {tensor_bytes}B", "one", count * tensor_bytes, timed, ok)
        _against(rows["put_many"], rows["put_blocks"])
    finally:
        pydatacopy.barrier()
        pydatacopy.free(pool)
    return [rows[name] for name in ("put_blocks", "put_many") if name in rows]


def report(rows: list[dict], args) -> None:
    """The table on the terminal; CSV and PNG files when asked for."""
    def by_size(path, key="gbps"):
        return {(r["direction"], r["bytes"]): r[key] for r in rows if r["path"] == path and key in r}

    nccl, copy_engine = by_size("NCCL"), by_size("cudaMemcpyAsync")
    nixl_host_us = by_size("NIXL", "host_us")  # NIXL is timed on the host: so are its ratios
    print(f"\n{'op':<15} {'path':<20} {'dir':<4} {'size':>12} {'us':>10} {'hostus':>7} {'GB/s':>8} "
          f"{'xNCCL':>6} {'xCE':>6} {'xNIXL':>6} {'xbase':>6} {'xbaseH':>6}  ok")

    def ratio(r, baselines):
        base = baselines.get((r["direction"], r["bytes"]))
        return f"{r['gbps'] / base:6.2f}" if base else "     -"

    def x_base(r, key="xbase"):
        return f"{r[key]:6.2f}" if r.get(key) else "     -"

    def issue(r):
        return f"{r['issue_us']:7.1f}" if r.get("issue_us") else "      -"

    def x_nixl(r):
        base = nixl_host_us.get((r["direction"], r["bytes"]))
        return f"{base / r['host_us']:6.2f}" if base and r.get("host_us") else "     -"

    for r in rows:
        print(f"{r['op']:<15} {r['path']:<20} {r['direction']:<4} {r['size']:>12} {r['us']:>10.1f} "
              f"{issue(r)} {r['gbps']:>8.1f} {ratio(r, nccl)} {ratio(r, copy_engine)} {x_nixl(r)} "
              f"{x_base(r)} {x_base(r, 'xbase_host')}  {'yes' if r['ok'] else 'NO'}")
    print("xbase: time over the row's baseline (a bare copy of the same bytes on this GPU, or the "
          "`base` named in --json/--csv), same run; xbaseH: host time per call, issuing only")
    if getattr(args, "csv", None):
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["op", "path", "direction", "bytes", "size", "us", "host_us",
                                                   "gbps", "ok", "issue_us", "base", "xbase", "xbase_host"])
            writer.writeheader()
            writer.writerows({k: r.get(k, "") for k in writer.fieldnames} for r in rows)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write("| op | path | direction | size | us | host us | GB/s | x NCCL | x CE | x NIXL | "
                    "x base | x base host | ok |\n"
                    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
            for r in rows:
                f.write(f"| {r['op']} | {r['path']} | {r['direction']} | {r['size']} | {r['us']:.1f} | "
                        f"{issue(r).strip()} | "
                        f"{r['gbps']:.1f} | {ratio(r, nccl).strip()} | {ratio(r, copy_engine).strip()} | "
                        f"{x_nixl(r).strip()} | {x_base(r).strip()} | {x_base(r, 'xbase_host').strip()} | "
                        f"{'yes' if r['ok'] else 'NO'} |\n")
    if getattr(args, "plot", None):
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """GB/s against message size, one panel per direction, one line per path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    directions = [d for d in ("one", "both") if any(r["direction"] == d for r in rows)]
    labels = sorted({f"{r['op']} ({r['path']})" for r in rows if r["op"] in ("put", "send/recv", "baseline")})
    colours = {label: f"C{i}" for i, label in enumerate(labels)}  # one colour per path in both panels
    figure, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 4.8), squeeze=False)
    for axis, direction in zip(axes[0], directions):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["direction"] == direction and r["op"] in ("put", "send/recv", "baseline"):
                series.setdefault(f"{r['op']} ({r['path']})", []).append((r["bytes"], r["gbps"]))
        for label, points in series.items():
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                      label=label, color=colours[label],
                      linestyle="--" if "NCCL" in label or "baseline" in label else "-")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel("GB/s per direction")
        axis.set_title("rank 0 -> rank 1" if direction == "one" else "both directions at once")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _placement() -> tuple[int, int]:
    """(CUDA device, ranks per GPU) of this rank: PYDATACOPY_RANKS_PER_GPU=K puts local rank r
    on device r // K; unset, ranks share GPUs when there are more of them than GPUs."""
    local_rank = _env.local_rank() or 0
    count = torch.cuda.device_count()
    text = os.environ.get("PYDATACOPY_RANKS_PER_GPU")
    if text:
        per_gpu = _env.parse_int(text, "PYDATACOPY_RANKS_PER_GPU", 1, _env.INT32_MAX, 2,
                                 "ranks sharing one GPU")
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        per_gpu = max(1, -(-local_world // max(count, 1)))
    device = local_rank // per_gpu
    if device >= count:
        raise _env.SettingError(f"local rank {local_rank} with {per_gpu} rank(s) per GPU needs device "
                                f"{device}, but this process sees {count}: set PYDATACOPY_RANKS_PER_GPU")
    return device, per_gpu


SHARED_GPU_SKIPS = {
    "nccl": "NCCL refuses two ranks on one GPU (torch.distributed runs on gloo here)",
    "torch_symm": "torch's symmetric memory refuses PEs sharing a GPU (\"TeamManager on multiple "
                  "devices\")",
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if args.from_json:
        with open(args.from_json) as f:
            report(json.load(f), args)
        return 0
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node=2 -m pydatacopy.bench", file=sys.stderr)
        return 2
    try:
        device, per_gpu = _placement()
    except _env.SettingError as error:
        print(f"python -m pydatacopy.bench: {error}", file=sys.stderr)
        return 2
    torch.cuda.set_device(device)
    if per_gpu > 1:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    pydatacopy.init(device=device)
    if pydatacopy.n_pes() != 2:
        print("the size sweep runs on exactly 2 PEs", file=sys.stderr)
        return 2
    ops = set(args.ops)
    skipped: list[str] = []
    if per_gpu > 1:
        for op, why in SHARED_GPU_SKIPS.items():
            if op in ops:
                ops.discard(op)
                skipped.append(f"{op}: {why}")
    directions = ["one", "both"] if args.direction == "all" else [args.direction]
    rows = []
    size = args.minbytes
    sizes = []
    while size <= args.maxbytes:
        sizes.append(size)
        size *= args.stepfactor
    labels = {"copy": ("baseline", "local copy"),
              "memcpy": ("baseline", "cudaMemcpyAsync"), "put_ce": ("put", "copy_engine"),
              "put_sm": ("put", "sm"), "put_rma": ("put", "rma"),
              "torch_symm": ("baseline", "torch symm_mem"),
              "sendrecv": ("send/recv", "pipeline"), "nccl": ("send/recv", "NCCL"),
              "nixl": ("baseline", "NIXL")}
    # Before the sweep: torch's symmetric memory (set up by the sweep) must not colour them.
    fixed_rows = []
    if "latency" in ops:
        fixed_rows.append(bench_latency(args))
    if "host" in ops:
        fixed_rows.extend(bench_host_overhead(args))
    if "put_many" in ops:
        fixed_rows.extend(bench_batched(args))
    if "graph" in ops:
        fixed_rows.extend(bench_graph_put(args))
    if "torch_symm" in ops and not _torch_symm_mem_ready():
        ops.discard("torch_symm")
    if "nixl" in ops and not _nixl_ready():
        ops.discard("nixl")

    def add_row(op, direction, nbytes, timed, ok, base=None):
        rows.append(_row(labels[op][0], labels[op][1], direction, nbytes, timed, ok))
        if base is not None:
            _against(rows[-1], base)
        if pydatacopy.my_pe() == 0:
            print(f"  {labels[op][0]:<10} {labels[op][1]:<12} {direction:<4} {_human(nbytes):>6} "
                  f"{rows[-1]['gbps']:8.1f} GB/s", file=sys.stderr, flush=True)
        return rows[-1]

    for direction in directions:
        for nbytes in sizes:
            sweep = Sweep(nbytes, direction == "both", args)
            # Every size's baseline first: a bare copy of the same bytes on this GPU.
            base = add_row("copy", direction, nbytes, *sweep.local_copy())
            for op in ("memcpy", "put_ce", "put_sm", "put_rma", "torch_symm", "sendrecv", "nccl"):
                if op not in ops or (op == "torch_symm" and direction == "both"):
                    continue  # torch's put reads and writes one tensor: one direction only
                add_row(op, direction, nbytes, *(
                    sweep.memcpy_baseline() if op == "memcpy" else
                    sweep.torch_symm_mem() if op == "torch_symm" else
                    sweep.put(labels[op][1]) if op.startswith("put") else
                    sweep.sendrecv() if op == "sendrecv" else sweep.nccl()), base=base)
            del sweep
    # NIXL last, so that UCX (its hooks and progress threads stay once loaded) colours no other
    # row; one direction (a WRITE is one-sided). A failure drops the baseline, not the run.
    if "nixl" in ops and "one" in directions:
        for nbytes in sizes:
            sweep = Sweep(nbytes, False, args)
            try:
                add_row("nixl", "one", nbytes, *sweep.nixl())
            except pydatacopy.Error as error:  # raised on every rank alike
                if pydatacopy.my_pe() == 0:
                    print(f"  NIXL baseline dropped from {_human(nbytes)} on: {error}", file=sys.stderr, flush=True)
                break
            finally:
                del sweep
    rows.extend(fixed_rows)
    if "tokens" in ops:
        for n_tokens, token_size in args.tokens:
            rows.extend(bench_token_exchange(n_tokens, token_size, args))

    if pydatacopy.my_pe() == 0:
        report(rows, args)
        for line in skipped:
            print(f"skipped {line}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    all_ok = all(r["ok"] for r in rows)
    pydatacopy.finalize()
    dist.destroy_process_group()
    return 0 if all_ok else 1

if __name__ == "__main__":
    sys.exit(main())
