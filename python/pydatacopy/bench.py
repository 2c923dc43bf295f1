"""pydatacopy benchmark: torchrun --nproc_per_node=2 -m pydatacopy.bench [options]

Times each path with CUDA events after warm-up, takes the median of repeats, checks the data
of every configuration (the `ok` column) and prints one table. Ratios against the baselines in
the same run decide; absolute figures move with the shared GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import pydatacopy


def _parse_shape(text: str) -> tuple[int, int]:
    n_tokens, token_size = text.lower().split("x")
    return int(n_tokens), int(token_size)


def _fill(tensor: torch.Tensor, pe: int, round_: int) -> None:
    generator = torch.Generator(device=tensor.device).manual_seed(7 + 131 * pe + 1_000_003 * round_)
    tensor.copy_(torch.randint(1, 256, tensor.shape, dtype=torch.uint8, device=tensor.device,
                               generator=generator))


def bench_token_exchange(n_tokens: int, token_size: int, iterations: int, warmup: int,
                         repeats: int) -> dict:
    """DoubleBufferManager exchange, both directions at once, pipelined over `iterations` rounds."""
    me, n = pydatacopy.my_pe(), pydatacopy.n_pes()
    peer = pydatacopy._C.DoubleBufferManager.default_src_pe(me, n)
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(n_tokens, token_size)
    try:
        # Fresh non-zero data in both sets; round r sends set r % 2.
        for s in (0, 1):
            _fill(dbm.send_buffer_of(s), me, s)
        ok = True

        def run(rounds: int) -> None:
            for _ in range(rounds):
                r = dbm.exchange()
                dbm.wait(r)

        run(warmup)
        times = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            run(iterations)
            stop.record()
            stop.synchronize()
            pydatacopy.check_errors()
            times.append(start.elapsed_time(stop) / 1e3 / iterations)
        # Correctness: the last two rounds' receive sets hold the peer's two sets.
        expected = torch.empty((n_tokens, token_size), dtype=torch.uint8, device="cuda")
        for r in (dbm.round - 2, dbm.round - 1):
            _fill(expected, peer, r % 2)
            ok = ok and torch.equal(dbm.recv_buffer(r), expected)
        seconds = statistics.median(times)
        return {"path": "DoubleBufferManager exchange (both ways)",
                "bytes": n_tokens * token_size, "shape": f"{n_tokens}x{token_size}",
                "us": seconds * 1e6, "gbps": n_tokens * token_size / seconds / 1e9, "ok": ok}
    finally:
        dbm.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydatacopy.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="*", type=_parse_shape,
                        default=[(1024, 4096), (4096, 7168), (16384, 14336)],
                        help="token-exchange shapes, N_TOKENSxTOKEN_BYTES")
    parser.add_argument("-n", "--iters", type=int, default=20, help="rounds per timing")
    parser.add_argument("-w", "--warmup", type=int, default=5)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node=2 -m pydatacopy.bench", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    pydatacopy.init()
    rows = [bench_token_exchange(n, t, args.iters, args.warmup, args.repeats) for n, t in args.tokens]
    if pydatacopy.my_pe() == 0:
        print(f"\n{'path':<42} {'shape':>12} {'bytes':>12} {'us':>10} {'GB/s':>8}  ok")
        for row in rows:
            print(f"{row['path']:<42} {row['shape']:>12} {row['bytes']:>12} {row['us']:>10.1f} "
                  f"{row['gbps']:>8.1f}  {'yes' if row['ok'] else 'NO'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    all_ok = all(row["ok"] for row in rows)
    pydatacopy.finalize()
    dist.destroy_process_group()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
