"""sahajBERT participation trace: generate (or read a CSV), compress into a replay schedule, model at full scale.

    python scripts/experiments/make_trace.py [--seed 0 | --csv my_trace.csv] [--max-concurrent 3] \
        [--replay-seconds 720]
                                 [--output-dir paper_results/cost]

Writes participation_trace.csv, participation_stats.json, replay_schedule.json (start/stop events in seconds
for at most K trainer processes), participation_full_scale.csv and participation_full_scale.png.
"""

import argparse
import csv
import json
import logging
from dataclasses import asdict
from pathlib import Path

from common.errors import exit_on_user_error
from common.lifecycle import setup_logging
from common.tools import participation
from common.tools.cost_model import load_setup, load_task_spec

logger = logging.getLogger("make_trace")
ROOT = Path(__file__).resolve().parents[2]


def plot_full_scale(result, published_steps: int, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [point.hour / 24.0 for point in result.points]
    figure, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(hours, [point.trainers for point in result.points], label="all trainers")
    axes[0].plot(hours, [point.client_mode_trainers for point in result.points], label="volunteers (client mode)")
    axes[0].set_ylabel("active trainers")
    axes[0].legend()
    axes[1].plot(hours, [point.compute_samples_per_second for point in result.points], label="compute")
    axes[1].plot(
        hours, [point.effective_samples_per_second for point in result.points], label="effective (incl. averaging)"
    )
    axes[1].set_ylabel("swarm samples/s")
    axes[1].legend()
    axes[2].plot(hours, [point.global_steps for point in result.points], label="model")
    axes[2].axhline(published_steps, color="grey", linestyle="--", label=f"published final step {published_steps}")
    axes[2].set_ylabel("global steps")
    axes[2].set_xlabel("days since the start of the event")
    axes[2].legend()
    axes[0].set_title("sahajBERT trace through the cost model (generated trace; throughputs assumed)")
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)


@exit_on_user_error
def main() -> None:
    setup_logging("make_trace")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="read this trace instead of generating one")
    parser.add_argument("--hardware", default=str(ROOT / "configs/setups/events/sahajbert_hardware.yaml"))
    parser.add_argument("--task", default=str(ROOT / "configs/setups/events/sahajbert_task.yaml"))
    parser.add_argument("--max-concurrent", type=int, default=3, help="K: trainer processes at most at once")
    parser.add_argument("--replay-seconds", type=float, default=720.0, help="the whole event compressed to this")
    parser.add_argument("--min-session-seconds", type=float, default=20.0)
    parser.add_argument("--output-dir", default=str(ROOT / "paper_results/cost"))
    args = parser.parse_args()

    table = load_setup(args.hardware)
    task = load_task_spec(args.task)
    if args.csv:
        sessions = participation.read_trace_csv(Path(args.csv))
    else:
        sessions = participation.generate_event_trace(args.seed, participation.hardware_rates(table, task.name))
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    participation.write_trace_csv(sessions, output_dir / "participation_trace.csv")
    statistics = participation.trace_statistics(sessions)
    logger.info(f"trace: {statistics.to_json()}")

    schedule = participation.compress_trace(
        sessions, args.max_concurrent, args.replay_seconds, args.min_session_seconds
    )
    (output_dir / "replay_schedule.json").write_text(json.dumps(schedule.to_json(), indent=1))
    logger.info(
        f"replay: x{schedule.time_scale:.0f} time scale, {schedule.sessions_replayed} sessions replayed, "
        f"{schedule.sessions_skipped_busy} skipped (all {args.max_concurrent} slots busy), "
        f"{schedule.sessions_skipped_short} skipped (< {args.min_session_seconds} s compressed), "
        f"peak concurrency {participation.max_concurrency(schedule.events)}"
    )

    result = participation.simulate_full_scale(sessions, table, task)
    with (output_dir / "participation_full_scale.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(result.points[0])))
        writer.writeheader()
        writer.writerows(asdict(point) for point in result.points)
    plot_full_scale(result, task.global_steps, output_dir / "participation_full_scale.png")
    summary = {
        "trace": statistics.to_json(),
        "seed": None if args.csv else args.seed,
        "source": args.csv or "generated",
        "full_scale_global_steps": round(result.global_steps),
        "published_final_step": task.global_steps,
        "mean_active_trainers": sum(p.trainers for p in result.points) / len(result.points),
        "mean_effective_samples_per_second": sum(p.effective_samples_per_second for p in result.points)
        / len(result.points),
        "replay": {key: value for key, value in schedule.to_json().items() if key != "events"},
    }
    (output_dir / "participation_stats.json").write_text(json.dumps(summary, indent=2))
    logger.info(
        f"full scale: {result.global_steps:,.0f} global steps predicted over "
        f"{statistics.event_hours / 24:.1f} days (published final checkpoint: step {task.global_steps:,})"
    )


if __name__ == "__main__":
    main()
