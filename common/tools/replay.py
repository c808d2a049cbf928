"""Play a compressed participation schedule (``common.tools.participation.compress_trace``) with real peers.

A monitor and one auxiliary peer stay up for the whole replay; trainer processes are started and stopped when
the schedule says, leaving gracefully (SIGTERM) or crashing (SIGKILL of the process group). A trainer started
later loads the swarm's state from its peers (the trainer role does that at start). While it plays, the driver
samples the resident memory of every live peer's process group, so a leak shows as steady growth.

Outputs (``write_outputs``): the leaderboard (CSV + Markdown), a figure of active peers, swarm samples/s, loss and
peer memory over replay time (with the trace time it stands for), and ``replay_summary.json``.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import psutil

from common.metrics import HistoryWriter
from common.swarm import LocalSwarm
from common.tools.participation import (
    ExitKind,
    LeaderboardRow,
    PeerSession,
    ReplayAction,
    ReplayEvent,
    ReplaySchedule,
    leaderboard,
    max_concurrency,
)

logger = logging.getLogger(__name__)

MONITOR, AUXILIARY = "monitor", "aux0"


@dataclass(frozen=True)
class MemorySample:
    seconds: float  # since the schedule's time zero
    peer_name: str
    role: str
    rss_mb: float  # the peer's whole process group (python process, p2pd daemon, DHT/averager children)
    pss_mb: float  # the same with shared pages split among their sharers: forked children are not double-counted


@dataclass
class ReplayRecord:
    """What actually happened: when each trainer ran, how it ended, and the memory samples."""

    origin: float  # unix time of the schedule's time zero
    sessions: List[PeerSession] = field(default_factory=list)
    exits: Dict[str, str] = field(default_factory=dict)  # peer name -> graceful | crash | exited (on its own)
    exit_codes: Dict[str, Optional[int]] = field(default_factory=dict)
    memory: List[MemorySample] = field(default_factory=list)
    lag_seconds: List[float] = field(default_factory=list)  # how late each event was played
    wall_seconds: float = 0.0
    refused: Dict[str, str] = field(default_factory=dict)  # peer name -> why its session was not started
    sockets_removed: int = 0  # socket files the peers left (SIGKILLed peers cannot remove theirs)
    gate_wait_seconds: float = 0.0  # how long gates held the schedule back in all


def process_groups() -> Dict[int, List[int]]:
    """pgid -> its pids, in one pass over the machine's processes (one pass per sample, not one per peer: with
    sixteen peers and a busy machine, a pass per peer delayed the schedule's events by seconds)."""
    groups: Dict[int, List[int]] = {}
    for pid in psutil.pids():
        try:
            groups.setdefault(os.getpgid(pid), []).append(pid)
        except (ProcessLookupError, OSError):
            continue
    return groups


def process_group_memory_mb(pgid: int, groups: Optional[Dict[int, List[int]]] = None) -> Tuple[float, float]:
    """(RSS, PSS) summed over every process in a process group, in MiB (zeros when the group is gone)."""
    rss = pss = 0
    for pid in (groups if groups is not None else process_groups()).get(pgid, []):
        try:
            memory = psutil.Process(pid).memory_full_info()
            rss, pss = rss + memory.rss, pss + memory.pss
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return rss / 2**20, pss / 2**20


def unix_socket_paths(pgid: int, groups: Optional[Dict[int, List[int]]] = None) -> Set[str]:
    """Filesystem paths of the unix sockets a process group holds open (its p2pd's and the peer's p2p client
    sockets): a SIGKILLed peer cannot remove them, so the driver notes them while the peer lives. Read through each
    process's own /proc view, which shows its network namespace's sockets."""
    paths: Set[str] = set()
    for pid in (groups if groups is not None else process_groups()).get(pgid, []):
        try:
            inodes = set()
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) >= 8 and fields[6] in inodes and "hivemind-" in fields[7]:
                    paths.add(fields[7])
        except OSError:
            continue
    return paths


def remove_stale_sockets(paths: Iterable[str]) -> int:
    """Delete the socket files the replay's peers left behind (they are all gone by now); returns how many."""
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            continue
    return removed


class ReplayDriver:
    """Plays ``schedule`` on ``swarm``; call :meth:`run` inside the swarm's context manager."""

    def __init__(
        self,
        swarm: LocalSwarm,
        schedule: ReplaySchedule,
        trainer_overrides: Sequence[str] = (),
        memory_every_seconds: float = 5.0,
        progress_every_seconds: float = 30.0,
        grace_seconds: float = 20.0,
        should_stop: Callable[[], bool] = lambda: False,
        admit: Optional[Callable[[str], Optional[str]]] = None,
        gate: Optional[Callable[[ReplayEvent], bool]] = None,
    ):
        """``admit(peer_name)``: asked before each trainer starts; a reason (a string) refuses the session, which
        is then recorded as not played (a machine without room for one more trainer). ``gate(event)``: an event
        is played only once it returns True, and the rest of the schedule waits as long (a test plays "join once
        the swarm has stepped" at the pace of the machine instead of guessing it with a long schedule)."""
        self.swarm, self.schedule = swarm, schedule
        self.admit, self.gate = admit, gate
        self.trainer_overrides = list(trainer_overrides)
        self.memory_every_seconds, self.progress_every_seconds = memory_every_seconds, progress_every_seconds
        self.grace_seconds, self.should_stop = grace_seconds, should_stop
        self.record: Optional[ReplayRecord] = None
        self._started_at: Dict[str, float] = {}
        self._participant: Dict[str, str] = {}
        self._leaving: Dict[str, float] = {}  # peer name -> deadline for its graceful exit
        self._sockets: Set[str] = set()

    # ------------------------------------------------------------------ schedule
    def run(self) -> ReplayRecord:
        self.swarm.start_first_peer("monitor", MONITOR)
        self.swarm.start("auxiliary", AUXILIARY)
        origin = time.time()
        self.record = ReplayRecord(origin=origin)
        events = sorted(self.schedule.events, key=lambda e: (e.time_seconds, e.action != ReplayAction.stop))
        self._next_memory = self._next_progress = 0.0
        try:
            for event in events:
                # a gate held back earlier events: the rest of the schedule moves later by as much
                while (now := time.time() - origin - self.record.gate_wait_seconds) < event.time_seconds:
                    if not self._idle(now):
                        return self.record
                    time.sleep(min(0.2, max(0.0, event.time_seconds - now)))
                if self.gate is not None and not self.gate(event):
                    waiting_since = time.time()
                    while not self.gate(event):
                        if not self._idle(time.time() - origin - self.record.gate_wait_seconds):
                            return self.record
                        time.sleep(0.2)
                    self.record.gate_wait_seconds += time.time() - waiting_since
                self.record.lag_seconds.append(
                    time.time() - origin - self.record.gate_wait_seconds - event.time_seconds
                )
                self._play(event)
            self._sample_memory(time.time() - origin)
            return self.record
        finally:
            self._stop_everything()
            self.record.wall_seconds = time.time() - origin

    def _idle(self, now: float) -> bool:
        """Between events: sample memory, log progress, reap leavers; False once the replay must stop."""
        if self.should_stop():
            logger.warning("replay interrupted: stopping every peer")
            return False
        if now >= self._next_memory:
            self._sample_memory(now)
            self._next_memory = now + self.memory_every_seconds
        if now >= self._next_progress:
            self._log_progress(now)
            self._next_progress = now + self.progress_every_seconds
        self._reap_leaving()
        return True

    def _play(self, event: ReplayEvent) -> None:
        if event.action == ReplayAction.start:
            refusal = self.admit(event.peer_name) if self.admit is not None else None
            if refusal:
                logger.warning(f"{event.peer_name} not started: {refusal}")
                self.record.refused[event.peer_name] = refusal
                return
            self.swarm.start("trainer", event.peer_name, self.trainer_overrides)
            self._started_at[event.peer_name] = time.time()
            self._participant[event.peer_name] = event.participant
            return
        if event.peer_name in self.record.refused:
            return
        peer = self.swarm.peers[event.peer_name]
        if not peer.alive():
            logger.warning(
                f"{event.peer_name} had already exited (code {peer.process.returncode}): {peer.log_tail(2)}"
            )
            self._end_session(event.peer_name, "exited")
            return
        self._sockets |= unix_socket_paths(peer.process.pid)
        if event.exit == ExitKind.crash:
            self.swarm.stop(event.peer_name, graceful=False)
            self._end_session(event.peer_name, "crash")
        else:
            # SIGTERM now, reap later: a leaving peer finishes its round while the schedule goes on
            peer.process.send_signal(signal.SIGTERM)
            self._leaving[event.peer_name] = time.monotonic() + self.grace_seconds
            self._end_session(event.peer_name, "graceful")

    def _end_session(self, peer_name: str, how: str) -> None:
        self.record.sessions.append(
            PeerSession(peer_name, self._participant[peer_name], self._started_at[peer_name], time.time())
        )
        self.record.exits[peer_name] = how

    def _reap_leaving(self) -> None:
        for name, deadline in list(self._leaving.items()):
            peer = self.swarm.peers[name]
            if not peer.alive() or time.monotonic() > deadline:
                self.swarm.stop(name, graceful=False)  # the group's leftovers (p2pd), or a peer that hung
                self.record.exit_codes[name] = peer.process.returncode
                del self._leaving[name]

    def _stop_everything(self) -> None:
        trainers = [name for name in self._started_at if name not in self.record.exits]
        for name in trainers:  # the schedule ended (or was interrupted) with these still running
            self._end_session(name, "graceful")
        groups = process_groups()
        for name in trainers + [AUXILIARY, MONITOR]:
            if name in self.swarm.peers and self.swarm.peers[name].alive():
                self._sockets |= unix_socket_paths(self.swarm.peers[name].process.pid, groups)
        self.swarm.stop_many(trainers, graceful=True, grace_seconds=self.grace_seconds)
        while self._leaving:  # already signalled: a second SIGTERM would make them exit at once
            self._reap_leaving()
            time.sleep(0.2)
        time.sleep(2.0)  # the monitor polls twice a second: let it see the last records before it stops
        self.swarm.stop_many([AUXILIARY, MONITOR], graceful=True, grace_seconds=self.grace_seconds)
        for name, peer in self.swarm.peers.items():
            self.record.exit_codes.setdefault(name, peer.process.returncode)
        self.record.sockets_removed = remove_stale_sockets(self._sockets)

    # ------------------------------------------------------------------ observation
    def _live_trainers(self) -> List[str]:
        return [name for name in self._started_at if name not in self.record.exits and self.swarm.peers[name].alive()]

    def _sample_memory(self, seconds: float) -> None:
        groups = process_groups()
        for name, peer in self.swarm.peers.items():
            if peer.alive():
                self._sockets |= unix_socket_paths(peer.process.pid, groups)
            if peer.alive() and name not in self._leaving:
                self.record.memory.append(
                    MemorySample(seconds, name, peer.role, *process_group_memory_mb(peer.process.pid, groups))
                )

    def _log_progress(self, seconds: float) -> None:
        history = HistoryWriter(self.swarm.output_dir / MONITOR).read()
        remaining = self.schedule.duration_seconds - seconds
        state = (
            f"global step {history[-1]['step']} | loss {history[-1]['loss']:.3f}" if history else "no global step yet"
        )
        logger.info(
            f"replay {seconds:.0f}/{self.schedule.duration_seconds:.0f} s (ETA {max(0.0, remaining):.0f} s) "
            f"| {len(self._live_trainers())} trainers live | {state}"
        )


# ---------------------------------------------------------------------- analysis


def active_trainers_over_time(sessions: Sequence[PeerSession], origin: float, times: np.ndarray) -> np.ndarray:
    return np.asarray([sum(1 for s in sessions if s.start_time - origin <= t < s.end_time - origin) for t in times])


def samples_per_second_over_time(history: Sequence[dict], origin: float, edges: np.ndarray) -> np.ndarray:
    """Swarm throughput: samples of the global steps that ended in each bin, over the bin's width."""
    totals, _ = np.histogram(
        [entry["time"] - origin for entry in history], bins=edges, weights=[entry["samples"] for entry in history]
    )
    return totals / np.diff(edges)


def memory_trend(samples: Sequence[MemorySample], peer_name: str, warmup_seconds: float) -> Optional[dict]:
    """One long-lived peer after warm-up: RSS and PSS first/last/max, and the fitted PSS slope (MiB per minute)."""
    points = [
        (s.seconds, s.rss_mb, s.pss_mb) for s in samples if s.peer_name == peer_name and s.seconds >= warmup_seconds
    ]
    if len(points) < 3:
        return None
    seconds, rss, pss = np.asarray(points).T
    return {
        "rss_start_mb": round(float(rss[0]), 1),
        "rss_end_mb": round(float(rss[-1]), 1),
        "rss_max_mb": round(float(rss.max()), 1),
        "pss_start_mb": round(float(pss[0]), 1),
        "pss_end_mb": round(float(pss[-1]), 1),
        "pss_max_mb": round(float(pss.max()), 1),
        "pss_slope_mb_per_minute": round(float(np.polyfit(seconds / 60.0, pss, 1)[0]), 2),
    }


def trainer_memory(samples: Sequence[MemorySample], warmup_seconds: float) -> dict:
    """Trainers come and go: mean PSS of a trainer process group in the first and the last fifth of the replay."""
    points = [(s.seconds, s.rss_mb, s.pss_mb) for s in samples if s.role == "trainer" and s.seconds >= warmup_seconds]
    if not points:
        return {}
    seconds, rss, pss = np.asarray(points).T
    span = seconds.max() - seconds.min()
    first, last = seconds <= seconds.min() + span / 5, seconds >= seconds.max() - span / 5
    return {
        "pss_first_fifth_mean_mb": round(float(pss[first].mean()), 1),
        "pss_last_fifth_mean_mb": round(float(pss[last].mean()), 1),
        "pss_max_mb": round(float(pss.max()), 1),
        "rss_max_mb": round(float(rss.max()), 1),
    }


def concurrency_reached(sessions: Sequence[PeerSession]) -> int:
    """The most trainer processes that ran at once (from when each was started to when it was stopped)."""
    edges = sorted([(s.start_time, 1) for s in sessions] + [(s.end_time, -1) for s in sessions])
    running = peak = 0
    for _, change in edges:  # a stop sorts before a start at the same instant: a slot handed over is not two
        running += change
        peak = max(peak, running)
    return peak


def utilisation_from_history(history: Sequence[dict]) -> dict:
    """Samples used vs computed over the whole swarm, from each peer's last running totals in the monitor's history.

    A peer reports its totals with its step records, so what a crashed trainer computed after its last record (the
    accumulation a SIGKILL threw away) is missing here; the trainers' own summaries (graceful exits only) hold it."""
    last: Dict[str, dict] = {}
    for entry in history:
        last.update(entry.get("utilisation") or {})
    computed = sum(peer["computed_total"] for peer in last.values())
    used = sum(peer["used_share"] * peer["computed_total"] for peer in last.values())
    wall = sum(peer["wall_seconds_total"] for peer in last.values())
    return {
        "peers_reporting": len(last),
        "samples_computed": round(computed),
        "samples_used": round(used),
        "used_share": round(used / computed, 4) if computed else None,
        "compute_share": round(sum(p["compute_share"] * p["wall_seconds_total"] for p in last.values()) / wall, 4)
        if wall
        else None,
        "history_last_used_share": history[-1].get("used_share") if history else None,
        "history_last_compute_share": history[-1].get("compute_share") if history else None,
    }


def utilisation_from_summaries(run_dir: Path, peer_names: Sequence[str]) -> dict:
    """The same from the trainers' summary.json (written at a graceful exit, start-up and last round included)."""
    summaries = []
    for name in peer_names:
        try:
            summaries.append(json.loads((run_dir / name / "summary.json").read_text()))
        except (OSError, ValueError):
            continue
    computed = sum(summary.get("samples", 0) for summary in summaries)
    used = sum(summary.get("samples_used", 0) for summary in summaries)
    return {
        "trainers_with_summary": len(summaries),
        "samples_computed": computed,
        "samples_used": used,
        "used_share": round(used / computed, 4) if computed else None,
    }


def summarise(
    record: ReplayRecord, schedule: ReplaySchedule, history: Sequence[dict], memory_warmup_seconds: float
) -> dict:
    """``memory_warmup_seconds``: memory trends start after the peers have built their task and joined."""
    steps = [entry["step"] for entry in history]
    warmup = memory_warmup_seconds
    return {
        "wall_seconds": round(record.wall_seconds, 1),
        "schedule_seconds": schedule.duration_seconds,
        "time_scale": schedule.time_scale,
        "max_concurrent_trainers": schedule.max_concurrent,
        "peak_concurrent_trainers_scheduled": max_concurrency(schedule.events),
        "peak_concurrent_trainers_reached": concurrency_reached(record.sessions),
        "sessions_in_schedule": schedule.sessions_replayed,
        "sessions_skipped_short": schedule.sessions_skipped_short,
        "sessions_skipped_busy": schedule.sessions_skipped_busy,
        "sessions_refused": len(record.refused),
        "refusals": record.refused,
        "trainer_sessions": len(record.sessions),
        "sessions_in_a_global_step": len(
            {name for entry in history for name in entry.get("names", {}).values()}
            & {session.peer_name for session in record.sessions}
        ),
        "exits": {
            how: sum(1 for value in record.exits.values() if value == how) for how in ("graceful", "crash", "exited")
        },
        "max_event_lag_seconds": round(max(record.lag_seconds, default=0.0), 2),
        "gate_wait_seconds": round(record.gate_wait_seconds, 1),
        "socket_files_removed": record.sockets_removed,
        "global_steps_recorded": len(history),
        "last_global_step": steps[-1] if steps else None,
        "steps_strictly_increasing": all(b > a for a, b in zip(steps, steps[1:])),
        "total_samples": sum(entry["samples"] for entry in history),
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "utilisation": utilisation_from_history(history),
        "memory": {
            MONITOR: memory_trend(record.memory, MONITOR, warmup),
            AUXILIARY: memory_trend(record.memory, AUXILIARY, warmup),
            "trainers": trainer_memory(record.memory, warmup),
        },
        "exit_codes": record.exit_codes,
    }


# ---------------------------------------------------------------------- outputs


def write_leaderboard(rows: Sequence[LeaderboardRow], time_scale: float, directory: Path) -> None:
    columns = [
        "rank",
        "participant",
        "sessions",
        "replay_minutes_online",
        "trace_hours_online",
        "samples",
        "global_steps",
    ]
    table = [
        [
            rank,
            row.participant,
            row.sessions,
            f"{row.hours_online * 60:.2f}",
            f"{row.hours_online * time_scale:.1f}",
            row.samples,
            row.global_steps,
        ]
        for rank, row in enumerate(rows, start=1)
    ]
    with (directory / "leaderboard.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(table)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(value) for value in line) + " |" for line in table]
    (directory / "leaderboard.md").write_text("\n".join(lines) + "\n")


def plot_replay(record: ReplayRecord, schedule: ReplaySchedule, history: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(record.wall_seconds, schedule.duration_seconds)
    times = np.linspace(0.0, end, 600)
    edges = np.arange(0.0, end + 15.0, 15.0)
    step_times = [entry["time"] - record.origin for entry in history]
    figure, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].step(
        times,
        active_trainers_over_time(record.sessions, record.origin, times),
        where="post",
        label="trainer processes running",
    )
    axes[0].plot(
        step_times,
        [entry["peers"] for entry in history],
        ".",
        markersize=3,
        label="trainers contributing to a global step",
    )
    axes[0].set_ylabel("active trainers")
    axes[0].legend(loc="upper right")
    axes[1].step(edges[:-1], samples_per_second_over_time(history, record.origin, edges), where="post")
    axes[1].set_ylabel("swarm samples/s (15 s bins)")
    axes[2].plot(step_times, [entry["loss"] for entry in history])
    axes[2].set_ylabel("training loss")
    for name in (MONITOR, AUXILIARY):
        points = [(s.seconds, s.pss_mb) for s in record.memory if s.peer_name == name]
        if points:
            axes[3].plot(*zip(*points), label=name)
    trainer_points = [(s.seconds, s.pss_mb) for s in record.memory if s.role == "trainer"]
    if trainer_points:
        axes[3].plot(*zip(*trainer_points), ".", markersize=3, label="each trainer")
    axes[3].set_ylabel("PSS of process group (MiB)")
    axes[3].set_xlabel("replay seconds")
    axes[3].legend(loc="upper left")
    days = axes[0].secondary_xaxis(
        "top", functions=(lambda s: s * schedule.time_scale / 86400.0, lambda d: d * 86400.0 / schedule.time_scale)
    )
    days.set_xlabel(f"trace days (1 replay second = {schedule.time_scale:.0f} trace seconds)")
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(
    record: ReplayRecord,
    schedule: ReplaySchedule,
    run_dir: Path,
    directory: Path,
    memory_warmup_seconds: float = 120.0,
) -> dict:
    """Leaderboard, figure, memory samples and summary from a finished replay; returns the summary."""
    directory.mkdir(parents=True, exist_ok=True)
    history = HistoryWriter(run_dir / MONITOR).read()
    rows = leaderboard(history, record.sessions)
    write_leaderboard(rows, schedule.time_scale, directory)
    with (directory / "memory.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(MemorySample.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(sample) for sample in record.memory)
    plot_replay(record, schedule, history, directory / "replay.png")
    summary = summarise(record, schedule, history, memory_warmup_seconds)
    summary["leaderboard_samples"] = sum(row.samples for row in rows)
    summary["utilisation_graceful_summaries"] = utilisation_from_summaries(
        run_dir, [session.peer_name for session in record.sessions]
    )
    summary["sessions"] = [
        {**asdict(session), "exit": record.exits.get(session.peer_name)} for session in record.sessions
    ]
    (directory / "replay_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
