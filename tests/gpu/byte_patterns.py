"""What the two-PE GPU tests send: random bytes each PE regenerates for its peer (so the receiver
compares without a second transfer), viewed as any dtype; and whether peers are directly
reachable in this run. Shared by test_transfer.py, test_symmetric.py and test_send_recv.py."""

from __future__ import annotations

import torch

import pydatacopy

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.bool]


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    """Random bytes that PE `pe` sends under `tag`; the receiver regenerates them to compare."""
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 1_000_003 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _as(tensor_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return (tensor_bytes & 1).view(torch.bool)
    return tensor_bytes.view(dtype)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.bool else tensor.view(torch.uint8)


def _direct() -> bool:
    """False when the whole suite runs with PYDATACOPY_FORCE_RMA=1 (scripts/gpu-check.sh runs it
    both ways): then no peer is directly reachable and the direct-only paths must refuse."""
    return not pydatacopy._C.rma_forced()


# Why tests that send torch-allocated memory on the remote path skip, or leave that path out,
# under expandable segments (gpu-check's gpu2-tests-expandable step).
NO_TORCH_MEMORY_ON_RMA = ("expandable segments: NVSHMEM cannot register VMM memory, so the remote path refuses "
                          "torch tensors on every PE by design (test_registration.py's "
                          "test_expandable_segments_are_refused_on_the_remote_path)")


def _torch_memory_registers() -> bool:
    """False under torch's expandable segments: a torch tensor cannot go out on the RMA path."""
    from pydatacopy._torch_utils import allocator_setting

    return allocator_setting() != "expandable_segments"
