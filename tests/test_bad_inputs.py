"""Bad inputs that need no GPU, as one table: each must raise pydatacopy.Error (or its
TimeoutError subclass) with the words that tell the user what to do - no crash, no hang, no
state left behind. The GPU-side ones (wrong device, non-symmetric, size/dtype mismatch on live
tensors, unwaited rounds, bad block indices...) are in tests/gpu.

Environment values NVSHMEM would crash on (NVSHMEM 3.4.5 segfaults on NVSHMEM_SYMMETRIC_SIZE=lots)
run in fresh processes, so that a check that stops working shows as a failed row, not a dead
pytest. The bad options of the doctor and the bench are a second table: argparse's exit code 2
and one line that says what to write."""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import pydatacopy
from pydatacopy import _C, _torch_utils, bench, doctor
from pydatacopy.runtime import network as _network
from pydatacopy.runtime import probes as _probes
from pydatacopy.runtime import settings as _settings
from pydatacopy.rma import symmetric as _symmetric
from pydatacopy.rma import transfer as _transfer

UID = pydatacopy.get_unique_id()
NO_GPU = torch.cuda.device_count() == 0
NEEDS_INIT = "needs NVSHMEM: call pydatacopy.init() (or pydatacopy.init_nvshmem()) first"
SIZE_HOWTO = "write a byte count with an optional k, M, G or T suffix, e.g. 2G"
DBM = pydatacopy.DoubleBufferManager


def _env_call(settings: dict[str, str], call):
    """`call` with environment variables set for its duration (checked before the core reads them)."""
    def run():
        with pytest.MonkeyPatch.context() as m:
            for name, value in settings.items():
                m.setenv(name, value)
            call()
    return run




# ---- calls in fresh processes ----------------------------------------------------------------
# One helper process imports pydatacopy (without starting NVSHMEM) and forks a child per case:
# each child sets its environment, makes the call and reports; a crash ends only that child.

_FORK_SERVER = r"""
import json, os, sys
import pydatacopy
from pydatacopy import _C
cases = json.load(sys.stdin)
results = []
for case in cases:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        for name, value in case["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            eval(case["call"], {"pydatacopy": pydatacopy, "_C": _C})
            report = {"type": None, "message": ""}
        except pydatacopy.Error as error:
            report = {"type": type(error).__name__, "message": str(error)}
        except BaseException as error:
            report = {"type": "other " + type(error).__name__, "message": str(error)}
        with os.fdopen(write_end, "w") as f:
            json.dump(report, f)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    report = json.loads(text) if text else {"type": "crash", "message": ""}
    report["status"] = status
    results.append(report)
json.dump(results, sys.stdout)
"""

_FRESH_CASES: list[tuple[str, dict[str, str | None]]] = []
_fresh_results: dict[int, dict] = {}


def in_fresh_process(call: str, **env: str | None) -> int:
    """Register `call` (Python source) to run in a fresh process with `env`; returns its key."""
    _FRESH_CASES.append((call, env))
    return len(_FRESH_CASES) - 1


def fresh_result(key: int) -> dict:
    """{"type", "message", "status"} of a registered case (all run together, the first time)."""
    if not _fresh_results:
        cases = [{"call": call, "env": env} for call, env in _FRESH_CASES]
        done = subprocess.run([sys.executable, "-c", _FORK_SERVER], input=json.dumps(cases),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        _fresh_results.update(enumerate(json.loads(done.stdout)))
    return _fresh_results[key]


def _fresh(call: str, **env: str | None):
    """A row's callable: raises in this process what the fresh process raised; a crash (NVSHMEM
    ended the process) or an exception of another type fails the row."""
    key = in_fresh_process(call, **env)

    def run():
        result = fresh_result(key)
        assert result["status"] == 0 and result["type"] != "crash", \
            f"the process died (wait status {result['status']}: 139/11 = segfault)"
        assert result["type"] is None or result["type"] in ("Error", "TimeoutError"), result
        if result["type"] == "TimeoutError":
            raise pydatacopy.TimeoutError(result["message"])
        if result["type"] == "Error":
            raise pydatacopy.Error(result["message"])
    return run


def _uid_with(**env: str | None):
    return _fresh("pydatacopy.get_unique_id()", **env)


ALL_INTERFACES = ",".join(name for _, name in socket.if_nameindex())

# ---- before init: every public call names itself ---------------------------------------------
# Plausible arguments for every public callable that needs NVSHMEM; test_every_public_name_...
# checks that this and WORKS_BEFORE_INIT together cover pydatacopy.__all__.
_t = torch.zeros(4)
_i = torch.zeros(1, dtype=torch.int64)
NEEDS_INIT_ARGS = {
    "AllToAll": ((4, 16), {}),
    "MoeDispatcher": ((8, 16, 2, 4), {}),
    "all_to_all_v": ((_t, _i, None), {}),
    "barrier": ((), {}),
    "empty": ((16,), {}),
    "free": ((_t,), {}),
    "get": ((_t, _t, 0), {}),
    "my_pe": ((), {}),
    "n_pes": ((), {}),
    "peer_view": ((_t, 0), {}),
    "prepare_put_many": (([_t], [_t], 0), {}),
    "PreparedPutMany": (([_t], [_t], 0), {}),
    "put": ((_t, _t, 0), {}),
    "put_blocks": ((_t, _t, _i, _i, 0), {}),
    "put_many": (([_t], [_t], 0), {}),
    "put_signal": ((_t, _t, 0, _i, 1), {}),
    "quiet": ((), {}),
    "recv": ((_t, 0), {}),
    "register": ((_t,), {}),
    "send": ((_t, 0), {}),
    "sendrecv": ((_t, 0, _t, 0), {}),
    "stats": ((), {}),
    "setup_send_recv": ((), {}),
    "signal_set": ((_i, 1, 0), {}),
    "signal_wait": ((_i, 1), {}),
    "unregister": ((_t,), {}),
    "is_registered": ((_t,), {}),
}
DBM_NEEDS_INIT = {  # DoubleBufferManager methods that need its init(n_tokens, token_size)
    "exchange": ((), {}),
    "recv_buffer": ((0,), {}),
    "send_buffer_of": ((0,), {}),
    "test_bandwidth": ((0, 1), {}),
    "wait": ((0,), {}),
}


def _call_public(name):
    args, kwargs = NEEDS_INIT_ARGS[name]
    return lambda: getattr(pydatacopy, name)(*args, **kwargs)


def _call_dbm(name):
    args, kwargs = DBM_NEEDS_INIT[name]
    return lambda: getattr(DBM(), name)(*args, **kwargs)


BAD_INPUTS = [
    # the unique ID
    ("id: 127 bytes", lambda: pydatacopy.init_nvshmem(b"\x01" * 127, 0, 1),
     "pydatacopy.init_nvshmem: root_unique_id must be 128 bytes (pass what pydatacopy.get_unique_id() returned"),
    ("id: 129 ints", lambda: pydatacopy.init_nvshmem(list(range(129)), 0, 1), "must be 128 bytes (pass what"),
    ("id: empty", lambda: pydatacopy.init_nvshmem([], 0, 1), "must be 128 bytes (pass what"),
    ("id: int above 255", lambda: pydatacopy.init_nvshmem([256] * 128, 0, 1),
     "must hold ints in [0, 255] (pass what pydatacopy.get_unique_id() returned on rank 0)"),
    ("id: negative int", lambda: pydatacopy.init_nvshmem([-1] * 128, 0, 1), "must hold ints in [0, 255]"),
    ("id: bools", lambda: pydatacopy.init_nvshmem([True] * 128, 0, 1), "must hold ints in [0, 255]"),
    ("id: str", lambda: pydatacopy.init_nvshmem("x" * 128, 0, 1),
     "root_unique_id must be bytes, bytearray, a list of ints or a uint8 tensor"),
    ("id: None", lambda: pydatacopy.init_nvshmem(None, 0, 1), "a list of ints or a uint8 tensor"),
    ("id: int32 tensor", lambda: pydatacopy.init_nvshmem(torch.zeros(128, dtype=torch.int32), 0, 1),
     "a unique ID tensor must be uint8"),
    ("id: short uint8 tensor", lambda: pydatacopy.init_nvshmem(torch.ones(64, dtype=torch.uint8), 0, 1),
     "must be 128 bytes (pass what"),
    ("core: id all zeros (corrupted)", lambda: _C.init_nvshmem([0] * 128, 0, 1, -1, 10.0),
     "is all zeros: pass the ID that get_unique_id() made on rank 0"),
    ("core: id of the wrong length", lambda: _C.init_nvshmem([1] * 100, 0, 1, -1, 10.0),
     "must be the 128 bytes from get_unique_id()"),
    # rank, world size
    ("world size 0", lambda: pydatacopy.init_nvshmem(UID, 0, 0), "pydatacopy.init_nvshmem: world_size must be at least 1"),
    ("world size 2**64", lambda: pydatacopy.init_nvshmem(UID, 0, 2**64),
     "pydatacopy.init_nvshmem: world_size must be at most 2147483647"),
    ("rank 2**40", lambda: pydatacopy.init_nvshmem(UID, 2**40, 2**31 - 1), "rank must be at most 2147483647"),
    ("negative rank", lambda: pydatacopy.init_nvshmem(UID, -1, 2), "pydatacopy.init_nvshmem: rank must be at least 0"),
    ("rank == world size", lambda: pydatacopy.init_nvshmem(UID, 2, 2), "rank must be in [0, world_size=2)"),
    ("rank > world size", lambda: pydatacopy.init_nvshmem(UID, 7, 2), "rank must be in [0, world_size=2)"),
    ("float rank", lambda: pydatacopy.init_nvshmem(UID, 0.0, 2), "pydatacopy.init_nvshmem: rank must be an int"),
    ("str world size", lambda: pydatacopy.init_nvshmem(UID, 0, "2"), "world_size must be an int, got str"),
    ("core: rank out of range", lambda: _C.init_nvshmem(UID, 3, 2, -1, 10.0), "rank must be in [0, world_size=2)"),
    ("choose_device: negative rank", lambda: pydatacopy.choose_device(-1),
     "pydatacopy.choose_device: rank must be at least 0"),
    # the device
    ("negative device", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device=-1),
     "pydatacopy.init_nvshmem: device must be at least 0"),
    ("device '0'", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device="0"),
     "device='0' is not a CUDA device: pass an index (0), 'cuda:0' or torch.device('cuda', 0)"),
    ("device 'cpu'", lambda: pydatacopy.init(device="cpu"), "pydatacopy.init: device='cpu' is not a CUDA device"),
    ("device torch.device('cpu')", lambda: pydatacopy.init(device=torch.device("cpu")),
     "device='cpu' is not a CUDA device: pydatacopy moves GPU memory"),
    ("device 'gpu0'", lambda: pydatacopy.init(device="gpu0"), "device='gpu0' is not a CUDA device"),
    ("device float", lambda: pydatacopy.init(device=1.0),
     "pydatacopy.init: device must be an int, a 'cuda:N' string or a torch.device"),
    # timeouts
    ("init timeout zero", lambda: pydatacopy.init_nvshmem(UID, 0, 1, timeout=0),
     "pydatacopy.init_nvshmem: timeout must be a positive number of seconds"),
    ("init timeout negative", lambda: pydatacopy.init_nvshmem(UID, 0, 1, timeout=-5.0),
     "timeout must be a positive number of seconds"),
    ("init timeout infinite", lambda: pydatacopy.init(timeout=float("inf")),
     "pydatacopy.init: timeout must be a positive number of seconds, at most 1e+09"),
    ("init timeout nan", lambda: pydatacopy.init(timeout=float("nan")), "pydatacopy.init: timeout must be a positive"),
    ("timeout bool", lambda: _torch_utils.timeout_seconds(True), "(None for the default), got True"),
    ("timeout str", lambda: _torch_utils.timeout_seconds("5"), "timeout must be a positive number of seconds"),
    ("core: PYDATACOPY_TIMEOUT_S not a number", _env_call({"PYDATACOPY_TIMEOUT_S": "soon"}, _C.default_timeout_seconds),
     "PYDATACOPY_TIMEOUT_S must be a positive number of seconds, got 'soon'"),
    ("stream of the wrong type", lambda: _torch_utils.stream_handle("stream", 0),
     "stream must be a torch.cuda.Stream, a raw cudaStream_t int or None"),
    # start-up without torch.distributed
    ("init() without torch.distributed", lambda: pydatacopy.init(),
     "pydatacopy.init needs torch.distributed: call torch.distributed.init_process_group() first"),
    ("share_unique_id() without torch.distributed", lambda: pydatacopy.share_unique_id(),
     "pydatacopy.share_unique_id needs torch.distributed: call torch.distributed.init_process_group()"),
    # DoubleBufferManager sizes and order
    ("n_tokens 0", lambda: DBM().init(0, 16), "pydatacopy.DoubleBufferManager.init: n_tokens must be at least 1"),
    ("n_tokens negative", lambda: DBM().init(-1, 16), "n_tokens must be at least 1, got -1"),
    ("n_tokens 2**64", lambda: DBM().init(2**64, 16),
     "pydatacopy.DoubleBufferManager.init: n_tokens must be at most 2147483647"),
    ("token_size 0", lambda: DBM().init(4, 0), "DoubleBufferManager.init: token_size must be at least 1"),
    ("token_size negative", lambda: DBM().init(4, -8), "token_size must be at least 1, got -8"),
    ("token_size 2**64", lambda: DBM().init(16, 2**64), "token_size must be at most 1099511627776"),
    ("buffer over 1 TiB", lambda: DBM().init(2**20, 2**21), "is larger than 1 TiB per buffer; use fewer or smaller tokens"),
    ("n_tokens float", lambda: DBM().init(2.5, 16), "n_tokens must be an int, got float"),
    ("token_size str", lambda: DBM().init(4, "16"), "token_size must be an int, got str"),
    ("n_tokens bool", lambda: DBM().init(True, 16), "n_tokens must be an int, got bool"),
    ("DBM init before pydatacopy.init", lambda: DBM().init(4, 16), f"pydatacopy.DoubleBufferManager.init {NEEDS_INIT}"),
    ("DBM send_buffer before its init", lambda: DBM().send_buffer,
     "pydatacopy.DoubleBufferManager.send_buffer: call init(n_tokens, token_size) first"),
    ("test_bandwidth negative rank", lambda: DBM().test_bandwidth(-1, 1),
     "pydatacopy.DoubleBufferManager.test_bandwidth: rank must be at least 0"),
    ("core: DBM init before init", lambda: _C.DoubleBufferManager().init(0, 0),
     "DoubleBufferManager.init needs NVSHMEM: call pydatacopy.init()"),
    # paths
    ("core: unknown path number", lambda: _C.put(0, 0, 16, 0, 0, 7), "path must be one of auto, copy_engine, sm, rma"),
    ("core: put_fast, unknown path number", lambda: _C.put_fast(0, 0, 16, 0, 0, 7),
     "path must be one of auto, copy_engine, sm, rma"),
    ("core: put_fast before init", lambda: _C.put_fast(0, 0, 16, 0, 0, 0), "put needs NVSHMEM: call pydatacopy.init()"),
    ("core: get_fast before init", lambda: _C.get_fast(0, 0, 16, 0, 0, 0), "get needs NVSHMEM: call pydatacopy.init()"),
    ("core: copy engine to an unreachable peer", lambda: _C.resolve_path(1, False, 4096),
     "needs a directly reachable peer (nvshmem_ptr), and this one is not"),
    ("unknown path name", lambda: _transfer._path("warp"), "path must be one of ['auto', 'copy_engine', 'rma', 'sm']"),
    # the core's own before-init checks
    ("core: barrier before init", lambda: _C.barrier(0, 1.0), "barrier needs NVSHMEM: call pydatacopy.init()"),
    ("core: blocking barrier before init", lambda: _C.barrier_all_blocking("test", 1.0), "test needs NVSHMEM: call pydatacopy.init()"),
    ("core: symmetric_malloc before init", lambda: _C.symmetric_malloc(16), "symmetric_malloc needs NVSHMEM: call pydatacopy.init()"),
    ("core: engine before init", lambda: _C.SendRecvEngine().init(1 << 20, 4, 8), "SendRecvEngine.init needs NVSHMEM: call"),
    ("core: put_blocks before init", lambda: _C.put_blocks(0, 1, 0, 1, 16, 0, 0, 1, 0, 0, 0), "put_blocks needs NVSHMEM: call"),
    ("core: signal_wait before init", lambda: _C.signal_wait(0, 1, 0, 1.0), "signal_wait needs NVSHMEM: call"),
    # put_many's rows, read and checked in one native pass before the core is called
    ("core: put_many before init", lambda: _C.put_many_tensors([], [], 0, 0, 0, 0, torch.Tensor),
     "put_many needs NVSHMEM: call"),
    ("put_many of empty lists before init", lambda: pydatacopy.put_many([], [], 0),
     "pydatacopy.put_many needs NVSHMEM: call"),
    ("core: put_many row not a tensor", lambda: _C.put_many_tensors([3], [_t], 0, 0, 0, 0, torch.Tensor),
     "pydatacopy.put_many: dsts[0] must be a torch.Tensor, got int"),
    ("core: put_many lists not sequences", lambda: _C.put_many_tensors(5, [], 0, 0, 0, 0, torch.Tensor),
     "pydatacopy.put_many: dsts must be a list or tuple of tensors, got int"),
    ("core: put_many lists of unequal length", lambda: _C.put_many_tensors([_t, _t], (_t,), 0, 0, 0, 0, torch.Tensor),
     "pydatacopy.put_many: 2 destinations but 1 sources; pass one source per destination"),
    ("core: put_many CPU source", lambda: _C.put_many_tensors([_t], [_t], 0, 0, 0, 0, torch.Tensor),
     "pydatacopy.put_many: srcs[0] is not on a CUDA device; pydatacopy moves CUDA tensors: use .cuda() first"),
    ("core: put_many strided row", lambda: _C.put_many_tensors([torch.zeros(4, 4).t()], [_t], 0, 0, 0, 0, torch.Tensor),
     "pydatacopy.put_many: dsts[0] must be contiguous (call .contiguous() first)"),
    ("core: put_many unknown path", lambda: _C.put_many_tensors([], [], 0, 0, 7, 0, torch.Tensor),
     "path must be one of auto, copy_engine, sm, rma"),
    # put_many prepared once: the same native row pass, naming the call that prepares
    ("from_addresses before init", lambda: pydatacopy.PreparedPutMany.from_addresses(_i, _i, _i, 0),
     "pydatacopy.PreparedPutMany.from_addresses needs NVSHMEM: call"),
    ("core: prepared rows, CPU source", lambda: _C.PreparedPutMany.from_tensors(
        [_t], [_t], 0, 0, 0, torch.Tensor, "pydatacopy.prepare_put_many"),
     "pydatacopy.prepare_put_many: srcs[0] is not on a CUDA device; pydatacopy moves CUDA tensors"),
    ("core: prepared rows, not tensors", lambda: _C.PreparedPutMany.from_tensors(
        [_t], ["x"], 0, 0, -1, torch.Tensor, "pydatacopy.PreparedPutMany"),
     "pydatacopy.PreparedPutMany: srcs[0] must be a torch.Tensor, got str"),
    ("core: prepared rows, unequal lists", lambda: _C.PreparedPutMany.from_tensors(
        [_t, _t], [_t], 0, 0, -1, torch.Tensor, "pydatacopy.prepare_put_many"),
     "pydatacopy.prepare_put_many: 2 destinations but 1 sources; pass one source per destination"),
    ("core: prepared rows, dtype mismatch", lambda: _C.PreparedPutMany.from_tensors(
        [_t], [_t.view(torch.int32)], 0, 0, -1, torch.Tensor, "pydatacopy.prepare_put_many"),
     "pydatacopy.prepare_put_many: dtype mismatch in row 0"),
    ("core: prepared rows, size mismatch", lambda: _C.PreparedPutMany.from_tensors(
        [_t], [_t[:3]], 0, 0, -1, torch.Tensor, "pydatacopy.prepare_put_many"),
     "pydatacopy.prepare_put_many: size mismatch in row 0: dst has 16 bytes, src has 12; pass equal-sized tensors"),
    ("core: prepared rows before init", lambda: _C.PreparedPutMany.from_tensors(
        [_t], [_t], 0, 0, -1, torch.Tensor, "pydatacopy.prepare_put_many"),
     "pydatacopy.prepare_put_many needs NVSHMEM: call"),
    ("core: prepared rows, unknown path", lambda: _C.PreparedPutMany.from_tensors(
        [], [], 0, 9, -1, torch.Tensor, "pydatacopy.prepare_put_many"),
     "path must be one of auto, copy_engine, sm, rma"),
    ("core: prepared from addresses before init", lambda: _C.PreparedPutMany.from_addresses(0, 0, 0, 1, 0, 0, 0),
     "pydatacopy.PreparedPutMany.from_addresses needs NVSHMEM: call"),
    # pydatacopy's environment variables, checked by init_nvshmem before anything starts
    *[(f"{name}={value!r}", _env_call({name: value}, lambda: pydatacopy.init_nvshmem(UID, 0, 1)), words)
      for name, value, words in [
          ("PYDATACOPY_TIMEOUT_S", "soon", "pydatacopy.init_nvshmem: PYDATACOPY_TIMEOUT_S='soon' is not a positive "
                                           "number of seconds (at most 1e+09): set it to e.g. 60"),
          ("PYDATACOPY_TIMEOUT_S", "-1", "PYDATACOPY_TIMEOUT_S='-1' is not a positive number of seconds"),
          ("PYDATACOPY_TIMEOUT_S", "0", "PYDATACOPY_TIMEOUT_S='0' is not a positive number of seconds"),
          ("PYDATACOPY_TIMEOUT_S", "1e300", "PYDATACOPY_TIMEOUT_S='1e300' is not a positive number of seconds (at most"),
          ("PYDATACOPY_TIMEOUT_S", "inf", "PYDATACOPY_TIMEOUT_S='inf' is not a positive number of seconds"),
          ("PYDATACOPY_INIT_TIMEOUT_S", "later", "pydatacopy.init_nvshmem: PYDATACOPY_INIT_TIMEOUT_S must be a "
                                                 "positive number of seconds, got 'later'"),
          ("PYDATACOPY_INIT_TIMEOUT_S", "1e300", "PYDATACOPY_INIT_TIMEOUT_S='1e300' is not a positive number of "
                                                 "seconds (at most 1e+09): set it to e.g. 300"),
          ("PYDATACOPY_CHUNK_BYTES", "8M", "pydatacopy.init_nvshmem: PYDATACOPY_CHUNK_BYTES='8M' is not a whole "
                                           "number (bytes per send/recv staging chunk): set it to e.g. 8388608"),
          ("PYDATACOPY_CHUNK_BYTES", "0", "PYDATACOPY_CHUNK_BYTES=0 is out of range: bytes per send/recv staging "
                                          "chunk must be in [1, 1099511627776]"),
          ("PYDATACOPY_NUM_CHUNKS", "1", "PYDATACOPY_NUM_CHUNKS=1 is out of range: staging chunks per peer must "
                                         "be in [2, 2147483647]; set it to e.g. 4"),
          ("PYDATACOPY_NUM_CHUNKS", "two", "PYDATACOPY_NUM_CHUNKS='two' is not a whole number"),
          ("PYDATACOPY_NUM_CHUNKS", str(2**64), "PYDATACOPY_NUM_CHUNKS=18446744073709551616 is out of range"),
          ("PYDATACOPY_SEND_BLOCKS", "2048", "PYDATACOPY_SEND_BLOCKS=2048 is out of range: thread blocks per send "
                                             "or recv must be in [1, 1024]; set it to e.g. 128"),
          ("PYDATACOPY_SEND_BLOCKS", "0", "PYDATACOPY_SEND_BLOCKS=0 is out of range"),
          ("PYDATACOPY_FORCE_RMA", "yes", "PYDATACOPY_FORCE_RMA='yes' must be 1 (every transfer takes NVSHMEM's "
                                          "RMA path, a test switch) or 0 (or unset)"),
          ("PYDATACOPY_FORCE_RMA", "false", "PYDATACOPY_FORCE_RMA='false' must be 1"),
          ("PYDATACOPY_IBGDA", "true", "PYDATACOPY_IBGDA='true' must be 1 (turn on NVSHMEM's GPU-initiated "
                                       "InfiniBand transport) or 0 (or unset)"),
          ("PYDATACOPY_CHECK_RMA", "on", "PYDATACOPY_CHECK_RMA='on' must be 1 (verify every local address "
                                         "handed to an NVSHMEM RMA call) or 0 (or unset)"),
          ("PYDATACOPY_AUTO_REGISTER", "no", "PYDATACOPY_AUTO_REGISTER='no' must be 1 (register local buffers "
                                             "with NVSHMEM on first use) or 0 (or unset)"),
          ("LOCAL_RANK", "x", "pydatacopy.init_nvshmem: LOCAL_RANK='x' is not a whole number (this process's index "
                              "on its node, which torchrun sets)"),
          ("LOCAL_RANK", "-1", "LOCAL_RANK='-1' is not a whole number"),
      ]],
    ("choose_device: LOCAL_RANK not a number", _env_call({"LOCAL_RANK": "one"}, lambda: pydatacopy.choose_device(0)),
     "pydatacopy.choose_device: LOCAL_RANK='one' is not a whole number"),
    # NVSHMEM's environment, in fresh processes: get_unique_id and init_nvshmem check it first
    *[(f"get_unique_id with NVSHMEM_SYMMETRIC_SIZE={value!r}", _uid_with(NVSHMEM_SYMMETRIC_SIZE=value),
       f"pydatacopy.get_unique_id: NVSHMEM_SYMMETRIC_SIZE={value!r} {words}")
      for value, words in [
          ("lots", f"is not a size: {SIZE_HOWTO}"),
          ("-1", f"is negative: {SIZE_HOWTO}"),
          ("", f"is not a size: {SIZE_HOWTO}"),
          ("0", "leaves no room: pydatacopy.init() takes its send/recv staging from this heap"),
          ("1 G", "has ' G' after the number, which NVSHMEM cannot read (it would end the process)"),
          ("1024 ", "has blanks after the number, which NVSHMEM cannot read"),
          ("1024B", "has 'B' after the number, which NVSHMEM cannot read"),
          ("1X", "has 'X' after the number"),
          ("20kk", "means 20k to NVSHMEM, which reads only the first letter after the number and ignores 'k'"),
          ("nan", f"is not a finite size: {SIZE_HOWTO}"),
          ("-1G", f"is negative: {SIZE_HOWTO}"),
          ("1e30T", "is more than 2^64 - 1 bytes"),
      ]],
    ("init_nvshmem with NVSHMEM_SYMMETRIC_SIZE='lots'",
     _fresh(f"pydatacopy.init_nvshmem({UID}, 0, 1)", NVSHMEM_SYMMETRIC_SIZE="lots"),
     f"pydatacopy.init_nvshmem: NVSHMEM_SYMMETRIC_SIZE='lots' is not a size: {SIZE_HOWTO}"),
    # NVSHMEM 3.4.5 aborts (dlopen failed, then a double free) on a plugin it cannot load.
    ("NVSHMEM_BOOTSTRAP_UID_PLUGIN='nope'", _uid_with(NVSHMEM_BOOTSTRAP_UID_PLUGIN="nope"),
     "pydatacopy.get_unique_id: NVSHMEM_BOOTSTRAP_UID_PLUGIN='nope' names no library NVSHMEM could "
     "load (not a file, and not in NVSHMEM's lib directory"),
    ("NVSHMEM_BOOTSTRAP_UID_PLUGIN='/nowhere/uid.so'", _uid_with(NVSHMEM_BOOTSTRAP_UID_PLUGIN="/nowhere/uid.so"),
     "NVSHMEM_BOOTSTRAP_UID_PLUGIN='/nowhere/uid.so' names no library NVSHMEM could load (not a file)"),
    ("NVSHMEM_CUMEM_GRANULARITY='lots'", _uid_with(NVSHMEM_CUMEM_GRANULARITY="lots"),
     "pydatacopy.get_unique_id: NVSHMEM_CUMEM_GRANULARITY='lots' is not a size"),
    ("NVSHMEM_REDUCE_SCRATCH_SIZE='-1'", _uid_with(NVSHMEM_REDUCE_SCRATCH_SIZE="-1"),
     "NVSHMEM_REDUCE_SCRATCH_SIZE='-1' is negative"),
    ("NCCL_SOCKET_IFNAME=nope", _uid_with(NCCL_SOCKET_IFNAME="nope", NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=None),
     "pydatacopy.get_unique_id: NCCL_SOCKET_IFNAME='nope' (which pydatacopy hands to NVSHMEM as "
     "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME) selects no network interface"),
    ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=nope", _uid_with(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="nope"),
     "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME='nope' selects no network interface with an IPv4 or IPv6 address"),
    ("interface: exact name that is only a prefix", _uid_with(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="=l"),
     "'=l' selects no network interface"),
    ("interface: every one excluded", _uid_with(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="^" + ALL_INTERFACES),
     "Set it to one of those (a name prefix, '=name' for an exact name, '^name' to exclude), or unset it"),
    ("init_nvshmem with NCCL_SOCKET_IFNAME=nope",
     _fresh(f"pydatacopy.init_nvshmem({UID}, 0, 1)", NCCL_SOCKET_IFNAME="nope",
            NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=None),
     "pydatacopy.init_nvshmem: NCCL_SOCKET_IFNAME='nope' (which pydatacopy hands to NVSHMEM"),
    ("NCCL_SOCKET_FAMILY=AF_INET4", _uid_with(NCCL_SOCKET_FAMILY="AF_INET4", NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY=None),
     "NCCL_SOCKET_FAMILY='AF_INET4' (which pydatacopy hands to NVSHMEM as NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY) "
     "must be AF_INET (IPv4) or AF_INET6 (IPv6)"),
    ("NVSHMEM_BOOTSTRAP_UID_SESSION_ID=lots", _uid_with(NVSHMEM_BOOTSTRAP_UID_SESSION_ID="lots"),
     "NVSHMEM_BOOTSTRAP_UID_SESSION_ID='lots' must be the address rank 0 listens on, HOST:PORT"),
    ("NVSHMEM_BOOTSTRAP_UID_SESSION_ID empty", _uid_with(NVSHMEM_BOOTSTRAP_UID_SESSION_ID=""),
     "NVSHMEM_BOOTSTRAP_UID_SESSION_ID='' must be the address"),
    ("NVSHMEM_BOOTSTRAP_UID_SESSION_ID port 0", _uid_with(NVSHMEM_BOOTSTRAP_UID_SESSION_ID="127.0.0.1:0"),
     "port 1-65535); or unset it"),
    # transports
    ("NVSHMEM_DISABLE_P2P=1 with no remote transport", lambda: _network.check_transport_preconditions(
        2, {"NVSHMEM_DISABLE_P2P": "1"}, sysfs_root="/nonexistent"),
     "pydatacopy.init: NVSHMEM_DISABLE_P2P=1 leaves NVSHMEM no way to reach the other PEs"),
    ("NVSHMEM_DISABLE_P2P=true (NVSHMEM reads it as on)", lambda: _network.check_transport_preconditions(
        2, {"NVSHMEM_DISABLE_P2P": "true"}, sysfs_root="/nonexistent"),
     "Unset NVSHMEM_DISABLE_P2P; to exercise the path a remote peer takes on one machine, set PYDATACOPY_FORCE_RMA=1"),
    # every public call before init names itself
    *[(f"{name} before init", _call_public(name), f"pydatacopy.{name} {NEEDS_INIT}") for name in NEEDS_INIT_ARGS],
    *[(f"DoubleBufferManager.{name} before its init", _call_dbm(name),
       f"pydatacopy.DoubleBufferManager.{name}: call init(n_tokens, token_size) first") for name in DBM_NEEDS_INIT],
]
if NO_GPU:
    BAD_INPUTS += [
        ("init_nvshmem on a machine without a GPU", lambda: pydatacopy.init_nvshmem(UID, 0, 1),
         "pydatacopy.init_nvshmem: no CUDA device is visible to this process: pydatacopy needs one GPU per process"),
        ("init(device='cuda:0') without a GPU", lambda: pydatacopy.init(device="cuda:0"),
         "pydatacopy.init: no CUDA device is visible to this process"),
        ("init(device=0) without a GPU", lambda: pydatacopy.init(device=0), "pydatacopy.init: no CUDA device is visible"),
        ("init(device=torch.device) without a GPU", lambda: pydatacopy.init(device=torch.device("cuda", 0)),
         "pydatacopy.init: no CUDA device is visible"),
        ("device=2**64 without a GPU", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device=2**64),
         "pydatacopy.init_nvshmem: no CUDA device is visible"),
        ("choose_device without a GPU", lambda: pydatacopy.choose_device(0),
         "pydatacopy.choose_device: no CUDA device is visible"),
        ("core: init without a GPU", lambda: _C.init_nvshmem(UID, 0, 1, -1, 10.0),
         "pydatacopy needs an NVIDIA GPU and driver in this process: check nvidia-smi"),
    ]
else:
    BAD_INPUTS += [
        ("device=2**64", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device=2**64),
         "device=18446744073709551616 is out of range: this process sees"),
    ]


@pytest.mark.parametrize("name, call, words", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_raises_the_project_error(name, call, words):
    with pytest.raises(pydatacopy.Error) as info:
        call()
    assert words in str(info.value), str(info.value)
    assert isinstance(info.value, RuntimeError)
    # Nothing left behind: no NVSHMEM job, no symmetric tensors, no device error recorded.
    assert not pydatacopy.is_initialized()
    assert not _symmetric._from_empty
    pydatacopy.check_errors()


def test_rows_expect_what_to_do_not_a_single_word():
    # A fragment like "init" would pass on almost any message: each row names the setting or
    # the remedy in at least three words, and no two rows share a name.
    names = [name for name, _, _ in BAD_INPUTS]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    for name, _, words in BAD_INPUTS:
        assert len(words.split()) >= 3, (name, words)


def _empty_group():
    with pydatacopy.group():
        pass  # nothing issued: nothing needs NVSHMEM


def test_every_public_callable_needs_init_or_works_before_it():
    # A new public name must land in one of these, with plausible arguments.
    works_before_init = {
        "DoubleBufferManager": lambda: pydatacopy.DoubleBufferManager(),
        "check_errors": pydatacopy.check_errors,
        "finalize": pydatacopy.finalize,
        "get_unique_id": pydatacopy.get_unique_id,
        "is_initialized": pydatacopy.is_initialized,
        "is_symmetric": lambda: pydatacopy.is_symmetric(torch.zeros(1)),
        "nvshmem_versions": pydatacopy.nvshmem_versions,
        "group": _empty_group,
        "MoeHandle": lambda: pydatacopy.MoeHandle(*([torch.zeros(1)] * len(pydatacopy.MoeHandle._fields))),
    }
    argument_errors = {"init", "init_nvshmem", "share_unique_id", "choose_device"}  # rows above
    not_callable = {"Error", "TimeoutError", "UNIQUE_ID_BYTES"}
    covered = set(NEEDS_INIT_ARGS) | set(works_before_init) | argument_errors | not_callable
    assert covered == set(pydatacopy.__all__), covered ^ set(pydatacopy.__all__)
    for name, call in works_before_init.items():
        call()
    for name in NEEDS_INIT_ARGS:
        with pytest.raises(pydatacopy.Error, match=f"^pydatacopy\\.{name} needs NVSHMEM: call pydatacopy.init"):
            _call_public(name)()
    public_methods = {n for n, v in vars(DBM).items() if not n.startswith("_") and inspect.isfunction(v)}
    assert public_methods == set(DBM_NEEDS_INIT) | {"init", "cleanup"}


def test_every_public_name_has_a_docstring():
    for name in pydatacopy.__all__:
        value = getattr(pydatacopy, name)
        if isinstance(value, int):
            continue  # UNIQUE_ID_BYTES: a constant, documented where it is defined
        doc = inspect.getdoc(value) if not isinstance(value, type) else value.__doc__
        assert doc and doc.strip(), f"pydatacopy.{name} has no docstring"
        if isinstance(value, type) and issubclass(value, BaseException):
            assert doc != RuntimeError.__doc__, name
    for name, member in vars(DBM).items():
        if not name.startswith("_"):
            assert member.__doc__ and member.__doc__.strip(), f"DoubleBufferManager.{name} has no docstring"


# ---- the size grammar, against NVSHMEM itself --------------------------------------------------

ACCEPTED_SIZES = {"2G": 2 << 30, "2GiB": 2 << 30, "2GB": 2 << 30, "1.5G": 3 << 29, "512m": 512 << 20,
                  "1073741824": 1 << 30, " 1G": 1 << 30, "1G ": 1 << 30, "3.1M": 3250586, ".5m": 1 << 19,
                  "1e3": 1000, "0x10": 16, "1T": 1 << 40, "64k": 64 << 10}
REFUSED_BY_NVSHMEM = ["lots", "-1", "", "1 G", "1024 ", "1024B", "1X"]
_accepted_keys = {text: in_fresh_process("_C.get_unique_id()", NVSHMEM_SYMMETRIC_SIZE=text)
                  for text in ACCEPTED_SIZES}
_refused_keys = {text: in_fresh_process("_C.get_unique_id()", NVSHMEM_SYMMETRIC_SIZE=text)
                 for text in REFUSED_BY_NVSHMEM}


@pytest.mark.parametrize("text", list(ACCEPTED_SIZES))
def test_sizes_nvshmem_accepts_are_read_as_nvshmem_reads_them(text):
    assert _settings.parse_nvshmem_size(text) == ACCEPTED_SIZES[text]
    result = fresh_result(_accepted_keys[text])  # the core's own call: NVSHMEM reads the value
    assert result["status"] == 0 and result["type"] is None, result


@pytest.mark.parametrize("text", REFUSED_BY_NVSHMEM)
def test_sizes_pydatacopy_refuses_are_ones_nvshmem_cannot_read(text):
    with pytest.raises(_settings.SettingError):
        _settings.parse_nvshmem_size(text)
    result = fresh_result(_refused_keys[text])  # without pydatacopy's check NVSHMEM fails or dies
    assert result["status"] != 0 or result["type"] is not None, result


# ---- interface selection, against NVSHMEM itself -----------------------------------------------

def test_interface_lists_follow_nccls_syntax():
    have = [("lo", socket.AF_INET), ("eth0", socket.AF_INET), ("eth0", socket.AF_INET6),
            ("eth10", socket.AF_INET), ("ib0", socket.AF_INET6)]
    select = _settings.select_interfaces
    assert select("eth", have) == ["eth0", "eth10"]
    assert select("=eth1", have) == []
    assert select("=eth10", have) == ["eth10"]
    assert select("^eth,lo", have) == ["ib0"]
    assert select("^=eth0", have) == ["lo", "eth10", "ib0"]
    assert select("nope,ib", have) == ["ib0"]
    assert select("eth0:1234", have) == ["eth0"]
    assert select("", have) == ["lo", "eth0", "eth10", "ib0"]
    assert select("^", have) == []
    assert select("ib", have, socket.AF_INET) == []
    with pytest.raises(_settings.SettingError, match="it has: eth0, eth10, lo"):
        _settings.check_interfaces({"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "ib", "NCCL_SOCKET_FAMILY": "AF_INET"}, have)
    assert _settings.check_interfaces({"NCCL_SOCKET_IFNAME": "ib", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}, have) \
        == ["lo"], "NVSHMEM's own setting wins over NCCL's"


SPECS = ["lo", "=lo", "^lo", "l", "=l", "nope,lo", "^=lo", "nope", "^" + ALL_INTERFACES]
_spec_keys = {spec: in_fresh_process("_C.get_unique_id()", NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=spec)
              for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS)
def test_interface_check_agrees_with_nvshmem_on_this_machine(spec):
    ours = bool(_settings.select_interfaces(spec, _probes.interface_addresses()))
    result = fresh_result(_spec_keys[spec])
    assert result["status"] == 0, result
    assert ours == (result["type"] is None), (spec, result)


# ---- the doctor's and the bench's options ------------------------------------------------------

BAD_OPTIONS = [
    ("doctor", ["--tokens", "4096"], {}, "argument --tokens: '4096' is not two whole numbers joined by 'x': "
                                         "write N_TOKENSxTOKEN_BYTES, e.g. 4096x7168"),
    ("doctor", ["--tokens", "4096xabc"], {}, "'4096xabc' is not two whole numbers joined by 'x'"),
    ("doctor", ["--tokens", "0x0"], {}, "'0x0': n_tokens must be at least 1, got 0; write N_TOKENSxTOKEN_BYTES"),
    ("doctor", ["--tokens=-5x-5"], {}, "'-5x-5' is not two whole numbers joined by 'x'"),
    ("doctor", ["--tokens", "16x0"], {}, "token_size must be at least 1, got 0"),
    ("doctor", ["--tokens", "3000000000x1"], {}, "n_tokens must be at most 2147483647"),
    ("doctor", ["--world-size", "0"], {}, "argument --world-size: --world-size=0 is out of range"),
    ("doctor", ["--world-size", "two"], {}, "--world-size='two' is not a whole number (the number of PEs)"),
    ("doctor", [], {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number (the number of processes in the "
                                          "job, which torchrun sets): set it to e.g. 2, or unset it; or pass "
                                          "--world-size N"),
    ("doctor", [], {"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
    ("bench", ["-b", ""], {}, "argument -b/--minbytes: '' is not a size: write bytes or a whole number with K, M, "
                              "G or T, e.g. 4K, 64M or 1G"),
    ("bench", ["-b", "lots"], {}, "'lots' is not a size"),
    ("bench", ["-b", "0"], {}, "'0' must be between 1 byte and 1T"),
    ("bench", ["-e", "1.5G"], {}, "argument -e/--maxbytes: '1.5G' is not a size"),
    ("bench", ["-b", "1M", "-e", "4K"], {}, "argument -e/--maxbytes: 4096 bytes is less than -b/--minbytes "
                                           "1048576: give -e at least -b"),
    ("bench", ["-f", "1"], {}, "argument -f/--stepfactor: '1' is not a step factor: give a whole number from 2"),
    ("bench", ["-n", "0"], {}, "argument -n/--iters: '0' is not an iteration count"),
    ("bench", ["-w", "-1"], {}, "argument -w/--warmup: '-1' is not a warm-up count: give a whole number from 0"),
    ("bench", ["-r", "0"], {}, "argument -r/--repeats: '0' is not a repeat count: give a whole number from 1"),
    ("bench", ["-d", "sideways"], {}, "argument -d/--direction: invalid choice: 'sideways'"),
    ("bench", ["--ops", "memcpy,warp"], {}, "argument --ops: unknown warp: choose a comma-separated subset of"),
    ("bench", ["--ops", ","], {}, "argument --ops: no operation given"),
    ("bench", ["--tokens", "4096"], {}, "argument --tokens: '4096' is not two whole numbers joined by 'x'"),
]


@pytest.mark.parametrize("tool, argv, env, words", BAD_OPTIONS,
                         ids=[f"{row[0]} {' '.join(row[1]) or row[2]}" for row in BAD_OPTIONS])
def test_bad_option_is_one_line_and_exit_2(tool, argv, env, words, capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parse = doctor.parse_args if tool == "doctor" else bench.parse_args
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert err.splitlines()[-1].startswith(f"python -m pydatacopy.{tool}: error: ")


def test_bad_option_from_the_command_line_has_no_traceback():
    for args in (["-m", "pydatacopy.doctor", "--tokens", "4096xabc"], ["-m", "pydatacopy.bench", "-b", ""]):
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr and done.stderr.count("error:") == 1, done.stderr


@pytest.mark.parametrize("value, code, words", [
    ("lots", 1, "[FAIL] NVSHMEM_SYMMETRIC_SIZE='lots' is not a size: write a byte count"),
    ("-1", 1, "[FAIL] NVSHMEM_SYMMETRIC_SIZE='-1' is negative"),
    ("2GiB", 0, "NVSHMEM_SYMMETRIC_SIZE 2GiB = 2048 MiB"),
])
def test_doctor_reads_the_heap_size_as_nvshmem_does(value, code, words):
    env = dict(os.environ, NVSHMEM_SYMMETRIC_SIZE=value)
    done = subprocess.run([sys.executable, "-m", "pydatacopy.doctor"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == code, done.stdout + done.stderr
    assert words in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_the_wheels_own_bootstrap_plugin_is_accepted():
    """The refusal above is not a refusal of everything: NVSHMEM's own plugin, by name and by
    path, passes the check, and NVSHMEM then makes an ID with it."""
    import nvidia.nvshmem
    lib = [os.path.join(base, "lib") for base in nvidia.nvshmem.__path__][0]
    name = next(f for f in os.listdir(lib) if f.startswith("nvshmem_bootstrap_uid.so"))
    for value in (name, os.path.join(lib, name)):
        _settings.check_bootstrap_plugin({"NVSHMEM_BOOTSTRAP_UID_PLUGIN": value})
    made = subprocess.run([sys.executable, "-c", "import pydatacopy; print(len(pydatacopy.get_unique_id()))"],
                          env=dict(os.environ, NVSHMEM_BOOTSTRAP_UID_PLUGIN=name), capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0 and made.stdout.split()[-1:] == ["128"], made.stdout + made.stderr
