"""Two bench JSON files (pydatacopy.bench or pydatacopy.bench.moe, --json) side by side, as Markdown:

    python scripts/bench_compare.py BEFORE.json AFTER.json

Rows are matched by (op, path, direction, size, bytes); each gets its time before and after, after/before,
and the rows' own `xbase` (time over the bare copy of the same run) where they have one; the 99th
percentile of one call (`p99_us`) before and after when both runs recorded it (runs before it did not).
Rows only one side has are listed after the table. A row whose data check failed (`ok` false) says so."""

from __future__ import annotations

import json
import sys

#: (op, path) of rows that older runs named otherwise -> today's, so that they still match.
RENAMED = {("send/recv", "NCCL"): ("baseline", "NCCL")}


def _key(row: dict) -> tuple:
    op, path = RENAMED.get((row.get("op"), row.get("path")), (row.get("op"), row.get("path")))
    return (op, path, row.get("direction"), row.get("size"), row.get("bytes"))


def _load(path: str) -> dict:
    with open(path) as handle:
        rows = json.load(handle)
    return {_key(row): row for row in rows}


def _figure(row: dict, key: str, digits: int) -> str:
    value = row.get(key)
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else ""


def _us(row: dict) -> str:
    text = f"{row['us']:.1f}"
    return text if row.get("ok", True) else text + " (check FAILED)"


def compare(before_path: str, after_path: str) -> str:
    before, after = _load(before_path), _load(after_path)
    matched = [(before[key], row, key) for key, row in after.items() if key in before]
    with_p99 = any("p99_us" in old and "p99_us" in row for old, row, _ in matched)
    p99_header, p99_rule = (" p99 before | p99 after |", "---:|---:|") if with_p99 else ("", "")
    lines = ["| op | path | dir | size | bytes | before us | after us | after / before | xbase before | xbase after |"
             + p99_header, "|---|---|---|---|---:|---:|---:|---:|---:|---:|" + p99_rule]
    for old, row, key in matched:
        ratio = row["us"] / old["us"] if old.get("us") else float("nan")
        p99 = f" {_figure(old, 'p99_us', 1)} | {_figure(row, 'p99_us', 1)} |" if with_p99 else ""
        lines.append(f"| {' | '.join(str(k) for k in key)} | {_us(old)} | {_us(row)} | {ratio:.2f} | "
                     f"{_figure(old, 'xbase', 2)} | {_figure(row, 'xbase', 2)} |" + p99)
    only_after = [key for key in after if key not in before]
    only_before = [key for key in before if key not in after]
    if only_after:
        lines.append(f"\nOnly after ({len(only_after)}): " + "; ".join(" ".join(map(str, k)) for k in only_after))
    if only_before:
        lines.append(f"\nOnly before ({len(only_before)}): " + "; ".join(" ".join(map(str, k)) for k in only_before))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(compare(sys.argv[1], sys.argv[2]))
