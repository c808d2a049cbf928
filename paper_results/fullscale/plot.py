"""The figures of this folder, from its JSON/CSV files: python paper_results/fullscale/plot.py"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def data_prep_figure() -> None:
    builders = {"before": "one process, padded rows", "parallel": "parallel, corpus in memory", "streamed": "streamed"}
    points = {name: [] for name in builders}
    for path in sorted(HERE.glob("data_prep_*.json")):
        facts = json.loads(path.read_text())
        if "example_tokens" not in facts or "before_sop_split" in path.name or "run1" in path.name:
            continue
        label = facts.get("label") or ("before" if "before" in path.name else "parallel")
        label = {"after": "parallel", "smoke": "streamed", "smoke2": "streamed"}.get(label, label)
        if label in points:
            points[label].append((facts["example_tokens"] / 1e6, facts["peak_tree_rss_mib"] / 1024))
    figure, axes = plt.subplots(figsize=(6.5, 4))
    for name, values in points.items():
        values.sort()
        axes.plot([x for x, _ in values], [y for _, y in values], "o-", label=builders[name])
    axes.axhline(4, color="grey", linestyle="--", label="target: 4 GB")
    axes.set_xscale("log")
    axes.set_xlabel("example tokens, millions (100 = WikiText-103's size)")
    axes.set_ylabel("peak RSS of the build, GiB (summed)")
    axes.set_title("ALBERT data preparation of one volunteer, 2-core CPU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(HERE / "data_prep_peak_memory.png", dpi=120)


def machine_memory_figure() -> None:
    lines = (HERE / "machine_memory_third_session.csv").read_text().splitlines()
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    times = [datetime.strptime(row["time_utc"], "%H:%M:%S") for row in rows]
    used = [int(row["used_mib"]) / 1024 for row in rows]
    runs = json.loads((HERE / "rehearsal_third_session_runs.json").read_text())["runs"]
    figure, axes = plt.subplots(figsize=(9, 4))
    axes.plot(times, used, linewidth=0.8, color="black", label="machine memory in use (every process)")
    axes.axhline(23.5, color="red", linestyle="--", label="machine total")
    for index, run in enumerate(runs):
        start = datetime.strptime(run["run_start_utc"], "%H:%M:%S")
        end = datetime.strptime(run["run_end_utc"], "%H:%M:%S")
        axes.axvspan(start, end, alpha=0.15, color=f"C{index}")
        name = run["config"].split("/")[1] + ("" if "baseline" not in run["config"] else " DDP")
        axes.text(start, 0.5 + (index % 3), f"{name}\n{run['status'][:22]}", fontsize=6)
    axes.set_ylabel("GiB")
    axes.set_xlabel("UTC, 2026-12-07")
    axes.set_title("Machine memory during the third session's rehearsals (others' work ran beside them)")
    axes.legend(loc="upper right", fontsize=7)
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
    figure.tight_layout()
    figure.savefig(HERE / "machine_memory_third_session.png", dpi=120)


if __name__ == "__main__":
    data_prep_figure()
    machine_memory_figure()
