"""What the zero-copy send/recv pays beyond its floor, priced piece by piece (issue 35), in one run:
the bench's `kernel + handshake` floor (one kernel per PE, a ready word, one fence and one count a
block), then the same with each thing the zero-copy path adds (kernels/api.cuh, kHandoff*): the
per-block begin (a store at the receiver, a system fence, two looks), the resolver (block 0 reads a
host-mapped word and publishes it), two blocks a multiprocessor, and all three; beside a bare copy
and the zero-copy send/recv itself. One way, rank 0 to rank 1; every row checked.
    torchrun --nproc_per_node=2 scripts/handoff_variants.py [--sizes 1M,4M,16M] [--json FILE]
(on one GPU: PYDATACOPY_RANKS_PER_GPU=2 under MPS, as scripts/gpu-check.sh runs the bench)."""

from __future__ import annotations

import argparse
import json
import sys

import torch.distributed as dist

import pydatacopy
from pydatacopy.bench import baselines, send_recv
from pydatacopy.bench._cli import _placement, _size
from pydatacopy.bench._harness import Sweep, against, make_row, start

_C = pydatacopy._C
VARIANTS = {
    "floor": 0,
    "+ begin": _C.BENCH_HANDOFF_BEGIN,
    "+ resolver": _C.BENCH_HANDOFF_RESOLVE,
    "+ 2 blocks/SM": _C.BENCH_HANDOFF_TWO_BLOCKS_PER_SM,
    "+ all three": _C.BENCH_HANDOFF_BEGIN | _C.BENCH_HANDOFF_RESOLVE | _C.BENCH_HANDOFF_TWO_BLOCKS_PER_SM,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,4M,16M")
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup", type=int, default=5)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    device, per_gpu = _placement()
    start(device, per_gpu)
    rows = []
    try:
        for nbytes in [_size(text) for text in args.sizes.split(",")]:
            sweep = Sweep(nbytes, False, args)
            base = make_row("baseline", "local copy", "one", nbytes, *baselines.local_copy(sweep))
            rows.append(base)
            for name, variant in VARIANTS.items():
                def handoff(*call, variant=variant):
                    _C.bench_kernel_handoff(*call, variant=variant)
                timed, ok = baselines._handoff(sweep, handoff, "kernel_handoff")
                rows.append(against(make_row("handoff", name, "one", nbytes, timed, ok), base))
            rows.append(against(make_row("send/recv", "zero-copy", "one", nbytes, *send_recv.sendrecv(sweep)), base))
            del sweep
        if pydatacopy.my_pe() == 0:
            for r in rows:
                print(f"{r['op']:<10} {r['path']:<14} {r['size']:>5} {r['us']:8.1f} us  p99 {r['p99_us']:8.1f}  "
                      f"x {r.get('xbase', 1.0):5.2f}  {'ok' if r['ok'] else 'NOT OK'}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        ok = all(r["ok"] for r in rows)
    finally:
        pydatacopy.finalize()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
