"""The participation replay driver with real peers: joins, a graceful leave, a crash and a late join."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from common.swarm import LocalSwarm
from common.tools.participation import ExitKind, ParticipantKind, PeerSession, ReplayAction, Session, compress_trace
from common.tools.replay import ReplayDriver, concurrency_reached, utilisation_from_history, write_outputs
from tests.helpers import ROOT, read_jsonl

TINY = str(ROOT / "configs/albert/tiny.yaml")


def session(participant: str, start: float, end: float, exit_kind: ExitKind) -> Session:
    # one trace hour = one replay second here; gates hold each event until the swarm got where the test needs it
    return Session(participant, start, end, ParticipantKind.organiser, exit_kind, "T4", 1.0)


def processes_mentioning(path: Path) -> str:
    return subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True).stdout.strip()


def test_concurrency_counts_a_handed_over_slot_once():
    sessions = [PeerSession("a", "a", 0, 10), PeerSession("b", "b", 10, 20), PeerSession("c", "c", 5, 15)]
    assert concurrency_reached(sessions) == 2
    assert concurrency_reached([]) == 0


def test_utilisation_uses_each_peers_last_totals():
    def totals(used_share, computed, compute_share, wall):
        return dict(
            used_share=used_share, compute_share=compute_share, computed_total=computed, wall_seconds_total=wall
        )

    history = [
        {"utilisation": {"p1": totals(1.0, 100, 0.5, 10)}},
        {"utilisation": {"p1": totals(0.5, 200, 0.5, 20), "p2": totals(1.0, 100, 1.0, 20)}, "used_share": 0.67},
    ]
    result = utilisation_from_history(history)
    assert (result["peers_reporting"], result["samples_computed"], result["samples_used"]) == (2, 300, 200)
    assert result["used_share"] == round(200 / 300, 4) and result["compute_share"] == 0.75
    assert result["history_last_used_share"] == 0.67
    assert utilisation_from_history([])["used_share"] is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_replay_keeps_training_through_leaves_crashes_and_late_joins(tmp_path, tiny_overrides):
    trace = [
        session("alice", 0, 30, ExitKind.graceful),
        session("bob", 0, 10, ExitKind.crash),
        session("carol", 5, 40, ExitKind.graceful),  # joins late: loads the swarm's state from a peer
    ]
    schedule = compress_trace(trace, max_concurrent=3, duration_seconds=40, min_session_seconds=1)
    assert schedule.sessions_replayed == 3
    overrides = [
        *tiny_overrides,
        "collaboration.expected_peers=1",
        "training.max_global_steps=100000",
        "collaboration.target_batch_size=64",
        "monitor.checkpoint_every_steps=2",
    ]
    run_dir = tmp_path / "run"
    peer_of = {event.participant: event.peer_name for event in schedule.events}
    deadline = time.monotonic() + 200

    def steps_of(participant: str) -> list:
        path = run_dir / peer_of[participant] / "steps.jsonl"
        return read_jsonl(path) if path.exists() else []

    def gate(event) -> bool:
        """Each event waits for what the checks below need to have happened before it, however slow the machine."""
        assert time.monotonic() < deadline, f"the replay waited 200 s to play {event}"
        history = read_jsonl(run_dir / "monitor/history.jsonl") if (run_dir / "monitor/history.jsonl").exists() else []
        if event.action == ReplayAction.start and event.participant == "carol":  # a state worth loading exists
            return bool(history)
        if event.action == ReplayAction.stop and event.participant == "alice":  # carol took part; alice outlived bob
            bob_end = next(s.end_time for s in driver.record.sessions if s.participant == "bob")
            return bool(steps_of("carol")) and any(entry["time"] > bob_end for entry in steps_of("alice"))
        if event.action == ReplayAction.stop and event.participant == "carol":  # carol stepped alone after alice
            alice_done = not swarm.peers[peer_of["alice"]].alive()
            alice_last = max((entry["step"] for entry in steps_of("alice")), default=0)
            return alice_done and any(entry["step"] > alice_last for entry in history)
        return True

    with LocalSwarm(TINY, run_dir, overrides) as swarm:
        driver = ReplayDriver(swarm, schedule, memory_every_seconds=5.0, gate=gate)
        record = driver.run()
    summary = write_outputs(record, schedule, run_dir, tmp_path / "results", memory_warmup_seconds=20)

    assert not processes_mentioning(tmp_path), "peers outlived the replay"
    name_of = {s.participant: s.peer_name for s in record.sessions}
    assert record.exits == {name_of["alice"]: "graceful", name_of["bob"]: "crash", name_of["carol"]: "graceful"}
    assert record.exit_codes[name_of["alice"]] == 0 and record.exit_codes[name_of["carol"]] == 0, {
        name: swarm.peers[name].log_tail() for name in name_of.values()
    }

    history = read_jsonl(run_dir / "monitor/history.jsonl")
    steps = [entry["step"] for entry in history]
    assert len(steps) >= 3 and all(b > a for a, b in zip(steps, steps[1:])), steps
    own_steps = {}
    for participant, peer_name in name_of.items():  # no trainer's own step ever goes backwards either
        own_steps[participant] = read_jsonl(run_dir / peer_name / "steps.jsonl")
        own = [entry["step"] for entry in own_steps[participant]]
        assert all(b > a for a, b in zip(own, own[1:])), (peer_name, own)
    assert own_steps["carol"] and own_steps["carol"][0]["step"] > 0, (
        "the late joiner started over instead of loading the swarm's state"
    )

    ended = {s.participant: s.end_time for s in record.sessions}
    assert any(entry["time"] > ended["bob"] for entry in own_steps["alice"]), "training stopped after the crash"
    alice_last = max(entry["step"] for entry in own_steps["alice"])
    after_leave = [e for e in history if e["step"] > alice_last]
    assert after_leave and all(list(e["names"].values()) == [name_of["carol"]] for e in after_leave), (
        "training stopped (or the departed peers still counted) after the graceful leave"
    )

    rows = {line.split(",")[1]: line for line in (tmp_path / "results/leaderboard.csv").read_text().splitlines()[1:]}
    assert set(rows) == {"alice", "bob", "carol"}, rows
    assert summary["leaderboard_samples"] == summary["total_samples"] == sum(e["samples"] for e in history)
    live_board = json.loads((run_dir / "monitor/leaderboard.json").read_text())  # the monitor's own, per peer
    assert sum(row["samples"] for row in live_board) == summary["total_samples"]
    assert summary["steps_strictly_increasing"]
    assert (tmp_path / "results/replay.png").stat().st_size > 10_000
