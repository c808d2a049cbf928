"""Compute utilisation as the monitor sees it: each trainer's step records carry its running totals (samples
computed and used, seconds computing and alive); the monitor turns them into per-peer and swarm shares in the
history, the leaderboard and the live page. The end-to-end check against the trainers' own summaries is in
tests/core/test_swarm.py."""

import json

import pytest

from common.dashboard import DashboardState
from common.metrics import HistoryWriter, StepAggregator, StepRecord, aggregate_step
from common.roles.monitor import Leaderboard
from common.trainer import ComputeTotals, StepAccumulator


def record(step: int, samples: int, computed: int, used: int, gradient_seconds: float, wall: float) -> StepRecord:
    return StepRecord(
        step=step,
        samples=samples,
        loss=5.0,
        seconds=1.0,
        time=1000.0 + step,
        computed_total=computed,
        used_total=used,
        gradient_seconds_total=gradient_seconds,
        wall_seconds_total=wall,
    )


def test_swarm_shares_weight_each_peer_by_what_its_share_is_of():
    records = {
        "A": record(3, 64, computed=400, used=400, gradient_seconds=30.0, wall=40.0),
        "B": record(3, 32, computed=100, used=50, gradient_seconds=5.0, wall=60.0),
    }
    aggregate = aggregate_step(3, records, {"A": "alice", "B": "bob"})
    assert aggregate.utilisation["A"]["used_share"] == 1.0 and aggregate.utilisation["B"]["used_share"] == 0.5
    assert aggregate.used_share == pytest.approx(450 / 500)
    assert aggregate.compute_share == pytest.approx(35.0 / 100.0)
    entry = aggregate.to_json()
    assert entry["used_share"] == pytest.approx(0.9) and entry["utilisation"]["B"]["compute_share"] == pytest.approx(
        5 / 60
    )


def test_records_without_totals_leave_the_shares_unknown(tmp_path):
    old_peer = StepRecord(step=0, samples=64, loss=5.0, seconds=1.0, time=1000.0)  # a record of the earlier schema
    aggregate = aggregate_step(0, {"A": old_peer})
    assert aggregate.utilisation == {} and aggregate.used_share is None and aggregate.compute_share is None
    writer = HistoryWriter(tmp_path)
    writer.write(aggregate)
    header, row = (tmp_path / "history.csv").read_text().splitlines()
    values = dict(zip(header.split(","), row.split(",")))
    assert values["used_share"] == "" and values["compute_share"] == ""
    assert writer.read()[0]["used_share"] is None


def test_the_trainers_record_carries_its_running_totals():
    totals = ComputeTotals(started=0.0, computed=96, used=64, gradient_seconds=12.5)
    accumulator = StepAccumulator(step=2)
    accumulator.add(loss=4.0, batch_size=32, metrics={}, batch_ids=None)
    step_record = accumulator.record(totals)
    # the step being recorded counts as used: its 32 samples enter global step 2
    assert (step_record.computed_total, step_record.used_total) == (96, 96)
    assert step_record.gradient_seconds_total == 12.5 and step_record.wall_seconds_total > 0


def test_history_leaderboard_and_page_show_utilisation(tmp_path):
    aggregator = StepAggregator()
    for step in range(4):
        aggregator.add(
            "A", "alice", record(step, 64, 64 * (step + 1) + 16, 64 * (step + 1), step + 1.0, 2.0 * (step + 1))
        )
    entries = [aggregate.to_json() for aggregate in aggregator.pop_ready(flush=True)]
    assert [entry["used_share"] for entry in entries] == pytest.approx([64 / 80, 128 / 144, 192 / 208, 256 / 272])
    leaderboard = Leaderboard(tmp_path / "leaderboard.json", entries)
    leaderboard.write()
    (row,) = json.loads((tmp_path / "leaderboard.json").read_text())
    assert row["used_share"] == pytest.approx(256 / 272) and row["compute_share"] == pytest.approx(0.5)
    state = DashboardState("run", 64, 10)
    for entry in entries:
        state.add_step(entry)
    snapshot = state.to_json()
    assert snapshot["used_share"] == pytest.approx(256 / 272) and snapshot["compute_share"] == pytest.approx(0.5)
    assert snapshot["series"]["used_share"] == pytest.approx([entry["used_share"] for entry in entries])
