"""Bytes sent per sample per trainer and wall time per setup, from a compare_setups summary.csv (log scale).

.venv/bin/python paper_results/comparison/diloco/plot_bytes.py paper_results/comparison/diloco/emulated
"""

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    folder = Path(sys.argv[1])
    with (folder / "summary.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle)]
    names = [row["setup"] for row in rows]
    sent = [float(row["bytes_sent_per_sample"] or 0) for row in rows]
    wall = [float(row["wall_seconds"]) for row in rows]
    sync = next((value for name, value in zip(names, sent) if name == "collab_sync"), None)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = left.bar(names, [max(value, 1.0) for value in sent], color="tab:blue")
    left.set_yscale("log")
    left.set_ylabel("TCP bytes a trainer sent per sample (log)")
    for bar, value in zip(bars, sent):
        label = "0 (one process)" if value == 0 else f"{value:,.0f}"
        if sync and value and value != sync:
            label += f"\n{sync / value:.1f}x fewer than sync"
        top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
        left.annotate(label, top, ha="center", va="bottom", fontsize=7)
    right.bar(names, wall, color="tab:orange")
    right.set_ylabel("wall time, launch to exit (s)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30, labelsize=8)
        axis.grid(alpha=0.3, axis="y")
    figure.suptitle("swarms on emulated paper-mix hosts (200/100/100/50 Mb/s + aux); one process and DDP on loopback")
    figure.tight_layout()
    figure.savefig(folder / "bytes_and_wall_time.png", dpi=120)


if __name__ == "__main__":
    main()
