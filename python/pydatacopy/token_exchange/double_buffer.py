"""DoubleBufferManager: the design note's class, with a real token exchange around it."""

from __future__ import annotations

import torch

from .. import _C, ops
from .._limits import INT32_MAX
from ..ops import dispatch_modes as _dispatch_modes, dynamo_compiling as _dynamo_compiling, refuse_capture
from .._torch_utils import check_int, core_property, stream_handle, tensor_from_address
from .._torch_utils import timeout_seconds

Error = _C.Error

MAX_TOKENS = INT32_MAX  # the core's limits: tokens are counted in 32 bits,
MAX_BUFFER_BYTES = _C.MAX_TOKEN_BUFFER_BYTES  # and one buffer set holds at most 1 TiB
_ROUND_MAX = 2**63 - 1


def _owned_stream(stream) -> torch.cuda.Stream | None:
    """`stream` as a torch stream that stays alive (torch pools its streams and never destroys
    them), or None for streams torch does not own (ExternalStream, raw handles): the caller may
    destroy those at any time, so nothing may be enqueued on them later."""
    if stream is None:
        stream = torch.cuda.current_stream(_C.cuda_device())
    if isinstance(stream, torch.cuda.ExternalStream) or not isinstance(stream, torch.cuda.Stream):
        return None
    # An external stream made current (torch.cuda.stream(ExternalStream(...))) comes back as a
    # plain Stream: torch gives it the cudaStream_t itself as its id.
    if stream.cuda_stream != 0 and stream.stream_id == stream.cuda_stream:
        return None
    return stream


def check_tokens(n_tokens: object, token_size: object, call: str) -> tuple[int, int]:
    """The sizes DoubleBufferManager.init takes (also the doctor's and the bench's --tokens)."""
    check_int("n_tokens", n_tokens, 1, MAX_TOKENS, call=call)
    check_int("token_size", token_size, 1, MAX_BUFFER_BYTES, call=call)
    if n_tokens * token_size > MAX_BUFFER_BYTES:
        raise Error(f"{call}: n_tokens x token_size = {n_tokens} x {token_size} bytes is larger than "
                    "1 TiB per buffer; use fewer or smaller tokens")
    return n_tokens, token_size


class DoubleBufferManager:
    """Two sets of symmetric send/receive buffers of ``[n_tokens, token_size]`` bytes.

    Round ``r`` uses buffer set ``r % 2``. A round::

        dbm.send_buffer.copy_(tokens)       # fill this round's send set
        r = dbm.exchange()                  # put every token to the peer, one signal per token
        received = dbm.wait(r)              # stream-ordered wait for the peer's round r
        use(received)                       # valid until you call exchange() twice more

    While round ``r`` is in flight the next round's ``send_buffer`` (the other set) can be
    filled and exchanged. Everything is ordered on torch's current stream (or ``stream=``);
    ``init``, ``cleanup`` and ``test_bandwidth`` block, as the note uses them.

    Peers: with two PEs, the other one. With more, by default PEs pair up (``pe ^ 1``) when
    their number is even and form a ring (send to ``pe + 1``, receive from ``pe - 1``) when it
    is odd; ``peer=`` (both directions) or ``dst_pe=``/``src_pe=`` choose explicitly, and every
    PE must make matching choices.
    """

    def __init__(self) -> None:
        self._core = _C.DoubleBufferManager()
        self._send: list[torch.Tensor] = []
        self._recv: list[torch.Tensor] = []
        self._src_of_round: dict[int, int] = {}
        # Per buffer set: the torch stream that waited for its last round (its consumer), or None.
        self._consumer: list[torch.cuda.Stream | None] = [None, None]
        self._op_number = ops.register_object(self)  # how the traced calls name it

    # ---- the note's API -------------------------------------------------------------------
    def init(self, n_tokens: int, token_size: int) -> None:
        """Allocate both buffer sets on every PE (collective, blocking). token_size is in bytes.

        Needs pydatacopy.init() first; n_tokens in [1, 2^31 - 1], n_tokens x token_size at most
        1 TiB, and the symmetric heap (NVSHMEM_SYMMETRIC_SIZE) must hold four such buffers.
        """
        ops.refuse_tracing("DoubleBufferManager.init")
        check_tokens(n_tokens, token_size, "pydatacopy.DoubleBufferManager.init")
        if not _C.is_initialized():
            raise Error("pydatacopy.DoubleBufferManager.init needs NVSHMEM: call pydatacopy.init() "
                        "(or pydatacopy.init_nvshmem()) first")
        refuse_capture("DoubleBufferManager.init")
        self._core.init(n_tokens, token_size)
        device = _C.cuda_device()
        shape = (n_tokens, token_size)
        # Static addresses for torch.compile: CUDA graphs must use the buffers in place.
        self._send = [ops.mark_static(tensor_from_address(self._core.send_buffer(s), shape,
                                                           torch.uint8, device, self)) for s in (0, 1)]
        self._recv = [ops.mark_static(tensor_from_address(self._core.recv_buffer(s), shape,
                                                           torch.uint8, device, self)) for s in (0, 1)]
        self._src_of_round.clear()
        self._consumer = [None, None]

    def cleanup(self) -> None:
        """Free both buffer sets on every PE (collective, blocking); harmless twice.

        Tensors obtained from this manager must not be used afterwards.
        """
        ops.refuse_tracing("DoubleBufferManager.cleanup")
        refuse_capture("DoubleBufferManager.cleanup")
        self._send, self._recv = [], []
        self._src_of_round.clear()
        self._consumer = [None, None]
        self._core.cleanup()

    def test_bandwidth(self, rank: int, world_size: int, *, stream=None) -> float:
        """One round with the default peers, blocking until this PE's tokens are delivered and
        the peer's have arrived. Returns this PE's send rate in GB/s (10^9 bytes per second)."""
        ops.refuse_tracing("DoubleBufferManager.test_bandwidth")
        call = "pydatacopy.DoubleBufferManager.test_bandwidth"
        check_int("rank", rank, 0, INT32_MAX, call=call)
        check_int("world_size", world_size, 1, INT32_MAX, call=call)
        self._require_init("test_bandwidth")
        round_ = self._core.round
        refuse_capture("DoubleBufferManager.test_bandwidth")
        gbps = self._core.test_bandwidth(rank, world_size, stream_handle(stream, _C.cuda_device()))
        self._src_of_round[round_] = _C.DoubleBufferManager.default_src_pe(rank, world_size)
        return gbps

    # ---- the token exchange -----------------------------------------------------------------
    n_tokens = core_property("n_tokens", "Tokens per buffer, as given to init() (0 before init() "
                                         "and after cleanup()).")

    token_size = core_property("token_size", "Bytes per token, as given to init() (0 before init()"
                                             " and after cleanup()).")

    round = core_property("round", "The number of rounds exchanged so far: the next exchange() is "
                                   "this round.")

    @property
    def current_set(self) -> int:
        """The buffer set (0 or 1) the next exchange() sends from."""
        return self._core.round % 2

    @property
    def send_buffer(self) -> torch.Tensor:
        """``[n_tokens, token_size]`` uint8: what the next exchange() sends. Fill it first."""
        self._require_init("send_buffer")
        return self._send[self.current_set]

    def send_buffer_of(self, round_: int) -> torch.Tensor:
        """``[n_tokens, token_size]`` uint8 that round `round_` sends (set ``round_ % 2``): fill
        it ahead of time. Do not change it while that round is in flight (until the peer has
        waited for it)."""
        self._require_init("send_buffer_of")
        return self._send[check_int("round", round_, 0) % 2]

    def recv_buffer(self, round_: int | None = None) -> torch.Tensor:
        """``[n_tokens, token_size]`` uint8 receiving `round_` (default: the last exchanged).
        Read it only after wait(round_)."""
        self._require_init("recv_buffer")
        if round_ is None:
            round_ = self._last_round("recv_buffer")
        return self._recv[check_int("round", round_, 0) % 2]

    def exchange(self, peer: int | None = None, *, dst_pe: int | None = None,
                 src_pe: int | None = None, stream=None, timeout: float | None = None) -> int:
        """Send this round's ``send_buffer`` to the peer and switch to the other buffer set.

        Stream-ordered; returns the round number to pass to wait(). Calling it for round r
        declares this PE's receive buffer of round r - 2 free (the peer may overwrite it), so
        round r - 2 must have been waited for. Under torch.compile it returns None (the round
        is counted when the compiled code runs): call wait() there without a round.
        """
        if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
            return ops.exchange(self, self._op_number, self._send, self._recv, peer, dst_pe=dst_pe,
                                 src_pe=src_pe, stream=stream, timeout=timeout)
        self._require_init("exchange")
        dst, src = self._peers(peer, dst_pe, src_pe)
        handle = stream_handle(stream, _C.cuda_device())
        self._after_consumer(self._core.round % 2, handle)
        round_ = self._core.exchange(dst, src, handle, timeout_seconds(timeout))
        self._src_of_round[round_] = src
        self._src_of_round.pop(round_ - 3, None)
        return round_

    def wait(self, round_: int | None = None, *, stream=None, timeout: float | None = None,
             blocking: bool = False) -> torch.Tensor:
        """Wait until every token of `round_` (default: the last exchanged) has arrived.

        Stream-ordered: work queued on the stream afterwards sees the data. With
        ``blocking=True`` the call also synchronises the stream and raises TimeoutError here if
        the peer did not deliver in time; otherwise a timeout surfaces at the next call (or
        ``pydatacopy.check_errors()``). Returns the round's receive buffer; under torch.compile,
        a copy of it (the set is known only when the compiled code runs, and an op's output
        cannot alias its input), for the last exchanged round (``round_`` None).
        """
        if _dynamo_compiling() or _dispatch_modes():  # traced: the op (pydatacopy.ops), not _C
            return ops.wait(self, self._op_number, self._recv, round_, stream=stream,
                             timeout=timeout, blocking=blocking)
        self._require_init("wait")
        if round_ is None:
            round_ = self._last_round("wait")
        check_int("round", round_, 0, _ROUND_MAX)
        src = self._src_of_round.get(round_, self._default_src())
        handle = stream_handle(stream, _C.cuda_device())
        if blocking:
            refuse_capture("DoubleBufferManager.wait(blocking=True)", handle)
        # Before the call: a blocking wait that raises its timeout has still enqueued the wait.
        self._consumer[round_ % 2] = _owned_stream(stream)
        # blocking: the core waits on the raw handle, with the GIL released (_C.wait_for_stream).
        self._core.wait(round_, src, handle, timeout_seconds(timeout), blocking)
        return self._recv[round_ % 2]

    # ---- helpers ------------------------------------------------------------------------------
    def _after_consumer(self, set_: int, handle: int) -> None:
        """exchange() frees the set's receive buffer to the peer: what was enqueued after wait()
        on the stream that waited for it (the reader of the buffer) must be done first. The core
        orders only after the wait() itself, as it keeps no stream; here torch's own streams,
        which torch never destroys, are safe to record on. Eager calls only: an event cannot
        cross into or out of a graph capture (captured consumers are the caller's to order)."""
        consumer, self._consumer[set_] = self._consumer[set_], None
        if consumer is None or consumer.cuda_stream == handle:
            return
        if _C.is_capturing(handle) or _C.is_capturing(consumer.cuda_stream):
            return
        torch.cuda.ExternalStream(handle).wait_stream(consumer)

    def _require_init(self, what: str) -> None:
        if not self._core.initialized:
            raise Error(f"pydatacopy.DoubleBufferManager.{what}: call init(n_tokens, token_size) "
                        "first (or it was cleaned up)")

    def _last_round(self, what: str) -> int:
        if self._core.round == 0:
            raise Error(f"DoubleBufferManager.{what}: no round has been exchanged yet")
        return self._core.round - 1

    def _default_src(self) -> int:
        return _C.DoubleBufferManager.default_src_pe(_C.my_pe(), _C.n_pes())

    def _peers(self, peer, dst_pe, src_pe) -> tuple[int, int]:
        me, n = _C.my_pe(), _C.n_pes()
        if peer is not None:
            if dst_pe is not None or src_pe is not None:
                raise Error("give either peer= or dst_pe=/src_pe=, not both")
            dst = src = check_int("peer", peer, 0)
        else:
            dst = _C.DoubleBufferManager.default_dst_pe(me, n) if dst_pe is None else check_int("dst_pe", dst_pe, 0)
            src = _C.DoubleBufferManager.default_src_pe(me, n) if src_pe is None else check_int("src_pe", src_pe, 0)
        for name, pe in (("dst_pe", dst), ("src_pe", src)):
            if pe >= n:
                raise Error(f"{name}={pe} is out of range: there are {n} PEs")
        return dst, src

    def __repr__(self) -> str:
        if not self._core.initialized:
            return "DoubleBufferManager(uninitialised)"
        return (f"DoubleBufferManager(n_tokens={self.n_tokens}, token_size={self.token_size}, "
                f"round={self.round})")
