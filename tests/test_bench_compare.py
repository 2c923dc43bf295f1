"""scripts/bench_compare.py: two bench JSON files side by side (the before/after table of a run)."""

import importlib.util
import json
import pathlib

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_compare.py"


def _compare_module():
    spec = importlib.util.spec_from_file_location("bench_compare", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(op, size, nbytes, us, ok=True, xbase=None):
    row = {"op": op, "path": "p", "direction": "all", "size": size, "bytes": nbytes, "us": us, "ok": ok}
    if xbase is not None:
        row["xbase"] = xbase
    return row


def test_rows_matched_by_size_and_bytes_with_ratio_and_failed_checks(tmp_path):
    before = [_row("baseline", "ds-128", 10, 2.0), _row("baseline", "ds-128", 20, 4.0),
              _row("moe", "ds-128", 30, 100.0, xbase=5.0), _row("gone", "4K", 1, 1.0)]
    after = [_row("baseline", "ds-128", 20, 3.0), _row("baseline", "ds-128", 10, 2.0),
             _row("moe", "ds-128", 30, 50.0, ok=False, xbase=2.5), _row("new", "4K", 1, 1.0)]
    (tmp_path / "b.json").write_text(json.dumps(before))
    (tmp_path / "a.json").write_text(json.dumps(after))
    table = _compare_module().compare(str(tmp_path / "b.json"), str(tmp_path / "a.json"))
    lines = table.splitlines()
    assert "| baseline | p | all | ds-128 | 20 | 4.0 | 3.0 | 0.75 |  |  |" in lines
    assert "| baseline | p | all | ds-128 | 10 | 2.0 | 2.0 | 1.00 |  |  |" in lines
    assert "| moe | p | all | ds-128 | 30 | 100.0 | 50.0 (check FAILED) | 0.50 | 5.00 | 2.50 |" in lines
    assert any(line.startswith("Only after (1): new p all 4K 1") for line in lines)
    assert any(line.startswith("Only before (1): gone p all 4K 1") for line in lines)


def _compare(tmp_path, before, after):
    (tmp_path / "b.json").write_text(json.dumps(before))
    (tmp_path / "a.json").write_text(json.dumps(after))
    return _compare_module().compare(str(tmp_path / "b.json"), str(tmp_path / "a.json")).splitlines()


def test_p99_before_and_after_when_both_runs_have_it(tmp_path):
    before = [dict(_row("send/recv", "4K", 4096, 10.0), p99_us=14.0), _row("put", "4K", 4096, 5.0)]
    after = [dict(_row("send/recv", "4K", 4096, 8.0), p99_us=9.5), dict(_row("put", "4K", 4096, 5.0), p99_us=6.0)]
    lines = _compare(tmp_path, before, after)
    assert lines[0].endswith("| xbase after | p99 before | p99 after |")
    assert "| send/recv | p | all | 4K | 4096 | 10.0 | 8.0 | 0.80 |  |  | 14.0 | 9.5 |" in lines
    assert "| put | p | all | 4K | 4096 | 5.0 | 5.0 | 1.00 |  |  |  | 6.0 |" in lines  # the old run had none


def test_no_p99_columns_against_a_run_without_p99(tmp_path):
    lines = _compare(tmp_path, [_row("put", "4K", 4096, 5.0)], [dict(_row("put", "4K", 4096, 4.0), p99_us=6.0)])
    assert lines[0].endswith("| xbase before | xbase after |")
    assert "| put | p | all | 4K | 4096 | 5.0 | 4.0 | 0.80 |  |  |" in lines


def test_the_nccl_row_of_older_runs_matches_todays_baseline_row(tmp_path):
    old = dict(_row("send/recv", "1M", 1 << 20, 40.0), path="NCCL")
    new = dict(_row("baseline", "1M", 1 << 20, 30.0), path="NCCL")
    lines = _compare(tmp_path, [old], [new])
    assert "| baseline | NCCL | all | 1M | 1048576 | 40.0 | 30.0 | 0.75 |  |  |" in lines
    assert not any(line.startswith(("\nOnly", "Only")) for line in lines)
