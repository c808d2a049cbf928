"""A join storm in small: 3 newcomers start within 3 s into a running swarm of 2 trainers (loopback, tiny ALBERT):
more newcomers than donors, so donors serve several states at once. Every newcomer loads the swarm's state and
contributes, no download fails or runs past the deadline, the donors keep stepping through the storm, and nothing is
left running. The run waits for events (donors stepping, newcomers in a global step), not for fixed windows."""

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import get_type_hints

import pytest
from hivemind.averaging.averager import DecentralizedAverager

from common.hivemind_patches.patcher import Patcher
from common.hivemind_patches.uploads import limit_concurrent_state_uploads
from tests.helpers import assert_no_processes_left, run_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_donor_serves_at_most_the_limit_and_turns_the_rest_away_at_once():
    async def serve_three_parts(self, request, context):
        for part in range(3):
            yield part

    patcher = Patcher()
    patcher.replace(DecentralizedAverager, "rpc_download_state", serve_three_parts)  # stands for hivemind's
    limit_concurrent_state_uploads(patcher, max_uploads=1)
    try:
        donor = object.__new__(DecentralizedAverager)
        donor._parent_pid = None  # not an averager this process started: its __del__ must not try to shut it down
        hints = get_type_hints(DecentralizedAverager.rpc_download_state)  # what hivemind registers the handler by
        assert "AsyncIterator" in str(hints["return"]) and "DownloadRequest" in str(hints["_request"])

        async def scenario():
            first = DecentralizedAverager.rpc_download_state(donor, None, None)
            assert await first.__anext__() == 0  # serving one newcomer
            assert [part async for part in DecentralizedAverager.rpc_download_state(donor, None, None)] == []
            await first.aclose()  # that newcomer gave up mid-stream: its slot is free again
            assert [part async for part in DecentralizedAverager.rpc_download_state(donor, None, None)] == [0, 1, 2]

        asyncio.run(scenario())
    finally:
        patcher.undo()
    with pytest.raises(ValueError, match="max_uploads"):
        limit_concurrent_state_uploads(Patcher(), 0)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_newcomers_arriving_at_once_all_load_the_state_and_contribute(tmp_path):
    run_dir, results = tmp_path / "run", tmp_path / "results"
    result = run_script(
        "scripts/experiments/scale_swarm.py",
        "storm",
        "--loopback",
        "--donors",
        "2",
        "--newcomers",
        "3",
        "--storm-seconds",
        "3",
        "--before-seconds",
        "8",
        "--after-seconds",
        "0",
        "--target-batch-size",
        "128",
        "--load-state-deadline",
        "120",
        "--join-timeout",
        "150",
        "--run-dir",
        str(run_dir),
        "--results",
        str(results),
        timeout=330,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    storm = json.loads((results / "storm.json").read_text())
    assert storm["aborted"] is None
    assert storm["newcomers_started_within_seconds"] <= 3.5
    assert storm["newcomers_contributed"] == 3, storm["newcomer_details"]
    for newcomer in storm["newcomer_details"]:
        assert newcomer["loaded_state"], f"{newcomer['name']} never loaded the swarm's state"
        assert newcomer["global_steps_contributed"] > 0, f"{newcomer['name']} is in no global step"
    # a donor too busy to answer within the request timeout is skipped and asked again later (a loaded CI machine
    # does that), but no newcomer waits for the state past the deadline
    assert storm["downloads_past_deadline"] == 0
    assert storm["state_download_phase_seconds_max"] < 120
    # the donors go on training while they serve: each finishes optimizer steps during the storm
    assert all(rate and rate > 0 for rate in storm["donor_steps_per_minute"]["storm"].values()), storm
    assert not {name: code for name, code in storm["exit_codes"].items() if code}, storm["exit_codes"]
    assert not storm["processes_left"]
    assert_no_processes_left(run_dir)


def test_a_storm_that_cannot_start_says_which_part_was_not_ready():
    spec = importlib.util.spec_from_file_location("scale_swarm", ROOT / "scripts" / "experiments" / "scale_swarm.py")
    scale_swarm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale_swarm)
    assert scale_swarm.donors_not_ready(4, 6, None) == "only 4 of 6 donors contributed within --join-timeout"
    assert "monitor recorded no global step" in scale_swarm.donors_not_ready(6, 6, None)  # not the donors' fault
    assert scale_swarm.donors_not_ready(6, 6, "the machine had only 1.0 GiB available").endswith("1.0 GiB available")
