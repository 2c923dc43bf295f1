"""GPU tests: run under torchrun, one process per PE, e.g.
    torchrun --nproc_per_node=2 -m pytest tests/gpu                          (2+ GPUs)
    PYDATACOPY_RANKS_PER_GPU=2 torchrun --nproc_per_node=2 -m pytest tests/gpu   (one GPU, under MPS)
    PYDATACOPY_RANKS_PER_GPU=4 torchrun --nproc_per_node=4 -m pytest tests/gpu -m any_pes
(scripts/gpu-check.sh does, and manages CUDA MPS on one GPU). Every process runs the same tests
in the same order, so the collective calls inside them line up.

Modules marked `pytestmark = pytest.mark.any_pes` work for any number of PEs >= 2; every other
module here is a two-PE module (`peer = 1 - rank`), skipped with the reason when WORLD_SIZE != 2.
Local rank r uses CUDA device r // PYDATACOPY_RANKS_PER_GPU (default 1), the package's rule;
torch.distributed runs on gloo when ranks share a GPU (NCCL refuses two ranks on one GPU), on
nccl otherwise. Where the job cannot run at all (no GPU, not under torchrun, fewer GPUs than the
ranks need), everything is skipped with the reason."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys

import pytest
import torch


def _int_env(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"{name}={text!r} is not a whole number") from None


def ranks_per_gpu() -> int:
    """PYDATACOPY_RANKS_PER_GPU (default 1): how many local ranks share one GPU."""
    value = _int_env("PYDATACOPY_RANKS_PER_GPU", 1)
    if value < 1:
        raise pytest.UsageError(f"PYDATACOPY_RANKS_PER_GPU={value}: give a whole number >= 1")
    return value


def device_of(local_rank: int) -> int:
    """The CUDA device of a local rank by the package's rule (pydatacopy.choose_device applies it
    in the package; computed here too, so the fixture does not depend on torch's CUDA state)."""
    return local_rank // ranks_per_gpu()


def _why_not(any_pes: bool) -> str | None:
    """Why this module cannot run in this job (the same answer on every rank), or None."""
    if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
        return ("run under torchrun, one process per PE: torchrun --nproc_per_node=2 -m pytest "
                "tests/gpu (scripts/gpu-check.sh; on one GPU add PYDATACOPY_RANKS_PER_GPU=2)")
    world_size = _int_env("WORLD_SIZE", 0)
    if any_pes and world_size < 2:
        return f"needs at least 2 PEs, WORLD_SIZE={world_size}"
    if not any_pes and world_size != 2:
        return (f"a two-PE module (peer = 1 - rank), WORLD_SIZE={world_size}; the N-PE tests are "
                "the modules marked any_pes (pytest -m any_pes)")
    count = torch.cuda.device_count()
    if count == 0:
        return "no CUDA device visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size)
    needed = device_of(local_world_size - 1) + 1
    if needed > count:
        return (f"{local_world_size} local ranks with PYDATACOPY_RANKS_PER_GPU={ranks_per_gpu()} "
                f"need {needed} GPU(s), this process sees {count}: set PYDATACOPY_RANKS_PER_GPU="
                f"{-(-local_world_size // count)} to share them")
    return None


def pytest_collection_modifyitems(config, items):
    reasons: dict[bool, str | None] = {}
    for item in items:
        if "tests/gpu" not in str(item.fspath).replace(os.sep, "/"):
            continue
        any_pes = item.get_closest_marker("any_pes") is not None
        if any_pes not in reasons:
            reasons[any_pes] = _why_not(any_pes)
        if reasons[any_pes] is not None:
            item.add_marker(pytest.mark.skip(reason=reasons[any_pes]))
        elif item.get_closest_marker("registers_torch_memory") is not None:
            from byte_patterns import NO_TORCH_MEMORY_ON_RMA, _torch_memory_registers

            if not _torch_memory_registers():
                item.add_marker(pytest.mark.skip(reason=NO_TORCH_MEMORY_ON_RMA))


def shares_a_gpu() -> bool:
    """True when this job puts several ranks on one GPU (then torch.distributed is on gloo)."""
    return ranks_per_gpu() > 1


@pytest.fixture(scope="session")
def local_device() -> int:
    """The CUDA device index this rank uses."""
    return device_of(int(os.environ["LOCAL_RANK"]))


@pytest.fixture(autouse=True)
def _native_backtrace():
    """PYDATACOPY_SEGV_BACKTRACE_SO (scripts/gpu-check.sh SEGV_BACKTRACE=1): the preloaded crash
    handler installed again before each test, over any a library loaded since has put there."""
    path = os.environ.get("PYDATACOPY_SEGV_BACKTRACE_SO")
    if path:
        import ctypes

        ctypes.CDLL(path).pydatacopy_segv_install()
    yield


_config = None
_hang_file = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """PYDATACOPY_TEST_HANG_S=N (gpu-check sets it): a test that runs longer than N seconds ends
    its process with every thread's traceback in PYDATACOPY_TEST_HANG_DIR/hang-rank<R>-<pid>.log,
    after the test's name (a run that ends removes its file); torchrun then stops the other
    ranks. A hang (a rank that failed and left its peers' collectives unpaired, a missed message)
    then costs N seconds of the GPU's time, not the rest of the step's limit, and says where."""
    global _hang_file
    seconds = _int_env("PYDATACOPY_TEST_HANG_S", 0)
    if seconds <= 0:
        yield
        return
    if _hang_file is None:
        folder = os.environ.get("PYDATACOPY_TEST_HANG_DIR") or "."
        name = f"hang-rank{os.environ.get('RANK', '0')}-{os.getpid()}.log"
        _hang_file = open(os.path.join(folder, name), "w")  # noqa: SIM115 - open until the session ends
    _hang_file.seek(0)
    _hang_file.truncate()
    _hang_file.write(f"{item.nodeid}: still running after {seconds} s on rank {os.environ.get('RANK')}\n")
    _hang_file.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=_hang_file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session, exitstatus):
    global _hang_file
    if _hang_file is not None:
        _hang_file.close()
        os.unlink(_hang_file.name)
        _hang_file = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """A failure printed at once, through the terminal (not captured), as well as in the summary:
    a run that a crash or a hang (the step's timeout) ends later never prints its summary
    (2026-12-06g: test_put_many's failures unnamed twice; 2026-12-07: four unnamed F before a hang)."""
    if report.failed and _config is not None:
        terminal = _config.pluginmanager.getplugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(f"\n=== failed at once: {report.nodeid} ({report.when}), rank "
                                f"{os.environ.get('RANK')}")
            terminal.write_line(str(report.longrepr)[-6000:])


@pytest.fixture(scope="session")
def world(local_device):
    """torch.distributed and NVSHMEM through the design note's own path: (rank, world_size,
    unique_id). gloo when ranks share a GPU, nccl otherwise."""
    import torch.distributed as dist

    import pydatacopy

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_device)
    if shares_a_gpu():
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_device))
    # The note's test: rank 0 makes the ID, all_gather_object shares it, every rank joins.
    unique_id = pydatacopy.get_unique_id() if rank == 0 else None
    gathered = [None] * world_size
    dist.all_gather_object(gathered, unique_id)
    pe = pydatacopy.init_nvshmem(gathered[0], rank, world_size)
    assert pe == rank
    assert torch.cuda.current_device() == local_device
    yield rank, world_size, gathered[0]
    pydatacopy.finalize()
    dist.destroy_process_group()


_FULL_SM_COUNT = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
device, count = ctypes.c_int(), ctypes.c_int()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), int(sys.argv[1])) == 0
assert cuda.cuDeviceGetAttribute(ctypes.byref(count), 16, device) == 0  # MULTIPROCESSOR_COUNT
print(count.value)
"""


def _whole_gpu_sm_count(device: int, reported: int) -> int:
    """The GPU's SM count outside this client's MPS limit: asked of a short process without
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (whether the count a limited client sees is already its
    share is not documented); `reported` (this process's count) if that process fails."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    try:
        out = subprocess.run([sys.executable, "-c", _FULL_SM_COUNT, str(device)], env=env,
                             capture_output=True, text=True, timeout=60)
        return max(int(out.stdout.strip()), reported)
    except (OSError, ValueError, subprocess.SubprocessError):
        return reported


@pytest.fixture(scope="session")
def sm_share(local_device) -> int:
    """The SMs this process may use: its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the GPU's SMs
    under MPS, else all of them. Kernels that hold SMs on purpose are sized by it."""
    reported = torch.cuda.get_device_properties(local_device).multi_processor_count
    percent = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        fraction = float(percent) / 100 if percent else 1.0
    except ValueError:
        fraction = 1.0
    if not 0 < fraction < 1:
        return reported
    whole = _whole_gpu_sm_count(local_device, reported)
    # MPS hands SMs out in pairs (TPCs) on recent GPUs and may round either way: round down to a
    # pair, never more than this client reports, never fewer than one.
    return max(1, min(reported, int(whole * fraction) // 2 * 2))


@pytest.fixture
def force_rma():
    """PYDATACOPY_FORCE_RMA=1 for one test: the NVSHMEM RMA path a peer on another server takes.
    The core reads the variable once (at load and at init), so the switch is also set in it."""
    import pydatacopy
    from byte_patterns import NO_TORCH_MEMORY_ON_RMA, _torch_memory_registers

    if not _torch_memory_registers():
        # A refusal reaching every PE is test_moe.py's, under the default allocator; the forced-RMA
        # tests run in gpu-check's gpu2-tests-rma step, under the default allocator.
        pytest.skip("forced RMA under " + NO_TORCH_MEMORY_ON_RMA)
    before = os.environ.get("PYDATACOPY_FORCE_RMA")
    was_forced = pydatacopy._C.rma_forced()
    os.environ["PYDATACOPY_FORCE_RMA"] = "1"
    pydatacopy._C.set_rma_forced(True)
    try:
        yield
    finally:
        pydatacopy._C.set_rma_forced(was_forced)
        if before is None:
            del os.environ["PYDATACOPY_FORCE_RMA"]
        else:
            os.environ["PYDATACOPY_FORCE_RMA"] = before


@pytest.fixture
def peer(world):
    """The other PE of a two-PE module."""
    return 1 - world[0]


@pytest.fixture(params=["direct", "rma"])
def path(request):
    """Both paths: the direct stores PEs on one node use, and NVSHMEM RMA (another server)."""
    if request.param == "rma":
        request.getfixturevalue("force_rma")
    return request.param
