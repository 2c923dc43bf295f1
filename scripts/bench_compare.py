"""Two bench JSON files (pydatacopy.bench or pydatacopy.bench.moe, --json) side by side, as Markdown:

    python scripts/bench_compare.py BEFORE.json AFTER.json

Rows are matched by (op, path, direction, size, bytes); each gets its time before and after, after/before,
and the rows' own `xbase` (time over the bare copy of the same run) where they have one. Rows only
one side has are listed after the table. A row whose data check failed (`ok` false) says so."""

from __future__ import annotations

import json
import sys


def _key(row: dict) -> tuple:
    return (row.get("op"), row.get("path"), row.get("direction"), row.get("size"), row.get("bytes"))


def _load(path: str) -> dict:
    with open(path) as handle:
        rows = json.load(handle)
    return {_key(row): row for row in rows}


def _xbase(row: dict) -> str:
    value = row.get("xbase")
    return f"{value:.2f}" if isinstance(value, (int, float)) else ""


def _us(row: dict) -> str:
    text = f"{row['us']:.1f}"
    return text if row.get("ok", True) else text + " (check FAILED)"


def compare(before_path: str, after_path: str) -> str:
    before, after = _load(before_path), _load(after_path)
    lines = ["| op | path | dir | size | bytes | before us | after us | after / before | xbase before | xbase after |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, row in after.items():
        if key not in before:
            continue
        old = before[key]
        ratio = row["us"] / old["us"] if old.get("us") else float("nan")
        lines.append(f"| {' | '.join(str(k) for k in key)} | {_us(old)} | {_us(row)} | {ratio:.2f} | "
                     f"{_xbase(old)} | {_xbase(row)} |")
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
