"""Zero-copy send/recv between any number of PEs (any_pes): a ring of sendrecvs above the
threshold, byte-exact in every round, and every PE's receives going zero-copy once the mapping
handshake with its predecessor has run (the engine's counters). Failures are gathered on every
PE before any PE raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import pydatacopy
from pydatacopy.send_recv import send_recv as _send_recv

pytestmark = pytest.mark.any_pes

MiB = 1 << 20


def _bytes(pe: int, tag: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed((pe + 1) * 5_000_011 + tag)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=generator)


def _agree(world, failures: list[str], step: str) -> None:
    every = [None] * world[1]
    dist.all_gather_object(every, failures)
    bad = [f"PE {pe}: {failure}" for pe, mine in enumerate(every) for failure in mine]
    if bad:
        pytest.fail(f"by {step}: " + "; ".join(bad), pytrace=False)


@pytest.mark.parametrize("shift", [1, -1], ids=["next", "previous"])
def test_ring_sendrecv_goes_zero_copy_and_stays_exact(world, shift):
    rank, n = world[0], world[1]
    pydatacopy.setup_send_recv()
    _send_recv.set_zero_copy_min_bytes(1 * MiB)
    to, frm = (rank + shift) % n, (rank - shift) % n
    nbytes = 8 * MiB + 7
    recv = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    failures: list[str] = []
    torch.cuda.synchronize()
    before = _send_recv._require_engine("test").zero_copy_counters()
    rounds = 6
    for round_ in range(rounds):
        try:
            recv.zero_()
            pydatacopy.sendrecv(_bytes(rank, round_, nbytes), to, recv, frm)
            if not torch.equal(recv, _bytes(frm, round_, nbytes)):
                failures.append(f"round {round_}: the bytes from PE {frm} differ")
        except Exception as error:  # recorded: every PE goes through the same barriers
            failures.append(f"round {round_}: {type(error).__name__}: {error}")
        torch.cuda.synchronize()
        dist.barrier()  # each host's next call finds the mapping requests of the last one
    try:
        pydatacopy.check_errors()
    except Exception as error:
        failures.append(f"check_errors: {error}")
    after = _send_recv._require_engine("test").zero_copy_counters()
    if pydatacopy._C.rma_forced():  # every message stays staged then
        if after["recv_zero_copy"] != before["recv_zero_copy"]:
            failures.append(f"forced RMA went zero-copy: {after}")
    elif after["recv_zero_copy"] - before["recv_zero_copy"] < rounds - 2:
        failures.append(f"only {after['recv_zero_copy'] - before['recv_zero_copy']} of {rounds} receives "
                        f"went zero-copy: {after}")
    _agree(world, failures, "the ring")
    pydatacopy.setup_send_recv()
