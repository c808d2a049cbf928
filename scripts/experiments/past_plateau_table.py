"""The headline table of paper_results/comparison/past_plateau: each swarm run against each baseline of its seed.

Reads the `summary.csv` files that `compare_setups.py` wrote for the 500-step runs at LAMB 0.005 (three seeds,
swarms of 3 trainers with `collaboration.catch_up_one_step_behind=true`) and writes `headline.csv`: for every
swarm run, its held-out loss, MLM loss and MLM accuracy and the differences from one process, DDP and one process
with `dpu`'s one-step-late updates of the same seed. Arithmetic only: nothing is trained.

    python scripts/experiments/past_plateau_table.py [--folder paper_results/comparison/past_plateau/lamb0005_500]
"""

import argparse
import csv
import logging
import time
from pathlib import Path

from common.errors import UserError, exit_on_user_error
from common.lifecycle import setup_logging

logger = logging.getLogger("past_plateau_table")

# (seed, folder relative to --folder, setup) of each baseline: the runs were split over folders as they were made
BASELINES = [
    (0, ".", "single"),
    (0, ".", "ddp"),
    (0, ".", "single_dpu"),
    (1, "seed1", "single"),
    (1, "seed1", "ddp"),
    (1, "baselines/seed1", "single_dpu"),
    (2, "seed2", "single"),
    (2, "baselines/seed2", "ddp"),
    (2, "baselines/seed2", "single_dpu"),
]
SWARMS = [
    (0, "catch_up/sync_seed0", "collab_sync"),
    (1, "catch_up/sync_seed1", "collab_sync"),
    (2, "catch_up/sync_seed2", "collab_sync"),
    (0, "catch_up/at_the_update/seed0", "collab_dpu"),
    (1, "catch_up/at_the_update/seed1", "collab_dpu"),
    (2, "catch_up/at_the_update/seed2", "collab_dpu"),
    (2, "catch_up/at_the_update/seed2_second", "collab_dpu"),
]
QUANTITIES = ("eval_loss", "eval_mlm_loss", "eval_mlm_accuracy")


def read_setup(folder: Path, setup: str) -> dict:
    path = folder / "summary.csv"
    if not path.is_file():
        raise UserError(f"{path} not found: pass the folder compare_setups.py wrote the 500-step runs to")
    for row in csv.DictReader(path.open()):
        if row["setup"] == setup:
            return {name: float(row[name]) for name in QUANTITIES}
    raise UserError(f"{path} has no row for setup {setup!r}")


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="paper_results/comparison/past_plateau/lamb0005_500")
    parser.add_argument("--output", default="paper_results/comparison/past_plateau/headline.csv")
    args = parser.parse_args()
    setup_logging("past_plateau_table")
    folder = Path(args.folder)
    baselines = {(seed, setup): read_setup(folder / sub, setup) for seed, sub, setup in BASELINES}
    rows = []
    for seed, sub, setup in SWARMS:
        swarm = read_setup(folder / sub, setup)
        row = {"swarm": setup, "seed": seed, "folder": sub, **{name: f"{swarm[name]:.5f}" for name in QUANTITIES}}
        for baseline in ("single", "ddp", "single_dpu"):
            reference = baselines[(seed, baseline)]
            row[f"loss_vs_{baseline}_percent"] = f"{100 * (swarm['eval_loss'] / reference['eval_loss'] - 1):+.2f}"
            row[f"mlm_loss_vs_{baseline}_percent"] = (
                f"{100 * (swarm['eval_mlm_loss'] / reference['eval_mlm_loss'] - 1):+.2f}"
            )
            row[f"mlm_accuracy_vs_{baseline}_points"] = (
                f"{100 * (swarm['eval_mlm_accuracy'] - reference['eval_mlm_accuracy']):+.2f}"
            )
        rows.append(row)
    output = Path(args.output)
    with output.open("w", newline="") as stream:
        stream.write(f"# python scripts/experiments/past_plateau_table.py --folder {args.folder} ")
        stream.write(f"(arithmetic on the summary.csv files; {time.strftime('%Y-%m-%d', time.gmtime())})\n")
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    logger.info(f"wrote {output} ({len(rows)} swarm runs)")


if __name__ == "__main__":
    main()
