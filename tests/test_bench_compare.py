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
