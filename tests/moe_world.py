"""A simulated world for the MoE CPU tests (test_moe_cpu.py, test_moe_expand_false_cpu.py): the
all-to-all-v between PEs in one process, a one-PE loopback buffer for the traced path, and buffer
stand-ins for the argument checks."""

from __future__ import annotations

import contextlib

import torch

import pydatacopy


def exchange(sends_per_pe, counts_per_pe, index_per_pe, capacity):
    """all_to_all_v between simulated PEs (index None: contiguous rows in PE order): what each PE
    receives, compacted by source, padded to n x capacity rows with a marker (never data)."""
    n = len(sends_per_pe)
    out = []
    for r in range(n):
        fields = [[] for _ in sends_per_pe[0]]
        counts = []
        for s in range(n):
            cnt = counts_per_pe[s]
            start, count = int(cnt[:r].sum()), int(cnt[r])
            assert count <= capacity
            index = index_per_pe[s]
            rows = torch.arange(start, start + count) if index is None else index[start:start + count]
            for f, send in enumerate(sends_per_pe[s]):
                fields[f].append(send.index_select(0, rows))
            counts.append(count)
        recvs = []
        for f, send in enumerate(sends_per_pe[0]):
            got = torch.cat(fields[f], 0)
            pad = torch.full((n * capacity - got.shape[0], *send.shape[1:]), 7, dtype=send.dtype)
            recvs.append(torch.cat([got, pad], 0))
        counts = torch.tensor(counts, dtype=torch.int64)
        out.append((recvs, counts, torch.cumsum(counts, 0) - counts))
    return out


class Loopback:
    """A one-PE AllToAll on the CPU: what it sends to itself it receives (rows past the count
    filled with `pad`, never data)."""

    def __init__(self, capacity, pad=0):
        self.capacity, self.n_pes, self.recv_rows, self.calls, self.pad = capacity, 1, capacity, 0, pad
        self._core = type("Core", (), {"calls": 0})()

    def _exchange_eager(self, sends, send_counts, send_index, stream, timeout):
        self.calls += 1
        count = int(send_counts[0])
        rows = send_index[:count] if send_index is not None else torch.arange(count)
        recvs = []
        for send in sends:
            recv = torch.full((self.recv_rows, *send.shape[1:]), self.pad, dtype=send.dtype)
            recv[:count] = send.index_select(0, rows)
            recvs.append(recv)
        return recvs, send_counts.to(torch.int64).clone(), torch.zeros(1, dtype=torch.int64)

    def _exchange_compact(self, sends, send_counts, send_index, timeout):
        """A compact call's stand-in: the same rows, in one buffer per field kept across calls
        (the region: what is past the count stays from before), counted in _core.calls."""
        self.calls += 1
        self._core.calls += 1
        count = int(send_counts[0])
        rows = send_index[:count] if send_index is not None else torch.arange(count)
        if not hasattr(self, "region"):
            self.region = [torch.full((self.recv_rows, *s.shape[1:]), self.pad, dtype=s.dtype) for s in sends]
        for view, send in zip(self.region, sends):
            view[:count] = send.index_select(0, rows)
        return list(self.region), send_counts.to(torch.int64).clone(), torch.zeros(1, dtype=torch.int64)


def stub_buffer(number: int, n_pes: int = 1) -> pydatacopy.AllToAll:
    """An AllToAll object as the traced path sees it (its number and order tensor), with no
    NVSHMEM behind it: the ops' kernels reach the loopback registered under `number`."""
    stub = object.__new__(pydatacopy.AllToAll)
    stub.number, stub._n_pes, stub._device = number, n_pes, -1
    stub._order = torch.zeros(1, dtype=torch.uint8)
    return stub


@contextlib.contextmanager
def traced_dispatcher(tokens: int, hidden: int, topk: int, experts: int, capacities, **attributes):
    """A one-PE float32 MoeDispatcher for the traced path (torch.compile): its two buffers stubs
    whose ops reach Loopbacks (capacities: dispatch's, combine's; rows past the count filled
    with 3, never data) registered under fresh numbers while the block runs (the registry holds
    them weakly: kept alive here). ``attributes``: the mode's (expand, pre_reduce, ...).
    Yields (moe, loopbacks)."""
    import random

    from pydatacopy.moe import all_to_all as moe_all_to_all

    numbers = tuple(random.randrange(10**6, 10**9) for _ in range(2))
    loopbacks = tuple(Loopback(capacity, pad=3) for capacity in capacities)
    for number, loopback in zip(numbers, loopbacks):
        moe_all_to_all._buffers[number] = loopback
    try:
        moe = object.__new__(pydatacopy.MoeDispatcher)
        moe.num_experts, moe.hidden, moe.topk, moe.max_tokens = experts, hidden, topk, tokens
        moe.dtype = moe.combine_dtype = torch.float32
        moe.n_pes, moe.experts_per_pe, moe.my_pe = 1, experts, 0
        moe._dispatch, moe._combine = stub_buffer(numbers[0]), stub_buffer(numbers[1])
        for name, value in attributes.items():
            setattr(moe, name, value)
        yield moe, loopbacks
    finally:
        for number in numbers:
            moe_all_to_all._buffers.pop(number, None)


class RefusingBuffer:
    """Stands in for an AllToAll: _refuse records the refusal (the round the core would run) and
    raises it, as AllToAll._refuse does."""

    def __init__(self, number: int) -> None:
        self.number, self.refused, self.compact = number, [], []

    def _refuse(self, error, stream, timeout, compact=False):
        self.refused.append(str(error))
        self.compact.append(compact)
        raise error


# ---- a world of threads: each simulated PE runs its own calls, exchanges meet at a barrier ------

class ThreadWorld:
    """n simulated PEs, one thread each (tests/test_compat_deep_ep_cpu.py): ThreadedAllToAll's
    exchanges meet at a barrier; a refusal or a tag mismatch is recorded for every PE of the
    round (as the device does) and raised by ``raise_errors`` (check_errors' stand-in)."""

    def __init__(self, n: int) -> None:
        import threading

        self.n, self.barrier = n, threading.Barrier(n, timeout=60)
        self.slots = [None] * n
        self.errors = [None] * n

    def raise_errors(self, rank: int) -> None:
        error, self.errors[rank] = self.errors[rank], None
        if error is not None:
            raise pydatacopy.Error(error)

    def run(self, body):
        """body(rank) on n threads; returns their results; re-raises the first failure."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.n) as pool:
            futures = [pool.submit(body, rank) for rank in range(self.n)]
            return [f.result() for f in futures]


class _Core:
    def __init__(self) -> None:
        self.calls, self.initialized = 0, True


class ThreadedAllToAll:
    """An AllToAll of one simulated PE in a ThreadWorld (its number shared by the PEs' buffers
    made in the same order, as on the device)."""

    def __init__(self, world: ThreadWorld, rank: int, capacity: int, number: int) -> None:
        self.world, self.rank, self.capacity, self.number = world, rank, capacity, number
        self._n_pes, self._device, self._core = world.n, -2, _Core()
        self.recv_rows = world.n * capacity

    def close(self) -> None:
        self._core.initialized = False

    def _round(self, entry):
        world = self.world
        world.slots[self.rank] = entry
        world.barrier.wait()
        entries = list(world.slots)
        world.barrier.wait()
        self._core.calls += 1
        return entries

    def _refuse(self, error, stream, timeout, compact=False):
        self._round(("refused", str(error)))
        raise error

    def _exchange_eager(self, sends, send_counts, send_index, stream, timeout, tag: int = 0,
                        zero_unused_rows: bool = False):
        bytes_view = [s.view(torch.uint8) if s.element_size() == 1 else s for s in sends]
        entries = self._round(("sends", bytes_view, send_counts.to(torch.int64), send_index, tag))
        refused = [e[1] for e in entries if e[0] == "refused"]
        tags = {e[4] for e in entries if e[0] == "sends"}
        over = [e for e in entries if e[0] == "sends" and int(e[2].max()) > self.capacity]
        if refused or len(tags) > 1 or over:
            self.world.errors[self.rank] = (refused[0] if refused else "all_to_all: refused on the device (a "
                                            "count over the capacity, or PEs combining different dispatches)")
            recvs = [torch.zeros((self.recv_rows, *s.shape[1:]), dtype=s.dtype) for s in sends]
            zeros = torch.zeros(self.world.n, dtype=torch.int64)
            return recvs, zeros, zeros.clone()
        got = exchange([e[1] for e in entries], [e[2] for e in entries], [e[3] for e in entries], self.capacity)
        recvs, counts, offsets = got[self.rank]
        recvs = [r.view(s.dtype) if s.element_size() == 1 else r for r, s in zip(recvs, sends)]
        return recvs, counts, offsets
