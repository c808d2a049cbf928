"""Cost/time model (common/tools/cost_model.py) from the command line.

Cost comparison of the paper's setups for every task spec (CSV + Markdown + PNG):
    python scripts/experiments/cost_model.py compare [--setups configs/setups/*.yaml] \
        [--tasks configs/setups/tasks/*.yaml] [--diloco-inner-steps 100]
                                         [--output-dir paper_results/cost]
Predicted vs measured time per global step of a recorded swarm run (the monitor's history.jsonl):
    python scripts/experiments/cost_model.py validate --run-dir outputs/albert_tiny --bandwidth-mbps 8000
                                          [--config configs/albert/tiny.yaml] [--throughput-dir outputs/calibration]
"""

import argparse
import csv
import json
import logging
import sys
from pathlib import Path
from typing import Dict, List

from common.config import Compression, Semantics, load_config, script_argument_parser
from common.errors import DataError, exit_on_user_error
from common.lifecycle import setup_logging
from common.tools.cost_model import (
    Peer,
    Prediction,
    SetupConfig,
    SetupKind,
    as_diloco,
    fit_round_overhead,
    fit_swarm_calibration,
    load_setup,
    load_task_spec,
    predict,
    validate_against_history,
)
from common.tools.netns import load_network_setup

logger = logging.getLogger("cost_model")
ROOT = Path(__file__).resolve().parents[2]
WIRE_BYTES = {
    Compression.none: 4.0,
    Compression.fp16: 2.0,
    Compression.scaled_fp16: 2.0,
    Compression.uniform8bit: 1.0,
    Compression.blockwise8bit: 1.0,
}
TABLE_START = "<!-- cost-table:start (written by scripts/experiments/cost_model.py compare) -->"
TABLE_END = "<!-- cost-table:end -->"


def write_comparison(predictions: List[Prediction], setups: List[SetupConfig], output_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir.mkdir(parents=True, exist_ok=True)
    rows = [prediction.to_row() for prediction in predictions]
    with (output_dir / "cost_comparison.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    # every CSV column but the semantics (each setup's notes below name it) and the hours (the days say it)
    columns = [column for column in rows[0] if column not in ("semantics", "total_hours")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[column]) for column in columns) + " |" for row in rows]
    lines += ["", "Inputs and their sources (every figure marked 'assumption' is one):", ""]
    for setup in setups:
        if setup.semantics == Semantics.diloco:  # a variant of a setup listed above: only its semantics differ
            lines.append(f"- **{setup.name}**: {setup.description}; a model prediction, like every row")
            continue
        lines.append(
            f"- **{setup.name}** ({setup.kind.value}, {setup.semantics.value}): round overhead "
            f"{setup.round_overhead_seconds} s ({setup.round_overhead_source})"
            + (
                f"; interconnect {setup.interconnect_gbps} Gb/s ({setup.interconnect_source})"
                if setup.interconnect_gbps
                else ""
            )
        )
        for group in setup.nodes:
            rates = ", ".join(f"{task} {rate} samples/s" for task, rate in group.samples_per_second.items())
            lines.append(
                f"  - {group.count} x {group.name} ({group.accelerator}, {group.role.value}"
                f"{', client mode' if group.client_mode else ''}): {rates or 'no gradients'}"
                f"{' (' + group.throughput_source + ')' if rates else ''}; {group.upload_mbps}/{group.download_mbps}"
                f" Mb/s up/down ({group.bandwidth_source}); ${group.usd_per_hour}/h {group.pricing.value} "
                f"({group.price_source})"
                + (
                    f"; {group.interruptions_per_hour} interruptions/h, {group.restart_minutes} min to rejoin"
                    if group.interruptions_per_hour
                    else ""
                )
            )
    (output_dir / "cost_comparison.md").write_text("\n".join(lines) + "\n")
    table = "\n".join(lines[: len(rows) + 2])
    for readme in (output_dir / "README.md", output_dir.parent / "README.md"):  # paper_results/cost/ and its index
        if readme.exists() and TABLE_START in readme.read_text():
            head, rest = readme.read_text().split(TABLE_START, 1)
            tail = rest.split(TABLE_END, 1)[1]
            readme.write_text(f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}")

    tasks = sorted({prediction.task for prediction in predictions})
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        for prediction in (p for p in predictions if p.task == task):
            axis.scatter(prediction.total_hours / 24.0, prediction.total_cost_usd, s=60)
            axis.annotate(
                prediction.setup,
                (prediction.total_hours / 24.0, prediction.total_cost_usd),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
        axis.set_xlabel("predicted wall time (days)")
        axis.set_ylabel("predicted cost (USD)")
        axis.set_title(f"{task}: cost vs time (model; inputs partly assumed)")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(output_dir / "cost_vs_time.png", dpi=120)
    plt.close(figure)
    logger.info(f"wrote cost_comparison.csv, cost_comparison.md and cost_vs_time.png to {output_dir}")


def command_compare(args: argparse.Namespace) -> None:
    setups = [load_setup(path) for path in args.setups]
    setups += [
        as_diloco(setup, steps)
        for steps in args.diloco_inner_steps
        for setup in list(setups)
        if setup.kind == SetupKind.swarm and setup.semantics != Semantics.diloco
    ]
    tasks = [load_task_spec(path) for path in args.tasks]
    predictions = [predict(setup, task) for task in tasks for setup in setups]
    for prediction in predictions:
        logger.info(
            f"{prediction.task} on {prediction.setup}: {prediction.step_seconds:.2f} s/step, "
            f"{prediction.total_hours / 24:.1f} days, ${prediction.total_cost_usd:,.0f}"
        )
    write_comparison(predictions, setups, Path(args.output_dir))


def _trainer_rates(directory: Path) -> Dict[str, float]:
    rates = {}
    for path in sorted(directory.rglob("summary.json")):
        summary = json.loads(path.read_text())
        if summary.get("samples", 0) > 0:
            rates[summary.get("peer_name", str(path.parent))] = float(summary["samples_per_second"])
    return rates


def _count_parameters(run_dir: Path) -> int:
    import torch

    for path in sorted(run_dir.rglob("final_model.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        return int(sum(tensor.numel() for tensor in state.values() if tensor.is_floating_point()))
    raise DataError(f"no final_model.pt under {run_dir} to count parameters; pass --parameters")


def _history_path(run_dir: Path) -> Path:
    histories = sorted(run_dir.rglob("history.jsonl"))
    if not histories:
        raise DataError(f"no history.jsonl (the monitor's per-step record) under {run_dir}")
    return histories[0]


def _read_history(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in _history_path(run_dir).read_text().splitlines() if line.strip()]


def _emulated_peers(setup_path: Path, uncapped_mbps: float) -> List[Peer]:
    """The trainers and auxiliary peers of an emulated network setup with their links (client mode = no inbound)."""
    setup = load_network_setup(setup_path)
    return [
        Peer(
            upload_mbps=host.upload_mbit or uncapped_mbps,
            download_mbps=host.download_mbit or uncapped_mbps,
            sends_vector=host.role == "trainer",
            client_mode=not host.accepts_inbound,
        )
        for host in setup.hosts
        if host.role in ("trainer", "auxiliary")
    ]


def command_validate(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    history = _read_history(run_dir)
    throughput_dir = Path(args.throughput_dir or run_dir)
    rates = _trainer_rates(throughput_dir)
    parameters = args.parameters or _count_parameters(run_dir)
    bytes_per_parameter, average_state_every = args.bytes_per_parameter, args.average_state_every
    semantics = Semantics(args.semantics)
    if args.config:  # the run's own collaboration settings win over the flags
        collaboration = load_config(args.config).collaboration
        bytes_per_parameter = WIRE_BYTES[collaboration.compression]
        average_state_every, semantics = collaboration.average_state_every, collaboration.semantics
    peers = _emulated_peers(Path(args.network_setup), args.bandwidth_mbps) if args.network_setup else None

    def validate(recorded: List[dict], overhead: float):
        """The model's step time for this run's inputs, set against a recorded history."""
        return validate_against_history(
            recorded,
            rates,
            parameters=parameters,
            bytes_per_parameter=bytes_per_parameter,
            bandwidth_mbps=args.bandwidth_mbps,
            round_overhead_seconds=overhead,
            average_state_every=average_state_every,
            semantics=semantics,
            auxiliary_peers=args.auxiliary_peers,
            peers=peers,
        )

    round_overhead = args.round_overhead_seconds
    calibration = None
    if args.calibrate_on:  # this machine's inputs fitted on other runs, so this run's error is out of sample
        fitted_histories = [_read_history(Path(directory)) for directory in args.calibrate_on]
        fitted_runs = [validate(fitted, 0.0) for fitted in fitted_histories]
        if len(fitted_runs) == 1:  # throughput from --throughput-dir, overhead fitted
            round_overhead = fit_round_overhead(
                lambda overhead: validate(fitted_histories[0], overhead).predicted_step_seconds,
                fitted_runs[0].measured_step_seconds,
            )
        else:  # throughput and overhead both fitted
            fitted = fit_swarm_calibration(*fitted_runs, semantics=semantics)
            round_overhead = fitted.round_overhead_seconds
            rates = {name: fitted.swarm_samples_per_second / len(rates) for name in rates}
        calibration = {
            "runs": args.calibrate_on,
            "round_overhead_seconds": round_overhead,
            "swarm_samples_per_second": sum(rates.values()),
            "runs_measured_step_seconds": [run.measured_step_seconds for run in fitted_runs],
            "runs_samples_per_step": [run.samples_per_step for run in fitted_runs],
        }
        logger.info(
            f"calibrated on {', '.join(args.calibrate_on)}: {round_overhead:.3f} s per averaging round, "
            f"swarm throughput {sum(rates.values()):.1f} samples/s"
        )
    validation = validate(history, round_overhead)
    report = {
        **validation.to_json(),
        "history": str(_history_path(run_dir)),
        "calibration": calibration,
        "throughput_from": str(throughput_dir),
        "trainer_samples_per_second": rates,
        "parameters": parameters,
        "bandwidth_mbps": args.bandwidth_mbps,
        "round_overhead_seconds": round_overhead,
        "bytes_per_parameter": bytes_per_parameter,
        "average_state_every": average_state_every,
        "semantics": semantics.value,
    }
    logger.info(
        f"predicted {validation.predicted_step_seconds:.3f} s/step "
        f"(accumulation {validation.predicted_accumulation_seconds:.3f} + averaging "
        f"{validation.predicted_averaging_seconds:.3f}), measured {validation.measured_step_seconds:.3f} "
        f"s/step over {validation.steps_measured} steps: error {100 * validation.relative_error:+.1f} %"
    )
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    else:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")


def command_validation_plot(args: argparse.Namespace) -> None:
    """Collect `validate` reports named <run>-<method>.json into one CSV and a predicted-vs-measured plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for path in sorted(Path(p) for p in args.reports):
        report = json.loads(path.read_text())
        run, _, method = path.stem.partition("-")
        rows.append(
            {
                "run": run,
                "method": method or "default",
                "samples_per_step": round(report["samples_per_step"]),
                "swarm_samples_per_second": round(report["swarm_samples_per_second"], 1),
                "round_overhead_seconds": round(report["round_overhead_seconds"], 3),
                "predicted_step_seconds": round(report["predicted_step_seconds"], 2),
                "measured_step_seconds": round(report["measured_step_seconds"], 2),
                "error_percent": round(100 * report["relative_error"], 1),
            }
        )
    if not rows:
        raise DataError("no validation reports given")
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with (output_dir / "validation.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    figure, axis = plt.subplots(figsize=(6.5, 5))
    largest = max(max(row["predicted_step_seconds"], row["measured_step_seconds"]) for row in rows) * 1.1
    axis.plot([0, largest], [0, largest], color="black", linewidth=1, label="exact")
    axis.fill_between(
        [0, largest], [0, 0.8 * largest], [0, 1.2 * largest], color="grey", alpha=0.2, label="within 20 %"
    )
    for method in sorted({row["method"] for row in rows}):
        chosen = [row for row in rows if row["method"] == method]
        axis.plot(
            [row["measured_step_seconds"] for row in chosen],
            [row["predicted_step_seconds"] for row in chosen],
            "o",
            label=method,
        )
    axis.set_xlabel("measured time per global step (s)")
    axis.set_ylabel("predicted time per global step (s)")
    axis.set_title("Step-time model vs tiny ALBERT swarm on this machine")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output_dir / "validation.png", dpi=120)
    logger.info(f"wrote {output_dir / 'validation.csv'} and validation.png ({len(rows)} reports)")


def parse_arguments() -> argparse.Namespace:
    parser = script_argument_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("compare", help="cost comparison table and plot for the paper's setups")
    compare.add_argument(
        "--setups", nargs="+", default=sorted(str(p) for p in (ROOT / "configs/setups").glob("*.yaml"))
    )
    compare.add_argument(
        "--tasks", nargs="+", default=sorted(str(p) for p in (ROOT / "configs/setups/tasks").glob("*.yaml"))
    )
    compare.add_argument(
        "--diloco-inner-steps",
        type=int,
        nargs="*",
        default=[100],
        help="add each swarm setup run with semantics=diloco and this many global steps between outer rounds",
    )
    compare.add_argument("--output-dir", default=str(ROOT / "paper_results/cost"))
    plot = commands.add_parser("validation-plot", help="validate reports (<run>-<method>.json) -> CSV + PNG")
    plot.add_argument("reports", nargs="+")
    plot.add_argument("--output-dir", default=str(ROOT / "paper_results/cost"))
    validate = commands.add_parser("validate", help="predicted vs measured time per global step of a run")
    validate.add_argument("--run-dir", required=True, help="folder holding the monitor's history.jsonl")
    validate.add_argument("--bandwidth-mbps", type=float, required=True, help="measured link bandwidth per peer")
    validate.add_argument(
        "--throughput-dir",
        default=None,
        help="folder with trainers' summary.json giving compute samples/s (default: --run-dir)",
    )
    validate.add_argument(
        "--round-overhead-seconds",
        type=float,
        default=1.0,
        help="fixed cost of one averaging round (~1 s on loopback)",
    )
    validate.add_argument(
        "--network-setup",
        default=None,
        help="configs/network/*.yaml the run used (local_swarm.py --network-setup): each peer gets "
        "its emulated link, --bandwidth-mbps only fills uncapped directions",
    )
    validate.add_argument(
        "--calibrate-on",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="fit this machine's inputs on other runs of the same swarm: one run fits the per-round "
        "overhead (throughput from --throughput-dir), two runs with different target batches "
        "fit the swarm's throughput too; overrides --round-overhead-seconds",
    )
    validate.add_argument(
        "--config", default=None, help="the run's config: wire bytes, average_state_every and semantics come from it"
    )
    validate.add_argument("--parameters", type=int, default=0, help="default: counted from final_model.pt")
    validate.add_argument("--bytes-per-parameter", type=float, default=2.0)
    validate.add_argument("--average-state-every", type=int, default=1)
    validate.add_argument("--auxiliary-peers", type=int, default=0)
    validate.add_argument("--semantics", choices=[s.value for s in Semantics], default=Semantics.sync.value)
    validate.add_argument("--output", default=None, help="write the report here as JSON (default: stdout)")
    return parser.parse_args()


@exit_on_user_error
def main() -> None:
    setup_logging("cost_model")
    args = parse_arguments()
    if args.command == "compare":
        command_compare(args)
    elif args.command == "validation-plot":
        command_validation_plot(args)
    else:
        command_validate(args)


if __name__ == "__main__":
    main()
