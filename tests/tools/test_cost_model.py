"""Cost/time model: the averaging-time formula against hand-computed cases, predictions, configs, validation CLI."""

import json
from pathlib import Path

import numpy as np
import pytest

from common.config import Semantics
from common.errors import ConfigError, DataError
from common.tools.cost_model import (
    NodeGroup,
    NodeRole,
    Peer,
    Pricing,
    SetupConfig,
    SetupKind,
    TaskSpec,
    as_diloco,
    butterfly_seconds,
    butterfly_shares,
    fit_round_overhead,
    fit_swarm_calibration,
    load_setup,
    load_task_spec,
    predict,
    ring_allreduce_seconds,
    swarm_averaging_seconds,
    validate_against_history,
)
from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
MEGABYTE = 1_000_000  # vector bytes in the hand-computed cases: 8e6 bits


def test_symmetric_bandwidth_matches_textbook_butterfly():
    peers = [Peer(100, 100)] * 4
    shares = butterfly_shares(MEGABYTE, peers)
    assert np.allclose(shares, 0.25)
    # each peer moves 2 (n-1)/n of the vector each way: 1.5 * 8e6 bits / 100e6 bit/s
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(0.12, rel=1e-6)


def test_skewed_bandwidth_load_balanced_split():
    peers = [Peer(300, 300), Peer(200, 200), Peer(200, 200)]
    # LP by hand: (1 + w_i)/b_i equal for all, w_1 = w_2 = w, w_0 = 1 - 2w  =>  w = 1/7, w_0 = 5/7
    shares = butterfly_shares(MEGABYTE, peers)
    assert shares == pytest.approx([5 / 7, 1 / 7, 1 / 7], abs=1e-3)
    # time = (1 + 1/7) * 8e6 bits / 200e6 bit/s
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(8e6 * (8 / 7) / 200e6, rel=1e-3)
    equal_split = butterfly_seconds(MEGABYTE, peers, shares=np.full(3, 1 / 3))
    assert equal_split == pytest.approx(8e6 * (4 / 3) / 200e6, rel=1e-6)
    assert butterfly_seconds(MEGABYTE, peers) < equal_split


def test_slow_peer_is_bounded_by_its_own_upload():
    peers = [Peer(300, 300), Peer(100, 100), Peer(100, 100)]
    # the slow peers must at least send their whole vector once: 8e6 / 100e6 = 0.08 s; the LP gives them nothing
    shares = butterfly_shares(MEGABYTE, peers)
    assert shares[1] == pytest.approx(0.0, abs=1e-6) and shares[2] == pytest.approx(0.0, abs=1e-6)
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(0.08, rel=1e-6)


def test_asymmetric_link_limited_by_slower_direction():
    peers = [Peer(upload_mbps=50, download_mbps=400), Peer(50, 400)]
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(8e6 / 50e6, rel=1e-6)


def test_client_mode_peers_aggregate_nothing():
    peers = [Peer(100, 100), Peer(100, 100), Peer(100, 100, client_mode=True)]
    shares = butterfly_shares(MEGABYTE, peers)
    assert shares[2] == 0.0
    assert shares[:2] == pytest.approx([0.5, 0.5], abs=1e-6)
    # aggregators: S (1 + (3 - 2) * 0.5) = 1.5 S; the client only sends and receives its own S
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(1.5 * 8e6 / 100e6, rel=1e-6)


def test_auxiliary_peer_takes_a_share_without_sending_a_vector():
    peers = [Peer(100, 100), Peer(100, 100), Peer(100, 100, sends_vector=False)]
    shares = butterfly_shares(MEGABYTE, peers)
    assert shares == pytest.approx([1 / 3] * 3, abs=1e-6)
    # trainers: S (1 + 0 * w) = S; auxiliary: S * w * 2 senders = 2/3 S  => slowest is a trainer at S / b
    assert butterfly_seconds(MEGABYTE, peers) == pytest.approx(8e6 / 100e6, rel=1e-6)


def test_all_client_mode_is_a_clear_error():
    with pytest.raises(ConfigError, match="inbound"):
        butterfly_shares(MEGABYTE, [Peer(100, 100, client_mode=True)] * 3)


def test_ring_allreduce():
    assert ring_allreduce_seconds(MEGABYTE, 8, 100.0) == pytest.approx(2 * 7 / 8 * 8e6 / 100e9)
    assert ring_allreduce_seconds(MEGABYTE, 1, 100.0) == 0.0


def _swarm(semantics=Semantics.sync, interruptions=0.0):
    return SetupConfig(
        name="hand",
        kind=SetupKind.swarm,
        semantics=semantics,
        round_overhead_seconds=0.5,
        nodes=[
            NodeGroup(
                name="gpu",
                count=4,
                role=NodeRole.trainer,
                samples_per_second={"t": 25.0},
                upload_mbps=100,
                download_mbps=100,
                usd_per_hour=1.0,
                pricing=Pricing.preemptible,
                interruptions_per_hour=interruptions,
                restart_minutes=30.0,
            ),
            NodeGroup(name="boss", count=1, role=NodeRole.monitor, usd_per_hour=0.5),
        ],
    )


def test_prediction_sync_dpu_and_cost():
    task = TaskSpec(
        name="t",
        parameters=500_000,
        bytes_per_parameter=2.0,
        target_batch_size=1000,
        global_steps=3600,
        average_state_every=0,
    )
    sync = predict(_swarm(), task)
    assert sync.accumulation_seconds == pytest.approx(10.0)  # 1000 samples / (4 x 25 samples/s)
    assert sync.averaging_seconds == pytest.approx(0.5 + 0.12)  # overhead + the symmetric case above
    assert sync.step_seconds == pytest.approx(10.62)
    assert sync.total_hours == pytest.approx(10.62)
    assert sync.total_cost_usd == pytest.approx(10.62 * 4.5)
    assert predict(_swarm(Semantics.dpu), task).step_seconds == pytest.approx(10.0)
    with_state = predict(
        _swarm(), TaskSpec(name="t", parameters=500_000, target_batch_size=1000, global_steps=1, average_state_every=2)
    )
    assert with_state.averaging_seconds == pytest.approx(0.62)  # the state round hides behind the 10 s accumulation
    short_steps = predict(
        _swarm(), TaskSpec(name="t", parameters=500_000, target_batch_size=10, global_steps=1, average_state_every=1)
    )
    assert short_steps.averaging_seconds == pytest.approx(0.62 + (0.62 - 0.1))  # 0.1 s accumulation hides little


def test_diloco_pays_one_round_every_inner_steps_global_steps():
    task = TaskSpec(name="t", parameters=500_000, target_batch_size=1000, global_steps=3600, average_state_every=1)
    diloco = predict(as_diloco(_swarm(), 10), task)
    assert diloco.setup.endswith("_diloco_h10") and diloco.semantics == "diloco"
    assert diloco.averaging_seconds == pytest.approx((0.5 + 0.12) / 10)  # no gradient or state rounds between
    assert diloco.step_seconds == pytest.approx(10.0 + 0.062)
    with pytest.raises(ValueError, match="diloco needs a swarm"):
        SetupConfig(name="h", kind=SetupKind.hpc, semantics=Semantics.diloco, interconnect_gbps=1, nodes=[NodeGroup()])


def test_preemptible_availability_lowers_throughput_and_bill():
    task = TaskSpec(name="t", parameters=1000, target_batch_size=1000, global_steps=1)
    flaky = predict(_swarm(interruptions=1.0), task)  # up 1 / (1 + 0.5) of the time
    assert flaky.swarm_samples_per_second == pytest.approx(100.0 / 1.5)
    assert flaky.usd_per_hour == pytest.approx(4.0 / 1.5 + 0.5)


def test_paper_setup_configs_load_and_predict():
    tasks = [load_task_spec(path) for path in sorted((ROOT / "configs/setups/tasks").glob("*.yaml"))]
    setups = [load_setup(path) for path in sorted((ROOT / "configs/setups").glob("*.yaml"))]
    assert {task.name for task in tasks} == {"albert_large", "swav_resnet50"}
    assert len(setups) == 4
    for setup in setups:
        for task in tasks:
            prediction = predict(setup, task)
            assert prediction.step_seconds >= prediction.accumulation_seconds > 0
            assert prediction.total_cost_usd > 0
    cloud = next(setup for setup in setups if setup.name == "cloud_16xt4_spot")
    links = sorted(
        group.upload_mbps for group in cloud.nodes if group.role == NodeRole.trainer for _ in range(group.count)
    )
    assert links == [50] * 4 + [100] * 8 + [200] * 4


def test_bad_setup_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nnodes:\n  - name: gpu\n    count: 0\n")
    with pytest.raises(ConfigError, match=r"nodes\[gpu\]\.count must be >= 1"):
        load_setup(path)
    path.write_text("name: bad\nnodes:\n  - name: gpu\n    samples_per_second: {t: 1.0}\n    colour: red\n")
    with pytest.raises(ConfigError, match="colour"):
        load_setup(path)


def _synthetic_history(steps=8, interval=4.0):
    return [
        {
            "step": step,
            "peers": 3,
            "samples": 300,
            "loss": 5.0,
            "seconds": interval,
            "time": 1000.0 + interval * step,
            "metrics": {},
            "contributions": {"a": 100, "b": 100, "c": 100},
        }
        for step in range(steps)
    ]


def test_validation_against_a_synthetic_history():
    validation = validate_against_history(
        _synthetic_history(),
        {"a": 50.0, "b": 50.0, "c": 50.0},
        parameters=1_000_000,
        bytes_per_parameter=2.0,
        bandwidth_mbps=1000.0,
        round_overhead_seconds=1.0,
        average_state_every=1,
    )
    # accumulation 300 / 150 = 2 s; each round 1 s + 2e6 B * 8 * (4/3) / 1e9 b/s: the gradient round, while the
    # state round (1.02 s) hides in the background behind the next 2 s accumulation
    expected = 2.0 + (1.0 + 16e6 * (4 / 3) / 1e9)
    assert validation.predicted_step_seconds == pytest.approx(expected)
    assert validation.measured_step_seconds == pytest.approx(4.0)
    assert validation.relative_error == pytest.approx(expected / 4.0 - 1.0)
    with pytest.raises(DataError, match="global steps"):
        validate_against_history(_synthetic_history(steps=2), {"a": 1.0}, 10, 2.0, 100.0, 1.0, 1)


def test_fitted_round_overhead_reproduces_the_calibration_run():
    arguments = dict(parameters=1_000_000, bytes_per_parameter=2.0, bandwidth_mbps=1000.0, average_state_every=1)
    rates = {"a": 50.0, "b": 50.0, "c": 50.0}

    def predicted(overhead):
        return validate_against_history(
            _synthetic_history(), rates, round_overhead_seconds=overhead, **arguments
        ).predicted_step_seconds

    overhead = fit_round_overhead(predicted, measured_step_seconds=4.0)
    # measured 4 s = accumulation 2 s + one gradient round (overhead + 2e6 B * 8 * (4/3) / 1e9 b/s)
    assert overhead == pytest.approx(2.0 - 16e6 * (4 / 3) / 1e9)
    assert predicted(overhead) == pytest.approx(4.0)
    assert fit_round_overhead(predicted, measured_step_seconds=1.0) == 0.0  # even no overhead over-predicts


def test_slow_state_round_shows_where_it_outlasts_the_accumulation():
    task = TaskSpec(
        name="t", parameters=1_000_000, bytes_per_parameter=2.0, target_batch_size=100, average_state_every=1
    )
    peers = [Peer(10.0, 10.0)] * 2  # 2 MB over 10 Mb/s: 1.6 s per round
    assert swarm_averaging_seconds(task, peers, 0.0, accumulation_seconds=5.0) == pytest.approx(1.6)
    assert swarm_averaging_seconds(task, peers, 0.0, accumulation_seconds=1.0) == pytest.approx(1.6 + 0.6)


def test_two_calibration_runs_determine_throughput_and_overhead():
    arguments = dict(
        parameters=1_000_000,
        bytes_per_parameter=2.0,
        bandwidth_mbps=1000.0,
        average_state_every=1,
        round_overhead_seconds=0.0,
    )
    rates = {"a": 50.0, "b": 50.0, "c": 50.0}  # what side-by-side runs claimed; the swarm really got 100 samples/s
    transfer = 16e6 * (4 / 3) / 1e9
    runs = []
    for samples in (300, 600):
        history = [
            {"step": step, "time": step * (samples / 100.0 + 0.5 + transfer), "samples": samples, "peers": 3}
            for step in range(6)
        ]
        runs.append(validate_against_history(history, rates, **arguments))
    fitted = fit_swarm_calibration(*runs, semantics=Semantics.sync)
    assert fitted.swarm_samples_per_second == pytest.approx(100.0)
    assert fitted.round_overhead_seconds == pytest.approx(0.5)
    with pytest.raises(DataError, match="larger target batch"):
        fit_swarm_calibration(runs[0], runs[0], semantics=Semantics.sync)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_validate_cli_on_a_run_folder(tmp_path):
    run = tmp_path / "run"
    (run / "monitor").mkdir(parents=True)
    (run / "monitor" / "history.jsonl").write_text("\n".join(json.dumps(r) for r in _synthetic_history()) + "\n")
    for name in "abc":
        (run / name).mkdir()
        (run / name / "summary.json").write_text(
            json.dumps({"peer_name": name, "samples": 400, "samples_per_second": 50.0})
        )
    report_path = tmp_path / "report.json"

    def validate(*options: str):
        return run_script("scripts/experiments/cost_model.py", "validate", *options, timeout=110)

    measured = ["--bandwidth-mbps", "1000", "--parameters", "1000000", "--output", str(report_path)]
    completed = validate("--run-dir", str(run), *measured, "--config", str(ROOT / "configs/albert/tiny.yaml"))
    assert completed.returncode == 0, completed.stderr
    report = json.loads(report_path.read_text())
    assert report["trainer_samples_per_second"] == {"a": 50.0, "b": 50.0, "c": 50.0}
    assert report["measured_step_seconds"] == pytest.approx(4.0)
    assert report["bytes_per_parameter"] == 2.0 and report["semantics"] == "sync"  # from the tiny config (fp16)
    fitted = validate("--run-dir", str(run), *measured, "--calibrate-on", str(run))
    assert fitted.returncode == 0, fitted.stderr
    report = json.loads(report_path.read_text())  # fitted on the same run: it predicts that run exactly
    assert report["relative_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["calibration"]["round_overhead_seconds"] == pytest.approx(report["round_overhead_seconds"])
    missing = validate("--run-dir", str(tmp_path / "nothing"), "--bandwidth-mbps", "1000")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].startswith("error: no history.jsonl")
