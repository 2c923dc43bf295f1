"""Baselines, measured in the same run as the rows they judge: a bare copy on this GPU, the copy
engine into the peer, NCCL, torch symm_mem's NVSHMEM put, NIXL's WRITE."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import pydatacopy

from ._harness import Timing, agree, fill, human, make_row, time_op


def bare_copy(nbytes: int, args, both: bool = True) -> dict:
    """A bare cudaMemcpyAsync of `nbytes` on this GPU, both PEs at once (or rank 0 alone),
    timed as the rows it is the baseline of; checked."""
    me = pydatacopy.my_pe()
    copies = both or me == 0
    src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 31 + me)
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        if copies:
            pydatacopy._C.bench_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream)

    timed = time_op(run, args.iters, args.warmup, args.repeats)
    fill(src, 41 + me)
    dst.zero_()
    run()
    torch.cuda.synchronize()
    ok = agree(not copies or torch.equal(dst, src))
    return make_row("baseline", "local copy", "both" if both else "one", nbytes, timed, ok)


def local_copy(sweep):
    """The baseline of every row: a bare cudaMemcpyAsync of the same bytes on the sender's own
    GPU (both PEs at once when both send), no pydatacopy code on the path."""
    stream = torch.cuda.current_stream().cuda_stream
    src, dst, nbytes = sweep.src.data_ptr(), sweep.out.data_ptr(), sweep.nbytes

    def run():
        if sweep.sends:
            pydatacopy._C.bench_memcpy(dst, src, nbytes, stream)

    return sweep.measure(run, sweep.out, local=True)


def _into_peer(sweep, copy, op: str):
    """A bare copy into the peer's memory, `copy(dst, src, bytes, stream)` from _C: no pydatacopy
    code on the path. `op` names the --ops entry (for the error on a peer beyond load/store)."""
    stream = torch.cuda.current_stream().cuda_stream

    def make_run(symmetric):
        peer_memory = pydatacopy.peer_view(symmetric, sweep.peer)
        if peer_memory is None:
            raise pydatacopy.Error(f"the {op} baseline needs a peer reachable by load/store "
                                   f"(NVLink/PCIe): leave {op} out of --ops")
        peer_address = peer_memory.data_ptr()

        def run():
            if sweep.sends:
                copy(peer_address, sweep.src.data_ptr(), sweep.nbytes, stream)
        return run

    return sweep._into_symmetric(make_run)


def memcpy(sweep):
    """A bare cudaMemcpyAsync into the peer's memory (torch's copy_ would add its own host cost:
    1-2 ms per call into a peer mapping, measured)."""
    return _into_peer(sweep, pydatacopy._C.bench_memcpy, "memcpy")


def kernel_copy(sweep):
    """The floor of every kernel path: put's SM copy kernel into the peer's memory, launched bare
    (one launch, no pydatacopy checks or bookkeeping), called as the memcpy row's copy is."""
    return _into_peer(sweep, pydatacopy._C.bench_kernel_copy, "kernel_copy")


def _handoff(sweep, handoff, op: str):
    """A message handed over by `handoff` (one of _C's bench_*_handoff: the receiver says it is
    ready in the sender's word, the sender copies into the receiver's memory and says it is done
    in the receiver's), no pydatacopy logic on the path; `op` names the --ops entry."""
    stream = torch.cuda.current_stream().cuda_stream
    words = pydatacopy.empty(pydatacopy._C.BENCH_HANDOFF_WORDS, dtype=torch.int64)  # {ready, done, ...}
    words.zero_()
    pydatacopy.barrier()
    message = [0]

    def make_run(symmetric):
        peer_memory = pydatacopy.peer_view(symmetric, sweep.peer)
        peer_words = pydatacopy.peer_view(words, sweep.peer)
        if peer_memory is None or peer_words is None:
            raise pydatacopy.Error(f"the {op} baseline needs a peer reachable by load/store "
                                   f"(NVLink/PCIe): leave {op} out of --ops")
        peer_address, my_words, their_words = peer_memory.data_ptr(), words.data_ptr(), peer_words.data_ptr()

        def run():
            message[0] += 1
            handoff(peer_address, sweep.src.data_ptr(), sweep.nbytes, my_words, their_words, sweep.sends,
                    sweep.receives, message[0], stream)
        return run

    try:
        timed, ok = sweep._into_symmetric(make_run)
        # A kernel handoff's wait that reached its deadline (a word never came: the copy skipped, or
        # the receiver gave up) fails the row, whatever the data say once every PE has synchronised.
        torch.cuda.synchronize()
        timed_out = int(words[pydatacopy._C.BENCH_HANDOFF_TIMED_OUT_WORD].item()) != 0
        if timed_out:
            print(f"  rank {sweep.me}: the {op} baseline's handshake timed out", file=sys.stderr, flush=True)
        return timed, agree(ok and not timed_out)
    finally:
        torch.cuda.synchronize()
        pydatacopy.barrier()
        pydatacopy.free(words)


def copy_engine_handoff(sweep):
    """The floor of a copy-engine send/recv (issue 35 item 2b), in the same run as the rows it
    judges: each message handed over with stream memory operations around one cudaMemcpyAsync
    into the peer's memory, no kernel and no pydatacopy logic (the receiver's stream writes its
    readiness into the sender's word, the sender's stream waits for it, copies and writes the
    receiver's done word, which the receiver's stream waits for). What a send/recv on the copy
    engine costs beyond a bare copy when the handshake is all it adds."""
    return _handoff(sweep, pydatacopy._C.bench_copy_engine_handoff, "ce_handoff")


def kernel_handoff(sweep):
    """The floor of a zero-copy send/recv made of kernels (issue 35 item 2a), in the same run: one
    kernel per PE, the receiver's block says it is ready in the sender's word, the sender's blocks
    wait for it, copy straight into the receiver's memory and each add one to its done word (one
    system fence a block), for which the receiver's block waits. No descriptor, table, refusal
    or watchdog: what a rendezvous adds to a kernel's copy when it is all that is added."""
    return _handoff(sweep, pydatacopy._C.bench_kernel_handoff, "kernel_handoff")


def torch_symm_mem(sweep):
    """torch.ops.symm_mem.nvshmem_put: the tensor goes to the same tensor on the peer."""
    import torch.distributed._symmetric_memory as symm_mem

    tensor = symm_mem.empty(sweep.nbytes, dtype=torch.uint8, device="cuda")
    symm_mem.rendezvous(tensor, dist.group.WORLD.group_name)
    tensor.copy_(sweep.src if sweep.sends else torch.zeros_like(sweep.src))
    torch.cuda.synchronize()
    dist.barrier()

    def run():
        if sweep.sends:
            torch.ops.symm_mem.nvshmem_put(tensor, sweep.peer)
            pydatacopy.quiet()  # one NVSHMEM in the process: this completes torch's put too

    try:
        return sweep.measure(run, tensor, src=tensor)  # one tensor: the sender's is the source
    finally:  # the tensor (and run, which holds it) go when this returns
        torch.cuda.synchronize()
        dist.barrier()


def nccl(sweep):
    def run():
        ops = []
        if sweep.sends:
            ops.append(dist.P2POp(dist.isend, sweep.src, sweep.peer))
        if sweep.receives:
            ops.append(dist.P2POp(dist.irecv, sweep.out, sweep.peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return sweep.measure(run, sweep.out)


def nixl(sweep) -> tuple[Timing, bool]:
    """NIXL's WRITE (UCX) from rank 0's tensor into rank 1's: one direction only, timed by
    the host's clock (its median over repeats; its 99th percentile of one call from the host's
    timestamps of every call). Raises pydatacopy.Error on every rank when NIXL failed on any."""
    from .nixl import NixlWrite

    with NixlWrite(sweep.src, sweep.out, timeout_s=pydatacopy._C.default_timeout_seconds()) as transfer:
        timed, ok = sweep.measure(transfer.write, sweep.out)
        failure = transfer.agreed_failure()
    if failure:
        raise pydatacopy.Error(f"NIXL's WRITE of {human(sweep.nbytes)} bytes: {failure}")
    return timed.by_host_clock(), ok


def nixl_ready() -> bool:
    """Whether NIXL can be used on every rank; says why not on rank 0."""
    from .nixl import nixl_problem

    reason = nixl_problem()
    ready = agree(not reason)
    if not ready and pydatacopy.my_pe() == 0:
        print(f"  NIXL baseline skipped: {reason or 'not installed on every rank'}", file=sys.stderr, flush=True)
    return ready


def torch_symm_mem_ready() -> bool:
    """Whether torch's symmetric memory runs on NVSHMEM here (decided on every rank alike)."""
    reason = ""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        if not symm_mem.is_nvshmem_available():
            reason = "torch reports NVSHMEM unavailable"
    except Exception as error:  # any torch without it: the baseline is skipped, not the run
        reason = f"{type(error).__name__}: {error}"
    ready = agree(not reason)
    if not ready and pydatacopy.my_pe() == 0:
        print(f"  torch symm_mem baseline skipped: {reason or 'not available on every rank'}",
              file=sys.stderr, flush=True)
    return ready
