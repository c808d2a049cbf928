"""An authorized sahajBERT swarm: two allowlisted volunteers train together on the streamed Bengali mix, while
peers without a token or with a forged one cannot even join the DHT."""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from albert.sahajbert.data import StreamConfig, tokenizer_training_texts
from albert.sahajbert.tokenizer import train_bengali_tokenizer
from common.auth import (
    AllowlistEntry,
    AllowlistTokenAuthorizer,
    AuthorizationService,
    AuthServer,
    TLSFiles,
    hash_password,
    make_self_signed_certificate,
)
from common.config import NetworkConfig
from common.dht import start_dht
from common.errors import PeerError
from common.peer import ADDRESS_FILE
from common.swarm import LOOPBACK_LISTEN, stop_process_group

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sahajbert"
PASSWORDS = {"alice": "correct horse", "bob": "battery staple"}
STEPS = 3


def _overrides(tmp_path: Path, tokenizer_dir: Path, name: str) -> list:
    return [
        f"task.stream.sources=[{FIXTURES / 'wikipedia_standin'},{FIXTURES / 'oscar_standin'}]",
        "task.stream.shuffle_buffer=200",
        f"task.tokenizer={tokenizer_dir}",
        "task.vocab_size=400",
        "task.max_seq_length=32",
        "task.hidden_size=32",
        "task.intermediate_size=64",
        "task.embedding_size=16",
        "task.num_hidden_layers=1",
        f"task.cache_dir={tmp_path / 'cache'}",
        "collaboration.target_batch_size=32",
        "collaboration.expected_peers=2",
        "collaboration.matchmaking_time=1.0",
        "collaboration.averaging_timeout=15.0",
        "collaboration.start_barrier_timeout=240",
        "training.local_batch_size=8",
        f"training.max_global_steps={STEPS}",
        "training.log_every_seconds=5",
        f"training.output_dir={tmp_path / name}",
        "monitor.metrics_expiration=60",
        LOOPBACK_LISTEN,  # every peer of this test is on this machine
    ]


def _start_moderated_peer(tmp_path, tokenizer_dir, server_url, script, name, user, extra) -> subprocess.Popen:
    """A peer of the moderated run, authorized as ``user``; its log is <tmp_path>/<name>.log."""
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    log = (tmp_path / f"{name}.log").open("wb")
    environment = {**os.environ, "DEDLOC_USERNAME": user, "DEDLOC_PASSWORD": PASSWORDS[user], "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        script,
        "--config",
        "configs/sahajbert/tiny.yaml",
        "--auth-server",
        server_url,
        "--auth-ca",
        str(tmp_path / "auth.crt"),  # the organiser's self-signed certificate
        "--name",
        name,
        *extra,
        *_overrides(tmp_path, tokenizer_dir, name),
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=environment,
        start_new_session=True,
    )


def _start_volunteer(tmp_path, tokenizer_dir, server_url, name, extra) -> subprocess.Popen:
    return _start_moderated_peer(tmp_path, tokenizer_dir, server_url, "scripts/volunteer.py", name, name, extra)


def _start_authorized_auxiliary(tmp_path, tokenizer_dir, server_url, initial_peers) -> subprocess.Popen:
    """An organiser's auxiliary peer: authorized like every other peer of a moderated run."""
    return _start_moderated_peer(
        tmp_path, tokenizer_dir, server_url, "scripts/aux_peer.py", "aux", "alice", ["--initial-peers", *initial_peers]
    )


def _wait_for(condition, timeout: float, what: str, processes) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(process.poll() not in (None, 0) for process in processes):
            raise AssertionError(f"a volunteer failed while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _assert_refused(initial_peers, authorizer) -> None:
    # one attempt: a refused peer would otherwise retry until the default startup deadline
    network = NetworkConfig(initial_peers=initial_peers, client_mode=True, bootstrap_timeout=5.0, startup_deadline=0)
    with pytest.raises(
        PeerError,
        match="none of the initial_peers responded|no initial peer answered|failed to connect to bootstrap peers",
    ):
        dht = start_dht(network, authorizer=authorizer)
        dht.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_allowlisted_volunteers_train_and_others_are_refused(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    stream = StreamConfig(
        sources=[str(FIXTURES / "wikipedia_standin"), str(FIXTURES / "oscar_standin")],
        source_configs=[None, None],
        tokenizer_training_documents=24,
    )
    train_bengali_tokenizer(tokenizer_training_texts(stream), 400).save_pretrained(str(tokenizer_dir))
    allowlist = {name: AllowlistEntry(name, hash_password(password)) for name, password in PASSWORDS.items()}
    service = AuthorizationService(allowlist, RSAPrivateKey(), timedelta(minutes=10))
    tls = TLSFiles(tmp_path / "auth.crt", tmp_path / "auth.key")
    make_self_signed_certificate(tls.certificate, tls.key, ["127.0.0.1"])
    server = AuthServer(service, tls).start()
    processes = []
    try:
        alice = _start_volunteer(tmp_path, tokenizer_dir, server.url, "alice", ["--server-mode"])
        processes.append(alice)
        address_file = tmp_path / "alice" / ADDRESS_FILE
        _wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "alice's address", processes
        )
        initial_peers = address_file.read_text().split()

        _assert_refused(initial_peers, authorizer=None)  # no token at all
        rogue = AuthorizationService(allowlist, RSAPrivateKey(), timedelta(minutes=10))
        forged = AllowlistTokenAuthorizer(server.url, "alice", PASSWORDS["alice"], server_public_key=rogue.public_key)
        forged._local_access_token = rogue.issue("alice", PASSWORDS["alice"], forged.local_public_key.to_bytes())
        _assert_refused(initial_peers, authorizer=forged)  # a token signed by someone else's key

        auxiliary = _start_authorized_auxiliary(tmp_path, tokenizer_dir, server.url, initial_peers)
        processes.append(auxiliary)
        aux_log = tmp_path / "aux.log"
        _wait_for(
            lambda: "auxiliary peer running" in aux_log.read_text(errors="replace"),
            120,
            "the authorized auxiliary peer to join",
            processes,
        )  # alice waits at her start barrier meanwhile

        bob = _start_volunteer(tmp_path, tokenizer_dir, server.url, "bob", ["--initial-peers", *initial_peers])
        processes.append(bob)
        _wait_for(lambda: alice.poll() is not None and bob.poll() is not None, 300, "training to finish", processes)
        assert "authorized as 'alice'" in aux_log.read_text(errors="replace")
        for name in ("alice", "bob"):
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            assert summary["global_steps"] >= STEPS and summary["samples"] > 0, summary
        bob_log = (tmp_path / "bob.log").read_text()
        assert "authorized as 'bob'" in bob_log
    except BaseException:
        for name in ("alice", "bob", "aux"):
            log = tmp_path / f"{name}.log"
            if log.exists():
                print(f"--- {name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        raise
    finally:
        for process in processes:
            stop_process_group(process, grace_seconds=10)
        server.shutdown()
