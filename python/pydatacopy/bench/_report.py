"""The table on the terminal, and CSV, Markdown and PNG files."""

from __future__ import annotations

import sys



def report(rows: list[dict], args) -> None:
    """The table on the terminal; CSV and PNG files when asked for."""
    def by_size(path, key="gbps"):
        return {(r["direction"], r["bytes"]): r[key] for r in rows if r["path"] == path and key in r}

    nccl, copy_engine = by_size("NCCL"), by_size("cudaMemcpyAsync")
    nixl_host_us = by_size("NIXL", "host_us")  # NIXL is timed on the host: so are its ratios
    print(f"\n{'op':<15} {'path':<20} {'dir':<4} {'size':>12} {'us':>10} {'p99us':>10} {'GB/s':>8} {'xNCCL':>6} "
          f"{'xCE':>6} {'xNIXL':>6} {'hostus':>7} {'xbase':>6} {'xbaseH':>6} {'1copy':>5}  ok  alloc")

    def ratio(r, baselines):
        base = baselines.get((r["direction"], r["bytes"]))
        return f"{r['gbps'] / base:6.2f}" if base else "     -"

    def x_base(r, key="xbase"):
        return f"{r[key]:6.2f}" if r.get(key) else "     -"

    def p99(r):  # rows timed as one kernel (the latency row) have no per-call times
        return f"{r['p99_us']:10.1f}" if r.get("p99_us") is not None else "         -"

    def issue(r):
        return f"{r['issue_us']:7.1f}" if r.get("issue_us") else "      -"

    def x_nixl(r):
        base = nixl_host_us.get((r["direction"], r["bytes"]))
        return f"{base / r['host_us']:6.2f}" if base and r.get("host_us") else "     -"

    def one_copy(r):  # send/recv rows: the receives that moved once, over all timed ones
        return f"{r['one_copy_fraction']:5.2f}" if r.get("one_copy_fraction") is not None else "    -"

    for r in rows:
        print(f"{r['op']:<15} {r['path']:<20} {r['direction']:<4} {r['size']:>12} {r['us']:>10.1f} "
              f"{p99(r)} {r['gbps']:>8.1f} {ratio(r, nccl)} {ratio(r, copy_engine)} {x_nixl(r)} "
              f"{issue(r)} {x_base(r)} {x_base(r, 'xbase_host')} {one_copy(r)}  {'yes' if r['ok'] else 'NO '} "
              f"{r.get('alloc', '-')}")
    print("us: median time of one call; p99us: its 99th percentile (every call of every repeat, the "
          "slower PE; NIXL's by the host's clock)")
    print("xbase: time over the row's baseline (a bare copy of the same bytes on this GPU, or the "
          "`base` named in --json/--csv), same run; xbaseH: host time per call, issuing only")
    print("1copy: send/recv rows, the receives that moved once (zero-copy) over all the row's timed receives; "
          "alloc: torch's allocator setting of the run")
    if getattr(args, "csv", None):
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["op", "path", "direction", "bytes", "size", "us", "p99_us", "host_us",
                                                   "gbps", "ok", "issue_us", "base", "xbase", "xbase_host",
                                                   "one_copy_fraction", "alloc"])
            writer.writeheader()
            writer.writerows({k: r.get(k, "") for k in writer.fieldnames} for r in rows)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write("| op | path | direction | size | us | p99 us | GB/s | x NCCL | x CE | x NIXL | host us | "
                    "x base | x base host | one copy | ok | alloc |\n"
                    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
            for r in rows:
                f.write(f"| {r['op']} | {r['path']} | {r['direction']} | {r['size']} | {r['us']:.1f} | "
                        f"{p99(r).strip()} | {r['gbps']:.1f} | {ratio(r, nccl).strip()} | {ratio(r, copy_engine).strip()} | "
                        f"{x_nixl(r).strip()} | {issue(r).strip()} | {x_base(r).strip()} | {x_base(r, 'xbase_host').strip()} | "
                        f"{one_copy(r).strip()} | {'yes' if r['ok'] else 'NO'} | {r.get('alloc', '-')} |\n")
    if getattr(args, "plot", None):
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    """GB/s against message size, one panel per direction, one line per path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    directions = [d for d in ("one", "both") if any(r["direction"] == d for r in rows)]
    rows = [r for r in rows if "spread" not in r]  # the engagement runs: one size, not a curve
    labels = sorted({f"{r['op']} ({r['path']})" for r in rows if r["op"] in ("put", "send/recv", "baseline")})
    colours = {label: f"C{i}" for i, label in enumerate(labels)}  # one colour per path in both panels
    figure, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 4.8), squeeze=False)
    for axis, direction in zip(axes[0], directions):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["direction"] == direction and r["op"] in ("put", "send/recv", "baseline"):
                series.setdefault(f"{r['op']} ({r['path']})", []).append((r["bytes"], r["gbps"]))
        for label, points in series.items():
            points.sort()
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                      label=label, color=colours[label],
                      linestyle="--" if "NCCL" in label or "baseline" in label else "-")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel("GB/s per direction")
        axis.set_title("rank 0 -> rank 1" if direction == "one" else "both directions at once")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
