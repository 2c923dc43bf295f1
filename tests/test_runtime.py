"""The runtime without a GPU (the package's runtime/): import and the unique ID, calls before
init, the device rule and its refusals with several ranks on one GPU, what init() decides from the
ranks' GPUs and MPS shares, the NCCL refusal, PYDATACOPY_FORCE_RMA read once, and the ID's
broadcast through real gloo groups."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pydatacopy
from pydatacopy import _C
from pydatacopy.runtime import agreement as _agreement
from pydatacopy.runtime.agreement import RankInfo

SETTINGS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "PYDATACOPY_RANKS_PER_GPU", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PIPE_DIRECTORY", "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


@pytest.fixture
def launch(monkeypatch):
    """A node with `gpus` visible devices, CUDA not yet initialised, and the given variables."""
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)

    def set_up(gpus: int, **variables: str) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_up


# ---- the device rule -----------------------------------------------------------------------

@pytest.mark.parametrize("gpus, per_gpu, on_node, local_rank, device", [
    (2, None, "2", "1", 1),   # one rank per GPU, as before
    (1, "2", "2", "1", 0),    # two ranks on one GPU
    (1, "4", "4", "3", 0),
    (2, "2", "4", "1", 0),    # two GPUs, two ranks each
    (2, "2", "4", "2", 1),
    (2, "2", "4", "3", 1),
    (4, "2", None, "5", 2),   # no LOCAL_WORLD_SIZE: the local rank alone
])
def test_local_rank_r_uses_device_r_over_ranks_per_gpu(launch, gpus, per_gpu, on_node, local_rank, device):
    variables = {"LOCAL_RANK": local_rank}
    if per_gpu:
        variables["PYDATACOPY_RANKS_PER_GPU"] = per_gpu
    if on_node:
        variables["LOCAL_WORLD_SIZE"] = on_node
    launch(gpus, **variables)
    assert pydatacopy.choose_device(7) == device


@pytest.mark.parametrize("rank, device", [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_without_local_rank_rank_over_ranks_per_gpu(launch, rank, device):
    launch(2, PYDATACOPY_RANKS_PER_GPU="2")
    assert pydatacopy.choose_device(rank) == device


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_without_local_rank_a_missing_device_is_refused_on_every_rank(launch, rank):
    """Four ranks, one GPU, no LOCAL_RANK: the old rule folded ranks 1-3 onto cuda:0 by a
    modulo (issue 18 forbids it); now every rank, rank 0 too, refuses (WORLD_SIZE tells each the
    last rank), naming the setting and device=."""
    launch(1, WORLD_SIZE="4")
    with pytest.raises(pydatacopy.Error) as info:
        pydatacopy.choose_device(rank)
    message = str(info.value)
    assert "rank 3 of 4 would need device 3" in message or "rank 3 would need device 3" in message
    assert "sees 1 CUDA device(s)" in message
    assert "PYDATACOPY_RANKS_PER_GPU=4 on every rank" in message and "device=" in message
    assert "LOCAL_RANK" in message


def test_without_local_rank_or_world_size_the_rank_alone_decides(launch):
    launch(2, PYDATACOPY_RANKS_PER_GPU="2")
    with pytest.raises(pydatacopy.Error, match="rank 4 would need device 2"):
        pydatacopy.choose_device(4)  # the old rule gave cuda:0 (modulo 2)
    launch(1, WORLD_SIZE="4", PYDATACOPY_RANKS_PER_GPU="4")
    assert [pydatacopy.choose_device(r) for r in range(4)] == [0, 0, 0, 0]


def test_more_local_ranks_than_devices_is_refused_naming_the_setting(launch):
    """The refusal seen with torchrun --nproc_per_node=2 on one GPU now says how to share it."""
    launch(1, LOCAL_RANK="1")
    with pytest.raises(pydatacopy.Error) as info:
        pydatacopy.choose_device(1)
    message = str(info.value)
    assert message.startswith("pydatacopy.choose_device: LOCAL_RANK=1 but this process sees 1 CUDA device(s)")
    assert "PYDATACOPY_RANKS_PER_GPU=2" in message and "device=" in message and "gloo" in message


@pytest.mark.parametrize("local_rank", ["0", "1", "2", "3"])
def test_every_rank_of_the_node_refuses_alike(launch, local_rank):
    """LOCAL_WORLD_SIZE=4 on one GPU with 2 per GPU: rank 0 refuses too, so that none waits in
    the ID's broadcast for ranks that refused (never a silent modulo onto cuda:0)."""
    launch(1, LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE="4", PYDATACOPY_RANKS_PER_GPU="2")
    with pytest.raises(pydatacopy.Error) as info:
        pydatacopy.choose_device(int(local_rank))
    message = str(info.value)
    assert "LOCAL_WORLD_SIZE=4 ranks on this node but this process sees 1 CUDA device(s)" in message
    assert "PYDATACOPY_RANKS_PER_GPU=4 on every rank" in message and "device=" in message


def test_a_bad_setting_is_refused_by_choose_device(launch):
    launch(1, LOCAL_RANK="0", PYDATACOPY_RANKS_PER_GPU="many")
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_RANKS_PER_GPU='many' is not a whole number"):
        pydatacopy.choose_device(0)


def test_the_rule_is_documented():
    doc = pydatacopy.choose_device.__doc__
    assert "LOCAL_RANK // PYDATACOPY_RANKS_PER_GPU" in doc and "silent modulo" in doc


# ---- what init() decides from every rank's GPU and MPS share --------------------------------

def _ranks(*specs) -> list[RankInfo]:
    """(gpu, mps, percentage) per rank."""
    return [RankInfo("d", "host", gpu, mps, pct) for gpu, mps, pct in specs]


def test_one_rank_per_gpu_has_nothing_to_say():
    assert _agreement.shared_gpu_verdict(_ranks(("A", False, None), ("B", False, None))) == (None, [])
    assert _agreement.shared_gpus(_ranks(("A", False, None), ("B", False, None), (None, False, None))) == []


def test_shared_gpus_groups_ranks_by_gpu():
    ranks = _ranks(("A", 1, 25), ("B", 1, 25), ("A", 1, 25), ("B", 1, 25), ("C", 1, None))
    assert _agreement.shared_gpus(ranks) == [[0, 2], [1, 3]]


def test_sharing_without_mps_warns_of_time_slicing():
    refusal, notes = _agreement.shared_gpu_verdict(_ranks(("A", False, None), ("A", False, None)))
    assert refusal is None and len(notes) == 1
    assert "ranks 0, 1 share GPU A without CUDA MPS" in notes[0] and "time-sliced" in notes[0]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in notes[0]


@pytest.mark.parametrize("shares", [(50, 50), (25, 25, 25, 25), (30, 30), (12.5,) * 8])
def test_shares_summing_to_at_most_100_pass(shares):
    assert _agreement.shared_gpu_verdict(_ranks(*[("A", True, s) for s in shares])) == (None, [])


def test_shares_past_100_are_refused_on_every_rank_alike():
    refusal, notes = _agreement.shared_gpu_verdict(_ranks(("A", True, 50), ("A", True, 60), ("B", True, 100)))
    assert notes == []
    assert "ranks 0, 1 share GPU A under CUDA MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 50 + 60 = 110 > 100" in refusal
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 (100 / 2 ranks)" in refusal
    assert "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1" in refusal


def test_nvshmems_own_override_turns_the_refusal_into_a_warning():
    refusal, notes = _agreement.shared_gpu_verdict(_ranks(("A", True, 100), ("A", True, 100)), True)
    assert refusal is None and "own risk" in notes[0]


def test_an_unset_share_under_mps_warns():
    refusal, notes = _agreement.shared_gpu_verdict(_ranks(("A", True, 50), ("A", True, None)))
    assert refusal is None
    assert "rank 1 did not set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in notes[0]


def test_the_gpu_identity_is_none_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _agreement._gpu_identity() is None


# ---- through a real gloo group: every rank decides alike --------------------------------------

def _sharing_worker(rank: int, store_file: str, shares: list, results) -> None:
    from pydatacopy.runtime import probes as _probes
    from pydatacopy.runtime import agreement as _agreement

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=len(shares))
    try:
        _agreement._gpu_identity = lambda: "GPU-one"  # every rank on one GPU
        _probes.mps_control_pipe = lambda environ=None: "/tmp/nvidia-mps/control"
        if shares[rank] is not None:
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(shares[rank])
        _, ranks = _agreement._share_unique_id_and_ranks()
        try:
            _agreement._check_shared_gpus(None, ranks, "pydatacopy.init")
            results[rank] = ("started", [r.gpu for r in ranks])
        except pydatacopy.Error as error:
            results[rank] = (str(error), [r.gpu for r in ranks])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shares, refused", [([50, 50], False), ([50, 75, 25], True)])
def test_ranks_learn_who_shares_their_gpu_and_refuse_together(tmp_path, shares, refused):
    results = mp.Manager().dict()
    mp.spawn(_sharing_worker, args=(str(tmp_path / "rendezvous"), shares, results), nprocs=len(shares), join=True)
    for rank in range(len(shares)):
        verdict, gpus = results[rank]
        assert gpus == ["GPU-one"] * len(shares)
        if refused:
            assert verdict.startswith("pydatacopy.init: NVSHMEM was not started on any rank: ranks 0, 1, 2 "
                                      "share GPU GPU-one under CUDA MPS"), verdict
        else:
            assert verdict == "started"


# ---- torch.distributed on nccl with ranks on one GPU ------------------------------------------

@pytest.fixture
def gloo_posing_as_nccl(tmp_path, monkeypatch):
    """A one-rank gloo group that reports the nccl backend."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _no_cuda_needed(monkeypatch) -> list:
    """torch.cuda.set_device records the device; _gpu_identity names a GPU per device."""
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(_agreement, "_gpu_identity", lambda: f"GPU-{chosen[-1]}")
    return chosen


def test_init_refuses_ranks_per_gpu_on_an_nccl_group_before_nccl_runs(gloo_posing_as_nccl, launch, monkeypatch):
    launch(1, LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", PYDATACOPY_RANKS_PER_GPU="2")
    _no_cuda_needed(monkeypatch)
    touched = []
    for name in ("broadcast_object_list", "all_gather_object"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: touched.append(_name))
    with pytest.raises(pydatacopy.Error) as info:
        pydatacopy.init()
    message = str(info.value)
    assert message.startswith("pydatacopy.init: NVSHMEM was not started on any rank: "
                              "PYDATACOPY_RANKS_PER_GPU > 1 on rank 0 put several ranks on one GPU, "
                              "and the torch.distributed group's backend is nccl: NCCL refuses two ranks on one GPU"), message
    assert "init_process_group('gloo')" in message
    assert touched == [], "refused before any collective of the backend (the store carried the facts)"


def _nccl_agreement_worker(rank: int, store_file: str, per_gpu: list, results) -> None:
    """A gloo group posing as nccl; PYDATACOPY_RANKS_PER_GPU set as `per_gpu` says (None: unset),
    each rank on its own GPU-<device> as the rule puts it. Reaching the ID's broadcast is
    recorded, not run (with real NCCL the ranks that refused would never come)."""
    import datetime

    from pydatacopy.runtime import agreement as _agreement

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=len(per_gpu), timeout=datetime.timedelta(seconds=60))
    try:
        dist.get_backend = lambda group=None: "nccl"
        torch.cuda.device_count = lambda: 2
        torch.cuda.is_initialized = lambda: False
        chosen: list = []
        torch.cuda.set_device = chosen.append
        _agreement._gpu_identity = lambda: f"GPU-{chosen[-1]}"
        _agreement._share_unique_id_and_ranks = lambda group=None: (_ for _ in ()).throw(
            RuntimeError("reached the ID's broadcast"))
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(len(per_gpu)),
                          PYDATACOPY_INIT_TIMEOUT_S="30")
        os.environ.pop("WORLD_SIZE", None)
        if per_gpu[rank] is None:
            os.environ.pop("PYDATACOPY_RANKS_PER_GPU", None)
        else:
            os.environ["PYDATACOPY_RANKS_PER_GPU"] = per_gpu[rank]
        try:
            pydatacopy.init()
            results[rank] = "started"
        except Exception as error:  # noqa: BLE001 - the test compares what every rank saw
            results[rank] = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def test_ranks_per_gpu_on_some_ranks_only_is_refused_on_every_rank(tmp_path):
    """PYDATACOPY_RANKS_PER_GPU=2 on rank 0 only, nccl: the old check refused on rank 0 alone and
    rank 1 went on into the ID's broadcast (with NCCL: a wait for rank 0 that never comes)."""
    results = mp.Manager().dict()
    mp.spawn(_nccl_agreement_worker, args=(str(tmp_path / "rendezvous"), ["2", None], results),
             nprocs=2, join=True)
    assert results[0] == results[1], dict(results)
    assert results[0].startswith("Error: pydatacopy.init: NVSHMEM was not started on any rank: "
                                 "PYDATACOPY_RANKS_PER_GPU > 1 on rank 0 (the ranks disagree: [1, 2]; "
                                 "set it alike on every rank) put several ranks on one GPU"), results[0]


def test_a_rank_that_cannot_choose_its_device_stops_every_rank(tmp_path):
    """PYDATACOPY_RANKS_PER_GPU bad on rank 1 only: rank 1's refusal reaches rank 0 too."""
    results = mp.Manager().dict()
    mp.spawn(_nccl_agreement_worker, args=(str(tmp_path / "rendezvous"), [None, "many"], results),
             nprocs=2, join=True)
    for rank in (0, 1):
        assert results[rank].startswith("Error: pydatacopy.init: NVSHMEM was not started on any rank, "
                                        "because on rank 1 of the group: "), results[rank]
        assert "PYDATACOPY_RANKS_PER_GPU='many'" in results[rank]


def test_one_rank_per_gpu_on_nccl_passes_the_agreement(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_nccl_agreement_worker, args=(str(tmp_path / "rendezvous"), [None, None], results),
             nprocs=2, join=True)
    assert results[0] == results[1] == "RuntimeError: reached the ID's broadcast", dict(results)


def test_ncclss_duplicate_gpu_error_becomes_ours(gloo_posing_as_nccl, monkeypatch):
    def broadcast(*args, **kwargs):  # what torch raises when NCCL finds two ranks on one GPU
        raise dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage\n"
                                    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(pydatacopy.Error) as info:
        _agreement._share_unique_id_and_ranks()
    message = str(info.value)
    assert "share a GPU, and its backend is nccl: NCCL refuses two ranks on one GPU" in message
    assert "init_process_group('gloo')" in message and "Duplicate GPU detected" in message


def test_other_nccl_errors_pass_through(gloo_posing_as_nccl, monkeypatch):
    def broadcast(*args, **kwargs):
        raise dist.DistBackendError("NCCL error: unhandled system error")
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(dist.DistBackendError, match="unhandled system error"):
        _agreement._share_unique_id_and_ranks()


# ---- PYDATACOPY_FORCE_RMA, read once -----------------------------------------------------------

def test_force_rma_is_read_once_and_set_through_the_core(monkeypatch):
    """rma_forced() is asked on every put and send: it no longer reads the environment each
    time (the old one did, so a change of os.environ showed at once); tests switch it with
    _C.set_rma_forced, as the force_rma fixture of tests/gpu does."""
    from pydatacopy import _C

    before = _C.rma_forced()
    try:
        monkeypatch.setenv("PYDATACOPY_FORCE_RMA", "0" if before else "1")
        assert _C.rma_forced() == before, "an environment change after load is not read per call"
        _C.set_rma_forced(True)
        assert _C.rma_forced()
        _C.set_rma_forced(False)
        assert not _C.rma_forced()
    finally:
        _C.set_rma_forced(before)


# ---- import, IDs and calls before init -------------------------------------------------------

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
    from pydatacopy.runtime import network as _network
    from pydatacopy.runtime import agreement as _agreement

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=len(hosts))
    try:
        _network.host_identity = lambda: hosts[rank]  # this rank's node, as the test lays them out
        unique_id, nodes = _agreement._share_unique_id()
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
    from pydatacopy.runtime import network as _network
    from pydatacopy.runtime import agreement as _agreement

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=3)
    try:
        def preflight(world_size, **kwargs):  # a node with a remote transport, or without
            if rank in refusing:
                raise pydatacopy.Error(f"no remote transport on the node of rank {rank}")
        _network.check_transport_preconditions = preflight
        try:
            _agreement._agree_on_preflight(None, 3, 2, "pydatacopy.init")
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
