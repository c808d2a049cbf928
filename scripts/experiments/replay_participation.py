"""Replay the sahajBERT participation trace with real peers on this machine, compressed in time.

    python scripts/experiments/replay_participation.py [--trace paper_results/cost/participation_trace.csv]
        [--replay-seconds 720] [--max-concurrent 3] [--run-dir outputs/replay]
        [--output-dir paper_results/participation] [key=value overrides for every peer]

A monitor and one auxiliary peer stay up; at most K trainer processes (tiny ALBERT) run at once, started and
stopped as the compressed trace says (SIGTERM for a graceful leave, SIGKILL of the process group for a crash).
Writes the leaderboard (CSV + Markdown), replay.png, memory.csv and replay_summary.json to --output-dir.
"""

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import List

from common.config import load_config, script_argument_parser
from common.errors import UserError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.swarm import LocalSwarm
from common.tools.participation import Session, compress_trace, max_concurrency, read_trace_csv
from common.tools.replay import ReplayDriver, write_outputs

logger = logging.getLogger("replay")
ROOT = Path(__file__).resolve().parents[2]

# Trainers run until the schedule stops them; one trainer alone must not wait for others at its start.
# The monitor checkpoints (and so serves the state) every 2 steps: a trainer joining an empty swarm continues from it.
REPLAY_OVERRIDES = [
    "collaboration.expected_peers=1",
    "training.max_global_steps=1000000",
    "monitor.checkpoint_every_steps=2",
    "monitor.wandb_mode=disabled",
]


def parse_arguments():
    parser = script_argument_parser(__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs/albert/tiny.yaml"))
    parser.add_argument(
        "--trace",
        default=str(ROOT / "paper_results/cost/participation_trace.csv"),
        help="a participation trace CSV (scripts/experiments/make_trace.py writes one)",
    )
    parser.add_argument(
        "--window-hours",
        type=float,
        nargs=2,
        default=None,
        metavar=("FROM", "TO"),
        help="replay only this part of the trace (hours since its start), sessions clipped to it",
    )
    parser.add_argument("--replay-seconds", type=float, default=720.0, help="the trace (or window) compressed to this")
    parser.add_argument("--max-concurrent", type=int, default=3, help="K: trainer processes at most at once")
    parser.add_argument(
        "--min-session-seconds",
        type=float,
        default=20.0,
        help="skip sessions shorter than this once compressed (a trainer could not even join)",
    )
    parser.add_argument("--run-dir", default=str(ROOT / "outputs/replay"), help="peers' folders and logs")
    parser.add_argument("--output-dir", default=str(ROOT / "paper_results/participation"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every peer")
    return parser.parse_args()


def clip_to_window(sessions: List[Session], first_hour: float, last_hour: float) -> List[Session]:
    """The sessions overlapping [first_hour, last_hour), cut to it. A trainer needs about a minute to start on a
    busy 2-core machine, so a whole 9-day trace squeezed into minutes leaves every session too short to train."""
    if not 0 <= first_hour < last_hour:
        raise UserError("--window-hours needs 0 <= FROM < TO")
    return [
        replace(session, start_hour=max(session.start_hour, first_hour), end_hour=min(session.end_hour, last_hour))
        for session in sessions
        if session.start_hour < last_hour and session.end_hour > first_hour
    ]


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_arguments()
    setup_logging("replay")
    if args.max_concurrent < 1 or args.replay_seconds <= 0:
        raise UserError("--max-concurrent must be >= 1 and --replay-seconds > 0")
    overrides = [*REPLAY_OVERRIDES, *args.overrides]
    load_config(args.config, overrides)  # fail fast, before any process starts
    run_dir = Path(args.run_dir)
    if (run_dir / "monitor" / "history.jsonl").exists():
        raise UserError(f"{run_dir} holds a previous replay (monitor/history.jsonl): pick another --run-dir")
    sessions = read_trace_csv(Path(args.trace))
    if args.window_hours is not None:
        sessions = clip_to_window(sessions, *args.window_hours)
    schedule = compress_trace(sessions, args.max_concurrent, args.replay_seconds, args.min_session_seconds)
    logger.info(
        f"schedule: {schedule.sessions_replayed} trainer sessions over {args.replay_seconds:.0f} s "
        f"(x{schedule.time_scale:.0f}), peak {max_concurrency(schedule.events)} at once; skipped "
        f"{schedule.sessions_skipped_busy} (all slots busy) and {schedule.sessions_skipped_short} (too short)"
    )
    with LocalSwarm(args.config, run_dir, overrides) as swarm:
        record = ReplayDriver(swarm, schedule, should_stop=stop.is_set).run()
    summary = write_outputs(record, schedule, run_dir, Path(args.output_dir))
    logger.info(
        "replay summary:\n%s",
        json.dumps({key: value for key, value in summary.items() if key not in ("sessions", "exit_codes")}, indent=2),
    )


if __name__ == "__main__":
    main()
