"""A peer's identity and the join command: peer id from a persisted key, contributors keyed by peer id,
dialable addresses only, and a portable command that reproduces the organiser's run."""

import stat

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator

from common.config import load_config, to_container
from common.dht import dialable, join_command
from common.errors import ConfigError
from common.identity import load_identity, peer_id_of_record_owner
from common.metrics import StepAggregator, StepRecord, contributor_labels
from common.peer import portable_config_path, run_overrides
from common.roles.monitor import Leaderboard
from tests.helpers import TINY_ALBERT


def test_identity_is_persisted_and_is_the_libp2p_peer_id_and_the_record_signer(tmp_path):
    path = tmp_path / "peer" / "identity.key"
    identity = load_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400  # a private key: readable by its owner only
    assert load_identity(path).peer_id == identity.peer_id  # a restarted peer is the same contributor
    assert load_identity(tmp_path / "other.key").peer_id != identity.peer_id
    # the metrics subkey a peer signs with names the same peer id
    subkey = RSASignatureValidator(identity.private_key).local_public_key
    assert peer_id_of_record_owner(subkey) == identity.peer_id
    assert peer_id_of_record_owner(b"no owner here") is None
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path), start=True)
    try:
        assert str(dht.peer_id) == identity.peer_id  # libp2p derives the same id from the file
    finally:
        dht.shutdown()


def test_a_damaged_identity_file_is_a_one_line_config_error(tmp_path):
    path = tmp_path / "identity.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="network.identity_path"):
        load_identity(path)


def test_two_volunteers_with_one_name_stay_two_contributors(tmp_path):
    aggregator = StepAggregator()
    for peer_id, samples in (("QmAAAAAAaaaaaa", 400), ("QmBBBBBBbbbbbb", 368)):
        for step in range(3):
            aggregator.add(
                peer_id, "trainer", StepRecord(step=step, samples=samples, loss=5.0, seconds=1.0, time=float(step))
            )
    history = [aggregate.to_json() for aggregate in aggregator.pop_ready(flush=True)]
    assert [entry["peers"] for entry in history] == [2, 2, 2]
    assert history[0]["contributions"] == {"QmAAAAAAaaaaaa": 400, "QmBBBBBBbbbbbb": 368}
    assert history[1]["samples_per_second"] == pytest.approx(768.0)  # 768 samples one second after step 0 ended
    board = Leaderboard(tmp_path / "leaderboard.json", history)
    assert sorted((row["peer"], row["samples"]) for row in board.rows.values()) == [
        ("trainer", 1104),
        ("trainer", 1200),
    ]
    assert contributor_labels(history) == {"QmAAAAAAaaaaaa": "trainer@aaaaaa", "QmBBBBBBbbbbbb": "trainer@bbbbbb"}


PEER = "QmeUVih8Bi3sT6RUEDuavMabqdTM1kg4339ABtPL4krnaA"  # a valid peer id (addresses are parsed, not dialed)


def test_only_addresses_another_machine_can_dial_are_printed():
    loopback, lan = f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", f"/ip4/192.0.2.2/tcp/1/p2p/{PEER}"
    link_local, relay = "/ip4/169.254.1.1/tcp/1", f"/ip4/198.51.100.7/tcp/1/p2p/{PEER}/p2p-circuit/p2p/{PEER}"
    assert dialable([loopback, lan, f"/ip6/::1/tcp/1/p2p/{PEER}", link_local]) == [lan]
    assert dialable([loopback, relay]) == [relay]
    assert dialable([loopback, link_local]) == [link_local]
    assert dialable([loopback]) == [loopback]  # a machine without a network still hosts a local swarm


def test_peers_listen_on_every_interface_by_default():
    assert load_config(TINY_ALBERT).network.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]


def test_join_command_is_portable_and_carries_the_run_defining_overrides():
    organiser = [
        "task.max_documents=3000",
        "collaboration.expected_peers=2",
        "training.max_global_steps=3",
        "training.output_dir=/home/organiser/run",
        "collaboration.bandwidth=50",
        "network.host_maddrs=[/ip4/0.0.0.0/tcp/31337]",
        "monitor.wandb_mode=disabled",
    ]
    config = load_config(TINY_ALBERT, organiser)
    overrides = run_overrides(config, TINY_ALBERT)
    assert sorted(overrides) == [
        "collaboration.expected_peers=2",
        "task.max_documents=3000",
        "training.max_global_steps=3",
    ]
    volunteer = to_container(load_config(TINY_ALBERT, overrides))
    for section in ("task", "collaboration"):
        expected = {key: value for key, value in to_container(config)[section].items() if key != "bandwidth"}
        assert {key: value for key, value in volunteer[section].items() if key != "bandwidth"} == expected
    address = f"/ip4/192.0.2.2/tcp/1/p2p/{PEER}"
    command = join_command([address], "scripts/train.py", portable_config_path(TINY_ALBERT))
    assert command == f".venv/bin/python scripts/train.py --config configs/albert/tiny.yaml --initial-peers {address}"
    moderated = join_command([address], "scripts/volunteer.py", "c.yaml", [], "http://h:1")
    assert moderated.startswith(
        ".venv/bin/python scripts/volunteer.py --config c.yaml --auth-server http://h:1 --initial-peers"
    )


def test_a_peer_publishing_a_step_late_does_not_make_the_next_step_look_instant():
    # step 1 ended at t=2 for the swarm; one peer, busy reloading state, published its record of it at t=3.99,
    # just before the swarm finished step 2 at t=4: the swarm's rate is still 512 samples per 2 s
    aggregator = StepAggregator()
    for peer_id, times in (("QmAAAAAAaaaaaa", (0.0, 2.0, 4.0)), ("QmBBBBBBbbbbbb", (0.0, 3.99, 4.0))):
        for step, time in enumerate(times):
            aggregator.add(peer_id, "trainer", StepRecord(step=step, samples=256, loss=5.0, seconds=1.0, time=time))
    history = [aggregate.to_json() for aggregate in aggregator.pop_ready(flush=True)]
    assert [entry["samples_per_second"] for entry in history[1:]] == pytest.approx([256.0, 256.0])
