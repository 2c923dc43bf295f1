"""torch.distributed's backend "pydatacopy": code written for torch.distributed moves its CUDA
tensors through pydatacopy unchanged. Importing this module registers it::

    import torch.distributed as dist, pydatacopy.distributed
    dist.init_process_group("cpu:gloo,cuda:pydatacopy")   # under torchrun
    dist.send(tensor, dst=1)                               # CUDA: pydatacopy; CPU: gloo

CUDA tensors: send, recv, isend, irecv, batch_isend_irecv, all_to_all_single (with and without
split sizes) and barrier, with NCCL's stream semantics; every other collective on a CUDA tensor,
and a recv from any source, raise pydatacopy.Error naming what to use instead. CPU tensors go to a
gloo group over the same ranks. NVSHMEM starts with the default group, through its store; a process
that called pydatacopy.init() first shares that runtime. docs/distributed.md has the details.
"""

from __future__ import annotations

from .backend import BACKEND_NAME, ProcessGroupPydatacopy, register

register()

__all__ = ["BACKEND_NAME", "ProcessGroupPydatacopy", "register"]
