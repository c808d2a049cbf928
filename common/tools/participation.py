"""Participation traces for the sahajBERT event: generate, read, compress into a replay, model at full scale.

A trace is a list of sessions: one participant online on one machine from ``start_hour`` to ``end_hour``
(hours since the event began), leaving gracefully or crashing. The CSV format a user may supply has the columns
``participant, start_hour, end_hour, kind, exit, hardware, samples_per_second`` with kind volunteer | organiser |
preemptible and exit graceful | crash.

Generator (:func:`generate_event_trace`); its defaults are sahajBERT's published statistics (blog post and
model card): 40 participants = 30 volunteers + 10 organisers, 600 sessions averaging 4 h, the longest 21 h,
over 9 days (May 12-21 2021), plus 16 preemptible T4s; volunteers in client mode. Everything else is an ASSUMPTION:

- session lengths are gamma-distributed (shape 1.5, the mean of 4 h), clipped to [0.25 h, 21 h]; the longest
  draw is set to exactly 21 h and the others rescaled so the mean is 4 h;
- sessions are split among participants multinomially, organisers weighted 2x a volunteer, each at least one;
- one participant's sessions never overlap (one machine each); the idle time of the 9 days is cut into random
  gaps (Dirichlet) placed between them;
- 70 % of volunteer/organiser sessions end gracefully, 30 % crash (notebook disconnects, OOM);
- volunteers use free-tier notebook GPUs: T4 40 %, P100 30 %, K80 20 %, consumer GPU 10 %; organisers: V100
  50 %, T4 50 %;
- the 16 preemptible T4s run for the whole event; each lives an exponential time (mean 12 h) capped at 24 h
  (preemptible VMs' maximum lifetime), is interrupted (a crash) and respawns after 10 minutes. These sessions
  are not among the 600.
"""

from __future__ import annotations

import csv
import enum
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from common.errors import DataError
from common.tools.cost_model import (
    NodeGroup,
    Peer,
    SetupConfig,
    TaskSpec,
    combine_step_time,
    swarm_averaging_seconds,
)


class ParticipantKind(str, enum.Enum):
    volunteer = "volunteer"  # client mode: behind NAT, never aggregates
    organiser = "organiser"
    preemptible = "preemptible"  # the organisers' preemptible cloud T4s


class ExitKind(str, enum.Enum):
    graceful = "graceful"  # SIGTERM: the peer finishes its round and leaves
    crash = "crash"  # SIGKILL of the process group: the swarm finds out by timeouts


@dataclass(frozen=True)
class Session:
    participant: str
    start_hour: float
    end_hour: float
    kind: ParticipantKind
    exit: ExitKind
    hardware: str
    samples_per_second: float

    @property
    def hours(self) -> float:
        return self.end_hour - self.start_hour

    @property
    def client_mode(self) -> bool:
        return self.kind == ParticipantKind.volunteer


CSV_COLUMNS = ("participant", "start_hour", "end_hour", "kind", "exit", "hardware", "samples_per_second")


@dataclass(frozen=True)
class TraceParameters:
    volunteers: int = 30
    organisers: int = 10
    sessions: int = 600
    mean_session_hours: float = 4.0
    max_session_hours: float = 21.0
    event_hours: float = 9 * 24.0
    min_session_hours: float = 0.25
    session_length_shape: float = 1.5
    organiser_weight: float = 2.0
    graceful_fraction: float = 0.7
    volunteer_hardware: Tuple[Tuple[str, float], ...] = (
        ("T4", 0.4),
        ("P100", 0.3),
        ("K80", 0.2),
        ("consumer_gpu", 0.1),
    )
    organiser_hardware: Tuple[Tuple[str, float], ...] = (("V100", 0.5), ("T4", 0.5))
    preemptible_nodes: int = 16
    preemptible_hardware: str = "cloud_T4"
    preemptible_mean_life_hours: float = 12.0
    preemptible_max_life_hours: float = 24.0
    preemptible_respawn_hours: float = 10.0 / 60.0


def _session_lengths(rng: np.random.Generator, params: TraceParameters) -> np.ndarray:
    scale = params.mean_session_hours / params.session_length_shape
    lengths = np.clip(
        rng.gamma(params.session_length_shape, scale, params.sessions),
        params.min_session_hours,
        params.max_session_hours,
    )
    longest = int(np.argmax(lengths))
    lengths[longest] = params.max_session_hours
    others = np.arange(params.sessions) != longest
    target_rest = params.mean_session_hours * params.sessions - params.max_session_hours
    for _ in range(50):  # rescaling then clipping converges in a few rounds
        lengths[others] *= target_rest / lengths[others].sum()
        lengths[others] = np.clip(lengths[others], params.min_session_hours, params.max_session_hours)
        if abs(lengths[others].sum() - target_rest) < 1e-6 * target_rest:
            break
    return lengths


def _place_sessions(rng: np.random.Generator, lengths: np.ndarray, event_hours: float) -> List[Tuple[float, float]]:
    """Non-overlapping (start, end) for one participant's sessions, in random order with random gaps."""
    lengths = rng.permutation(lengths)
    busy = float(lengths.sum())
    if busy > event_hours:
        raise DataError(f"a participant's sessions add up to {busy:.1f} h, more than the event's {event_hours} h")
    gaps = rng.dirichlet(np.ones(len(lengths) + 1)) * (event_hours - busy)
    placed, clock = [], 0.0
    for gap, length in zip(gaps, lengths):
        clock += gap
        placed.append((clock, clock + float(length)))
        clock += float(length)
    return placed


def _pick(rng: np.random.Generator, choices: Sequence[Tuple[str, float]]) -> str:
    names, weights = zip(*choices)
    return str(rng.choice(names, p=np.asarray(weights) / sum(weights)))


def generate_event_trace(
    seed: int, hardware: Mapping[str, float], params: TraceParameters = TraceParameters()
) -> List[Session]:
    """A trace matching the published statistics; ``hardware`` maps hardware name -> samples/s."""
    rng = np.random.default_rng(seed)
    people = [(f"volunteer{index:02d}", ParticipantKind.volunteer) for index in range(params.volunteers)] + [
        (f"organiser{index:02d}", ParticipantKind.organiser) for index in range(params.organisers)
    ]
    weights = np.asarray([params.organiser_weight if kind == ParticipantKind.organiser else 1.0 for _, kind in people])
    counts = 1 + rng.multinomial(params.sessions - len(people), weights / weights.sum())
    lengths = _session_lengths(rng, params)
    order = np.argsort(-lengths)  # hand the longest sessions out first, to whoever has the most free time
    assigned: List[List[float]] = [[] for _ in people]
    remaining = counts.copy()
    for index in order:
        free = [params.event_hours - sum(assigned[p]) if remaining[p] > 0 else -math.inf for p in range(len(people))]
        person = int(np.argmax(free))
        assigned[person].append(float(lengths[index]))
        remaining[person] -= 1

    sessions: List[Session] = []
    for (name, kind), person_lengths in zip(people, assigned):
        machine = _pick(
            rng, params.organiser_hardware if kind == ParticipantKind.organiser else params.volunteer_hardware
        )
        for start, end in _place_sessions(rng, np.asarray(person_lengths), params.event_hours):
            exit_kind = ExitKind.graceful if rng.random() < params.graceful_fraction else ExitKind.crash
            sessions.append(Session(name, start, end, kind, exit_kind, machine, _rate(hardware, machine)))

    for node in range(params.preemptible_nodes):
        clock = 0.0
        while clock < params.event_hours:
            life = min(rng.exponential(params.preemptible_mean_life_hours), params.preemptible_max_life_hours)
            end = min(clock + life, params.event_hours)
            exit_kind = ExitKind.crash if end < params.event_hours else ExitKind.graceful
            sessions.append(
                Session(
                    f"cloud_t4_{node:02d}",
                    clock,
                    end,
                    ParticipantKind.preemptible,
                    exit_kind,
                    params.preemptible_hardware,
                    _rate(hardware, params.preemptible_hardware),
                )
            )
            clock = end + params.preemptible_respawn_hours
    return sorted(sessions, key=lambda session: (session.start_hour, session.participant))


def _rate(hardware: Mapping[str, float], name: str) -> float:
    if name not in hardware:
        raise DataError(f"hardware {name!r} has no samples/s in the hardware table (known: {sorted(hardware)})")
    return float(hardware[name])


def hardware_rates(table: SetupConfig, task_name: str) -> Dict[str, float]:
    return {
        group.name: group.samples_per_second[task_name]
        for group in table.nodes
        if task_name in group.samples_per_second
    }


def write_trace_csv(sessions: Iterable[Session], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for session in sessions:
            writer.writerow(
                [
                    session.participant,
                    f"{session.start_hour:.4f}",
                    f"{session.end_hour:.4f}",
                    session.kind.value,
                    session.exit.value,
                    session.hardware,
                    f"{session.samples_per_second:g}",
                ]
            )


def read_trace_csv(path: Path) -> List[Session]:
    if not path.is_file():
        raise DataError(f"trace file not found: {path}")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = set(CSV_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise DataError(f"{path}: missing columns {sorted(missing)} (need {', '.join(CSV_COLUMNS)})")
        sessions = []
        for line, row in enumerate(reader, start=2):
            try:
                session = Session(
                    row["participant"],
                    float(row["start_hour"]),
                    float(row["end_hour"]),
                    ParticipantKind(row["kind"]),
                    ExitKind(row["exit"]),
                    row["hardware"],
                    float(row["samples_per_second"]),
                )
            except ValueError as error:
                raise DataError(f"{path} line {line}: {error}") from None
            if not session.participant or session.end_hour <= session.start_hour or session.start_hour < 0:
                raise DataError(f"{path} line {line}: need a participant name and 0 <= start_hour < end_hour")
            if session.samples_per_second <= 0:
                raise DataError(f"{path} line {line}: samples_per_second must be > 0")
            sessions.append(session)
    if not sessions:
        raise DataError(f"{path}: no sessions")
    return sorted(sessions, key=lambda session: (session.start_hour, session.participant))


@dataclass
class TraceStatistics:
    participants: int
    volunteers: int
    organisers: int
    preemptible_nodes: int
    sessions: int  # volunteer and organiser sessions (the published 600)
    mean_session_hours: float
    max_session_hours: float
    preemptible_sessions: int
    event_hours: float

    def to_json(self) -> dict:
        return asdict(self)


def trace_statistics(sessions: Sequence[Session]) -> TraceStatistics:
    people = [session for session in sessions if session.kind != ParticipantKind.preemptible]
    cloud = [session for session in sessions if session.kind == ParticipantKind.preemptible]

    def distinct(kind: ParticipantKind) -> int:
        return len({session.participant for session in sessions if session.kind == kind})

    lengths = [session.hours for session in people]
    return TraceStatistics(
        participants=distinct(ParticipantKind.volunteer) + distinct(ParticipantKind.organiser),
        volunteers=distinct(ParticipantKind.volunteer),
        organisers=distinct(ParticipantKind.organiser),
        preemptible_nodes=distinct(ParticipantKind.preemptible),
        sessions=len(people),
        mean_session_hours=float(np.mean(lengths)) if lengths else 0.0,
        max_session_hours=float(max(lengths)) if lengths else 0.0,
        preemptible_sessions=len(cloud),
        event_hours=max(session.end_hour for session in sessions) - min(session.start_hour for session in sessions),
    )


# ----------------------------------------------------------------------------------------------- replay


class ReplayAction(str, enum.Enum):
    start = "start"
    stop = "stop"


@dataclass(frozen=True)
class ReplayEvent:
    time_seconds: float
    action: ReplayAction
    slot: int  # 0..K-1: which of the K trainer processes (its port, output folder, ...)
    peer_name: str
    participant: str
    exit: Optional[ExitKind] = None  # stop events only: SIGTERM (graceful) or SIGKILL of the group (crash)

    def to_json(self) -> dict:
        return {
            "time_seconds": round(self.time_seconds, 3),
            "action": self.action.value,
            "slot": self.slot,
            "peer_name": self.peer_name,
            "participant": self.participant,
            "exit": self.exit.value if self.exit else None,
        }


@dataclass
class ReplaySchedule:
    time_scale: float  # trace seconds per replay second
    duration_seconds: float
    max_concurrent: int
    events: List[ReplayEvent]
    sessions_replayed: int
    sessions_skipped_busy: int  # every slot was taken at the session's start
    sessions_skipped_short: int  # shorter than min_session_seconds once compressed

    def to_json(self) -> dict:
        return {
            **{key: value for key, value in self.__dict__.items() if key != "events"},
            "events": [event.to_json() for event in self.events],
        }


def compress_trace(
    sessions: Sequence[Session],
    max_concurrent: int,
    duration_seconds: float,
    min_session_seconds: float = 20.0,
    slot_cooldown_seconds: float = 5.0,
    kinds: Optional[Sequence[ParticipantKind]] = None,
) -> ReplaySchedule:
    """Scale the trace to ``duration_seconds`` and keep at most ``max_concurrent`` trainers at any time.

    Sessions are taken in start order; a session runs if, at its start, some slot has been free for at least
    ``slot_cooldown_seconds`` (the previous process there needs time to exit); otherwise it is skipped. A
    session shorter than ``min_session_seconds`` once compressed is skipped (a trainer could not even join).
    """
    if max_concurrent < 1:
        raise DataError("max_concurrent must be >= 1")
    if duration_seconds <= 0:
        raise DataError("duration_seconds must be > 0")
    chosen = [session for session in sessions if kinds is None or session.kind in kinds]
    if not chosen:
        raise DataError("no sessions to replay")
    origin = min(session.start_hour for session in chosen)
    span_hours = max(session.end_hour for session in chosen) - origin
    time_scale = span_hours * 3600.0 / duration_seconds
    slot_free_at = [-math.inf] * max_concurrent
    events: List[ReplayEvent] = []
    skipped_busy = skipped_short = 0
    for index, session in enumerate(sorted(chosen, key=lambda s: (s.start_hour, s.participant))):
        start = (session.start_hour - origin) * 3600.0 / time_scale
        end = (session.end_hour - origin) * 3600.0 / time_scale
        if end - start < min_session_seconds:
            skipped_short += 1
            continue
        free = [slot for slot in range(max_concurrent) if slot_free_at[slot] + slot_cooldown_seconds <= start]
        if not free:
            skipped_busy += 1
            continue
        slot = free[0]
        slot_free_at[slot] = end
        peer_name = f"{session.participant}-{index:04d}"
        events.append(ReplayEvent(start, ReplayAction.start, slot, peer_name, session.participant))
        events.append(ReplayEvent(end, ReplayAction.stop, slot, peer_name, session.participant, session.exit))
    events.sort(key=lambda event: (event.time_seconds, event.action != ReplayAction.stop))
    return ReplaySchedule(
        time_scale=time_scale,
        duration_seconds=duration_seconds,
        max_concurrent=max_concurrent,
        events=events,
        sessions_replayed=len(events) // 2,
        sessions_skipped_busy=skipped_busy,
        sessions_skipped_short=skipped_short,
    )


def max_concurrency(events: Sequence[ReplayEvent]) -> int:
    running = peak = 0
    for event in sorted(events, key=lambda event: (event.time_seconds, event.action != ReplayAction.stop)):
        running += 1 if event.action == ReplayAction.start else -1
        peak = max(peak, running)
    return peak


# ----------------------------------------------------------------------------------------------- full scale


@dataclass
class FullScalePoint:
    hour: float
    trainers: int
    client_mode_trainers: int
    compute_samples_per_second: float
    effective_samples_per_second: float  # target batch / predicted step time
    step_seconds: float
    global_steps: float  # cumulative


@dataclass
class FullScaleResult:
    points: List[FullScalePoint] = field(default_factory=list)

    @property
    def global_steps(self) -> float:
        return self.points[-1].global_steps if self.points else 0.0


def simulate_full_scale(
    sessions: Sequence[Session], hardware_table: SetupConfig, task: TaskSpec, resolution_hours: float = 0.25
) -> FullScaleResult:
    """Feed the trace through the cost model: who is online each ``resolution_hours``, and what that achieves."""
    groups: Dict[str, NodeGroup] = {group.name: group for group in hardware_table.nodes}
    unknown = sorted({session.hardware for session in sessions} - set(groups))
    if unknown:
        raise DataError(
            f"hardware {unknown} not in the hardware table {hardware_table.name} (known: {sorted(groups)})"
        )
    start = min(session.start_hour for session in sessions)
    end = max(session.end_hour for session in sessions)
    averaging_cache: Dict[tuple, float] = {}
    result = FullScaleResult()
    steps = 0.0
    for hour in np.arange(start, end, resolution_hours):
        middle = hour + resolution_hours / 2
        online = [session for session in sessions if session.start_hour <= middle < session.end_hour]
        throughput = sum(session.samples_per_second for session in online)
        key = (throughput, *sorted((session.hardware, session.client_mode) for session in online))
        can_aggregate = any(not session.client_mode for session in online)
        if not online or not can_aggregate:
            step_seconds = math.inf  # nobody to aggregate: volunteers in client mode alone cannot average
        else:
            if key not in averaging_cache:
                peers = [
                    Peer(groups[name].upload_mbps, groups[name].download_mbps, client_mode=client)
                    for name, client in key[1:]
                ]
                averaging_cache[key] = swarm_averaging_seconds(
                    task, peers, hardware_table.round_overhead_seconds, task.target_batch_size / throughput
                )
            step_seconds = combine_step_time(
                task.target_batch_size / throughput, averaging_cache[key], hardware_table.semantics
            )
        steps += resolution_hours * 3600.0 / step_seconds
        result.points.append(
            FullScalePoint(
                hour=float(hour),
                trainers=len(online),
                client_mode_trainers=sum(1 for session in online if session.client_mode),
                compute_samples_per_second=throughput,
                effective_samples_per_second=task.target_batch_size / step_seconds,
                step_seconds=step_seconds,
                global_steps=steps,
            )
        )
    return result


# ----------------------------------------------------------------------------------------------- leaderboard


@dataclass(frozen=True)
class PeerSession:
    """One trainer process of a participant, with wall-clock (unix) start and end."""

    peer_name: str
    participant: str
    start_time: float
    end_time: float


@dataclass
class LeaderboardRow:
    participant: str
    sessions: int
    hours_online: float
    samples: int
    global_steps: int  # steps to which at least one of the participant's peers contributed samples

    def to_json(self) -> dict:
        return asdict(self)


def leaderboard(history_records: Sequence[Mapping], peer_sessions: Sequence[PeerSession]) -> List[LeaderboardRow]:
    """Per participant: time online, samples contributed, global steps participated in (most hours first).

    ``history_records`` are the monitor's ``history.jsonl`` lines (``step``, ``contributions`` {peer id:
    samples} and ``names`` {peer id: the name it was started with}). A peer seen in the history but in no session
    is listed under its own name with no time online, so the samples column always sums to the swarm's total.
    """
    participant_of = {session.peer_name: session.participant for session in peer_sessions}
    hours: Dict[str, float] = {}
    session_count: Dict[str, int] = {}
    for session in peer_sessions:
        hours[session.participant] = (
            hours.get(session.participant, 0.0) + max(0.0, session.end_time - session.start_time) / 3600.0
        )
        session_count[session.participant] = session_count.get(session.participant, 0) + 1
    samples: Dict[str, int] = {}
    steps: Dict[str, set] = {}
    for record in history_records:
        names = record.get("names", {})
        for peer, contributed in record.get("contributions", {}).items():
            name = names.get(peer, peer)
            participant = participant_of.get(name, name)
            samples[participant] = samples.get(participant, 0) + int(contributed)
            if contributed > 0:
                steps.setdefault(participant, set()).add(int(record["step"]))
    names = set(hours) | set(samples)
    rows = [
        LeaderboardRow(
            name, session_count.get(name, 0), hours.get(name, 0.0), samples.get(name, 0), len(steps.get(name, ()))
        )
        for name in names
    ]
    return sorted(rows, key=lambda row: (-row.hours_online, -row.samples, row.participant))


# ----------------------------------------------------------------------------------------------- links


@dataclass(frozen=True)
class ParticipantLink:
    """The home link a participant's emulated host gets in a replay."""

    hardware: str
    upload_mbit: float
    download_mbit: float
    accepts_inbound: bool  # volunteers are behind NAT (client mode, as published)


def participant_links(sessions: Sequence[Session], hardware_table: SetupConfig) -> Dict[str, ParticipantLink]:
    """Each participant's link: the upload/download of its hardware's node group in ``hardware_table`` (the
    machine it runs on; one participant keeps one machine, its sessions never overlap), and no inbound
    connections for a volunteer."""
    groups: Dict[str, NodeGroup] = {group.name: group for group in hardware_table.nodes}
    unknown = sorted({session.hardware for session in sessions} - set(groups))
    if unknown:
        raise DataError(
            f"hardware {unknown} not in the hardware table {hardware_table.name} (known: {sorted(groups)})"
        )
    links: Dict[str, ParticipantLink] = {}
    for session in sorted(sessions, key=lambda s: s.start_hour):
        group = groups[session.hardware]
        links.setdefault(
            session.participant,
            ParticipantLink(session.hardware, group.upload_mbps, group.download_mbps, not session.client_mode),
        )
    return links
