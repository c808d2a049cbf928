"""How far a `sync` swarm ends from one process replaying exactly its samples, over repeated runs, written to a CSV.

The scenario of ``tests/core/test_swarm.py::test_sync_collaboration_equals_single_process_on_the_same_samples``:
2 tiny-ALBERT trainers (no wire compression, no dropout) take 3 global steps of 512 samples; then one process
replays the micro-batches both logged, and each trainer's final parameters are compared with the replay's
(largest absolute difference of any element). The test asserts a bound; this script records the values, and the
averaging rounds that fell back to local values, run by run.

    python scripts/experiments/sync_equivalence.py [--runs 3] [--output paper_results/core/sync_equivalence.csv]
"""

import argparse
import csv
import importlib.util
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from common.errors import UserError, exit_on_user_error
from common.lifecycle import setup_logging
from common.swarm import ROOT
from common.tools.provenance import git_commit, machine_description


def _test_helpers():
    """The tests' own run and replay code (tests/ is not a package, and a top-level ``tests`` of an installed
    distribution may shadow it), so the script measures exactly what the test asserts on."""
    spec = importlib.util.spec_from_file_location("equivalence_helpers", ROOT / "tests" / "helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _test_helpers()
logger = logging.getLogger("sync_equivalence")
STEPS, TARGET = 3, 512
# the multi-peer tests' fast settings (tests/conftest.py, tiny_overrides)
FAST = [
    "monitor.wandb_mode=disabled",
    "monitor.refresh_seconds=0.5",
    "training.log_every_seconds=5",
    "collaboration.matchmaking_time=1.5",
    "collaboration.averaging_timeout=20",
    "collaboration.final_averaging_seconds=3",
    "task.max_documents=3000",
]


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="swarm runs, one after another")
    parser.add_argument("--timeout", type=float, default=240, help="seconds each swarm may take (the test's 240)")
    parser.add_argument("--output", default="paper_results/core/sync_equivalence.csv", help="the CSV written")
    args = parser.parse_args()
    if args.runs < 1:
        raise UserError("--runs must be at least 1")
    setup_logging("sync_equivalence")
    invocation = " ".join(["python", "scripts/experiments/sync_equivalence.py", *sys.argv[1:]])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = "/".join(f"{value:.1f}" for value in os.getloadavg())
    overrides = [
        *FAST,
        f"training.max_global_steps={STEPS}",
        f"collaboration.target_batch_size={TARGET}",
        *helpers.EQUIVALENCE_OVERRIDES,
    ]
    trainers = ["trainer0", "trainer1"]
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="sync_equivalence_") as folder:
            run_dir = Path(folder)
            began = time.monotonic()
            try:
                helpers.run_trainers(helpers.TINY_ALBERT, run_dir, overrides, trainers, timeout=args.timeout)
            except AssertionError as error:  # the helpers assert, as the test does
                raise UserError(f"run {run}: {error} (a loaded machine may need a larger --timeout)") from None
            seconds = time.monotonic() - began
            differences = helpers.differences_from_replay(helpers.TINY_ALBERT, run_dir, overrides, trainers, STEPS)
            degraded = helpers.degraded_rounds([run_dir / name for name in trainers])
        rows.append([run, *[f"{value:.3e}" for value in differences], len(degraded), f"{seconds:.0f}"])
        logger.info(f"run {run}: max difference {max(differences):.3e}, {len(degraded)} degraded round lines")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", newline="") as stream:
        stream.write(f"# command: {invocation}\n")
        stream.write(f"# machine: {machine_description()}; load average before {load_before}, ")
        stream.write(f"after {'/'.join(f'{value:.1f}' for value in os.getloadavg())}\n")
        stream.write(f"# started {started}, commit {git_commit()}; {STEPS} steps x {TARGET} samples, 2 trainers\n")
        writer = csv.writer(stream)
        writer.writerow(["run", *[f"{name}_max_abs_difference" for name in trainers], "degraded_rounds", "swarm_s"])
        writer.writerows(rows)
    logger.info(f"wrote {output}")


if __name__ == "__main__":
    main()
