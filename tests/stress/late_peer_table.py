"""When do blocking calls return with a late peer? torchrun --nproc_per_node=2 tests/stress/late_peer_table.py

PE 1 sleeps LATE seconds, then both make the same call; PE 0 prints, per call, when it returned
and when its GPU was idle (torch.cuda.synchronize() right after), both from its call. A blocking
call is right when the two agree (the wait was over on the GPU when it returned). A measurement
for the record (issue 23's table), not a test: tests/gpu/test_blocking.py asserts the state."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import pydatacopy

LATE = 1.0


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(pydatacopy.choose_device(rank))
    dist.init_process_group("gloo")
    pydatacopy.init()
    peer = 1 - rank
    signal = pydatacopy.empty(1, dtype=torch.uint64)
    data = pydatacopy.empty(4096, dtype=torch.uint8)
    signal.zero_()
    torch.cuda.synchronize()
    dbm = pydatacopy.DoubleBufferManager()
    dbm.init(64, 1000)
    pydatacopy.barrier(blocking=True)  # the first blocking call of the process, before any row
    rows = []
    value = 0

    def measure(name, call, late_call=None):
        dist.barrier()
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(LATE)
            (late_call or call)()
            torch.cuda.synchronize()
            return
        begin = time.perf_counter()
        call()
        returned = time.perf_counter() - begin
        torch.cuda.synchronize()
        idle = time.perf_counter() - begin
        rows.append((name, returned, idle))

    measure("barrier(blocking=True)", lambda: pydatacopy.barrier(blocking=True))
    value += 1
    measure("signal_wait(sig, v, blocking=True)",
            lambda: pydatacopy.signal_wait(signal, value, blocking=True),
            lambda: pydatacopy.put_signal(data, torch.ones(4096, dtype=torch.uint8, device="cuda"), peer, signal, value))

    def token_round():
        round_ = dbm.exchange()
        dbm.wait(round_, blocking=True)
    measure("DoubleBufferManager.wait(r, blocking=True)", token_round)
    allocated = []
    measure("empty() (collective)", lambda: allocated.append(pydatacopy.empty(1 << 20)))
    measure("test_bandwidth", lambda: dbm.test_bandwidth(rank, 2))
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"late-peer table: PE 1 {LATE:.1f} s late; pydatacopy {pydatacopy.__version__}")
        print(f"| call | returned after | GPU idle after |\n|---|---:|---:|")
        for name, returned, idle in rows:
            print(f"| `{name}` | {returned:.2f} s | {idle:.2f} s |")
    pydatacopy.barrier(blocking=True)
    dbm.cleanup()
    for tensor in allocated:
        pydatacopy.free(tensor)
    pydatacopy.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
