"""The graph rows (issue 35's 2 us target): send/recv replayed from a CUDA graph, beside a bare
copy replayed alike and the floor of a graph-replayed send/recv, in the same run."""

from __future__ import annotations

import sys

import torch

import pydatacopy

from ._harness import against, agree, capture_graphs, copies_to_capture, fill, human, make_row, refill, time_graph


def _graph_handoffs(nbytes: int, calls: int, src: torch.Tensor, peer: int):
    """What the graph floor captures: `calls` one-block kernel handoffs of src into the peer's
    symmetric `landing` (each PE sends and receives, as a sendrecv), numbered on the device so that
    every replay moves new messages (kernels/api.cuh, kHandoffMessageOnDevice). Returns (issue,
    landing, words, release), or None when the peer is not reachable by load/store or the size needs
    more than one block (on every PE alike: symmetric facts)."""
    if nbytes > pydatacopy._C.BENCH_HANDOFF_MESSAGE_ON_DEVICE_MAX_BYTES:
        return None
    landing = pydatacopy.empty(nbytes, dtype=torch.uint8)  # collective
    words = pydatacopy.empty(pydatacopy._C.BENCH_HANDOFF_WORDS, dtype=torch.int64)
    words.zero_()
    landing.zero_()

    def release():
        torch.cuda.synchronize()
        pydatacopy.barrier()
        pydatacopy.free(words)
        pydatacopy.free(landing)

    peer_landing, peer_words = pydatacopy.peer_view(landing, peer), pydatacopy.peer_view(words, peer)
    if not agree(peer_landing is not None and peer_words is not None):
        release()
        return None
    torch.cuda.synchronize()
    pydatacopy.barrier()  # zeroed on every PE before the first message

    def issue():
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(calls):
            pydatacopy._C.bench_kernel_handoff(peer_landing.data_ptr(), src.data_ptr(), nbytes, words.data_ptr(),
                                               peer_words.data_ptr(), True, True, 1, stream,
                                               pydatacopy._C.BENCH_HANDOFF_MESSAGE_ON_DEVICE)
    return issue, landing, words, release


def bench_graph_sendrecv(args, nbytes: int = 4096, calls: int = 100) -> list[dict]:
    """`calls` sendrecvs of `nbytes` with the peer (both PEs at once, the default path) captured in
    one CUDA graph and replayed, per call (issue 35's 2 us target); beside `calls` bare
    cudaMemcpyAsync calls of the same bytes on this GPU captured and replayed alike, on both PEs,
    and the floor of a graph-replayed send/recv: `calls` kernel handoffs (one kernel per PE and
    message: readiness, the bytes stored straight into the peer's memory, a done word; numbered on
    the device), between load/store peers. Checked: fresh data, the destination cleared, one
    replay (the floor also: no wait reached its deadline)."""
    me, peer = pydatacopy.my_pe(), 1 - pydatacopy.my_pe()
    src = fill(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), 11 + me)
    out = torch.zeros_like(src)
    local = torch.zeros_like(src)
    pydatacopy.sendrecv(src, peer, out, peer)  # first use outside the capture, as a user's loop
    torch.cuda.synchronize()

    def transfers():
        for _ in range(calls):
            pydatacopy.sendrecv(src, peer, out, peer)

    floor = _graph_handoffs(nbytes, calls, src, peer)
    captures = {"copies": copies_to_capture(local, src, calls), "sendrecvs": transfers}
    if floor is not None:
        captures["handoffs"] = floor[0]
    graphs = capture_graphs(captures, "graph sendrecv")
    rows = []
    try:
        for name, graph in (graphs or {}).items():
            seed = {"copies": 700, "sendrecvs": 800, "handoffs": 900}[name]
            expected = lambda seed=seed: fill(torch.empty_like(src), seed + peer)  # noqa: E731
            if name == "copies":
                timed, ok = time_graph(graph.replay, calls, args, refill(src, seed + me, local),
                                       lambda: torch.equal(local, src))
                rows.append(make_row("baseline", f"graph copy {human(nbytes)}", "both", nbytes, timed, ok))
            elif name == "sendrecvs":
                timed, ok = time_graph(graph.replay, calls, args, refill(src, seed + me, out),
                                       lambda: torch.equal(out, expected()))
                rows.append(against(make_row("send/recv", f"graph {human(nbytes)}", "both", nbytes, timed, ok),
                                    rows[0]))
            else:
                landing, words = floor[1], floor[2]
                timed, ok = time_graph(
                    graph.replay, calls, args, refill(src, seed + me, landing),
                    lambda: torch.equal(landing, expected())
                    and int(words[pydatacopy._C.BENCH_HANDOFF_TIMED_OUT_WORD].item()) == 0)
                rows.append(against(make_row("baseline", f"graph kernel + handshake {human(nbytes)}", "both", nbytes,
                                             timed, ok), rows[0]))
            if me == 0:
                print(f"  graph {name} {human(nbytes)}: {rows[-1]['us']:.2f} us a call", file=sys.stderr, flush=True)
    finally:
        del graphs
        torch.cuda.synchronize()
        if floor is not None:
            floor[3]()
        pydatacopy.barrier()
    return rows
