"""compare_setups on emulated hosts: per-host byte accounting across network namespaces, the launch command, and
the held-out points read from checkpoints."""

import csv
import json
import os
import subprocess
import time

import pytest
import torch

from common.checkpoints import save_checkpoint
from common.errors import ConfigError
from common.metrics import HistoryWriter
from common.tools.comparison import (
    EmulatedHosts,
    SetupRun,
    add_equal_sample_scores,
    all_setups,
    heldout_curve,
    interpolate,
    launch_command,
    parse_diloco_setup,
    traffic_and_utilisation,
    trainer_host_bytes,
)
from common.tools.netns import (
    EmulatedNetwork,
    HostSpec,
    HostTraffic,
    NetworkSetup,
    address_host,
    list_namespaces,
    parse_interface_bytes_sent,
    parse_tcp_bytes_sent,
    ss_connections,
)
from tests.helpers import ROOT, leftover_namespaces, needs_network_namespaces, python_on_host, running
from tests.tools.test_compare_setups import run_until_done

SS_LISTING = (
    "ESTAB 0 0 10.77.0.2:40001 10.77.0.3:7000 \n"
    "\t bbr wscale:7,7 rto:204 bytes_sent:123456 bytes_acked:123457 bytes_received:99 segs_out:90\n"
    "ESTAB 0 0 10.77.0.2:40002 10.77.0.1:7000 \n"
    "\t bbr wscale:7,7 rto:204 bytes_sent:5000 bytes_received:7\n"
    "ESTAB 0 0 127.0.0.1:41000 127.0.0.1:41001 \n"
    "\t cubic bytes_sent:777 bytes_received:1\n"
    "LISTEN 0 4096 10.77.0.2:7000 0.0.0.0:* \n"
    "\t cubic rto:1000\n"
)
LINK_JSON = (
    '[{"ifname":"lo","stats64":{"rx":{"bytes":5},"tx":{"bytes":5}}},'
    '{"ifname":"eth0","stats64":{"rx":{"bytes":10},"tx":{"bytes":130000}}}]'
)


def test_ss_and_link_listings_parse_into_bytes_sent_per_connection_and_per_interface():
    assert parse_tcp_bytes_sent(SS_LISTING) == {
        ("10.77.0.2:40001", "10.77.0.3:7000"): 123456,
        ("10.77.0.2:40002", "10.77.0.1:7000"): 5000,
        ("127.0.0.1:41000", "127.0.0.1:41001"): 777,
    }
    assert parse_interface_bytes_sent(LINK_JSON) == 130000
    assert parse_interface_bytes_sent(LINK_JSON, "wlan0") is None
    assert address_host("10.77.0.3:7000") == 2 and address_host("127.0.0.1:41001") is None


def test_ss_connections_keep_the_process_fields_of_a_p_listing():
    """The loopback counter (``ss -tinpH``) reads the owning processes from the fields after the peer address."""
    listing = 'ESTAB 0 0 127.0.0.1:5000 127.0.0.1:6000 users:(("python",pid=42,fd=7))\n\t cubic bytes_sent:321\n'
    ((fields, sent),) = ss_connections(listing)
    assert sent == 321 and fields[3:5] == ["127.0.0.1:5000", "127.0.0.1:6000"] and "pid=42" in fields[5]
    assert len(ss_connections(SS_LISTING)) == 3  # the listening socket has no bytes_sent


def test_host_traffic_charges_each_connection_to_its_destination_host_and_keeps_the_largest_count(monkeypatch):
    listings = iter([SS_LISTING, SS_LISTING.replace("bytes_sent:5000", "bytes_sent:9000")])

    def fake_run(command, **_):
        stdout = LINK_JSON if command[0] == "ip" else next(listings)
        return subprocess.CompletedProcess(command, 0, stdout=stdout)

    monkeypatch.setattr("common.tools.netns.host_namespaces", lambda pid: {1: f"dl{pid}-ab12-1"})
    monkeypatch.setattr("common.tools.netns.subprocess.run", fake_run)
    traffic = HostTraffic(4242, ["monitor", "fast0", "slow0"])
    traffic.sample()
    traffic.sample()
    # host 1 is fast0 (10.77.0.2); loopback inside the host is not its link's traffic
    assert traffic.tcp_sent_to() == {"fast0": {"slow0": 123456, "monitor": 9000}}
    assert traffic.link_sent == {"fast0": 130000}


def test_trainer_bytes_leave_out_the_monitor_and_non_trainer_hosts():
    hosts = {
        "monitor": {"role": "monitor", "link_bytes_sent": 9_000_000, "tcp_bytes_sent_to": {"fast0": 8_000_000}},
        "fast0": {
            "role": "trainer",
            "link_bytes_sent": 3_300_000,
            "tcp_bytes_sent_to": {"slow0": 1_000_000, "aux0": 500_000, "monitor": 1_500_000},
        },
        "slow0": {"role": "trainer", "link_bytes_sent": 1_100_000, "tcp_bytes_sent_to": {"fast0": 1_000_000}},
        "aux0": {"role": "auxiliary", "link_bytes_sent": 700_000, "tcp_bytes_sent_to": {"fast0": 600_000}},
    }
    swarm, link = trainer_host_bytes(hosts)
    assert swarm == {"fast0": 1_500_000, "slow0": 1_000_000}
    assert link == {"fast0": 3_300_000, "slow0": 1_100_000}
    setup = {setup.name: setup for setup in all_setups([8])}["collab_diloco_h8"]
    run = SetupRun(setup, ROOT / "no-such-run", 0.0, 1.0, 0, hosts=hosts)
    assert run.trainer_names() == ["fast0", "slow0"]
    traffic = traffic_and_utilisation(run, samples=1000)
    assert traffic["bytes_sent_per_sample"] == 2500 and traffic["mb_sent_per_trainer"] == 1.25
    assert traffic["link_bytes_sent_per_sample"] == 4400


def test_swarms_launch_on_the_network_setup_and_baselines_stay_on_this_machine(tmp_path):
    setups = {setup.name: setup for setup in all_setups([25])}
    path = "configs/network/paper_mix.yaml"
    swarm = launch_command(setups["collab_diloco_h25"], "configs/albert/tiny.yaml", ["a=1"], tmp_path, 4, path)
    flag = swarm.index("--network-setup")
    assert swarm[flag + 1] == path and flag < swarm.index("a=1")  # an option before the positional overrides
    assert swarm[-1] == "collaboration.run_id=compare_diloco_h25"
    for name in ("single", "ddp"):
        assert "--network-setup" not in launch_command(setups[name], "c.yaml", [], tmp_path, 4)


def test_a_network_setup_with_another_trainer_count_is_one_config_error():
    from scripts.experiments.compare_setups import emulated_hosts

    with pytest.raises(ConfigError, match="--trainers 3 differs from the 4 trainer hosts"):
        emulated_hosts(str(ROOT / "configs/network/paper_mix.yaml"), 3)


def test_heldout_curve_scores_each_checkpoint_at_the_samples_and_time_of_its_step(tmp_path):
    class Output:
        def __init__(self, loss):
            self.loss, self.metrics, self.batch_size = torch.tensor(loss), {"accuracy": loss / 10}, 4

    class Task:  # the "loss" of a model is its one weight's value
        model = torch.nn.Linear(1, 1, bias=False)

        def forward(self, model, batch):
            return Output(float(model.weight.item()))

    setup = {setup.name: setup for setup in all_setups()}["collab_sync"]
    run_dir = tmp_path / "run"
    history = HistoryWriter(run_dir / "monitor")
    history.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
    entries = [
        {"step": step, "time": 100.0 + 10 * step, "samples": 64, "peers": 2, "loss": 5.0, "metrics": {}}
        for step in range(4)
    ]
    history.jsonl_path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    for step in (0, 2):  # a checkpoint of the initial state has no point: nothing was trained yet
        weights = {"weight": torch.full((1, 1), float(step + 1))}
        save_checkpoint(run_dir / "monitor" / "checkpoints", step, {"step": step, "model": weights}, keep=10)
    (run_dir / "trainer0").mkdir()
    torch.save({"weight": torch.full((1, 1), 7.0)}, run_dir / "trainer0" / "final_model.pt")
    run = SetupRun(setup, run_dir, launched=90.0, finished=150.0, exit_code=0)
    curve = heldout_curve(run, Task(), [{}])
    assert [(row["global_steps"], row["source"]) for row in curve] == [(2, "checkpoint"), (4, "final")]
    assert [row["samples_seen"] for row in curve] == [128, 256]
    assert [row["wall_seconds"] for row in curve] == [20.0, 40.0]
    assert [row["eval_loss"] for row in curve] == [3.0, 7.0]
    assert curve[0]["eval_accuracy"] == pytest.approx(0.3)


def test_emulated_hosts_wrap_their_setup_file():
    hosts = EmulatedHosts("x.yaml", NetworkSetup(hosts=[HostSpec("monitor", role="monitor"), HostSpec("t")]))
    assert hosts.path == "x.yaml" and [host.name for host in hosts.setup.hosts] == ["monitor", "t"]


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_host_traffic_reads_what_a_host_sent_from_outside_its_namespace():
    """A megabyte sent from host 0 to host 1 is counted on host 0's link and on its connection to host 1."""
    before = set(list_namespaces())
    listen = (
        "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(); print('ready', flush=True); "
        "c=s.accept()[0]\nwhile c.recv(65536): pass\nprint('done', flush=True); import time; time.sleep(30)"
    )
    send = (
        "import socket,sys,time; c=socket.create_connection((sys.argv[1], 7000)); c.sendall(b'x' * 1_000_000); "
        "print('sent', flush=True); time.sleep(30)"
    )
    try:
        with EmulatedNetwork([HostSpec("a", upload_mbit=50), HostSpec("b")]) as network:
            traffic = HostTraffic(os.getpid(), ["a", "b"])
            address = network.host_ip(1)
            with running(python_on_host(network, 1, listen, address), stdout=subprocess.PIPE, text=True) as server:
                assert server.stdout.readline().strip() == "ready"
                with running(python_on_host(network, 0, send, address), stdout=subprocess.PIPE, text=True) as client:
                    assert client.stdout.readline().strip() == "sent"
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:  # sendall returns once the kernel holds the bytes
                        traffic.sample()
                        if traffic.tcp_sent_to().get("a", {}).get("b", 0) >= 1_000_000:
                            break
                        time.sleep(0.2)
        sent_to = traffic.tcp_sent_to()
        assert 1_000_000 <= sent_to["a"]["b"] < 1_010_000
        assert traffic.link_sent["a"] >= 1_000_000  # payload plus headers
        assert sent_to.get("b", {}).get("a", 0) < 10_000  # b only acknowledged
    finally:
        assert not leftover_namespaces(before)


def test_a_diloco_setup_may_carry_an_outer_lr_of_its_own_and_bad_ones_are_refused():
    assert parse_diloco_setup("25") == (25, None) and parse_diloco_setup("25:0.5") == (25, 0.5)
    for bad in ("0", "x", "25:", "25:-1", "25:abc"):
        if bad == "25:":
            assert parse_diloco_setup(bad) == (25, None)
            continue
        with pytest.raises(ValueError, match=bad):
            parse_diloco_setup(bad)
    setup = {setup.name: setup for setup in all_setups([(25, 0.5)])}["collab_diloco_h25_lr0.5"]
    command = launch_command(setup, "configs/albert/tiny.yaml", [], ROOT, 4)
    assert "collaboration.outer_lr=0.5" in command and "collaboration.inner_steps=25" in command
    assert command[-1] == "collaboration.run_id=compare_diloco_h25_lr0p5"  # a valid run id


def test_setups_are_compared_at_the_samples_every_one_reached():
    heldout = [
        {"setup": "collab_sync", "samples_seen": 1000, "eval_loss": 9.0, "eval_mlm_accuracy": 0.0},
        {"setup": "collab_sync", "samples_seen": 3000, "eval_loss": 8.0, "eval_mlm_accuracy": 0.2},
        {"setup": "collab_diloco_h25", "samples_seen": 1200, "eval_loss": 8.5, "eval_mlm_accuracy": 0.1},
        {"setup": "collab_diloco_h25", "samples_seen": 2000, "eval_loss": 8.2, "eval_mlm_accuracy": 0.1},
    ]
    summaries = [
        {"setup": "collab_sync", "bytes_sent_per_sample": 60000.0},
        {"setup": "collab_diloco_h25", "bytes_sent_per_sample": 1200.0},
    ]
    add_equal_sample_scores(summaries, heldout)
    sync, diloco = summaries
    assert sync["equal_samples"] == diloco["equal_samples"] == 2000
    assert sync["eval_loss_at_equal_samples"] == pytest.approx(8.5)
    assert diloco["eval_loss_at_equal_samples"] == pytest.approx(8.2)
    assert diloco["eval_loss_at_equal_samples_vs_sync_percent"] == pytest.approx(-30 / 8.5)
    assert diloco["bytes_per_sample_times_fewer_than_sync"] == pytest.approx(50.0)
    assert interpolate([(1.0, 2.0), (3.0, 4.0)], 0.5) is None


TWO_TRAINER_MIX = """name: two_trainers
hosts:
  - {name: monitor, role: monitor, upload_mbit: 500, download_mbit: 500}
  - {name: fast0, role: trainer, upload_mbit: 200, download_mbit: 200}
  - {name: slow0, role: trainer, upload_mbit: 50, download_mbit: 50}
"""


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_diloco_swarm_on_emulated_hosts_is_counted_per_host_and_scored_along_the_way(tmp_path):
    """End to end: the swarm's peers on their own hosts, each trainer's bytes read from its namespace (the monitor's
    share apart), and the monitor's checkpoints scored into a held-out curve."""
    setup_file = tmp_path / "two_trainers.yaml"
    setup_file.write_text(TWO_TRAINER_MIX)
    before = set(list_namespaces())
    output, runs = tmp_path / "results", tmp_path / "runs"
    arguments = [
        *("scripts/experiments/compare_setups.py", "--reduced", "--network-setup", str(setup_file)),
        *("--diloco-inner-steps", "2", "--setups", "collab_diloco_h2", "--eval-every", "2", "--eval-batches", "2"),
        *("--output", str(output), "--runs", str(runs), "--timeout", "300"),
    ]
    result = run_until_done(arguments, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not leftover_namespaces(before)
    hosts = json.loads((runs / "collab_diloco_h2" / "run.json").read_text())["hosts"]
    assert {name: host["role"] for name, host in hosts.items()} == {
        "monitor": "monitor",
        "fast0": "trainer",
        "slow0": "trainer",
    }
    for trainer, other in (("fast0", "slow0"), ("slow0", "fast0")):
        assert hosts[trainer]["tcp_bytes_sent_to"].get(other, 0) > 100_000  # at least one pseudo-gradient round
        assert hosts[trainer]["link_bytes_sent"] >= sum(hosts[trainer]["tcp_bytes_sent_to"].values())
    with (output / "summary.csv").open() as handle:
        summary = next(csv.DictReader(handle))
    assert float(summary["bytes_sent_per_sample"]) > 0
    assert float(summary["link_bytes_sent_per_sample"]) > float(summary["bytes_sent_per_sample"])
    with (output / "heldout.csv").open() as handle:
        curve = list(csv.DictReader(handle))
    assert [row["source"] for row in curve][-1] == "final" and len(curve) >= 2
    assert (output / "heldout_curves.png").read_bytes()[:4] == b"\x89PNG"
