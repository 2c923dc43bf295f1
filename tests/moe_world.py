"""A simulated world for the MoE CPU tests (test_moe_cpu.py, test_moe_expand_false_cpu.py): the
all-to-all-v between PEs in one process."""

from __future__ import annotations

import torch


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
