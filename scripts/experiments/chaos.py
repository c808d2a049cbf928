"""Chaos run: a monitor, an auxiliary peer and trainers on this machine, and a fault every few seconds: SIGKILL of a
trainer (restarted in its folder), SIGSTOP of a trainer (SIGCONT after a while), SIGKILL of the auxiliary peer or of
the monitor (each restarted in its folder). Peers join through the monitor's and the auxiliary peer's addresses,
which stay valid across their restarts. At the end every peer gets SIGTERM; the run's figures go to ``--out``:
faults by kind, global steps, steps the trainers finished that the monitor's history lacks, the longest gap in the
history, tracebacks in the logs, peak memory, processes left behind.

    python scripts/experiments/chaos.py --minutes 30 --fault-every 30 --out paper_results/chaos/chaos_30min.json
"""

import argparse
import json
import logging
import os
import platform
import random
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common.config import CONFIG_KEYS_HELP, load_config
from common.errors import UserError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import ADDRESS_FILE
from common.swarm import LocalSwarm, trainer_stop_seconds
from common.tools.provenance import process_group_rss_mib

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("chaos")

FAULTS = ("kill_trainer", "freeze_trainer", "kill_auxiliary", "kill_monitor")
RESTART_AFTER = {"kill_trainer": 10.0, "kill_auxiliary": 5.0, "kill_monitor": 5.0}
FREEZE_SECONDS = (20.0, 50.0)
# what a log line of a routine fault must never be: a Python traceback, or asyncio's complaints about lost errors
TRACEBACK_MARKERS = (
    "Traceback (most recent call last)",
    "Task exception was never retrieved",
    "Future exception was never retrieved",
    "Task was destroyed but it is pending",
)


def git_state() -> dict:
    """The commit this run starts from, and the tracked files changed since (other sessions edit this checkout)."""

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True).stdout

    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "uncommitted": git("status", "--porcelain", "-uno").splitlines(),
    }


def read_steps(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Chaos:
    def __init__(self, args, run_dir: Path, stop: StopFlag):
        self.args, self.run_dir, self.stop = args, run_dir, stop
        self.random = random.Random(args.seed)
        self.trainers = [f"trainer{index}" for index in range(args.trainers)]
        self.faults: list = []
        self.pending: list = []  # (when, action, name)
        self.frozen: dict = {}
        self.peak_rss: dict = {}
        overrides = [
            "monitor.wandb_mode=disabled",
            "monitor.refresh_seconds=0.5",
            "monitor.checkpoint_every_steps=5",
            "training.log_every_seconds=10",
            "training.max_global_steps=100000",
            f"collaboration.target_batch_size={args.target_batch_size}",
            "collaboration.expected_peers=2",
            "collaboration.matchmaking_time=2",
            "collaboration.averaging_timeout=20",
            "collaboration.final_averaging_seconds=0",
            "task.max_documents=3000",
            *args.overrides,
        ]
        self.swarm = LocalSwarm(args.config, run_dir, overrides)
        self.stop_grace = trainer_stop_seconds(load_config(args.config, overrides).collaboration.averaging_timeout)

    def addresses_of(self, names) -> list:
        files = [self.run_dir / name / ADDRESS_FILE for name in names]
        return [address for path in files if path.exists() for address in path.read_text().split()]

    def start(self, role: str, name: str) -> None:
        """Trainers join through the monitor's and the auxiliary peer's addresses (kept across their restarts), as a
        volunteer pasting the join command would; the monitor and the auxiliary peer through every other peer's."""
        entries = ["monitor", "aux"] if name in self.trainers else ["monitor", "aux", *self.trainers]
        self.swarm.initial_peers = self.addresses_of([entry for entry in entries if entry != name])
        self.swarm.start(role, name, initial_peers=bool(self.swarm.initial_peers))

    def run(self) -> None:
        with self.swarm:
            self.swarm.start_first_peer("monitor", "monitor", timeout=self.args.start_timeout)
            self.start("auxiliary", "aux")
            deadline = time.monotonic() + self.args.start_timeout
            while not (self.run_dir / "aux" / ADDRESS_FILE).exists():  # volunteers come once both are listed
                if not self.swarm.peers["aux"].alive() or time.monotonic() > deadline:
                    raise UserError(f"the auxiliary peer did not start: {self.swarm.peers['aux'].log_tail(5)}")
                time.sleep(1)
            for name in self.trainers:
                self.start("trainer", name)
            started = time.monotonic()
            next_fault = started + self.args.warmup
            end = started + self.args.minutes * 60
            scheduled = list(self.args.faults) if self.args.faults else None
            while time.monotonic() < end and not self.stop.is_set():
                now = time.monotonic()
                for item in [item for item in self.pending if item[0] <= now]:
                    self.pending.remove(item)
                    self.resume(item[1], item[2])
                if now >= next_fault and (scheduled is None or scheduled):
                    self.inject(scheduled.pop(0) if scheduled is not None else self.random.choice(FAULTS))
                    next_fault = now + self.args.fault_every
                for peer in self.swarm.peers.values():
                    if peer.alive():
                        self.peak_rss[peer.name] = max(
                            self.peak_rss.get(peer.name, 0.0), process_group_rss_mib(peer.process.pid)
                        )
                self.stop.wait(1.0)
            for when, action, name in sorted(self.pending):
                self.resume(action, name)
            for name, _ in list(self.frozen.items()):
                self.resume("thaw", name)
            time.sleep(self.args.settle)
            self.wait_for_the_monitor_to_catch_up()
            self.swarm.stop_many([*self.trainers, "aux"], graceful=True, grace_seconds=self.stop_grace)
            time.sleep(3)  # the monitor's last polls read the trainers' last records
            self.swarm.stop("monitor", graceful=True, grace_seconds=self.stop_grace)

    def wait_for_the_monitor_to_catch_up(self) -> None:
        """A monitor restarted by the last faults recovers the steps it missed from the records the trainers
        republish, which leave with the trainers: stop them only once its history is two steps behind theirs (the
        last two come with the final flush), or after ``--start-timeout``."""
        deadline = time.monotonic() + self.args.start_timeout
        while time.monotonic() < deadline:
            finished = [
                entry["step"] for name in self.trainers for entry in read_steps(self.run_dir / name / "steps.jsonl")
            ]
            recorded = [entry["step"] for entry in read_steps(self.run_dir / "monitor" / "history.jsonl")]
            if not finished or max(recorded, default=-1) >= max(finished) - 2:
                return
            time.sleep(2)
        logger.warning("the monitor did not catch up with the trainers before --start-timeout: stopping anyway")

    def inject(self, kind: str) -> None:
        live = [name for name in self.trainers if self.swarm.peers[name].alive() and name not in self.frozen]
        name = {"kill_auxiliary": "aux", "kill_monitor": "monitor"}.get(kind)
        if name is None:
            if len(live) <= 1:
                logger.info(f"skipping {kind}: one trainer left")
                return
            name = self.random.choice(live)
        if name in ("aux", "monitor") and not self.swarm.peers[name].alive():
            logger.info(f"skipping {kind}: {name} is down")
            return
        peer = self.swarm.peers[name]
        if kind == "freeze_trainer":
            seconds = self.random.uniform(*FREEZE_SECONDS)
            os.killpg(peer.process.pid, signal.SIGSTOP)
            self.frozen[name] = seconds
            self.pending.append((time.monotonic() + seconds, "thaw", name))
        else:
            self.swarm.stop(name, graceful=False)
            self.pending.append((time.monotonic() + RESTART_AFTER[kind], "restart", name))
            seconds = RESTART_AFTER[kind]
        self.faults.append({"time": time.time(), "kind": kind, "peer": name, "seconds": round(seconds, 1)})
        logger.info(f"fault {len(self.faults)}: {kind} {name} ({seconds:.0f} s)")

    def resume(self, action: str, name: str) -> None:
        if action == "thaw":
            self.frozen.pop(name, None)
            try:
                os.killpg(self.swarm.peers[name].process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            self.start(self.swarm.peers[name].role, name)


def summarize(chaos: Chaos, run_dir: Path, args, wall_seconds: float) -> dict:
    history = read_steps(run_dir / "monitor" / "history.jsonl")
    recorded = [entry["step"] for entry in history]
    finished = sorted(
        {entry["step"] for name in chaos.trainers for entry in read_steps(run_dir / name / "steps.jsonl")}
    )
    times = sorted(entry["time"] for entry in history)
    tracebacks = {}
    for log in sorted(run_dir.glob("*/peer.log")):
        text = log.read_text(errors="replace")
        count = sum(text.count(marker) for marker in TRACEBACK_MARKERS)
        if count:
            tracebacks[log.parent.name] = count
    listing = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout.splitlines()
    leftovers = [line for line in listing if "scripts/experiments/chaos.py" not in line]  # this driver is no peer
    kinds = {kind: sum(fault["kind"] == kind for fault in chaos.faults) for kind in FAULTS}
    return {
        "command": " ".join(["python", "scripts/experiments/chaos.py", *args.argv]),
        "machine": f"{platform.node()}: {os.cpu_count()}-core CPU container, no GPU",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **args.git_state,
        "wall_seconds": round(wall_seconds),
        "faults": len(chaos.faults),
        "faults_by_kind": kinds,
        "global_steps": (max(finished) + 1) if finished else 0,
        "steps_finished_by_trainers": len(finished),
        "steps_in_history": len(recorded),
        "history_in_order_without_repeats": recorded == sorted(set(recorded)),
        "steps_missing_from_history": sorted(set(finished) - set(recorded)),
        "longest_history_gap_seconds": round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 1),
        "tracebacks": tracebacks,
        "peak_rss_mib": {name: round(value) for name, value in sorted(chaos.peak_rss.items())},
        "processes_left": leftovers,
        "fault_log": chaos.faults,
    }


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CONFIG_KEYS_HELP
    )
    parser.add_argument("--config", default=str(ROOT / "configs/albert/tiny.yaml"))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between two faults")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the first fault")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after the last fault before stopping")
    parser.add_argument("--faults", nargs="*", choices=FAULTS, help="this sequence instead of random faults")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds the monitor and the auxiliary peer may take to start",
    )
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=ROOT / "outputs/chaos")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides for every peer")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    setup_logging("chaos")
    stop = StopFlag().install()
    if args.run_dir.exists() and any(args.run_dir.iterdir()):
        raise UserError(f"{args.run_dir} is not empty: give a new --run-dir")
    args.git_state = git_state()
    chaos = Chaos(args, args.run_dir, stop)
    started = time.monotonic()
    chaos.run()
    result = summarize(chaos, args.run_dir, args, time.monotonic() - started)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    logger.info(
        f"{result['faults']} faults, {result['global_steps']} global steps, "
        f"{len(result['steps_missing_from_history'])} missing from the history, tracebacks {result['tracebacks']}"
    )


if __name__ == "__main__":
    main()
