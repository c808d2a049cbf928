"""sahajBERT participation trace: statistics, CSV, replay compression, full-scale model, leaderboard."""

from collections import defaultdict
from pathlib import Path

import pytest

from common.errors import DataError
from common.tools.cost_model import load_setup, load_task_spec
from common.tools.participation import (
    ExitKind,
    ParticipantKind,
    PeerSession,
    ReplayAction,
    Session,
    compress_trace,
    generate_event_trace,
    hardware_rates,
    leaderboard,
    max_concurrency,
    participant_links,
    read_trace_csv,
    simulate_full_scale,
    trace_statistics,
    write_trace_csv,
)

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = load_setup(ROOT / "configs/setups/events/sahajbert_hardware.yaml")
TASK = load_task_spec(ROOT / "configs/setups/events/sahajbert_task.yaml")
RATES = hardware_rates(HARDWARE, TASK.name)


@pytest.fixture(scope="module")
def trace():
    return generate_event_trace(seed=0, hardware=RATES)


def test_trace_matches_published_statistics(trace):
    stats = trace_statistics(trace)
    assert (stats.participants, stats.volunteers, stats.organisers) == (40, 30, 10)
    assert stats.sessions == 600
    assert stats.mean_session_hours == pytest.approx(4.0, rel=0.02)
    assert stats.max_session_hours == pytest.approx(21.0) and stats.max_session_hours <= 21.0
    assert stats.preemptible_nodes == 16 and stats.preemptible_sessions > 16  # interrupted and respawned
    assert all(0.0 <= s.start_hour < s.end_hour <= 9 * 24.0 for s in trace)
    assert all(s.client_mode == (s.kind == ParticipantKind.volunteer) for s in trace)
    by_participant = defaultdict(list)
    for session in trace:
        by_participant[session.participant].append(session)
    for sessions in by_participant.values():  # one machine per participant: its sessions never overlap
        sessions.sort(key=lambda s: s.start_hour)
        assert all(a.end_hour <= b.start_hour for a, b in zip(sessions, sessions[1:]))
    assert {s.exit for s in trace if s.kind != ParticipantKind.preemptible} == {ExitKind.graceful, ExitKind.crash}


def test_trace_is_seeded(trace):
    assert generate_event_trace(seed=0, hardware=RATES) == trace
    assert generate_event_trace(seed=1, hardware=RATES) != trace


def test_csv_round_trip_and_errors(tmp_path, trace):
    path = tmp_path / "trace.csv"
    write_trace_csv(trace[:50], path)
    again = read_trace_csv(path)
    assert [(s.participant, s.kind, s.exit, s.hardware) for s in again] == [
        (s.participant, s.kind, s.exit, s.hardware) for s in trace[:50]
    ]
    assert [s.start_hour for s in again] == pytest.approx([s.start_hour for s in trace[:50]], abs=1e-4)
    path.write_text("participant,start_hour,end_hour\nx,0,1\n")
    with pytest.raises(DataError, match="missing columns"):
        read_trace_csv(path)
    path.write_text(
        "participant,start_hour,end_hour,kind,exit,hardware,samples_per_second\nx,5,1,volunteer,crash,T4,3\n"
    )
    with pytest.raises(DataError, match="line 2"):
        read_trace_csv(path)
    path.write_text("participant,start_hour,end_hour,kind,exit,hardware,samples_per_second\nx,0,1,alien,crash,T4,3\n")
    with pytest.raises(DataError, match="alien"):
        read_trace_csv(path)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_compression_respects_k(trace, slots):
    schedule = compress_trace(
        trace, max_concurrent=slots, duration_seconds=900.0, min_session_seconds=15.0, slot_cooldown_seconds=5.0
    )
    assert schedule.sessions_replayed > 0
    assert max_concurrency(schedule.events) <= slots
    assert schedule.time_scale == pytest.approx(9 * 24 * 3600 / 900.0)
    assert all(0.0 <= event.time_seconds <= 900.0 + 1e-6 for event in schedule.events)
    intervals = defaultdict(dict)
    for event in schedule.events:
        intervals[event.peer_name][event.action] = event
        assert event.slot < slots
    for pair in intervals.values():
        start, stop = pair[ReplayAction.start], pair[ReplayAction.stop]
        assert start.slot == stop.slot and stop.time_seconds - start.time_seconds >= 15.0
        assert stop.exit in (ExitKind.graceful, ExitKind.crash) and start.exit is None
    per_slot = defaultdict(list)
    for pair in intervals.values():
        per_slot[pair[ReplayAction.start].slot].append(
            (pair[ReplayAction.start].time_seconds, pair[ReplayAction.stop].time_seconds)
        )
    for spans in per_slot.values():
        spans.sort()
        assert all(end + 5.0 <= next_start + 1e-9 for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert schedule.sessions_replayed + schedule.sessions_skipped_busy + schedule.sessions_skipped_short == len(trace)


def _session(name, start, end, kind=ParticipantKind.organiser, hardware="T4"):
    return Session(name, start, end, kind, ExitKind.graceful, hardware, RATES[hardware])


def test_full_scale_model_steps_and_client_only_gaps():
    sessions = [_session("org", 0.0, 2.0), _session("vol", 1.0, 4.0, kind=ParticipantKind.volunteer)]
    result = simulate_full_scale(sessions, HARDWARE, TASK, resolution_hours=0.5)
    assert [point.trainers for point in result.points] == [1, 1, 2, 2, 1, 1, 1, 1]
    steps = [point.global_steps for point in result.points]
    assert all(b >= a for a, b in zip(steps, steps[1:]))
    assert steps[-1] == steps[3] > 0  # volunteers in client mode alone cannot average: no progress after hour 2
    assert result.points[2].compute_samples_per_second == pytest.approx(2 * RATES["T4"])
    with pytest.raises(DataError, match="hardware"):
        simulate_full_scale(
            [Session("x", 0, 1, ParticipantKind.organiser, ExitKind.crash, "TPU", 1.0)], HARDWARE, TASK
        )


def test_leaderboard_sums_to_swarm_total():
    history = [
        {"step": 0, "samples": 30, "contributions": {"alice-0001": 10, "bob-0002": 20}},
        {"step": 1, "samples": 35, "contributions": {"alice-0001": 5, "bob-0002": 0, "alice-0003": 10, "ghost": 20}},
        {"step": 2, "samples": 12, "contributions": {"alice-0003": 12}},
    ]
    sessions = [
        PeerSession("alice-0001", "alice", 0.0, 3600.0),
        PeerSession("alice-0003", "alice", 4000.0, 5800.0),
        PeerSession("bob-0002", "bob", 0.0, 7200.0),
    ]
    rows = {row.participant: row for row in leaderboard(history, sessions)}
    assert sum(row.samples for row in rows.values()) == sum(record["samples"] for record in history)
    assert (
        rows["alice"].samples == 10 + 5 + 10 + 12 and rows["alice"].global_steps == 3 and rows["alice"].sessions == 2
    )
    assert rows["alice"].hours_online == pytest.approx(1.5)
    assert rows["bob"].samples == 20 and rows["bob"].global_steps == 1  # a zero contribution is no participation
    assert rows["ghost"].hours_online == 0.0 and rows["ghost"].samples == 20
    assert [row.participant for row in leaderboard(history, sessions)][0] == "bob"  # most hours first


def test_participant_links_follow_hardware_and_kind(trace):
    links = participant_links(trace, HARDWARE)
    assert set(links) == {session.participant for session in trace}
    groups = {group.name: group for group in HARDWARE.nodes}
    for session in trace:
        link = links[session.participant]
        assert link.hardware == session.hardware
        assert (link.upload_mbit, link.download_mbit) == (
            groups[link.hardware].upload_mbps,
            groups[link.hardware].download_mbps,
        )
        assert link.accepts_inbound == (session.kind != ParticipantKind.volunteer)
    odd = [Session("x", 0, 1, ParticipantKind.volunteer, ExitKind.crash, "TPU", 1.0)]
    with pytest.raises(DataError, match="TPU"):
        participant_links(odd, HARDWARE)
