"""python -m pydatacopy.doctor and the bench's command line, without a GPU: the sections, the
version check, multicast settings, options, the symmetric heap's size hints (the core's own
layouts), and the several-ranks-per-GPU lines."""

from __future__ import annotations

import pytest
import torch

import pydatacopy
from pydatacopy import _C, doctor

NO_GPU = torch.cuda.device_count() == 0
SETTINGS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "PYDATACOPY_RANKS_PER_GPU", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PIPE_DIRECTORY", "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


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
    from pydatacopy.runtime import startup as _startup

    for name, value in _startup.SET_AT_IMPORT.items():
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
    # refusal words, 2 x 2 uint64 (256-byte aligned); then zero-copy's rendezvous rings, 64
    # descriptors of 64 bytes per PE, and its done words, one uint64 per PE and block; then the
    # low-latency rings, 4 slots per PE of 2 + capacity / 4 lines of 8 bytes (rounded up to 16
    # lines), and their credit words, one uint64 per PE (256-byte aligned).
    headers = 2 * (2 * 4 * 256 * 32)
    rings = 2 * 64 * 64
    slot_lines = (2 + _C.LOW_LATENCY_CAPACITY_BYTES // 4 + 15) // 16 * 16
    low_latency = 2 * 4 * slot_lines * 8 + 256
    low_latency_one_pe = 4 * slot_lines * 8 + 256
    assert _C.SendRecvEngine.symmetric_bytes_needed(2, 8 << 20, 4, 64) == (
        (64 << 20) + 2 * 16384 + headers + 256 + rings + 2 * 64 * 8 + low_latency)
    assert _C.SendRecvEngine.symmetric_bytes_needed(2, 8 << 20, 4, 1024) == (
        (64 << 20) + 2 * 16384 + headers + 256 + rings + 2 * 1024 * 8 + low_latency)
    # A chunk under one page is one page of its size rounded to 16 bytes: 1000 -> 1008, so
    # 2 x 1008 bytes of staging and one signal and header per slot, each array 256-byte aligned.
    assert _C.SendRecvEngine.symmetric_bytes_needed(1, 1000, 2, 64) == (
        2048 + 2 * 256 + 2 * 256 + 256 + 64 * 64 + 512 + low_latency_one_pe)
    # 33 KiB chunks round up to two 32 KiB pages
    assert _C.SendRecvEngine.symmetric_bytes_needed(1, 33 << 10, 2, 8) == (
        2 * (64 << 10) + 2 * 256 + 2 * 256 + 256 + 64 * 64 + 256 + low_latency_one_pe)
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


# ---- several ranks on one GPU ----------------------------------------------------------------

def _lines(count, sms, environ, pipe):
    return doctor.shared_gpu_lines(count, sms, environ, control_pipe=pipe)


def _verdicts(lines):
    return [verdict for verdict, _ in lines]


def test_doctor_one_rank_per_gpu():
    lines = _lines(2, 132, {"LOCAL_WORLD_SIZE": "2"}, None)
    assert lines[0] == ("OK", "PYDATACOPY_RANKS_PER_GPU unset (1): local rank r uses cuda:r; "
                              "LOCAL_WORLD_SIZE=2 ranks: 1 per GPU on 2 of this node's 2 GPU(s)")
    assert "WARN" not in _verdicts(lines) and "FAIL" not in _verdicts(lines)
    assert not any("gloo" in text for _, text in lines)


def test_doctor_four_ranks_on_one_gpu_under_mps_at_25():
    environ = {"LOCAL_WORLD_SIZE": "4", "PYDATACOPY_RANKS_PER_GPU": "4", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    lines = _lines(1, 132, environ, "/tmp/nvidia-mps/control")
    text = "\n".join(t for _, t in lines)
    assert _verdicts(lines) == ["OK", "INFO", "OK", "OK"], lines
    assert "4 per GPU on 1 of this node's 1 GPU(s)" in text
    assert "gloo" in text and "NCCL refuses two ranks on one GPU" in text
    assert "CUDA MPS: a control daemon listens at /tmp/nvidia-mps/control" in text
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25: this process may use 25% of its GPU's threads, about 33 of its 132 SMs" in text


def test_doctor_sharing_without_mps_warns_of_the_speed():
    lines = _lines(1, 132, {"LOCAL_WORLD_SIZE": "2", "PYDATACOPY_RANKS_PER_GPU": "2"}, None)
    warnings_ = [t for v, t in lines if v == "WARN"]
    assert len(warnings_) == 1 and "time-sliced" in warnings_[0] and "nvidia-cuda-mps-control -d" in warnings_[0]
    assert lines[-1] == ("INFO", "SM share: the whole GPU (132 SMs), time-sliced with the other ranks on it")


def test_doctor_shares_past_100_and_unset_shares_warn():
    over = _lines(1, 132, {"LOCAL_WORLD_SIZE": "2", "PYDATACOPY_RANKS_PER_GPU": "2",
                           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}, "/p/control")
    assert over[-1][0] == "WARN" and "2 ranks x 60% is more than 100" in over[-1][1]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in over[-1][1]
    unset = _lines(1, 132, {"LOCAL_WORLD_SIZE": "2", "PYDATACOPY_RANKS_PER_GPU": "2"}, "/p/control")
    assert unset[-1][0] == "WARN" and "is unset" in unset[-1][1]


def test_doctor_fails_what_init_refuses():
    lines = _lines(1, 132, {"LOCAL_WORLD_SIZE": "2"}, None)
    assert lines[0][0] == "FAIL"
    assert "LOCAL_WORLD_SIZE=2 ranks on 1 GPU(s) need 2 ranks per GPU" in lines[0][1]
    assert "PYDATACOPY_RANKS_PER_GPU=2 on every rank" in lines[0][1]
    bad = _lines(1, 132, {"PYDATACOPY_RANKS_PER_GPU": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "200"}, None)
    assert [v for v in _verdicts(bad) if v == "FAIL"] == ["FAIL", "FAIL"], bad


def test_doctor_reports_ranks_per_gpu(capsys, monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYDATACOPY_RANKS_PER_GPU", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent-mps")
    doctor.run(["--world-size", "2"])
    out = capsys.readouterr().out
    assert "== ranks per GPU" in out
    assert "PYDATACOPY_RANKS_PER_GPU=2: local rank r uses cuda:r // 2" in out
    assert "CUDA MPS is not running (no daemon listens at /nonexistent-mps/control: nothing there)" in out
    assert "gloo" in out


@pytest.mark.parametrize("conf, setting, verdict", [
    ("", "default", "OK"),
    ("expandable_segments:True", "expandable_segments", "OK"),
    ("max_split_size_mb:128,expandable_segments:True", "expandable_segments", "OK"),
    ("expandable_segments:True,expandable_segments:False", "default", "OK"),  # the last one wins
    ("backend:cudaMallocAsync", "cudaMallocAsync", "WARN"),
    ("backend:native", "default", "OK"),
])
def test_allocator_setting_and_its_doctor_line(conf, setting, verdict):
    from pydatacopy._torch_utils import allocator_setting
    from pydatacopy.doctor import allocator_line

    assert allocator_setting(conf) == setting
    said, text = allocator_line({"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {})
    assert said == verdict and text.startswith(setting)
    if setting == "cudaMallocAsync":
        assert "staged" in text


def test_one_copy_fraction_counts_receives_only():
    from pydatacopy.bench.send_recv import one_copy_fraction

    before = {"zero_copy": 10, "staged": 5, "low_latency": 0}
    assert one_copy_fraction(before, {"zero_copy": 13, "staged": 6, "low_latency": 0}) == 0.75
    assert one_copy_fraction(before, dict(before)) is None  # a PE that only sent
    assert one_copy_fraction(before, {"zero_copy": 10, "staged": 9, "low_latency": 0}) == 0.0


def test_report_shows_one_copy_and_alloc(capsys):
    from types import SimpleNamespace

    from pydatacopy.bench._report import report

    row = {"op": "send/recv", "path": "default", "direction": "both", "bytes": 1 << 26, "size": "64M",
           "us": 100.0, "p99_us": 120.0, "gbps": 671.0, "ok": True, "one_copy_fraction": 0.75,
           "alloc": "expandable_segments"}
    report([row], SimpleNamespace(csv=None, markdown=None, plot=None))
    out = capsys.readouterr().out
    assert "  0.75  yes expandable_segments" in out
    assert "expandable_segments" in out
