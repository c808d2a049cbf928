"""Replay the sahajBERT participation trace with real peers on this machine, compressed in time.

    python scripts/experiments/replay_participation.py [--trace paper_results/cost/participation_trace.csv]
        [--replay-seconds 720] [--max-concurrent 3] [--run-dir outputs/replay]
        [--output-dir paper_results/participation] [key=value overrides for every peer]

A monitor and one auxiliary peer stay up; at most K trainer processes (tiny ALBERT) run at once, started and
stopped as the compressed trace says (SIGTERM for a graceful leave, SIGKILL of the process group for a crash).
Writes the leaderboard (CSV + Markdown), replay.png, memory.csv and replay_summary.json to --output-dir.

With --emulate-links every participant is its own network-namespace host (common/tools/netns.py) with its
hardware's link from --hardware-table (volunteers accept no inbound connections: client mode) and --delay-ms one
way; the monitor and the auxiliary peer are hosts of their own (500 Mbit/s, reachable). A trainer starts only
while the machine keeps --min-available-gib after it (--gib-per-peer for it and each trainer still starting);
a session refused for memory is recorded as such. Needs root.
"""

import contextlib
import json
import logging
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import psutil

from common.config import load_config, script_argument_parser
from common.errors import UserError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.startup import STARTUP_FILE
from common.swarm import LocalSwarm
from common.tools.cost_model import load_setup
from common.tools.netns import EmulatedNetwork, HostSpec
from common.tools.participation import (
    ReplayAction,
    ReplaySchedule,
    Session,
    compress_trace,
    max_concurrency,
    participant_links,
    read_trace_csv,
)
from common.tools.provenance import git_commit, load_average, machine_description
from common.tools.replay import AUXILIARY, MONITOR, ReplayDriver, write_outputs

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
    parser.add_argument(
        "--emulate-links",
        action="store_true",
        help="every participant on its own emulated host with its hardware's link (needs root)",
    )
    parser.add_argument(
        "--hardware-table",
        default=str(ROOT / "configs/setups/events/sahajbert_hardware.yaml"),
        help="each hardware's upload/download (Mbit/s) for --emulate-links",
    )
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of every emulated host")
    parser.add_argument("--server-mbit", type=float, default=500.0, help="the monitor's and auxiliary's link")
    parser.add_argument("--min-available-gib", type=float, default=2.0, help="memory a trainer start leaves free")
    parser.add_argument(
        "--gib-per-peer",
        type=float,
        default=1.0,
        help="one trainer's memory once it trains (the 16-slot replay measured 0.95 GiB PSS per trainer)",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="peers run with MALLOC_ARENA_MAX=2 GOGC=50 (less memory per peer: fewer heaps, Go collects sooner)",
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


LEAN_ENVIRONMENT = {"MALLOC_ARENA_MAX": "2", "GOGC": "50"}


def emulated_hosts(args, sessions: List[Session], schedule: ReplaySchedule) -> List[HostSpec]:
    """The monitor's and the auxiliary peer's hosts, then one per participant the schedule plays."""
    played = {event.participant for event in schedule.events}
    links = participant_links(
        [session for session in sessions if session.participant in played], load_setup(args.hardware_table)
    )
    servers = [
        HostSpec(MONITOR, "monitor", args.server_mbit, args.server_mbit, delay_ms=args.delay_ms),
        HostSpec(AUXILIARY, "auxiliary", args.server_mbit, args.server_mbit, delay_ms=args.delay_ms),
    ]
    return servers + [
        HostSpec(
            name,
            "trainer",
            link.upload_mbit,
            link.download_mbit,
            accepts_inbound=link.accepts_inbound,
            delay_ms=args.delay_ms,
        )
        for name, link in sorted(links.items())
    ]


class MemoryAdmission:
    """Refuses a trainer start that would leave the machine under --min-available-gib: the new trainer and every
    trainer still starting (no first contribution yet) are counted at --gib-per-peer, what one grows to."""

    def __init__(self, swarm: LocalSwarm, floor_gib: float, per_peer_gib: float):
        self.swarm, self.floor_gib, self.per_peer_gib = swarm, floor_gib, per_peer_gib
        self.min_available_gib = float("inf")

    def __call__(self, peer_name: str) -> Optional[str]:
        starting = [
            name
            for name, peer in self.swarm.peers.items()
            if peer.role == "trainer" and peer.alive() and not (peer.output_dir / STARTUP_FILE).exists()
        ]
        available = psutil.virtual_memory().available / 2**30
        self.min_available_gib = min(self.min_available_gib, available)
        needed = self.floor_gib + self.per_peer_gib * (len(starting) + 1)
        if available < needed:
            return (
                f"no memory: {available:.1f} GiB available, {len(starting)} trainers still starting, "
                f"{needed:.1f} GiB needed"
            )
        return None


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
    # the code the peers run is the code at the start (a peer started later imports the files then present)
    started = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load": load_average(),
        "commit": git_commit(),
    }
    with contextlib.ExitStack() as stack:
        network = None
        if args.emulate_links:
            network = stack.enter_context(EmulatedNetwork(emulated_hosts(args, sessions, schedule)))
        # a trainer's peer name is per session; its host is its participant's
        host_of: Dict[str, str] = {MONITOR: MONITOR, AUXILIARY: AUXILIARY}
        host_of.update({e.peer_name: e.participant for e in schedule.events if e.action == ReplayAction.start})
        swarm = stack.enter_context(
            LocalSwarm(
                args.config,
                run_dir,
                overrides,
                command_prefix=(lambda name: network.command_prefix_for(host_of[name])) if network else None,
                host_overrides=(lambda name: network.peer_overrides(host_of[name])) if network else None,
                environment=LEAN_ENVIRONMENT if args.lean else None,
            )
        )
        admission = MemoryAdmission(swarm, args.min_available_gib, args.gib_per_peer)
        record = ReplayDriver(swarm, schedule, should_stop=stop.is_set, admit=admission).run()
        links = network.describe() if network else "loopback"
    summary = write_outputs(record, schedule, run_dir, Path(args.output_dir))
    summary.update(
        command="python scripts/experiments/replay_participation.py " + " ".join(sys.argv[1:]),
        machine=machine_description(),
        commit_at_start=started["commit"],
        commit_at_end=git_commit(),
        date=started["date"],
        load_average_at_start=started["load"],
        load_average_at_end=load_average(),
        window_hours=args.window_hours,
        min_session_seconds=args.min_session_seconds,
        links=links,
        machine_available_min_gib=round(admission.min_available_gib, 2),
    )
    (Path(args.output_dir) / "replay_summary.json").write_text(json.dumps(summary, indent=2))
    logger.info(
        "replay summary:\n%s",
        json.dumps({key: value for key, value in summary.items() if key not in ("sessions", "exit_codes")}, indent=2),
    )


if __name__ == "__main__":
    main()
