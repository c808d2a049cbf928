"""From the emulated run's heldout.csv and runs.json: each setup against sync at its own samples, and where each
trainer's bytes went (to trainers, the auxiliary peer, the monitor).

    .venv/bin/python paper_results/comparison/diloco/analyse_emulated.py FOLDER [RUNS]

With RUNS (the driver's ``--runs`` folder) it first writes FOLDER/runs.json: each setup's run.json with its peers'
summary.json files under ``peer_summaries``.

Writes equal_samples.csv and bytes_by_destination.csv into that folder. The table's "at equal samples" column
compares every setup at the fewest samples any setup reached (9,600: one process and DDP); this compares each
setup's final model with sync's held-out curve at the samples that setup had seen, and at the same 75 global steps.
"""

import csv
import json
import sys
from pathlib import Path


def interpolate(points, x):
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def collect_runs(runs: Path) -> dict:
    """Each setup's run.json (launch, recipe, per-host bytes) with its peers' summaries."""
    collected = {}
    for setup in sorted(path for path in runs.iterdir() if (path / "run.json").is_file()):
        run = json.loads((setup / "run.json").read_text())
        summaries = setup.glob("*/summary.json")
        run["peer_summaries"] = {path.parent.name: json.loads(path.read_text()) for path in summaries}
        collected[setup.name] = run
    return collected


def main() -> None:
    folder = Path(sys.argv[1])
    if len(sys.argv) > 2:
        (folder / "runs.json").write_text(json.dumps(collect_runs(Path(sys.argv[2])), indent=1) + "\n")
    with (folder / "heldout.csv").open() as handle:
        heldout = list(csv.DictReader(handle))
    setups = list(dict.fromkeys(row["setup"] for row in heldout))
    sync = sorted(
        (int(row["samples_seen"]), float(row["eval_loss"]), float(row["eval_mlm_accuracy"]))
        for row in heldout
        if row["setup"] == "collab_sync"
    )
    sync_final = sync[-1][1]
    rows = []
    for setup in setups:
        final = [row for row in heldout if row["setup"] == setup and row["source"] == "final"][-1]
        samples, loss = int(final["samples_seen"]), float(final["eval_loss"])
        sync_there = interpolate([(seen, value) for seen, value, _ in sync], samples)
        sync_accuracy = interpolate([(s, a) for s, _, a in sync], samples)
        rows.append(
            {
                "setup": setup,
                "final_samples": samples,
                "final_eval_loss": round(loss, 4),
                "final_mlm_accuracy": round(float(final["eval_mlm_accuracy"]), 4),
                "sync_eval_loss_at_these_samples": None if sync_there is None else round(sync_there, 4),
                "sync_mlm_accuracy_at_these_samples": None if sync_accuracy is None else round(sync_accuracy, 4),
                "vs_sync_at_these_samples_percent": (
                    None if sync_there is None else round(100 * (loss - sync_there) / sync_there, 2)
                ),
                "vs_sync_at_75_global_steps_percent": round(100 * (loss - sync_final) / sync_final, 2),
            }
        )
    with (folder / "equal_samples.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    runs = json.loads((folder / "runs.json").read_text())
    traffic = []
    for setup, run in runs.items():
        hosts = run.get("hosts")
        if not hosts:
            continue
        roles = {name: host["role"] for name, host in hosts.items()}
        for name, host in hosts.items():
            if host["role"] != "trainer":
                continue
            sent = host["tcp_bytes_sent_to"]
            by_role = {role: sum(b for d, b in sent.items() if roles.get(d) == role) for role in set(roles.values())}
            traffic.append(
                {
                    "setup": setup,
                    "trainer": name,
                    "mb_to_trainers": round(by_role.get("trainer", 0) / 1e6, 2),
                    "mb_to_auxiliary": round(by_role.get("auxiliary", 0) / 1e6, 2),
                    "mb_to_monitor": round(by_role.get("monitor", 0) / 1e6, 2),
                    "mb_link_sent": round(host["link_bytes_sent"] / 1e6, 2),
                    "samples_computed": run["peer_summaries"].get(name, {}).get("samples"),
                }
            )
    with (folder / "bytes_by_destination.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(traffic[0]))
        writer.writeheader()
        writer.writerows(traffic)


if __name__ == "__main__":
    main()
