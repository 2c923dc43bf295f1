"""Integrity under load: torchrun --nproc_per_node=2 tests/stress/stress.py --rounds 10000
(two PEs sharing one GPU: PYDATACOPY_RANKS_PER_GPU=2, under CUDA MPS; scripts/gpu-check.sh)

Random rounds mixing every data path (put on the copy engine, SM and RMA paths, get, put_signal,
send/recv both ways, put_many, the DoubleBufferManager exchange), sizes from 1 byte to 256 MiB
(log-uniform), random offsets and dtypes, both PEs moving data at once; every round verified
byte-exact against data the receiver regenerates. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import pydatacopy

DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
KINDS = ["put_ce", "put_sm", "put_rma", "get", "put_signal", "sendrecv", "put_many", "tokens"]


def random_bytes(pe: int, round_: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(pe * 7_919_993 + round_)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10000)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--empty-cache-every", type=int, default=0,
                        help="return torch's cached memory to the driver every N rounds (0: never)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="stop after this many seconds, at a round all PEs agree on (0: no limit); "
                             "the summary says how many rounds ran")
    args = parser.parse_args()

    # pydatacopy's device rule: local rank r on device r // PYDATACOPY_RANKS_PER_GPU. Ranks that
    # share a GPU talk over gloo (NCCL refuses two ranks on one GPU).
    ranks_per_gpu = int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) // ranks_per_gpu)
    if ranks_per_gpu > 1:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    pe = pydatacopy.init()
    peer = 1 - pe
    rng = random.Random(args.seed)  # the same sequence on both PEs
    heap = pydatacopy.empty(args.max_bytes + 64, dtype=torch.uint8)
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    signal.zero_()
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(512, 4099)
    pydatacopy.barrier()
    torch.cuda.synchronize()
    moved = 0
    counts = {kind: 0 for kind in KINDS}
    start = time.time()
    # PYDATACOPY_FORCE_RMA=1: no peer is directly reachable, so the direct-only paths are out.
    forced = pydatacopy._C.rma_forced()
    kinds = [k for k in KINDS if not (forced and k in ("put_ce", "put_sm"))]
    get_paths = ["auto", "rma"] if forced else ["auto", "sm", "rma"]
    rounds_done = 0
    for round_ in range(args.rounds):
        if args.max_seconds and round_ % 50 == 0 and round_:
            # PE 0's clock decides for all: every PE stops after the same round.
            stop = [time.time() - start > args.max_seconds]
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                break
        if args.empty_cache_every and round_ % args.empty_cache_every == 0:
            # Segments go back to the driver and come again, often at the same addresses: the
            # registrations of the RMA path must follow (stale ones dropped, new ones made).
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        kind = rng.choice(kinds)
        dtype = rng.choice(DTYPES)
        element = torch.empty((), dtype=dtype).element_size()
        nbytes = max(element, int(math.exp(rng.uniform(0, math.log(args.max_bytes)))) // element * element)
        offset = rng.randrange(0, 64 // element) * element
        outgoing = random_bytes(pe, round_, nbytes)
        expected = random_bytes(peer, round_, nbytes)
        window = heap[offset:offset + nbytes].view(dtype)
        if kind.startswith("put_") and kind in ("put_ce", "put_sm", "put_rma"):
            path = {"put_ce": "copy_engine", "put_sm": "sm", "put_rma": "rma"}[kind]
            pydatacopy.put(window, outgoing.view(dtype), peer, path=path)
            pydatacopy.barrier()
            received = heap[offset:offset + nbytes]
        elif kind == "get":
            heap[offset:offset + nbytes].copy_(outgoing)
            pydatacopy.barrier()
            received = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            pydatacopy.get(received.view(dtype), window, peer, path=rng.choice(get_paths))
        elif kind == "put_signal":
            pydatacopy.put_signal(window, outgoing.view(dtype), peer, signal, round_ + 1)
            pydatacopy.signal_wait(signal, round_ + 1, timeout=30)
            received = heap[offset:offset + nbytes]
        elif kind == "sendrecv":
            base = torch.empty(nbytes + offset, dtype=torch.uint8, device="cuda")
            received = base[offset:]
            pydatacopy.sendrecv(outgoing.view(dtype), peer, received.view(dtype), peer)
        elif kind == "put_many":
            count = rng.randint(1, 64)
            piece = max(1, nbytes // count)
            count = max(1, min(count, nbytes // piece))
            nbytes = piece * count
            outgoing, expected = outgoing[:nbytes], expected[:nbytes]
            dsts = list(heap[offset:offset + nbytes].view(count, piece))
            pydatacopy.put_many(dsts, list(outgoing.view(count, piece)), peer)
            pydatacopy.barrier()
            received = heap[offset:offset + nbytes]
        else:  # tokens
            nbytes = dbm.n_tokens * dbm.token_size
            outgoing = random_bytes(pe, round_, nbytes)
            expected = random_bytes(peer, round_, nbytes)
            dbm.send_buffer.view(-1).copy_(outgoing)
            received = dbm.wait(dbm.exchange()).view(-1)
        if not torch.equal(received, expected):
            bad = (received != expected).nonzero()
            print(f"PE {pe}: MISMATCH in round {round_} ({kind}, {nbytes} bytes, offset {offset}, "
                  f"{dtype}): {bad.numel()} bytes differ, first at {bad[0].item()}", flush=True)
            return 1
        pydatacopy.barrier()  # the peer has checked before this round's buffers are reused
        moved += nbytes
        counts[kind] += 1
        rounds_done += 1
        if pe == 0 and (round_ + 1) % 2000 == 0:
            print(f"  {round_ + 1} rounds verified, {moved / 2**30:.1f} GiB received per PE", flush=True)
    torch.cuda.synchronize()
    pydatacopy.check_errors()
    elapsed = time.time() - start
    if pe == 0:
        cut = f" (of {args.rounds}: stopped at --max-seconds {args.max_seconds:.0f})" \
            if rounds_done < args.rounds else ""
        print(f"stress: {rounds_done} rounds{cut} verified byte-exact on both PEs in {elapsed:.0f} s, "
              f"{moved / 2**30:.1f} GiB received per PE; rounds per path: {counts}; "
              f"registrations: {pydatacopy._C.registration_stats()}")
    dbm.cleanup()
    pydatacopy.finalize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
