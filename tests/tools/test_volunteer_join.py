"""Volunteers on other machines who paste the command the monitor prints take part correctly.

Emulated hosts (network namespaces): the monitor on one, a volunteer on each of two others. Each volunteer runs the
monitor's printed join command verbatim (``python`` from its PATH, from the repository root) plus only its own
output folder; the line printed before it, which clones this repository at the monitor's commit, is checked, not
run (the volunteers run from this checkout). The test adds ``debug.record_sample_ids=true`` (to compare
micro-batches) and a short progress period, and the firewalled volunteer adds ``network.client_mode=true`` as such
a volunteer is told to. Both must contribute to every step under their own peer ids, on different micro-batches.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.identity import load_identity
from common.peer import JOIN_COMMAND_FILE, RESOLVED_CONFIG_FILE
from common.startup import STARTUP_FILE
from common.tools.netns import EmulatedNetwork, HostSpec
from tests.helpers import ROOT, needs_network_namespaces, read_jsonl

STEPS = 3
ORGANISER_OVERRIDES = [  # a small, fast run; the run-defining ones reach volunteers through the printed command
    f"training.max_global_steps={STEPS}",
    "collaboration.expected_peers=2",
    # volunteer2 trains a tokenizer and builds its examples before it reaches the start barrier: on a busy machine
    # that takes longer than the barrier's default 120 s, after which volunteer1 would train alone
    "collaboration.start_barrier_timeout=400",
    "collaboration.target_batch_size=256",
    "collaboration.matchmaking_time=1.5",
    "collaboration.averaging_timeout=20",
    "task.max_documents=3000",
    "monitor.wandb_mode=disabled",
    "monitor.refresh_seconds=0.5",
    "monitor.checkpoint_every_steps=0",
]


def _start(prefix: list, command: str, log: Path) -> subprocess.Popen:
    """Run a shell command line on an emulated host, as a user types it in the root of their clone."""
    env = dict(os.environ)
    with log.open("wb") as handle:
        return subprocess.Popen(
            [*prefix, "sh", "-c", f"exec {command}"],  # exec: signals reach python, its exit code is ours
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM to the peer itself, as the launcher stops a peer; its hivemind children go with its shutdown."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def _wait_for_file(path: Path, process: subprocess.Popen, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{path.name} never appeared:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    return path.read_text().strip()


def _vocabulary(tokenizer_file: Path) -> list:
    return json.loads(tokenizer_file.read_text())["model"]["vocab"]


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(540)
@pytest.mark.parametrize("second_volunteer", ["reachable", "firewalled"])
def test_volunteers_pasting_the_printed_command_on_other_hosts_are_two_contributors(tmp_path, second_volunteer):
    hosts = [
        HostSpec("organiser", role="monitor"),
        HostSpec("volunteer1"),
        HostSpec("volunteer2", accepts_inbound=second_volunteer == "reachable"),
    ]
    with EmulatedNetwork(hosts) as network:
        monitor_dir = tmp_path / "monitor"
        monitor_log = tmp_path / "monitor.log"
        monitor = _start(
            network.command_prefix(0),
            shlex.join(
                [".venv/bin/python", "scripts/monitor.py", "--config", "configs/albert/tiny.yaml"]
                + [f"training.output_dir={monitor_dir}", *ORGANISER_OVERRIDES]
            ),
            monitor_log,
        )
        volunteers = {}
        try:
            clone, printed = _wait_for_file(monitor_dir / JOIN_COMMAND_FILE, monitor, monitor_log, 180).splitlines()
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
            assert clone.startswith("git clone ") and clone.endswith(f" && git checkout --quiet {head.strip()}")
            assert printed.startswith(
                ".venv/bin/python scripts/train.py --config configs/albert/tiny.yaml --initial-peers /ip4/"
            )
            assert "127.0.0.1" not in printed and network.host_ip(0) in printed, printed
            for index, name in ((1, "volunteer1"), (2, "volunteer2")):
                extra = [f"training.output_dir={tmp_path / name}", "debug.record_sample_ids=true"]
                extra.append("training.log_every_seconds=2")
                if not hosts[index].accepts_inbound:
                    extra.append("network.client_mode=true")
                if name == "volunteer2":  # a fresh machine: trains the tokenizer and builds the examples itself
                    extra.append(f"task.cache_dir={tmp_path / name / 'cache'}")
                volunteers[name] = _start(
                    network.command_prefix(index), f"{printed} {shlex.join(extra)}", tmp_path / f"{name}.log"
                )
            deadline = time.monotonic() + 360
            while any(process.poll() is None for process in volunteers.values()) and time.monotonic() < deadline:
                time.sleep(1)
            codes = {name: _stop(process) for name, process in volunteers.items()}
            time.sleep(2)  # the monitor's next polls see the last step's records
        finally:
            for process in volunteers.values():
                _stop(process)
            monitor_code = _stop(monitor)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in volunteers}
    assert codes == {"volunteer1": 0, "volunteer2": 0}, {name: log[-3000:] for name, log in logs.items()}
    assert monitor_code == 0, monitor_log.read_text()[-3000:]
    assert all("start barrier passed: 2 trainers visible" in log for log in logs.values()), {
        name: log[-3000:] for name, log in logs.items()
    }

    # identity: each volunteer is its own peer id, with a name derived from it
    peer_ids = {name: load_identity(tmp_path / name / "identity.key").peer_id for name in volunteers}
    assert len(set(peer_ids.values())) == 2
    history = read_jsonl(monitor_dir / "history.jsonl")
    assert [entry["step"] for entry in history] == list(range(STEPS)), history
    contributors_per_step = [len(entry["contributions"]) for entry in history]
    assert contributors_per_step == [2] * STEPS and all(entry["peers"] == 2 for entry in history), history
    assert all(set(entry["contributions"]) == set(peer_ids.values()) for entry in history)
    assert all(min(entry["contributions"].values()) > 0 for entry in history)
    assert all(
        entry["names"][peer_ids[name]] == f"trainer-{peer_ids[name][-6:]}" for entry in history for name in peer_ids
    )
    assert all(entry["samples_per_second"] > 0 for entry in history[1:])
    board = json.loads((monitor_dir / "leaderboard.json").read_text())
    assert sorted(row["peer_id"] for row in board) == sorted(peer_ids.values())

    # data: no micro-batch trained by both volunteers
    batches = {
        name: [
            tuple(batch["ids"])
            for entry in read_jsonl(tmp_path / name / "steps.jsonl")
            for batch in entry["micro_batches"]
        ]
        for name in volunteers
    }
    first, second = (set(found) for found in batches.values())
    assert all(batches.values()) and not first & second, f"{len(first & second)} micro-batches shared"

    # volunteer2 trained its own tokenizer; it numbers every piece as the one volunteer1 took from the shared cache
    (own,) = (tmp_path / "volunteer2/cache").glob("tokenizer-*/tokenizer.json")
    shared = ROOT / ".cache/albert" / own.parent.name / "tokenizer.json"
    assert [entry[0] for entry in _vocabulary(own)] == [entry[0] for entry in _vocabulary(shared)]

    # what each volunteer sees and keeps
    for name, log in logs.items():
        assert "your contribution:" in log and "| swarm: " in log, log[-2000:]
        assert "start-up: first micro-batch contributed" in log
        assert (tmp_path / name / RESOLVED_CONFIG_FILE).exists()
    print(
        json.dumps(
            {
                "contributors_per_step": contributors_per_step,
                "micro_batches": {name: len(found) for name, found in batches.items()},
                "distinct_micro_batches": len(first | second),
                "shared_micro_batches": len(first & second),
                "leaderboard_rows": len(board),
                "startup_seconds": {
                    name: json.loads((tmp_path / name / STARTUP_FILE).read_text())["total"] for name in volunteers
                },
            }
        )
    )
