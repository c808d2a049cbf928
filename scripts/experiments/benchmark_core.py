"""Benchmark of the collaborative core on this machine, written to paper_results/core/.

1. The embedded default: monitor + N trainers + 1 auxiliary peer (local_swarm.py) -> wall time, samples/s per peer.
2. The same loop with a plain torch optimizer (single backend), N copies side by side for the same CPU load
   -> samples/s per process; ratio collaborative / plain.
3. One process with the same global batch and number of global steps -> final loss beside the swarm's.

    python scripts/experiments/benchmark_core.py [--trainers 3] [--steps 25]
"""

import argparse
import csv
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from common.errors import exit_on_user_error
from common.lifecycle import setup_logging
from common.metrics import HistoryWriter
from common.swarm import ROOT, stop_process_group
from common.tools.provenance import git_commit, load_average, machine_description

logger = logging.getLogger("benchmark_core")
CONFIG = "configs/albert/tiny.yaml"


def run(command: list, log_path: Path) -> float:
    started = time.time()
    with log_path.open("w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - started


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=3, help="trainers in the swarm; as many plain loops")
    parser.add_argument("--steps", type=int, default=25, help="global steps of the swarm and of the one process")
    parser.add_argument("--plain-seconds", type=float, default=120, help="how long the plain loops run")
    parser.add_argument("--output", default="outputs/benchmark_core", help="run folders and logs")
    parser.add_argument("--results", default="paper_results/core", help="benchmark.csv and the demo loss curve")
    args = parser.parse_args()
    invocation = " ".join(["python", "scripts/experiments/benchmark_core.py", *sys.argv[1:]])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    setup_logging("benchmark")
    output, results = Path(args.output), Path(args.results)
    output.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    common = ["monitor.wandb_mode=disabled", f"training.max_global_steps={args.steps}"]

    loads = {"swarm_start": load_average()}  # other jobs on the machine change what each phase gets
    logger.info("1/3 collaborative swarm (the README's demo)")
    swarm_dir = output / "swarm"
    swarm_seconds = run(
        [
            python,
            "scripts/local_swarm.py",
            "--config",
            CONFIG,
            "--trainers",
            str(args.trainers),
            "--aux",
            "1",
            "--output",
            str(swarm_dir),
            *common,
        ],
        output / "swarm.log",
    )
    swarm = json.loads((swarm_dir / "summary.json").read_text())

    loads["plain_start"] = load_average()
    logger.info(f"2/3 {args.trainers} plain-torch loops side by side for {args.plain_seconds:.0f} s")
    processes = []
    for index in range(args.trainers):
        log = (output / f"plain{index}.log").open("w")
        processes.append(
            subprocess.Popen(
                [
                    python,
                    "scripts/train.py",
                    "--config",
                    CONFIG,
                    "--name",
                    f"plain{index}",
                    "training.backend=single",
                    f"training.max_wall_seconds={args.plain_seconds}",
                    "training.max_global_steps=100000",
                    f"training.output_dir={output / f'plain{index}'}",
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    for process in processes:
        try:
            process.wait(timeout=args.plain_seconds + 300)
        finally:
            stop_process_group(process, graceful=True)
    plain_rates = [
        json.loads((output / f"plain{index}" / "summary.json").read_text())["samples_per_second"]
        for index in range(args.trainers)
    ]

    loads["single_start"] = load_average()
    logger.info("3/3 one process, same global batch and number of global steps")
    single_dir = output / "single"
    single_seconds = run(
        [
            python,
            "scripts/train.py",
            "--config",
            CONFIG,
            "--name",
            "single",
            "training.backend=single",
            *common,
            f"training.output_dir={single_dir}",
        ],
        output / "single.log",
    )
    single_history = HistoryWriter(single_dir).read()

    swarm_rates = swarm["samples_per_second"]
    mean_swarm = sum(swarm_rates.values()) / len(swarm_rates)
    mean_plain = sum(plain_rates) / len(plain_rates)
    swarm_per_trainer = " / ".join(f"{swarm_rates[name]:.1f}" for name in sorted(swarm_rates))
    peers_per_step = swarm["peers_per_step"]
    rows = [
        ("command", invocation),
        ("machine", machine_description()),
        (
            "load_average_1_5_15_min",
            "; ".join(f"{phase} {value}" for phase, value in {**loads, "end": load_average()}.items()),
        ),
        ("started", started),
        ("commit", git_commit()),
        ("config", CONFIG),
        ("demo_wall_seconds", f"{swarm_seconds:.0f}"),
        ("global_steps", swarm["global_steps"]),
        (
            "steps_with_all_trainers",
            f"{sum(count == args.trainers for count in peers_per_step)} of {len(peers_per_step)}",
        ),
        ("swarm_samples_per_second_per_trainer", f"{mean_swarm:.1f}"),
        ("swarm_samples_per_second_each", swarm_per_trainer),
        ("plain_samples_per_second_per_process_same_load", f"{mean_plain:.1f}"),
        ("plain_samples_per_second_each", " / ".join(f"{rate:.1f}" for rate in plain_rates)),
        ("ratio_collaborative_over_plain", f"{mean_swarm / mean_plain:.2f}"),
        ("swarm_loss_first", f"{swarm['loss_first']:.4f}"),
        ("swarm_loss_last", f"{swarm['loss_last']:.4f}"),
        ("single_process_loss_last", f"{single_history[-1]['loss']:.4f}"),
        ("single_process_wall_seconds", f"{single_seconds:.0f}"),
        ("swarm_max_param_diff", f"{swarm['max_param_diff']:.2e}"),
        ("swarm_mlm_accuracy_last", f"{swarm['metrics_last'].get('mlm_accuracy', float('nan')):.3f}"),
        ("swarm_sop_accuracy_last", f"{swarm['metrics_last'].get('sop_accuracy', float('nan')):.3f}"),
    ]
    with (results / "benchmark.csv").open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["quantity", "value"])
        writer.writerows(rows)
    if (swarm_dir / "loss_curve.png").exists():
        (results / "demo_loss_curve.png").write_bytes((swarm_dir / "loss_curve.png").read_bytes())
    logger.info("results:\n" + "\n".join(f"  {name}: {value}" for name, value in rows))


if __name__ == "__main__":
    main()
