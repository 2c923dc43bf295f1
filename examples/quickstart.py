# torchrun --nproc_per_node=2 examples/quickstart.py   (one GPU: see docs/shared-gpu.md)
import torch, torch.distributed as dist, pydatacopy

dist.init_process_group("gloo")        # carries only NVSHMEM's 128-byte ID; the data moves over NVSHMEM
pydatacopy.init()                      # the ID made on rank 0, broadcast, every rank joins
me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()

x = pydatacopy.empty(1 << 20)          # a symmetric tensor (collective); put writes the peer's copy
pydatacopy.put(x, torch.full((1 << 20,), float(me), device="cuda"), peer)
pydatacopy.barrier(blocking=True)      # our puts are delivered and every PE has arrived
assert bool((x == peer).all())

out = torch.full((4096, 7168), me, dtype=torch.bfloat16, device="cuda")
into = torch.empty_like(out)           # send/recv: any CUDA tensor, no symmetric memory
pydatacopy.sendrecv(out, peer, into, peer)
assert bool((into == peer).all())

dbm = pydatacopy.DoubleBufferManager() # the design note's token exchange
dbm.init(4096, 7168)                   # n_tokens, token_size (bytes)
print(f"PE {me}: all right; token exchange {dbm.test_bandwidth(me, 2):.0f} GB/s")
dbm.cleanup(); pydatacopy.free(x); pydatacopy.finalize()
