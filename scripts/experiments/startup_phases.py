"""Where a trainer's start-up goes, from process start to its first contributed micro-batch, written to a CSV.

A monitor is started on loopback, then ``--trainers`` tiny-ALBERT trainers join it one after another, each with a
run id of its own (so it joins an empty swarm: the state download finds nothing to fetch, the start barrier waits
for itself only) and one global step of 64 samples. Each trainer writes ``startup.json`` (``common/startup.py``);
this script collects them into one CSV with the command, machine, commit, load average and date. Run it with the
data caches warm (any earlier run of the tiny config), or the first trainer's "task" phase includes building them.

    python scripts/experiments/startup_phases.py [--trainers 3] [--output paper_results/participation/startup.csv]
"""

import argparse
import csv
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from common.errors import UserError, exit_on_user_error
from common.lifecycle import setup_logging
from common.startup import STARTUP_FILE
from common.swarm import LocalSwarm
from common.tools.provenance import git_commit, load_average, machine_description

logger = logging.getLogger("startup_phases")
CONFIG = "configs/albert/tiny.yaml"
TRAINER_SECONDS = 600  # one step of 64 samples; generous for a loaded 2-core machine


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=3, help="trainers started one after another")
    parser.add_argument("--runs", default="outputs/startup_phases", help="the peers' output folders and logs")
    parser.add_argument("--output", default="paper_results/participation/startup.csv", help="the CSV written")
    args = parser.parse_args()
    if args.trainers < 1:
        raise UserError("--trainers must be at least 1")
    setup_logging("startup_phases")
    invocation = " ".join(["python", "scripts/experiments/startup_phases.py", *sys.argv[1:]])
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average()
    overrides = [
        "monitor.wandb_mode=disabled",
        "monitor.checkpoint_every_steps=0",
        "collaboration.expected_peers=1",
        "training.max_global_steps=1",
        "collaboration.target_batch_size=64",
    ]
    results = []
    with LocalSwarm(CONFIG, Path(args.runs), overrides=overrides) as swarm:
        swarm.start_first_peer()
        for index in range(args.trainers):
            name = f"trainer{index}"
            startup_file = Path(args.runs) / name / STARTUP_FILE
            startup_file.unlink(missing_ok=True)
            swarm.start("trainer", name, [f"collaboration.run_id=startup{index}"])
            if not swarm.wait([name], timeout=TRAINER_SECONDS):
                raise UserError(
                    f"{name} did not finish its step within {TRAINER_SECONDS} s (log: {swarm.peers[name].log_path})"
                )
            if not startup_file.is_file():
                raise UserError(f"{name} exited without writing {startup_file} (log: {swarm.peers[name].log_path})")
            results.append(json.loads(startup_file.read_text()))
            logger.info(f"{name}: first micro-batch {results[-1]['total']:.2f} s after process start")
    phases = list(results[0]["phases"])
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", newline="") as stream:
        stream.write(f"# command: {invocation}\n")
        stream.write(
            f"# machine: {machine_description()}; load average before {load_before}, after {load_average()}\n"
        )
        stream.write(f"# started {started}, commit {git_commit()}, config {CONFIG}\n")
        writer = csv.writer(stream)
        writer.writerow(["phase", *[f"trainer{index}_s" for index in range(len(results))], "median_s"])
        for phase in phases:
            values = [result["phases"].get(phase, 0.0) for result in results]
            writer.writerow([phase, *[f"{value:.2f}" for value in values], f"{statistics.median(values):.2f}"])
        totals = [result["total"] for result in results]
        writer.writerow(["total", *[f"{value:.2f}" for value in totals], f"{statistics.median(totals):.2f}"])
    logger.info(f"wrote {output}")


if __name__ == "__main__":
    main()
