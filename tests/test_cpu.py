"""Tests that need no GPU: import, IDs, argument checks, errors, the ID broadcast over gloo."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
from pydatacopy import _C

NO_GPU = torch.cuda.device_count() == 0


def test_public_names_resolve():
    for name in pydatacopy.__all__:
        assert hasattr(pydatacopy, name), name
    assert issubclass(pydatacopy.Error, RuntimeError)
    assert issubclass(pydatacopy.TimeoutError, pydatacopy.Error)


def test_nvshmem_version_built_matches_loaded():
    versions = pydatacopy.nvshmem_versions()
    assert versions["built"] == versions["loaded"]
    assert versions["built"].count(".") == 2


def test_unique_id_is_128_picklable_bytes():
    first, second = pydatacopy.get_unique_id(), pydatacopy.get_unique_id()
    assert len(first) == pydatacopy.UNIQUE_ID_BYTES == 128
    assert all(isinstance(v, int) and 0 <= v <= 255 for v in first)
    assert pickle.loads(pickle.dumps(first)) == first
    assert first != second, "two IDs must name two different jobs"


@pytest.mark.parametrize("id_type", [list, bytes, bytearray, lambda v: torch.tensor(v, dtype=torch.uint8)])
@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error")
def test_init_nvshmem_without_gpu_says_so(id_type):
    uid = id_type(pydatacopy.get_unique_id())
    with pytest.raises(pydatacopy.Error, match="no CUDA device is visible"):
        pydatacopy.init_nvshmem(uid, 0, 1)
    assert not pydatacopy.is_initialized()


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error")
def test_core_init_without_gpu_names_the_driver():
    with pytest.raises(pydatacopy.Error, match="NVIDIA GPU and driver") as info:
        _C.init_nvshmem(pydatacopy.get_unique_id(), 0, 1, -1, 10.0)
    assert "runtime.cpp:" in str(info.value), "core errors carry file:line"


def test_calls_before_init_raise_the_project_error():
    assert not pydatacopy.is_initialized()
    pydatacopy.finalize()  # harmless when not initialised
    pydatacopy.finalize()
    for call in (pydatacopy.my_pe, pydatacopy.n_pes):
        with pytest.raises(pydatacopy.Error, match="call pydatacopy.init"):
            call()
    dbm = pydatacopy.DoubleBufferManager()
    with pytest.raises(pydatacopy.Error, match="call pydatacopy.init"):
        dbm.init(4, 16)
    with pytest.raises(pydatacopy.Error, match="init\\(n_tokens, token_size\\) first"):
        dbm.exchange()
    with pytest.raises(pydatacopy.Error, match="init\\(n_tokens, token_size\\) first"):
        _ = dbm.send_buffer
    with pytest.raises(pydatacopy.Error, match="init\\(n_tokens, token_size\\) first"):
        dbm.test_bandwidth(0, 1)
    dbm.cleanup()  # harmless when never initialised
    pydatacopy.check_errors()  # nothing reported


def test_core_double_buffer_checks_sizes_after_init_check():
    with pytest.raises(pydatacopy.Error, match="call pydatacopy.init"):
        _C.DoubleBufferManager().init(0, 0)


def test_default_peers():
    assert [_C.DoubleBufferManager.default_dst_pe(p, 2) for p in range(2)] == [1, 0]
    assert [_C.DoubleBufferManager.default_dst_pe(p, 4) for p in range(4)] == [1, 0, 3, 2]
    assert [_C.DoubleBufferManager.default_dst_pe(p, 3) for p in range(3)] == [1, 2, 0]
    assert [_C.DoubleBufferManager.default_src_pe(p, 3) for p in range(3)] == [2, 0, 1]
    assert _C.DoubleBufferManager.default_dst_pe(0, 1) == 0


def test_timeout_environment_variable(monkeypatch):
    monkeypatch.setenv("PYDATACOPY_TIMEOUT_S", "2.5")
    assert _C.default_timeout_seconds() == 2.5
    monkeypatch.setenv("PYDATACOPY_TIMEOUT_S", "soon")
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_TIMEOUT_S"):
        _C.default_timeout_seconds()
    monkeypatch.delenv("PYDATACOPY_TIMEOUT_S")
    assert _C.default_timeout_seconds() == 60.0


def test_init_without_torch_distributed_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(pydatacopy.Error, match="init_process_group"):
        pydatacopy.init()
    with pytest.raises(pydatacopy.Error, match="init_process_group"):
        pydatacopy.share_unique_id()


def test_choose_device_without_gpu():
    if not NO_GPU:
        pytest.skip("checks the no-GPU error")
    with pytest.raises(pydatacopy.Error, match="no CUDA device"):
        pydatacopy.choose_device(0)


# ---- the ID broadcast through a real two-process gloo group ----------------------------------

def _hosts_worker(rank: int, store_file: str, hosts: list[str], results) -> None:
    from pydatacopy import _network, _runtime

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=len(hosts))
    try:
        _network.host_identity = lambda: hosts[rank]  # this rank's node, as the test lays them out
        unique_id, nodes = _runtime._share_unique_id()
        results[rank] = (len(unique_id), nodes)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hosts, nodes", [(["a", "a", "a"], 1), (["a", "b", "a"], 2), (["a", "b", "c"], 3)])
def test_init_counts_the_hosts_of_its_ranks(tmp_path, hosts, nodes):
    """pydatacopy.init learns whether the job spans nodes from the ranks themselves (the
    preflight then asks for a remote transport), whatever launched them."""
    results = mp.Manager().dict()
    mp.spawn(_hosts_worker, args=(str(tmp_path / "rendezvous"), hosts, results), nprocs=len(hosts), join=True)
    assert [results[r] for r in range(len(hosts))] == [(128, nodes)] * len(hosts)


def _preflight_worker(rank: int, store_file: str, refusing: list[int], results) -> None:
    from pydatacopy import _network, _runtime

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=3)
    try:
        def preflight(world_size, **kwargs):  # a node with a remote transport, or without
            if rank in refusing:
                raise pydatacopy.Error(f"no remote transport on the node of rank {rank}")
        _network.check_transport_preconditions = preflight
        try:
            _runtime._agree_on_preflight(None, 3, 2, "pydatacopy.init")
            results[rank] = "started"
        except pydatacopy.Error as error:
            results[rank] = str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("refusing", [[], [1], [0, 2]])
def test_a_preflight_refusal_on_one_rank_stops_every_rank(tmp_path, refusing):
    """No rank goes on into NVSHMEM's bootstrap when another refused: it would wait there."""
    results = mp.Manager().dict()
    mp.spawn(_preflight_worker, args=(str(tmp_path / "rendezvous"), refusing, results), nprocs=3, join=True)
    if not refusing:
        assert [results[r] for r in range(3)] == ["started"] * 3
        return
    for rank in range(3):
        assert f"NVSHMEM was not started on any rank, because on rank {', '.join(map(str, refusing))} " \
               f"of the group: no remote transport on the node of rank {refusing[0]}" in results[rank]


def _gloo_worker(rank: int, world_size: int, store_file: str, results) -> None:
    # A file rendezvous: no port to race for.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    try:
        shared = pydatacopy.share_unique_id()
        error = ""
        try:
            pydatacopy.init()  # no GPU here: must fail cleanly after the broadcast machinery
        except pydatacopy.Error as e:
            error = str(e)
        results[rank] = (shared, error)
    finally:
        dist.destroy_process_group()


def test_unique_id_broadcast_over_two_process_gloo_group(tmp_path):
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True)
    (id0, err0), (id1, err1) = results[0], results[1]
    assert len(id0) == 128 and id0 == id1, "both ranks must hold rank 0's ID"
    if NO_GPU:
        assert "no CUDA device" in err0 and "no CUDA device" in err1


def test_path_choice():
    assert _C.resolve_path(0, True, 1 << 30) == "copy_engine"
    assert _C.resolve_path(0, True, 4096) == "copy_engine"
    assert _C.resolve_path(0, False, 1 << 30) == "rma"
    assert _C.resolve_path(2, True, 1 << 30) == "sm"
    with pytest.raises(pydatacopy.Error, match="directly reachable"):
        _C.resolve_path(1, False, 4096)


# ---- network settings and the doctor ----------------------------------------------------------

from pydatacopy import _network, doctor  # noqa: E402


def test_nccl_settings_carry_over_to_nvshmem_when_unset():
    environ = {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0,mlx5_1",
               "NVSHMEM_HCA_LIST": "mlx5_3", "PYDATACOPY_IBGDA": "1"}
    applied = _network.apply_network_settings(environ)
    assert environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth1"
    assert environ["NVSHMEM_HCA_LIST"] == "mlx5_3", "a user's NVSHMEM setting wins"
    assert environ["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert applied == {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth1", "NVSHMEM_IB_ENABLE_IBGDA": "1"}


def test_unique_id_is_made_after_the_interface_settings(monkeypatch):
    # The ID carries rank 0's bootstrap address: NCCL_SOCKET_IFNAME must reach NVSHMEM first.
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "unset-below")  # restored after the test
    monkeypatch.delenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
    assert len(pydatacopy.get_unique_id()) == 128
    assert os.environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"


def test_p2p_disabled_without_a_remote_transport_is_refused(tmp_path):
    # (tests/test_network.py covers each transport; tmp_path stands for a machine with no NIC.)
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_FORCE_RMA"):
        _network.check_transport_preconditions(2, {"NVSHMEM_DISABLE_P2P": "1"}, sysfs_root=str(tmp_path))
    _network.check_transport_preconditions(1, {"NVSHMEM_DISABLE_P2P": "1"}, sysfs_root=str(tmp_path))


def test_doctor_runs_without_gpu(capsys):
    assert doctor.run(["--world-size", "2", "--tokens", "4096x7168"]) == 0
    out = capsys.readouterr().out
    for section in ("== software", "== GPUs", "== network", "== symmetric heap", "== environment"):
        assert section in out
    # The version line is what this process has loaded, through the same check as the doctor's.
    versions = pydatacopy.nvshmem_versions()
    verdict, line = doctor.check_nvshmem_version(versions)
    assert f"[{verdict:<4}] {line}" in out
    assert line.startswith(f"NVSHMEM built {versions['built']}, loaded {versions['loaded']}")
    if NO_GPU:
        assert "no CUDA device visible" in out
        assert "transport settings can start" not in out and "no PE can start on this machine" in out


def test_doctor_fails_a_version_mismatch():
    assert doctor.check_nvshmem_version({"built": "3.4.5", "loaded": "3.4.7"})[0] == "OK"
    verdict, line = doctor.check_nvshmem_version({"built": "3.4.5", "loaded": "3.3.24"})
    assert verdict == "FAIL" and "NVSHMEM built 3.4.5, loaded 3.3.24: rebuild pydatacopy" in line


def test_doctor_tells_multicast_settings_apart():
    safe = {"NCCL_NVLS_ENABLE": "0"}
    verdict, line = doctor.multicast_line("NCCL_NVLS_ENABLE", "0", safe, set_at_import=safe)
    assert verdict == "INFO" and "set by pydatacopy at import, not by you" in line
    verdict, line = doctor.multicast_line("NCCL_NVLS_ENABLE", "0", safe, set_at_import={})
    assert verdict == "OK" and "set by you" in line
    verdict, line = doctor.multicast_line("NCCL_NVLS_ENABLE", "0", {"NCCL_NVLS_ENABLE": "1"}, set_at_import={})
    assert verdict == "WARN" and "NVLink multicast may be on" in line
    # The package records what it set at import, and only what was unset before.
    from pydatacopy import _runtime

    for name, value in _runtime.SET_AT_IMPORT.items():
        assert doctor.MULTICAST_OFF[name] == value


def test_doctor_and_bench_options_parse():
    args = doctor.parse_args(["--tokens", "4096x7168", "--world-size", "8"], environ={})
    assert (args.tokens, args.world_size) == ((4096, 7168), 8)
    assert doctor.parse_args([], environ={"WORLD_SIZE": "4"}).world_size == 4
    assert doctor.parse_args([], environ={}).world_size == 2
    from pydatacopy import bench

    args = bench.parse_args([])
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (4 << 10, 1 << 30, 16)
    assert args.tokens == [(1024, 4096), (4096, 7168), (16384, 14336)]
    assert args.ops == set(bench.OPS) - {"compile"}  # compile only when named (it compiles first)
    assert bench.parse_args(["--ops", "host,compile"]).ops == {"host", "compile"}
    args = bench.parse_args(["-b", "64K", "-e", "64K", "--ops", "put_ce,nccl", "--tokens", "8x16"])
    assert (args.minbytes, args.maxbytes, args.ops, args.tokens) == (64 << 10, 64 << 10, {"put_ce", "nccl"}, [(8, 16)])


def test_bench_help_shows_every_option_with_its_default():
    from pydatacopy import bench

    parser = bench.build_parser()
    parser.formatter_class = lambda prog: bench._HelpFormatter(prog, width=1000, max_help_position=200)  # one line each
    lines = parser.format_help().splitlines()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        line = next(line for line in lines if line.strip().startswith(action.option_strings[0]))
        assert action.help and action.help in line, action.dest
        if action.default is not None:
            assert f"(default: {action.default})" in line, line


def test_symmetric_layouts_are_the_cores_own():
    # 2 PEs x 4 chunks x 8 MiB of staging, then arrivals and credits: one uint64 per 32 KiB page,
    # 2 x 4 x 256 each; then incoming and outgoing slot headers, 32 bytes per page, and the
    # refusal words, 2 x 2 uint64 (256-byte aligned); then zero-copy's rendezvous rings, 16
    # descriptors of 64 bytes per PE, and its done words, one uint64 per PE and block.
    headers = 2 * (2 * 4 * 256 * 32)
    rings = 2 * 16 * 64
    assert _C.SendRecvEngine.symmetric_bytes_needed(2, 8 << 20, 4, 64) == (
        (64 << 20) + 2 * 16384 + headers + 256 + rings + 2 * 64 * 8)
    assert _C.SendRecvEngine.symmetric_bytes_needed(2, 8 << 20, 4, 1024) == (
        (64 << 20) + 2 * 16384 + headers + 256 + rings + 2 * 1024 * 8)
    # A chunk under one page is one page of its size rounded to 16 bytes: 1000 -> 1008, so
    # 2 x 1008 bytes of staging and one signal and header per slot, each array 256-byte aligned.
    assert _C.SendRecvEngine.symmetric_bytes_needed(1, 1000, 2, 64) == 2048 + 2 * 256 + 2 * 256 + 256 + 1024 + 512
    # 33 KiB chunks round up to two 32 KiB pages
    assert _C.SendRecvEngine.symmetric_bytes_needed(1, 33 << 10, 2, 8) == (
        2 * (64 << 10) + 2 * 256 + 2 * 256 + 256 + 1024 + 256)
    # 4 token buffers, 2 signal arrays, 2 credit arrays, each 256-byte aligned
    assert _C.DoubleBufferManager.symmetric_bytes_needed(3, 100, 2) == 4 * 512 + 2 * 256 + 2 * 256
    with pytest.raises(pydatacopy.Error, match="must be positive"):
        _C.SendRecvEngine.symmetric_bytes_needed(2, 8 << 20, 4, 0)


def test_doctor_flags_a_heap_that_is_too_small(monkeypatch, capsys):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "64M")
    assert doctor.run(["--world-size", "8", "--tokens", "4096x7168"]) == 1
    assert "set NVSHMEM_SYMMETRIC_SIZE=" in capsys.readouterr().out
    assert doctor.symmetric_bytes_needed(2, None) < doctor.symmetric_bytes_needed(2, (16, 16))
    assert doctor.parse_size("2G") == 2 << 30 and doctor.parse_size("512m") == 512 << 20
    assert doctor.parse_size("2GiB") == 2 << 30, "NVSHMEM reads 2GiB as 2G: so does the doctor"
