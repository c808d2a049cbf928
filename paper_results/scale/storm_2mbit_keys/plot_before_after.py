"""The slow-donor storm before/after: each newcomer's process start to loaded state, without and with the limit,
every run (a repeat's JSON is drawn when it exists).

Run from the repository root: .venv/bin/python paper_results/scale/storm_2mbit_keys/plot_before_after.py
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the file backend)

BASE = "paper_results/scale/storm_2mbit_keys/"
RUNS = [
    ("no limit, 11:30", "storm_2mbit_nolimit.json", "tab:red"),
    ("no limit, 15:27", "storm_2mbit_nolimit_r2.json", "lightcoral"),
    ("max_concurrent_state_uploads=1, 11:56", "storm_2mbit_limit1.json", "tab:green"),
    ("max_concurrent_state_uploads=1, 15:44", "storm_2mbit_limit1_r2.json", "yellowgreen"),
]
RUNS = [run for run in RUNS if os.path.exists(BASE + run[1])]
WIDTH = 0.8 / len(RUNS)

fig, ax = plt.subplots(figsize=(9, 4.2))
for k, (label, name, color) in enumerate(RUNS):
    with open(BASE + name) as file:
        run = json.load(file)
    xs, ys, left_out = [], [], []
    for index, newcomer in enumerate(run["newcomer_details"]):
        x = index + (k - (len(RUNS) - 1) / 2) * WIDTH
        if newcomer["contributed"]:
            xs.append(x)
            ys.append(newcomer["to_loaded_state_seconds"])
        else:
            left_out.append(x)
    failed = run["newcomers_failed_download_attempts"]
    ax.bar(
        xs,
        ys,
        WIDTH,
        color=color,
        label=f"{label}: {run['newcomers_contributed']}/10 joined, {failed} failed attempts",
    )
    if left_out:
        ax.scatter(
            left_out,
            [10] * len(left_out),
            marker="x",
            color=color,
            s=60,
            label=f"{label}: did not get in (exit 2 at the 300-s deadline)",
        )
ax.set_xticks(range(10))
ax.set_xticklabels([f"n{index:02d}" for index in range(10)])
ax.set_ylabel("process start to loaded state (s)")
ax.set_title("10 newcomers into 6 donors on 2 Mbit/s uplinks (tiny ALBERT, 6.3 MB state)", fontsize=10)
ax.legend(fontsize=8, loc="upper left")
ax.set_ylim(0, 520)
fig.tight_layout()
fig.savefig(BASE + "storm_2mbit_before_after.png", dpi=120)
