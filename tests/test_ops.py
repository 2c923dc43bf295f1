"""The torch.library ops (torch.ops.pydatacopy.*) on the CPU, without a GPU or NVSHMEM: schemas,
torch.library.opcheck, tracing with make_fx and torch.compile (fullgraph), the refusal of blocking
calls when traced, and that eager calls never take the ops.

The ops' real kernels call the public functions; here those are swapped for a loopback on the CPU
(one PE that is its own peer: a put writes its own dst, recv gets a fixed pattern), which writes
exactly the tensors each op declares, so opcheck's schema test checks the declarations against a
kernel that behaves like the real one. Written for torch 2.11 and the newest torch alike; what
differs between versions is said where it matters."""

from __future__ import annotations

import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pydatacopy
from pydatacopy import _torch_utils
from pydatacopy import ops as _ops
from pydatacopy.send_recv import send_recv as _send_recv
from pydatacopy.rma import symmetric as _symmetric
from pydatacopy.rma import transfer as _transfer

U64_MAX = 2**64 - 1


def _pattern(tensor: torch.Tensor) -> torch.Tensor:
    """What the loopback's recv writes: fixed, so that reruns of an op (opcheck) agree."""
    flat = (torch.arange(tensor.numel()) % 97).to(tensor.dtype)
    return flat.view(tensor.shape)


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


class Loopback:
    """The public calls as one PE talking to itself, on the CPU; `calls` logs (name, details)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.addresses: list[int] = []  # of the tensors a put writes at the peer

    def put(self, dst, src, pe, *, stream=None, path="auto"):
        self.calls.append(("put", pe, stream, path))
        self.addresses.append(dst.data_ptr())
        dst.copy_(src)

    def get(self, dst, src, pe, *, stream=None, path="auto"):
        self.calls.append(("get", pe, stream, path))
        dst.copy_(src)

    def put_signal(self, dst, src, pe, signal, value, *, stream=None):
        self.calls.append(("put_signal", pe, value, stream))
        self.addresses += [dst.data_ptr(), signal.data_ptr()]
        dst.copy_(src)
        signal.fill_(_signed(value))

    def signal_set(self, signal, value, pe, *, stream=None):
        self.calls.append(("signal_set", value, pe, stream))
        signal.fill_(_signed(value))

    def signal_wait(self, signal, value, *, stream=None, timeout=None, blocking=False, received=()):
        self.calls.append(("signal_wait", value, stream, timeout, blocking))

    def quiet(self, *, stream=None):
        self.calls.append(("quiet", stream))

    def barrier(self, *, stream=None, timeout=None, blocking=False, received=()):
        self.calls.append(("barrier", stream, timeout, blocking))

    def put_many(self, dsts, srcs, pe, *, stream=None, path="auto"):
        self.calls.append(("put_many", len(dsts), pe, stream, path))
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)

    def put_blocks(self, dst_pool, src_pool, dst_indices, src_indices, pe, *, stream=None,
                   path="auto"):
        self.calls.append(("put_blocks", pe, stream, path))
        dst_pool.index_copy_(0, dst_indices, src_pool.index_select(0, src_indices))

    def send(self, tensor, dst_pe, *, stream=None, timeout=None):
        self.calls.append(("send", dst_pe, stream, timeout))

    def recv(self, tensor, src_pe, *, stream=None, timeout=None):
        self.calls.append(("recv", src_pe, stream, timeout))
        tensor.copy_(_pattern(tensor))

    def sendrecv(self, send_tensor, dst_pe, recv_tensor, src_pe, *, stream=None, timeout=None):
        self.calls.append(("sendrecv", dst_pe, src_pe, stream, timeout))
        recv_tensor.copy_(send_tensor)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


class LoopbackManager:
    """A DoubleBufferManager's exchange/wait on the CPU: the round's send set arrives in its
    receive set at once."""

    def __init__(self, send, recv):
        self.send, self.recv, self.round, self.calls = send, recv, 0, []

    def exchange(self, peer=None, *, dst_pe=None, src_pe=None, stream=None, timeout=None):
        self.calls.append(("exchange", dst_pe, src_pe, stream, timeout))
        self.recv[self.round % 2].copy_(self.send[self.round % 2])
        self.round += 1
        return self.round - 1

    def wait(self, round_=None, *, stream=None, timeout=None, blocking=False):
        self.calls.append(("wait", round_, stream, timeout))
        return self.recv[(self.round - 1) % 2]


@pytest.fixture
def loopback(monkeypatch):
    """The ops' real kernels on the CPU loopback, and an ordering tensor on the CPU (init makes it
    on the PE's GPU)."""
    fake = Loopback()
    for name in ("put", "get", "put_signal", "signal_set", "signal_wait", "quiet", "barrier",
                 "put_many", "put_blocks", "send", "recv", "sendrecv"):
        monkeypatch.setattr(_send_recv if name in ("send", "recv", "sendrecv") else _transfer, name,
                            getattr(fake, name))
    monkeypatch.setattr(_ops.traced, "_order", torch.zeros(1, dtype=torch.uint8))
    torch._dynamo.reset()
    yield fake
    torch._dynamo.reset()


def _t(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def _op_cases():
    """(op name, args) for opcheck: CPU tensors; streams None (current) and a raw int."""
    order = lambda: torch.zeros(1, dtype=torch.uint8)  # noqa: E731
    signal = lambda: torch.zeros(1, dtype=torch.int64)  # noqa: E731
    return [
        ("put", lambda: (torch.zeros(8), _t(8), 1, None, "auto", order())),
        ("get", lambda: (torch.zeros(2, 4), _t(2, 4), 1, 1234, "copy_engine", order())),
        ("put_signal", lambda: (torch.zeros(8), _t(8), 1, signal(), _signed(U64_MAX), None, order())),
        ("signal_set", lambda: (signal(), 7, 1, None, order())),
        ("signal_wait", lambda: (signal(), 7, [torch.zeros(4)], None, 5.0, order())),
        ("quiet", lambda: (None, order())),
        ("barrier", lambda: ([torch.zeros(4), torch.zeros(2)], 99, None, order())),
        ("put_many", lambda: ([torch.zeros(4), torch.zeros(3, dtype=torch.int32)],
                              [_t(4), torch.arange(3, dtype=torch.int32)], 1, None, "sm", order())),
        ("put_blocks", lambda: (torch.zeros(6, 4), _t(5, 4), torch.tensor([0, 5, 2]),
                                torch.tensor([4, 1, 0]), 1, None, "auto", order())),
        ("send", lambda: (_t(16), 1, None, None, order())),
        ("recv", lambda: (torch.zeros(16), 1, None, 2.5, order())),
        ("sendrecv", lambda: (_t(16), 1, torch.zeros(16), 1, None, None, order())),
        # Activations in training require grad: what is sent carries none (as with NCCL).
        ("put", lambda: (torch.zeros(8), _t(8).requires_grad_(), 1, None, "auto", order())),
        ("sendrecv", lambda: (_t(16).requires_grad_(), 1, torch.zeros(16), 1, None, None, order())),
    ]


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")

EXPECTED_SCHEMAS = {
    "put": "pydatacopy::put(Tensor(a!) dst, Tensor src, int pe, int? stream, str path, Tensor(b!) order) -> ()",
    "quiet": "pydatacopy::quiet(int? stream, Tensor(a!) order) -> ()",
    "barrier": ("pydatacopy::barrier(Tensor(a!)[] received, int? stream, float? timeout, "
                "Tensor(b!) order) -> ()"),
    "send": "pydatacopy::send(Tensor tensor, int dst_pe, int? stream, float? timeout, Tensor(a!) order) -> ()",
    "wait": ("pydatacopy::wait(int manager, Tensor(a!)[] recv_buffers, int? stream, float? timeout, "
             "Tensor(b!) order) -> Tensor"),
}


# ---- registrations ----------------------------------------------------------------------------

def test_every_stream_ordered_call_has_an_op():
    assert sorted(_ops.OPS) == sorted(
        ["put", "get", "put_signal", "signal_set", "signal_wait", "quiet", "barrier", "put_many",
         "put_blocks", "send", "recv", "sendrecv", "exchange", "wait", "put_many_prepared"])
    for name, op in _ops.OPS.items():
        assert op is getattr(torch.ops.pydatacopy, name).default
        assert str(op._schema) == f"pydatacopy::{name}{_ops.SCHEMAS[name]}"


@pytest.mark.parametrize("name", sorted(EXPECTED_SCHEMAS))
def test_schemas(name):
    assert str(_ops.OPS[name]._schema) == EXPECTED_SCHEMAS[name]


def test_every_op_writes_the_ordering_tensor_and_what_it_changes():
    """Every op declares `order` written (program order, never dead code); the tensors each one
    writes, here or at a peer, are declared too."""
    writes = {
        "put": {"dst"}, "get": {"dst"}, "put_signal": {"dst", "signal"}, "signal_set": {"signal"},
        "signal_wait": {"signal", "received"}, "quiet": set(), "barrier": {"received"},
        "put_many": {"dsts"}, "put_blocks": {"dst_pool"}, "send": set(), "recv": {"tensor"},
        "sendrecv": {"recv_tensor"}, "exchange": {"recv_buffers"}, "wait": {"recv_buffers"},
        "put_many_prepared": {"dsts"},
    }
    for name, op in _ops.OPS.items():
        written = {arg.name for arg in op._schema.arguments
                   if arg.alias_info is not None and arg.alias_info.is_write}
        assert written == writes[name] | {"order"}, name


@pytest.mark.parametrize("name,make_args", _op_cases(),
                         ids=[f"{case[0]}-{number}" for number, case in enumerate(_op_cases())])
def test_opcheck(loopback, name, make_args):
    torch.library.opcheck(_ops.OPS[name], make_args(), test_utils=OPCHECK_TESTS)


def test_opcheck_token_exchange(loopback):
    send = [_t(4, 8, dtype=torch.uint8, seed=1), _t(4, 8, dtype=torch.uint8, seed=2)]
    recv = [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8)]
    number = _ops.register_object(manager := LoopbackManager(send, recv))
    order = torch.zeros(1, dtype=torch.uint8)
    torch.library.opcheck(_ops.OPS["exchange"], (number, send, recv, None, None, None, None, order),
                          test_utils=OPCHECK_TESTS)
    torch.library.opcheck(_ops.OPS["wait"], (number, recv, None, 3.0, order), test_utils=OPCHECK_TESTS)
    assert manager.calls  # the real kernels ran


class LoopbackPrepared:
    """A prepared put_many on the CPU: run() copies the rows (what PreparedPutMany.run moves)."""

    def __init__(self, dsts, srcs):
        self.dsts, self.srcs, self.runs = dsts, srcs, []

    def run(self, *, stream=None):
        self.runs.append(stream)
        for dst, src in zip(self.dsts, self.srcs):
            dst.copy_(src)


def test_opcheck_prepared_put_many(loopback):
    dsts, srcs = [torch.zeros(4), torch.zeros(2, 3)], [_t(4), _t(2, 3, seed=1)]
    prepared = LoopbackPrepared(dsts, srcs)
    number = _ops.register_object(prepared)
    torch.library.opcheck(_ops.OPS["put_many_prepared"],
                          (number, dsts, srcs, None, torch.zeros(1, dtype=torch.uint8)),
                          test_utils=OPCHECK_TESTS)
    assert prepared.runs


def test_compile_prepared_put_many(loopback):
    """The traced form a PreparedPutMany.run() takes (the class hooks it in: see ops/traced.py)."""
    dsts, srcs = [torch.zeros(4), torch.zeros(3)], [torch.arange(4.0), torch.ones(3)]
    prepared = LoopbackPrepared(dsts, srcs)
    number = _ops.register_object(prepared)

    def step(x):
        srcs[0].mul_(2)
        _ops.put_many_prepared(prepared, number, dsts, srcs, stream=5)
        return dsts[0] + dsts[1].sum() + x

    got = torch.compile(step, fullgraph=True)(torch.zeros(4))
    assert torch.equal(got, torch.arange(4.0) * 2 + 3) and prepared.runs == [5]


# ---- eager: no op, no change ------------------------------------------------------------------

class _FakeCore(types.SimpleNamespace):
    """_C for the eager path on the CPU: every call is logged, nothing runs."""

    def __init__(self):
        super().__init__(calls=[])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            return {"is_initialized": True, "cuda_device": -1, "is_symmetric": True,
                    "n_pes": 2, "my_pe": 0, "default_timeout_seconds": 60.0}.get(name)
        return call


@pytest.fixture
def eager_core(monkeypatch):
    core = _FakeCore()
    monkeypatch.setattr(_transfer, "_C", core)
    monkeypatch.setattr(_torch_utils, "_C", core)
    monkeypatch.setattr(_transfer, "_stream", lambda stream: 0)  # no CUDA here
    # The checked path (the host fast path would ask torch for CUDA streams, which need a GPU).
    monkeypatch.setattr(_torch_utils, "bind", lambda: None)
    for module in (_transfer, _torch_utils):
        monkeypatch.setattr(module, "_device", None)
        monkeypatch.setattr(module, "_n_pes", 0)
    for name in _ops.OPS:
        if hasattr(_ops, name):
            monkeypatch.setattr(_ops, name, lambda *a, **k: pytest.fail("eager call took the op"))
    return core


def test_eager_calls_go_to_the_core_not_the_ops(eager_core):
    dst, src, signal = torch.zeros(8), torch.ones(8), torch.zeros(1, dtype=torch.int64)
    pydatacopy.put(dst, src, 1)
    pydatacopy.get(dst, src, 1)
    pydatacopy.put_signal(dst, src, 1, signal, 3)
    pydatacopy.signal_set(signal, 3, 1)
    pydatacopy.signal_wait(signal, 3)
    pydatacopy.quiet()
    pydatacopy.barrier()
    pydatacopy.put_blocks(torch.zeros(4, 2), torch.ones(4, 2), torch.tensor([0]), torch.tensor([1]), 1)
    assert eager_core.calls.count("put") == 1 and "barrier" in eager_core.calls
    assert "put_blocks" in eager_core.calls


# ---- tracing ------------------------------------------------------------------------------------

def _step(x, dst, peer_in, signal, api=pydatacopy):
    """Compute, put, signal, receive, compute again: the shape of a model's step. `api`: the
    loopback itself for the eager result (eager pydatacopy calls go to _C, not to the ops)."""
    y = torch.sin(x) * 2
    api.put(dst, y, 1)
    api.quiet()
    api.barrier(received=[dst])
    got = torch.empty_like(y)
    api.sendrecv(y, 1, got, 1)
    api.put_signal(dst, y, 1, signal, U64_MAX)
    api.signal_wait(signal, U64_MAX, received=[dst])
    api.send(y, 1)
    api.recv(peer_in, 1)
    return got + dst * 3 + peer_in


STEP_CALLS = ["put", "quiet", "barrier", "sendrecv", "put_signal", "signal_wait", "send", "recv"]


def _inputs():
    return _t(16, seed=3), torch.zeros(16), torch.zeros(16), torch.zeros(1, dtype=torch.int64)


def _pydatacopy_nodes(graph_module) -> list[str]:
    names = []
    for node in graph_module.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "pydatacopy":
            names.append(target._opname)
        elif "auto_functionalized" in str(target) and node.args:
            names.append(node.args[0]._opname)
    return names


def test_make_fx_records_the_ops_in_order(loopback):
    graph = make_fx(lambda x, dst, peer_in, signal: _step(x, dst, peer_in, signal))(*_inputs())
    assert _pydatacopy_nodes(graph) == STEP_CALLS
    assert loopback.names() == STEP_CALLS  # real tracing ran the kernels once, in order


def test_make_fx_fake_mode_runs_no_kernel(loopback):
    graph = make_fx(lambda x, dst, peer_in, signal: _step(x, dst, peer_in, signal), tracing_mode="fake",
                    _allow_non_fake_inputs=True)(*_inputs())
    assert _pydatacopy_nodes(graph) == STEP_CALLS
    assert loopback.calls == []


def test_fake_tensor_mode_runs_no_kernel(loopback):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x, dst, peer_in, signal = (mode.from_tensor(t) for t in _inputs())
        out = _step(x, dst, peer_in, signal)
    assert out.shape == (16,) and loopback.calls == []


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"_C.{name} was reached while tracing or running a traced call")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(loopback, backend, monkeypatch):
    """aot_eager runs each op on copies of the tensors it writes (functionalization), which a
    real put cannot use (a copy is not symmetric): on the GPU only "eager" and inductor run.
    Here the loopback does not care, so the bytes and the order are checked; _C is never
    reached (tracing runs the fake kernels only)."""
    for module in (_transfer, pydatacopy.rma.prepared_put_many, _send_recv, _symmetric, _torch_utils,
                   pydatacopy.runtime.startup, pydatacopy.runtime.agreement, pydatacopy.runtime.placement,
                   pydatacopy.runtime.unique_id, pydatacopy.token_exchange.double_buffer):
        monkeypatch.setattr(module, "_C", _Untouchable())
    expected = _step(*_inputs(), api=loopback)
    eager_calls = list(loopback.calls)
    loopback.calls.clear()
    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    got = compiled(*_inputs())
    assert torch.equal(got, expected)
    assert loopback.calls == eager_calls
    # The stream goes through as None (resolved when the op runs), the signal value's 64 bits too.
    assert ("put_signal", 1, U64_MAX, None) in loopback.calls


def test_compile_inductor_keeps_every_call_in_order(loopback):
    """Inductor drops ops that write nothing and may reorder independent ones: the ordering
    tensor keeps quiet/barrier/send (which write no tensor of the caller's) and their order."""
    pytest.importorskip("torch._inductor")
    expected = _step(*_inputs(), api=loopback)
    eager_calls = list(loopback.calls)
    loopback.calls.clear()
    try:
        compiled = torch.compile(_step, fullgraph=True)
        got = compiled(*_inputs())
    except Exception as error:  # no C++ compiler for inductor's CPU code: say so, do not hide it
        if "compiler" in str(error).lower() and "pydatacopy" not in str(error):
            pytest.skip(f"inductor cannot build CPU code here: {error}")
        raise
    assert torch.equal(got, expected)
    assert loopback.calls == eager_calls


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_puts_write_the_callers_tensors_in_place(loopback, backend):
    """A put's destination and a signal must be the caller's symmetric tensors themselves, not
    copies: a copy is not symmetric (the core refuses it) and the peer would never see it.
    Functionalization copies what an op writes; inductor's reinplacing undoes that (aot_eager
    does not: see test_compile_fullgraph_matches_eager). A slice keeps its offset."""
    def step(x, sym, signal):
        pydatacopy.put(sym[2:10], x[:8] + 1, 1)
        pydatacopy.put_signal(sym, x, 1, signal, 5)
        return sym * 2

    sym, signal = torch.zeros(16), torch.zeros(1, dtype=torch.int64)
    try:
        torch.compile(step, backend=backend, fullgraph=True)(_t(16), sym, signal)
    except Exception as error:  # as in test_compile_inductor_keeps_every_call_in_order
        if "compiler" in str(error).lower() and "pydatacopy" not in str(error):
            pytest.skip(f"inductor cannot build CPU code here: {error}")
        raise
    assert loopback.addresses == [sym.data_ptr() + 2 * 4, sym.data_ptr(), signal.data_ptr()]


def test_compile_with_raw_stream_and_put_many_and_blocks(loopback):
    def step(a, b, pool, src_pool, index, api=pydatacopy):
        api.put_many([a, b], [a + 1, b * 2], 1, stream=77)
        api.put_blocks(pool, src_pool, index, index.flip(0), 1, path="sm")
        api.get(a, b, 1, stream=78, path="rma")
        return a.sum() + pool.sum()

    def inputs():
        return torch.ones(4), torch.arange(4.0), torch.zeros(3, 2), _t(3, 2), torch.tensor([0, 2, 1])

    expected = step(*inputs(), api=loopback)
    eager_calls = list(loopback.calls)
    loopback.calls.clear()
    got = torch.compile(step, backend="eager", fullgraph=True)(*inputs())
    assert torch.equal(got, expected) and loopback.calls == eager_calls
    assert ("put_many", 2, 1, 77, "auto") in loopback.calls
    assert ("get", 1, 78, "rma") in loopback.calls


def test_changing_signal_values_do_not_recompile_every_call(loopback):
    """A round number as the signal value: symbolic after the second value (SymInt in the
    schemas), so one recompile, not one per value (Dynamo gives up after 8)."""
    from torch._dynamo.utils import counters

    def step(x, sym, signal, value):
        pydatacopy.put_signal(sym, x, 1, signal, value)
        pydatacopy.signal_wait(signal, value, received=[sym])
        pydatacopy.signal_set(signal, value, 1)
        return sym + 1

    counters.clear()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for value in range(1, 7):
        compiled(torch.ones(3), torch.zeros(3), torch.zeros(1, dtype=torch.int64), value)
    assert counters["stats"]["unique_graphs"] <= 2
    assert [call[2] for call in loopback.calls if call[0] == "put_signal"] == list(range(1, 7))


def test_compile_token_exchange(loopback):
    manager = pydatacopy.DoubleBufferManager()
    send = [_t(4, 8, dtype=torch.uint8, seed=5), _t(4, 8, dtype=torch.uint8, seed=6)]
    recv = [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8)]
    manager._send, manager._recv = send, recv
    fake = LoopbackManager(send, recv)
    _ops.kernels._objects[manager._op_number] = fake

    def step(manager):
        r = manager.exchange()
        return manager.wait(r).float().sum()

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for round_ in range(3):  # the set alternates when the compiled code runs, not when traced
        assert float(compiled(manager)) == float(send[round_ % 2].float().sum())
    assert [call[0] for call in fake.calls] == ["exchange", "wait"] * 3


def test_my_pe_and_n_pes_are_constants_when_compiled(loopback, monkeypatch):
    """`peer = (my_pe() + 1) % n_pes()` inside a compiled function: no graph break."""
    from pydatacopy.runtime import startup as _startup

    core = types.SimpleNamespace(is_initialized=lambda: True, my_pe=lambda: 2, n_pes=lambda: 4)
    monkeypatch.setattr(_startup, "_C", core)
    monkeypatch.setattr(_transfer, "_C", core)
    monkeypatch.setattr(_torch_utils, "_C", core)
    monkeypatch.setattr(_torch_utils, "bind", lambda: None)  # the host fast path's cache: not here

    def step(x, dst):
        pydatacopy.put(dst, x, (pydatacopy.my_pe() + 1) % pydatacopy.n_pes())
        return dst + 1

    torch.compile(step, backend="eager", fullgraph=True)(torch.ones(2), torch.zeros(2))
    assert loopback.calls == [("put", 3, None, "auto")]


# ---- refusals -----------------------------------------------------------------------------------

def _blocking_calls():
    return {
        "empty": lambda x: pydatacopy.empty(4),
        "free": lambda x: pydatacopy.free(x),
        "setup_send_recv": lambda x: pydatacopy.setup_send_recv(),
        "init": lambda x: pydatacopy.init(),
        "init_nvshmem": lambda x: pydatacopy.init_nvshmem([0] * 128, 0, 1),
        "finalize": lambda x: pydatacopy.finalize(),
        "barrier(blocking=True)": lambda x: pydatacopy.barrier(blocking=True),
        "signal_wait(blocking=True)": lambda x: pydatacopy.signal_wait(x, 1, blocking=True),
        "group": lambda x: pydatacopy.group().__enter__(),
    }


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("what", sorted(_blocking_calls()))
def test_blocking_calls_refuse_compile(loopback, what, fullgraph):
    """A clear pydatacopy.Error, also without fullgraph (a graph break would run the call eagerly
    mid-graph, where one PE could block alone)."""
    call = _blocking_calls()[what]

    def step(x):
        y = x + 1
        call(x)
        return y * 2

    with pytest.raises(pydatacopy.Error, match=r"cannot be (part of a )?traced|cannot be traced"):
        torch.compile(step, backend="eager", fullgraph=fullgraph)(torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("what", sorted(_blocking_calls()))
def test_blocking_calls_refuse_make_fx(loopback, what):
    call = _blocking_calls()[what]
    with pytest.raises(pydatacopy.Error, match=r"cannot be (part of a )?traced|cannot be traced"):
        make_fx(lambda x: call(x))(torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("what", ["init", "cleanup", "test_bandwidth", "wait(blocking=True)"])
def test_token_exchange_blocking_calls_refuse_compile(loopback, what):
    manager = pydatacopy.DoubleBufferManager()
    manager._send = manager._recv = [torch.zeros(2, 2, dtype=torch.uint8)] * 2
    calls = {"init": lambda: manager.init(4, 8), "cleanup": manager.cleanup,
             "test_bandwidth": lambda: manager.test_bandwidth(0, 2),
             "wait(blocking=True)": lambda: manager.wait(blocking=True)}

    def step(x):
        calls[what]()
        return x + 1

    with pytest.raises(pydatacopy.Error, match="cannot be part of a traced"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(1))


def test_traced_wait_refuses_a_round_number(loopback):
    manager = pydatacopy.DoubleBufferManager()
    manager._send = manager._recv = [torch.zeros(2, 2, dtype=torch.uint8)] * 2

    def step(x):
        return manager.wait(0).float() + x

    with pytest.raises(pydatacopy.Error, match="without a round"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(1))


def test_tracing_before_init_is_refused(loopback, monkeypatch):
    monkeypatch.setattr(_ops.traced, "_order", None)

    def step(x):
        pydatacopy.quiet()
        return x + 1

    with pytest.raises(pydatacopy.Error, match=r"before pydatacopy.init\(\)"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(1))
    with pytest.raises(pydatacopy.Error, match=r"before pydatacopy.init\(\)"):
        make_fx(step)(torch.zeros(1))


def test_user_dispatch_mode_still_runs_the_call(loopback):
    """A dispatch mode that is not tracing (a logger) sees the op, and the call still runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    dst = torch.zeros(4)
    with Log():
        pydatacopy.put(dst, torch.ones(4), 1)
        pydatacopy.barrier(blocking=True)  # not traced: runs eagerly (the blocking form)
    assert any("pydatacopy.put" in name for name in seen)
    assert torch.equal(dst, torch.ones(4))
    assert loopback.names() == ["put", "barrier"] and loopback.calls[-1][-1] is True
