"""Under donors killed, frozen, corrupting or speaking another protocol mid-transfer, with newcomers downloading at
once, no newcomer ever accepts a state that is not the donors' exact state (the short CI version of
scripts/experiments/state_download_faults.py; the loop's results are in paper_results/state_download)."""

import argparse
import importlib.util
import os

import pytest

from tests.helpers import ROOT

DRIVER = ROOT / "scripts/experiments/state_download_faults.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("state_download_faults", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)  # start-up alone took minutes on the 2 shared cores
def test_no_corrupt_state_is_accepted_from_killed_frozen_corrupting_or_digestless_donors(tmp_path, monkeypatch):
    driver = load_driver()
    started = []
    start = driver._start
    monkeypatch.setattr(driver, "_start", lambda *arguments: started.append(start(*arguments)) or started[-1])
    args = argparse.Namespace(
        seed=0,
        faults=["kill-averager", "freeze", "corrupt", "no-digest"],
        protocol="ours",
        part_delay=0.005,
        max_after_parts=60,
        newcomers=2,
        load_timeout=60,
        attempts=3,
        start_timeout=300,
        newcomer_timeout=300,
    )
    trial = driver.run_trial(0, args, tmp_path)
    assert started and not [process.pid for process in started if group_alive(process.pid)]
    outcomes = [newcomer["outcome"] for newcomer in trial["newcomers"]]
    assert outcomes == ["exact", "exact"], trial
    # the faults were met: the first newcomer to ask sees every donor (the others' view of the donors can lack the
    # frozen or killed ones' DHT records) and refuses the corrupt and the digest-less state; the killed donor's
    # stream was cut
    summary = driver.summarize([trial])
    assert summary["refusals"]["digest mismatch"] >= 1, trial
    assert summary["refusals"]["no digests"] >= 1, trial
    assert summary["refusals"]["stream cut short"] >= 1, trial
