"""The design note's test, as the note writes it: run with
    torchrun --nproc_per_node=2 examples/note_test.py
Two ranks sharing one GPU (under CUDA MPS, see README): PYDATACOPY_RANKS_PER_GPU=2 torchrun ...;
then torch.distributed runs on gloo (NCCL refuses two ranks on one GPU) and both use cuda:0.
"""
import os
import time

import torch
import torch.distributed as dist

import pydatacopy


def main():
    ranks_per_gpu = int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1)
    dist.init_process_group(backend="gloo" if ranks_per_gpu > 1 else "nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    # pydatacopy's device rule: local rank r uses GPU r // PYDATACOPY_RANKS_PER_GPU.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) // ranks_per_gpu)

    # Rank 0 creates the NVSHMEM unique ID; torch.distributed shares it.
    unique_id = pydatacopy.get_unique_id() if rank == 0 else None
    all_ids = [None] * world_size
    dist.all_gather_object(all_ids, unique_id)
    root_unique_id = all_ids[0]
    pydatacopy.init_nvshmem(root_unique_id, rank, world_size)

    n_tokens, token_size = 4096, 7168
    manager = pydatacopy.DoubleBufferManager()
    manager.init(n_tokens, token_size)
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.time()
        bandwidth = manager.test_bandwidth(rank, world_size)
        torch.cuda.synchronize()
        end = time.time()
        print(f"rank {rank}: test_bandwidth {bandwidth:.1f} GB/s (host-timed {end - start:.6f} s)")
    manager.cleanup()
    pydatacopy.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
