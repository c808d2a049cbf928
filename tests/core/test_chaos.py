"""Chaos in CI: a monitor, an auxiliary peer and three trainers while every role is killed (the monitor twice) and a
trainer frozen; the monitor's history must hold every global step the trainers finished, no log may hold a
traceback, and nothing may be left running."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_script

FAULTS = ["kill_trainer", "freeze_trainer", "kill_monitor", "kill_auxiliary", "kill_trainer", "kill_monitor"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_step_is_in_the_history_after_kills_and_freezes_of_every_role(tmp_path):
    out = tmp_path / "chaos.json"
    result = run_script(
        "scripts/experiments/chaos.py",
        *("--minutes", "2.5", "--fault-every", "20", "--warmup", "45", "--faults", *FAULTS),
        *("--run-dir", str(tmp_path / "run"), "--out", str(out)),
        timeout=1100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    chaos = json.loads(out.read_text())
    assert chaos["faults_by_kind"] == {"kill_trainer": 2, "freeze_trainer": 1, "kill_auxiliary": 1, "kill_monitor": 2}
    assert chaos["global_steps"] >= 3, chaos
    assert chaos["steps_missing_from_history"] == [], chaos
    assert chaos["history_in_order_without_repeats"], chaos
    assert chaos["tracebacks"] == {}, chaos
    assert chaos["processes_left"] == [], chaos
