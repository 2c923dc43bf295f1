"""The torch.distributed backend started as its users start it (issue 38): under torchrun,

    torchrun --nproc_per_node=N tests/gpu/distributed_default_group.py

(scripts/gpu-check.sh's distributed step, 2 and 4 PEs) makes the default group on
"cpu:gloo,cuda:pydatacopy", so NVSHMEM starts through the group's store, and checks that PEs are
the ranks, a ring through batch_isend_irecv (4 KiB, 3 MiB + 5, 64 MiB), dist.send/recv, an
all_to_all_single, a barrier and a CPU all_reduce (gloo) move byte-exact; then tears down. Exit
status 0 on every rank, or the failure on stderr."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import pydatacopy
import pydatacopy.distributed  # noqa: F401 - registers the backend: the user's one extra line


def payload(src: int, dst: int, tag: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed((src * 1009 + dst) * 7919 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.cuda.synchronize()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{what}: {bad.numel()} bytes differ, first at {bad[0].item()}")


def main() -> int:
    dist.init_process_group("cpu:gloo,cuda:pydatacopy", timeout=timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    assert (pydatacopy.my_pe(), pydatacopy.n_pes()) == (rank, n), (pydatacopy.my_pe(), pydatacopy.n_pes())
    assert dist.get_backend() == "cpu:gloo,cuda:pydatacopy", dist.get_backend()
    # The native backend where it was asked for (it must build here), else the Python group.
    from pydatacopy.distributed import ProcessGroupPydatacopy, native
    group = dist.distributed_c10d._get_default_group()
    if native.requested():
        cuda = group._get_backend(torch.device("cuda"))
        assert isinstance(cuda, native.load().Backend), (type(cuda), native.failure())
    else:
        assert isinstance(group, ProcessGroupPydatacopy), type(group)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for nbytes in (4096, 3 * (1 << 20) + 5, 64 << 20):
        for repeat in range(3):
            src, dst = payload(rank, nxt, repeat, nbytes), torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, dst, prv), dist.P2POp(dist.isend, src, nxt)]):
                work.wait()
            same(dst, payload(prv, rank, repeat, nbytes), f"ring {nbytes} B, repeat {repeat}, rank {rank} from {prv}")
    partner = rank ^ 1
    if partner < n:
        got = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        if rank % 2 == 0:
            dist.send(payload(rank, partner, 9, 1 << 20), partner)
            dist.recv(got, partner)
        else:
            dist.recv(got, partner)
            dist.send(payload(rank, partner, 9, 1 << 20), partner)
        same(got, payload(partner, rank, 9, 1 << 20), f"send/recv, rank {rank} from {partner}")
    rows = torch.arange(n * 4 * 8, dtype=torch.float32, device="cuda").view(n * 4, 8) + 1000 * rank
    out = torch.zeros_like(rows)
    dist.all_to_all_single(out, rows)
    want = torch.cat([torch.arange(n * 4 * 8, dtype=torch.float32, device="cuda").view(n * 4, 8)[4 * rank:4 * rank + 4]
                      + 1000 * s for s in range(n)])
    same(out.view(torch.uint8), want.view(torch.uint8), f"all_to_all_single, rank {rank}")
    cpu = torch.tensor([float(rank)])
    dist.all_reduce(cpu)
    assert cpu.item() == n * (n - 1) / 2, cpu
    dist.barrier()
    dist.destroy_process_group()
    pydatacopy.finalize()
    print(f"rank {rank} of {n}: the default group on cpu:gloo,cuda:pydatacopy moved every byte right", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
