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
memory is local (2 PEs sharing one GPU) as on two. send/recv has a row per path: `default` (no
setting touched: what a user gets), then forced for the row: `zero-copy` (every message moves
once between load/store peers), `staged` (every message through the staging) and `low-latency`
(sizes up to the protocol's capacity); where they cross is where PYDATACOPY_ZERO_COPY_MIN_BYTES
and PYDATACOPY_LOW_LATENCY_MAX_BYTES belong. Also: put_many against put_blocks, a 4 KiB
put replayed in a CUDA graph against bare copies replayed alike, and the token exchange against
a bare copy of its bytes, and a step (compute, sendrecv of 64 KiB, compute) eager beside the
same step under torch.compile and under mode="reduce-overhead" (`--ops compile`). MoE dispatch/combine for any
PE count: python -m pydatacopy.bench.moe.

Two PEs on two GPUs (nccl), or sharing one GPU (PYDATACOPY_RANKS_PER_GPU=2, or more ranks than
GPUs: torch.distributed on gloo, as NCCL refuses two ranks on one GPU; the NCCL and torch
symm_mem baselines are then skipped, and say so).
Times are CUDA events after warm-up, one before every call: `us` is the median of one call's
time over every call of every repeat, `p99_us` its 99th percentile, the slower PE's. Every row
is checked (`ok`) by one more run after the timings, with fresh data from a new seed and the
destination cleared first, so a stale, lost or replayed delivery fails. Ratios between rows of
one run decide: the GPUs are shared and absolute figures move.
"""

from ._cli import MAX_MESSAGE_BYTES, OPS, _HelpFormatter, _size, build_parser, main, parse_args
from ._report import plot, report

__all__ = ["OPS", "build_parser", "main", "parse_args", "plot", "report"]
