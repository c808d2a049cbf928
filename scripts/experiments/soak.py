"""Soak benchmark: a 3-trainer swarm (+ monitor) for a long time, sampling every peer's memory and the number of
p2pd daemons; writes paper_results/soak/{soak.csv,soak.png,summary.json}.

    python scripts/experiments/soak.py --minutes 30
"""

import argparse
import csv
import json
import logging
import os
import time
from pathlib import Path

import psutil

from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.metrics import HistoryWriter
from common.swarm import LocalSwarm
from common.tools.provenance import process_group_rss_mib

logger = logging.getLogger("soak")


def count_p2pd(pgids: set) -> int:
    count = 0
    for process in psutil.process_iter(["name", "pid"]):
        try:
            if process.info["name"] == "p2pd" and os.getpgid(process.pid) in pgids:
                count += 1
        except (psutil.Error, ProcessLookupError, OSError):
            continue
    return count


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30, help="how long the swarm trains")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--sample-seconds", type=float, default=30, help="seconds between two memory samples")
    parser.add_argument("--output", default="outputs/soak", help="the swarm's run folder")
    parser.add_argument("--results", default="paper_results/soak", help="soak.csv, soak.png and summary.json")
    args = parser.parse_args()
    stop = StopFlag().install()
    setup_logging("soak")
    output, results = Path(args.output), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60
    overrides = [
        "monitor.wandb_mode=disabled",
        "training.max_global_steps=1000000",
        f"training.max_wall_seconds={seconds:.0f}",
        f"collaboration.expected_peers={args.trainers}",
        "task.total_steps=1000000",
        "monitor.checkpoint_every_steps=50",
    ]
    trainers = [f"trainer{index}" for index in range(args.trainers)]
    rows = []
    started = time.time()
    with LocalSwarm("configs/albert/tiny.yaml", output, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor")
        for name in trainers:
            swarm.start("trainer", name)
        while any(swarm.peers[name].alive() for name in trainers) and not stop.is_set():
            pgids = {peer.process.pid for peer in swarm.peers.values() if peer.alive()}
            row = {"seconds": round(time.time() - started), "p2pd": count_p2pd(pgids)}
            for name, peer in swarm.peers.items():
                row[f"{name}_rss_mib"] = round(process_group_rss_mib(peer.process.pid), 1) if peer.alive() else ""
            history = HistoryWriter(output / "monitor").read()
            row["global_step"] = history[-1]["step"] if history else -1
            rows.append(row)
            logger.info(
                f"{row['seconds']} s / {seconds:.0f} s: step {row['global_step']}, p2pd {row['p2pd']}, "
                + ", ".join(f"{name} {row[f'{name}_rss_mib']} MiB" for name in swarm.peers)
            )
            stop.wait(args.sample_seconds)
        swarm.stop_many(list(swarm.peers))
    with (results / "soak.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "minutes": (time.time() - started) / 60,
        "samples": len(rows),
        "global_steps": rows[-1]["global_step"] + 1,
    }
    for name in ["monitor", *trainers]:
        values = [row[f"{name}_rss_mib"] for row in rows if row.get(f"{name}_rss_mib") not in ("", None)]
        if len(values) >= 4:
            quarter = len(values) // 4
            summary[name] = {
                "first_quarter_mean_mib": sum(values[:quarter]) / quarter,
                "last_quarter_mean_mib": sum(values[-quarter:]) / quarter,
                "max_mib": max(values),
            }
    summary["p2pd_counts_seen"] = sorted({row["p2pd"] for row in rows})
    (results / "summary.json").write_text(json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory_axis, daemon_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    minutes = [row["seconds"] / 60 for row in rows]
    for name in ["monitor", *trainers]:
        memory_axis.plot(minutes, [row[f"{name}_rss_mib"] or None for row in rows], label=name)
    memory_axis.set_ylabel("process-group RSS (MiB)")
    memory_axis.legend()
    memory_axis.grid(alpha=0.3)
    daemon_axis.plot(minutes, [row["p2pd"] for row in rows])
    daemon_axis.set_ylabel("p2pd daemons")
    daemon_axis.set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(results / "soak.png", dpi=120)
    logger.info(f"soak summary: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
