"""Bad inputs that need no GPU, as one table: each must raise pydatacopy.Error (or its
TimeoutError subclass) with words that say what to do - no crash, no hang, no state left behind.
The GPU-side ones (wrong device, non-symmetric, size/dtype mismatch on live tensors, unwaited
rounds, bad block indices...) are in tests/gpu."""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy import _C, _network, _torch_utils, _transfer

UID = pydatacopy.get_unique_id()
NO_GPU = torch.cuda.device_count() == 0


def _env(name, value, read=_C.default_timeout_seconds):
    def call():
        with pytest.MonkeyPatch.context() as m:
            m.setenv(name, value)
            read()
    return call


def _without_infiniband(call):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_network, "infiniband_devices", lambda: [])
        call()


BAD_INPUTS = [
    # the unique ID
    ("id: 127 bytes", lambda: pydatacopy.init_nvshmem(b"\x01" * 127, 0, 1), "128 bytes"),
    ("id: 129 ints", lambda: pydatacopy.init_nvshmem(list(range(129)), 0, 1), "128 bytes"),
    ("id: empty", lambda: pydatacopy.init_nvshmem([], 0, 1), "128 bytes"),
    ("id: int above 255", lambda: pydatacopy.init_nvshmem([256] * 128, 0, 1), "ints in [0, 255]"),
    ("id: negative int", lambda: pydatacopy.init_nvshmem([-1] * 128, 0, 1), "ints in [0, 255]"),
    ("id: bools", lambda: pydatacopy.init_nvshmem([True] * 128, 0, 1), "ints in [0, 255]"),
    ("id: str", lambda: pydatacopy.init_nvshmem("x" * 128, 0, 1), "uint8 tensor"),
    ("id: None", lambda: pydatacopy.init_nvshmem(None, 0, 1), "uint8 tensor"),
    ("id: int32 tensor", lambda: pydatacopy.init_nvshmem(torch.zeros(128, dtype=torch.int32), 0, 1), "uint8"),
    ("id: short uint8 tensor", lambda: pydatacopy.init_nvshmem(torch.ones(64, dtype=torch.uint8), 0, 1), "128 bytes"),
    ("id: all zeros (corrupted)", lambda: _C.init_nvshmem([0] * 128, 0, 1, -1, 10.0), "all zeros"),
    ("id: wrong length in the core", lambda: _C.init_nvshmem([1] * 100, 0, 1, -1, 10.0), "128 bytes"),
    # rank, world size, device
    ("world size 0", lambda: pydatacopy.init_nvshmem(UID, 0, 0), "world_size must be at least 1"),
    ("negative rank", lambda: pydatacopy.init_nvshmem(UID, -1, 2), "rank must be at least 0"),
    ("rank == world size", lambda: pydatacopy.init_nvshmem(UID, 2, 2), "rank must be in [0, world_size=2)"),
    ("rank > world size", lambda: pydatacopy.init_nvshmem(UID, 7, 2), "rank must be in [0, world_size=2)"),
    ("float rank", lambda: pydatacopy.init_nvshmem(UID, 0.0, 2), "rank must be an int"),
    ("str world size", lambda: pydatacopy.init_nvshmem(UID, 0, "2"), "world_size must be an int"),
    ("negative device", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device=-1), "device must be at least 0"),
    ("str device", lambda: pydatacopy.init_nvshmem(UID, 0, 1, device="0"), "device must be an int"),
    ("core: rank out of range", lambda: _C.init_nvshmem(UID, 3, 2, -1, 10.0), "rank must be in"),
    ("init timeout zero", lambda: pydatacopy.init_nvshmem(UID, 0, 1, timeout=0), "positive number of seconds"),
    ("init timeout negative", lambda: pydatacopy.init_nvshmem(UID, 0, 1, timeout=-5.0), "positive number of seconds"),
    ("PYDATACOPY_INIT_TIMEOUT_S not a number", _env("PYDATACOPY_INIT_TIMEOUT_S", "later", _C.default_init_timeout_seconds),
     "PYDATACOPY_INIT_TIMEOUT_S"),
    # start-up without torch.distributed
    ("init() without torch.distributed", lambda: pydatacopy.init(), "init_process_group"),
    ("share_unique_id() without torch.distributed", lambda: pydatacopy.share_unique_id(), "init_process_group"),
    # DoubleBufferManager sizes and order
    ("n_tokens 0", lambda: pydatacopy.DoubleBufferManager().init(0, 16), "n_tokens must be at least 1"),
    ("n_tokens negative", lambda: pydatacopy.DoubleBufferManager().init(-1, 16), "n_tokens must be at least 1"),
    ("token_size 0", lambda: pydatacopy.DoubleBufferManager().init(4, 0), "token_size must be at least 1"),
    ("token_size negative", lambda: pydatacopy.DoubleBufferManager().init(4, -8), "token_size must be at least 1"),
    ("n_tokens float", lambda: pydatacopy.DoubleBufferManager().init(2.5, 16), "n_tokens must be an int"),
    ("token_size str", lambda: pydatacopy.DoubleBufferManager().init(4, "16"), "token_size must be an int"),
    ("n_tokens bool", lambda: pydatacopy.DoubleBufferManager().init(True, 16), "n_tokens must be an int"),
    ("DBM init before pydatacopy.init", lambda: pydatacopy.DoubleBufferManager().init(4, 16), "call pydatacopy.init"),
    ("exchange before DBM init", lambda: pydatacopy.DoubleBufferManager().exchange(), "init(n_tokens, token_size) first"),
    ("wait before DBM init", lambda: pydatacopy.DoubleBufferManager().wait(0), "init(n_tokens, token_size) first"),
    ("test_bandwidth before DBM init", lambda: pydatacopy.DoubleBufferManager().test_bandwidth(0, 1), "init(n_tokens, token_size) first"),
    ("test_bandwidth negative rank", lambda: pydatacopy.DoubleBufferManager().test_bandwidth(-1, 1), "rank must be at least 0"),
    # timeouts
    ("PYDATACOPY_TIMEOUT_S not a number", _env("PYDATACOPY_TIMEOUT_S", "soon"), "PYDATACOPY_TIMEOUT_S"),
    ("PYDATACOPY_TIMEOUT_S negative", _env("PYDATACOPY_TIMEOUT_S", "-1"), "PYDATACOPY_TIMEOUT_S"),
    ("PYDATACOPY_TIMEOUT_S zero", _env("PYDATACOPY_TIMEOUT_S", "0"), "PYDATACOPY_TIMEOUT_S"),
    ("timeout negative", lambda: _torch_utils.timeout_seconds(-1), "positive number of seconds"),
    ("timeout bool", lambda: _torch_utils.timeout_seconds(True), "positive number of seconds"),
    ("timeout str", lambda: _torch_utils.timeout_seconds("5"), "positive number of seconds"),
    ("stream of the wrong type", lambda: _torch_utils.stream_handle("stream", 0), "torch.cuda.Stream"),
    # paths
    ("unknown path number", lambda: _C.put(0, 0, 16, 0, 0, 7), "path must be"),
    ("copy engine to an unreachable peer", lambda: _C.resolve_path(1, False, 4096), "directly reachable"),
    ("unknown path name", lambda: _transfer._path("warp"), "path must be one of"),
    # data movement before init
    ("empty before init", lambda: pydatacopy.empty(16), "init"),
    ("free before init", lambda: pydatacopy.free(torch.zeros(1)), "init"),
    ("put before init", lambda: pydatacopy.put(torch.zeros(1), torch.zeros(1), 0), "init"),
    ("get before init", lambda: pydatacopy.get(torch.zeros(1), torch.zeros(1), 0), "init"),
    ("send before init", lambda: pydatacopy.send(torch.zeros(1), 0), "init"),
    ("recv before init", lambda: pydatacopy.recv(torch.zeros(1), 0), "init"),
    ("sendrecv before init", lambda: pydatacopy.sendrecv(torch.zeros(1), 0, torch.zeros(1), 0), "init"),
    ("put_many before init", lambda: pydatacopy.put_many([], [], 0), "init"),
    ("quiet before init", lambda: pydatacopy.quiet(), "init"),
    ("barrier before init", lambda: pydatacopy.barrier(), "init"),
    ("core barrier before init", lambda: _C.barrier(0, 1.0), "call pydatacopy.init"),
    ("core blocking barrier before init", lambda: _C.barrier_all_blocking("test", 1.0), "call pydatacopy.init"),
    ("signal_wait before init", lambda: pydatacopy.signal_wait(torch.zeros(1), 1), "init"),
    ("setup_send_recv before init", lambda: pydatacopy.setup_send_recv(), "init"),
    ("my_pe before init", lambda: pydatacopy.my_pe(), "call pydatacopy.init"),
    ("core symmetric_malloc before init", lambda: _C.symmetric_malloc(16), "call pydatacopy.init"),
    ("core engine before init", lambda: _C.SendRecvEngine().init(1 << 20, 4, 8), "call pydatacopy.init"),
    ("core put_blocks before init", lambda: _C.put_blocks(0, 1, 0, 1, 16, 0, 0, 1, 0, 0, 0), "call pydatacopy.init"),
    ("core signal_wait before init", lambda: _C.signal_wait(0, 1, 0, 1.0), "call pydatacopy.init"),
    # transports
    ("NVSHMEM_DISABLE_P2P with no remote transport", lambda: _without_infiniband(
        lambda: _network.check_transport_preconditions(2, {"NVSHMEM_DISABLE_P2P": "1"})), "PYDATACOPY_FORCE_RMA"),
]
if NO_GPU:
    BAD_INPUTS.append(("init on a machine without a GPU", lambda: pydatacopy.init_nvshmem(UID, 0, 1), "no CUDA device is visible"))
    BAD_INPUTS.append(("core init without a GPU", lambda: _C.init_nvshmem(UID, 0, 1, -1, 10.0), "NVIDIA GPU and driver"))


def test_the_table_has_at_least_40_distinct_bad_inputs():
    assert len({name for name, _, _ in BAD_INPUTS}) >= 40


@pytest.mark.parametrize("name, call, words", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_raises_the_project_error(name, call, words):
    with pytest.raises(pydatacopy.Error) as info:
        call()
    assert words in str(info.value), str(info.value)
    assert isinstance(info.value, RuntimeError)
    # Nothing left behind: no NVSHMEM job, no symmetric tensors, no device error recorded.
    assert not pydatacopy.is_initialized()
    assert not _transfer._allocations
    pydatacopy.check_errors()
