"""The bench without a GPU: the percentile, the call counts of large messages, the timing's
conversions, the p99 column of the table and the CSV, the send/recv rows' names and paths, and
the engine's cuts put back after a forced row."""

import csv
import types

import pytest

import pydatacopy
from pydatacopy import bench
from pydatacopy.bench import _cli, _harness, report
from pydatacopy.bench import group as bench_group
from pydatacopy.bench import send_recv as bench_send_recv


def test_percentile_is_linear_between_the_nearest_ranks():
    samples = [float(n) for n in range(100, 0, -1)]  # 1..100, unsorted
    assert _harness.percentile(samples, 50) == pytest.approx(50.5)
    assert _harness.percentile(samples, 99) == pytest.approx(99.01)
    assert _harness.percentile(samples, 0) == 1.0
    assert _harness.percentile(samples, 100) == 100.0
    assert _harness.percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("samples, q", [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_refuses_no_samples_and_a_q_out_of_range(samples, q):
    with pytest.raises(ValueError):
        _harness.percentile(samples, q)


def test_gaps_are_the_times_between_consecutive_stamps():
    assert _harness.gaps([1.0, 1.5, 3.5]) == [0.5, 2.0]
    assert _harness.gaps([1.0, 1.5], 1e6) == [500000.0]


@pytest.mark.parametrize("nbytes, counts", [
    (4 << 10, (20, 5)), (64 << 20, (20, 5)),   # up to 64 MiB: -n and -w as given
    (128 << 20, (10, 2)), (256 << 20, (5, 2)), (1 << 30, (5, 2)),  # above: fewer, with a floor
])
def test_large_messages_time_fewer_calls(nbytes, counts):
    assert _harness.counts_for_size(nbytes, 20, 5) == counts


def test_large_messages_never_time_more_calls_than_asked():
    assert _harness.counts_for_size(1 << 30, 3, 1) == (3, 1)
    assert _harness.counts_for_size(1 << 30, 200, 0) == (12, 0)


def test_timing_per_operation_and_by_the_host_clock():
    timed = _harness.Timing(seconds=2.0, p99_seconds=4.0, host_seconds=6.0, host_p99_seconds=8.0,
                            issue_seconds=1.0)
    assert timed.per(2) == _harness.Timing(1.0, 2.0, 3.0, 4.0, 0.5)
    host = timed.by_host_clock()
    assert (host.seconds, host.p99_seconds, host.issue_seconds) == (6.0, 8.0, 1.0)


def test_a_row_has_its_median_and_p99_in_microseconds():
    timed = _harness.Timing(10e-6, 25e-6, 12e-6, 30e-6, 4e-6)
    row = _harness.make_row("send/recv", "default", "one", 4096, timed, True)
    assert row["us"] == pytest.approx(10.0) and row["p99_us"] == pytest.approx(25.0)
    assert row["host_us"] == pytest.approx(12.0) and row["issue_us"] == pytest.approx(4.0)
    assert row["gbps"] == pytest.approx(4096 / 10e-6 / 1e9)


def test_the_table_and_csv_show_p99_beside_us(tmp_path, capsys):
    timed = _harness.Timing(10e-6, 25e-6, 12e-6, 30e-6, 4e-6)
    rows = [_harness.make_row("send/recv", "default", "one", 4096, timed, True),
            {"op": "latency", "path": "8B signal ping-pong", "direction": "one-way", "bytes": 8,
             "size": "8", "us": 0.5, "gbps": 0.016, "ok": True}]  # one kernel: no p99
    args = types.SimpleNamespace(csv=str(tmp_path / "rows.csv"), markdown=str(tmp_path / "rows.md"), plot=None)
    report(rows, args)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    assert header.split()[4:6] == ["us", "p99us"]
    assert next(line for line in lines if line.startswith("send/recv")).split()[4:6] == ["10.0", "25.0"]
    # "8B signal ping-pong" is three words: its us and p99 come three words later
    assert next(line for line in lines if line.startswith("latency")).split()[6:8] == ["0.5", "-"]
    with open(tmp_path / "rows.csv") as f:
        written = list(csv.DictReader(f))
    assert float(written[0]["p99_us"]) == pytest.approx(25.0) and written[1]["p99_us"] == ""
    markdown = (tmp_path / "rows.md").read_text().splitlines()
    assert markdown[0].startswith("| op | path | direction | size | us | p99 us |")
    assert markdown[2].startswith("| send/recv | default | one | 4K | 10.0 | 25.0 |")


SEND_RECV_OPS = {"sendrecv_default": "default", "sendrecv": "zero-copy", "sendrecv_ce": "copy-engine",
                 "sendrecv_staged": "staged",
                 "sendrecv_ll": "low-latency", "sendrecv_distributed": "torch.distributed (default)",
                 "sendrecv_distributed_python": "torch.distributed Python group"}


def test_every_send_recv_path_has_its_op_and_the_default_row_runs_first():
    assert {op: path for op, (kind, path) in _cli.LABELS.items() if kind == "send/recv"} == SEND_RECV_OPS
    assert [op for op in _cli.SWEEP_OPS if op in SEND_RECV_OPS][0] == "sendrecv_default"
    assert set(_cli.SWEEP_ROWS) == set(_cli.SWEEP_OPS) and set(_cli.SWEEP_OPS) <= set(bench.OPS)
    assert set(SEND_RECV_OPS) <= bench.parse_args([]).ops  # all of them by default
    assert bench.parse_args(["--ops", "sendrecv_default,sendrecv_ll"]).ops == {"sendrecv_default", "sendrecv_ll"}


class _FakeEngineSettings:
    """The cuts of pydatacopy.send_recv.send_recv, kept here: what engine_cuts sets."""

    def __init__(self, monkeypatch, zero_copy_min: int, low_latency_max: int, copy_engine_min: int = 64 << 20):
        self.zero_copy_min, self.low_latency_max, self.copy_engine_min = zero_copy_min, low_latency_max, copy_engine_min
        module = bench_send_recv._send_recv
        monkeypatch.setattr(module, "copy_engine_min_bytes", lambda: self.copy_engine_min)
        monkeypatch.setattr(module, "set_copy_engine_min_bytes", lambda n: setattr(self, "copy_engine_min", n))
        monkeypatch.setattr(module, "zero_copy_min_bytes", lambda: self.zero_copy_min)
        monkeypatch.setattr(module, "low_latency_max_bytes", lambda: self.low_latency_max, raising=False)
        monkeypatch.setattr(module, "set_zero_copy_min_bytes", lambda n: setattr(self, "zero_copy_min", n))
        monkeypatch.setattr(module, "set_low_latency_max_bytes", lambda n: setattr(self, "low_latency_max", n),
                            raising=False)


def test_a_forced_row_sets_the_cuts_and_puts_back_the_ones_before(monkeypatch):
    engine = _FakeEngineSettings(monkeypatch, zero_copy_min=32 << 20, low_latency_max=16 << 10)
    cuts = lambda: (engine.zero_copy_min, engine.low_latency_max, engine.copy_engine_min)  # noqa: E731
    with bench_send_recv.engine_cuts(zero_copy_min_bytes=0, low_latency_max_bytes=64 << 10):
        assert cuts() == (0, 64 << 10, 0)  # the copy engine off unless the row asks for it
    assert cuts() == (32 << 20, 16 << 10, 64 << 20)
    with bench_send_recv.engine_cuts(zero_copy_min_bytes=1, low_latency_max_bytes=0, copy_engine_min_bytes=1):
        assert cuts() == (1, 0, 1)
    assert cuts() == (32 << 20, 16 << 10, 64 << 20)
    with pytest.raises(RuntimeError):
        with bench_send_recv.engine_cuts(zero_copy_min_bytes=1, low_latency_max_bytes=0):
            raise RuntimeError("the row failed")
    assert cuts() == (32 << 20, 16 << 10, 64 << 20)


def test_the_low_latency_row_runs_only_up_to_the_capacity(monkeypatch):
    monkeypatch.setattr(pydatacopy._C, "LOW_LATENCY_CAPACITY_BYTES", 64 << 10, raising=False)
    assert bench_send_recv.low_latency_fits(64 << 10)
    assert not bench_send_recv.low_latency_fits((64 << 10) + 1)


def test_the_group_rows_send_and_receive_every_piece_under_each_paths_cuts(monkeypatch):
    """bench_group without a GPU: per size, a local copy and one row per path (low-latency only
    where the size fits it), each group moving every piece of the send buffer to the matching
    piece of the receive buffer, under the path's cuts, which are put back after."""
    engine = _FakeEngineSettings(monkeypatch, zero_copy_min=16 << 20, low_latency_max=16 << 10)
    monkeypatch.setattr(pydatacopy._C, "LOW_LATENCY_CAPACITY_BYTES", 64 << 10, raising=False)
    calls = []  # (what, offset into its buffer, bytes, the cuts at the call)

    class FakeSweep:
        def __init__(self, nbytes, both, args):
            import torch

            self.nbytes, self.both, self.peer = nbytes, both, 1
            self.src = torch.zeros(nbytes, dtype=torch.uint8)
            self.out = torch.zeros(nbytes, dtype=torch.uint8)

        def measure(self, run, dst, local=False):
            run()
            return _harness.Timing(10e-6, 20e-6, 11e-6, 21e-6, 5e-6), True

    def record(what, buffer):
        def call(tensor, peer):
            assert peer == 1
            calls.append((what, tensor.data_ptr() - buffer().data_ptr(), tensor.numel(),
                          (engine.zero_copy_min, engine.low_latency_max)))
        return call

    sweeps = []
    monkeypatch.setattr(bench_group, "Sweep", lambda *a: sweeps.append(FakeSweep(*a)) or sweeps[-1])
    monkeypatch.setattr(bench_group.baselines, "local_copy", lambda sweep: sweep.measure(lambda: None, sweep.out))
    monkeypatch.setattr(pydatacopy, "group", lambda: __import__("contextlib").nullcontext())
    monkeypatch.setattr(pydatacopy, "send", record("send", lambda: sweeps[-1].src))
    monkeypatch.setattr(pydatacopy, "recv", record("recv", lambda: sweeps[-1].out))
    rows = bench_group.bench_group(types.SimpleNamespace(), messages=4, sizes=(16 << 10, 128 << 10))
    assert [r["path"] for r in rows] == [
        "group 4 x 16K, local copy", "group 4 x 16K, default", "group 4 x 16K, staged",
        "group 4 x 16K, low-latency", "group 4 x 128K, local copy", "group 4 x 128K, default",
        "group 4 x 128K, staged"]
    assert all(r["direction"] == "both" for r in rows) and rows[1]["xbase"] == pytest.approx(1.0)
    assert [r["bytes"] for r in rows] == [64 << 10] * 4 + [512 << 10] * 3
    piece = 16 << 10
    default, staged, low_latency = calls[:8], calls[8:16], calls[16:24]
    assert [(c[0], c[1], c[2]) for c in default] == [
        (what, m * piece, piece) for m in range(4) for what in ("send", "recv")]
    assert {c[3] for c in default} == {(16 << 20, 16 << 10)}
    assert {c[3] for c in staged} == {(0, 0)}
    assert {c[3] for c in low_latency} == {(0, 64 << 10)}
    assert len(calls) == 24 + 16 and (engine.zero_copy_min, engine.low_latency_max) == (16 << 20, 16 << 10)
