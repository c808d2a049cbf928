"""hivemind all-reduce across emulated hosts (common/tools/allreduce.py) and its bandwidth lower bound."""

import csv
from pathlib import Path

import pytest

from common.tools import allreduce as benchmark
from common.tools.netns import HostSpec, list_namespaces
from tests.helpers import ROOT, leftover_namespaces, needs_network_namespaces, own_processes, run_script

SCRIPT = "scripts/experiments/averaging_benchmark.py"


def test_symmetric_bound_is_two_n_minus_one_over_n_of_the_vector_over_one_link():
    hosts = [HostSpec(f"p{i}", upload_mbit=100, download_mbit=100) for i in range(4)]
    vector_bytes = 10e6
    bounds = benchmark.lower_bounds(hosts, vector_bytes)
    expected = 2 * 3 / 4 * vector_bytes * 8 / 100e6
    assert bounds["bound_uniform_s"] == pytest.approx(expected)
    assert bounds["bound_optimal_s"] == pytest.approx(expected, rel=1e-6)


def test_skewed_links_make_the_best_split_beat_the_uniform_one():
    hosts = [HostSpec("fast", upload_mbit=500, download_mbit=500)] + [
        HostSpec(f"slow{i}", upload_mbit=50, download_mbit=50) for i in range(3)
    ]
    bounds = benchmark.lower_bounds(hosts, 10e6)
    # uniform: a slow peer moves 1.5 V over 50 Mb/s; best: slow peers reduce nothing and move just V
    assert bounds["bound_uniform_s"] == pytest.approx(1.5 * 10e6 * 8 / 50e6)
    assert bounds["bound_optimal_s"] == pytest.approx(10e6 * 8 / 50e6, rel=1e-6)


def test_client_mode_and_aux_peers_in_the_bound():
    hosts = [
        HostSpec("public", upload_mbit=100, download_mbit=100),
        HostSpec("home", upload_mbit=10, download_mbit=50, accepts_inbound=False),
        HostSpec("aux", role="auxiliary", upload_mbit=100, download_mbit=100),
    ]
    bounds = benchmark.lower_bounds(hosts, 1e6)
    # the client-mode peer reduces nothing but must still upload its whole vector over 10 Mb/s
    assert bounds["bound_optimal_s"] == pytest.approx(1e6 * 8 / 10e6, rel=1e-6)
    assert bounds["bound_uniform_s"] == pytest.approx(1e6 * 8 / 10e6)


def _run_benchmark(tmp_path, setup: Path, *extra):
    before = set(list_namespaces())
    small = ["--params", "200000", "--rounds", "2", "--matchmaking-time", "1", "--setup-timeout", "100"]
    result = run_script(SCRIPT, "--setups", str(setup), *small, "--output-dir", str(tmp_path), *extra, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not leftover_namespaces(before), "namespaces left behind"
    assert not own_processes("common.tools.allreduce"), "averaging workers outlived the benchmark"
    with (tmp_path / "averaging.csv").open() as handle:
        return list(csv.DictReader(handle)), result.stderr


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_peers_across_namespaces_average_correctly(tmp_path):
    setup = tmp_path / "setup.yaml"
    setup.write_text(
        "name: two\nhosts:\n"
        "  - {name: a, upload_mbit: 100, download_mbit: 100}\n"
        "  - {name: b, upload_mbit: 50, download_mbit: 50}\n"
    )
    rows, _ = _run_benchmark(tmp_path, setup)
    (row,) = rows
    assert row["rounds_ok"] == "2"
    assert float(row["max_relative_l2_error"]) < 1e-3  # fp16 on the wire
    assert float(row["round_s_median"]) >= float(row["bound_optimal_s"])  # no faster than the links allow
    assert (tmp_path / "averaging.png").stat().st_size > 0


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_client_mode_peer_behind_no_inbound_host_contributes(tmp_path):
    # the shipped NAT setup: two public hosts and one at home that accepts no inbound connections. Each peer holds
    # (rank + 1) x a shared pattern; the result is only correct if the NAT peer's vector is in it
    rows, _ = _run_benchmark(tmp_path, ROOT / "configs/network/nat3.yaml")
    (row,) = rows
    assert row["client_mode_peers"] == "1" and row["peers"] == "3"
    assert row["rounds_ok"] == "2"
    assert float(row["max_relative_l2_error"]) < 1e-3


def test_uncapped_hosts_have_no_bandwidth_bound():
    bounds = benchmark.lower_bounds([HostSpec("a"), HostSpec("b")], 1e6)
    assert bounds == {"bound_uniform_s": 0.0, "bound_optimal_s": 0.0}


def test_planned_shares_are_hivemind_load_balancer_output():
    hosts = [HostSpec("fast", upload_mbit=500, download_mbit=500)] + [
        HostSpec(f"slow{i}", upload_mbit=50, download_mbit=50) for i in range(3)
    ]
    balanced = benchmark.planned_shares(hosts, benchmark.Condition(0, 1000, "balanced", "without", "fp16"))
    uniform = benchmark.planned_shares(hosts, benchmark.Condition(0, 1000, "uniform", "without", "fp16"))
    assert balanced == pytest.approx([1.0, 0.0, 0.0, 0.0])  # the slow peers reduce nothing
    assert uniform == pytest.approx([0.25] * 4)


def test_per_peer_bytes_are_counter_differences_between_round_barriers():
    hosts = [HostSpec("a", upload_mbit=100, download_mbit=100), HostSpec("b", upload_mbit=100, download_mbit=100)]
    condition = benchmark.Condition(0, 1_000_000, "balanced", "without", "fp16")

    def samples(tx_per_round):
        return [
            {"round": r, "time": 10.0 * r, "cpu_s": 0.5 * r, "load1": 1.0, "tx": tx_per_round * r, "rx": 7 * r}
            for r in range(3)
        ]

    records = [
        {"condition": 0, "round": 1, "host": name, "step_called": 9.0, "started": 10.0, "finished": 11.5}
        for name in ("a", "b")
    ] + [
        {"condition": 0, "host": "a", "samples": samples(2_000_000)},
        {"condition": 0, "host": "b", "samples": samples(1)},
    ]
    rows = benchmark.per_peer(benchmark.NetworkSetup("two", hosts=hosts), hosts, condition, records, rounds=1)
    by_host = {row["host"]: row for row in rows}
    assert by_host["a"]["share_planned"] == pytest.approx(0.5)
    # a 2 MB fp16 vector: half of it out to be reduced, plus the averaged other half back to the other peer
    assert by_host["a"]["planned_up_MB"] == pytest.approx(2.0)
    assert by_host["a"]["observed_up_MB"] == pytest.approx(2.0)
    assert by_host["a"]["cpu_s"] == pytest.approx(0.5) and by_host["a"]["group_round_s"] == pytest.approx(1.5)
    assert benchmark.median_matchmaking(condition, records, rounds=1) == pytest.approx(1.0)
