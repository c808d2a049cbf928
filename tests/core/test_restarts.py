"""Peers that restart on a busy machine: joining through the one live initial peer among stale ones, giving up in
one line naming the addresses tried, and a monitor that listens on the same port after a restart."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from hivemind.utils.serializer import MSGPackSerializer

from common.identity import load_identity
from common.metrics import MAX_RECORDS_PUBLISHED, PeerMetrics, StepRecord, records_to_publish
from common.peer import ADDRESS_FILE, JOIN_COMMAND_FILE, PORT_FILE
from common.swarm import LocalSwarm
from tests.helpers import PYTHON, ROOT, TINY_ALBERT, assert_no_processes_left, run_command, run_script

STARTUP_SCRIPT = "scripts/experiments/startup_under_load.py"


def _stale_address(port: int = 9) -> str:
    with tempfile.TemporaryDirectory() as folder:
        return f"/ip4/127.0.0.1/tcp/{port}/p2p/{load_identity(Path(folder) / 'identity.key').peer_id}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restarted_peer_joins_through_its_one_live_initial_peer_on_a_busy_machine(tmp_path):
    out = tmp_path / "result.json"
    result = run_script(STARTUP_SCRIPT, "--tries", "2", "--hogs", "4", "--stale", "3", "--out", str(out), timeout=560)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(out.read_text())
    assert measured["tries"] == 2
    assert [row["exit_code"] for row in measured["rows"]] == [0, 0], measured["rows"]
    assert all(row["tracebacks"] == 0 for row in measured["rows"]), measured["rows"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_giving_up_is_one_line_naming_every_address_tried(tmp_path):
    load_identity(tmp_path / "identity.key")
    stale = [_stale_address(9), _stale_address(7)]
    started = time.monotonic()
    result = run_script(STARTUP_SCRIPT, "--try", str(tmp_path), *stale, "--startup-deadline", "10", timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert all(address in errors[0] for address in stale), errors[0]
    assert "network.startup_deadline" in errors[0]
    attempts = int(re.search(r"\((\d+) attempt\(s\)", errors[0]).group(1))
    retries = [line for line in result.stderr.splitlines() if re.search(r"start-up attempt \d+ failed", line)]
    assert len(retries) == attempts - 1, result.stderr[-3000:]  # one WARNING line per attempt that is retried
    assert time.monotonic() - started < 200


def _start_monitor(folder: Path) -> subprocess.Popen:
    log = (folder / "monitor.log").open("ab")
    return subprocess.Popen(
        [
            PYTHON,
            "scripts/monitor.py",
            "--config",
            TINY_ALBERT,
            f"training.output_dir={folder}",
            "monitor.wandb_mode=disabled",
            "monitor.checkpoint_every_steps=0",
            "task.max_documents=500",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _addresses_of(process: subprocess.Popen, folder: Path, timeout: float = 240, log: Path = None) -> list:
    log = log or folder / "monitor.log"
    deadline = time.monotonic() + timeout
    while not (folder / ADDRESS_FILE).exists():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(0.5)  # written in one call, but read it whole
    return (folder / ADDRESS_FILE).read_text().split()


def _stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        return process.wait(60)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restarted_monitor_listens_where_it_did_and_publishes_the_same_addresses(tmp_path):
    first = _start_monitor(tmp_path)
    try:
        before = _addresses_of(first, tmp_path)
    finally:
        assert _stop(first) == 0, (tmp_path / "monitor.log").read_text()[-3000:]
    port = int((tmp_path / PORT_FILE).read_text())
    assert all(f"/tcp/{port}/" in address for address in before), before
    (tmp_path / ADDRESS_FILE).unlink()
    second = _start_monitor(tmp_path)  # at once: the old listener's port may still be in TIME_WAIT
    try:
        after = _addresses_of(second, tmp_path)
    finally:
        assert _stop(second) == 0, (tmp_path / "monitor.log").read_text()[-3000:]
    assert after == before
    assert "Traceback" not in (tmp_path / "monitor.log").read_text()
    listing = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert not listing.strip(), listing


def test_peers_republish_the_records_of_the_last_span_within_a_size_that_forty_peers_can_share():
    def record(step: int, seconds_apart: float = 10.0) -> StepRecord:
        metrics = {name: 0.5 for name in ("mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy", "grad_norm")}
        return StepRecord(
            step=step, samples=4096, loss=7.25, seconds=9.5, time=1e9 + seconds_apart * step, metrics=metrics
        )

    records = [record(step) for step in range(400)]
    assert [kept.step for kept in records_to_publish(records, 1800)] == list(range(219, 400))  # 1800 s at 10 s a step
    fast = [record(step, seconds_apart=1.0) for step in range(400)]
    assert [kept.step for kept in records_to_publish(fast, 1800)] == list(range(400 - MAX_RECORDS_PUBLISHED, 400))
    assert records_to_publish([], 1800) == []
    value = PeerMetrics(peer_name="trainer-abcdef", role="trainer", recent=records_to_publish(fast, 1800)).dict()
    assert 40 * len(MSGPackSerializer.dumps(value)) < 4 * 2**20  # hivemind's largest message


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_the_join_command_lists_the_auxiliary_peer_and_a_volunteer_joins_through_it_while_the_monitor_is_down(
    tmp_path, tiny_overrides
):
    with LocalSwarm(TINY_ALBERT, tmp_path, [*tiny_overrides, "training.max_global_steps=1000"]) as swarm:
        swarm.start_first_peer("monitor", "monitor", timeout=300)
        swarm.start("auxiliary", "aux")
        aux_addresses = _addresses_of(swarm.peers["aux"].process, tmp_path / "aux", log=tmp_path / "aux/peer.log")
        join_file = tmp_path / "monitor" / JOIN_COMMAND_FILE
        deadline = time.monotonic() + 240
        while not all(address in join_file.read_text() for address in aux_addresses):
            assert time.monotonic() < deadline, join_file.read_text()
            assert swarm.peers["monitor"].alive(), swarm.peers["monitor"].log_tail(20)
            time.sleep(1)
        listed = shlex.split(join_file.read_text().strip().splitlines()[-1])
        listed = listed[listed.index("--initial-peers") + 1 :]
        listed = [item for item in listed if item.startswith("/")]
        assert set(aux_addresses) < set(listed), listed  # the monitor's own addresses and the auxiliary peer's
        swarm.stop("monitor", graceful=False)
        swarm.initial_peers = listed  # as a volunteer pastes them, the monitor's now dead
        swarm.start("trainer", "volunteer")
        _addresses_of(swarm.peers["volunteer"].process, tmp_path / "volunteer", log=tmp_path / "volunteer/peer.log")
        swarm.stop_many(["volunteer", "aux"])
        assert all(swarm.peers[name].process.returncode == 0 for name in ("volunteer", "aux"))
    logs = "".join((tmp_path / name / "peer.log").read_text() for name in ("monitor", "aux", "volunteer"))
    assert "Traceback" not in logs
    assert_no_processes_left(tmp_path)


UNRETRIEVED_PROBE = """
import asyncio, gc, logging, sys
from concurrent.futures import InvalidStateError
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
from common import hivemind_patches
hivemind_patches.install()

async def cancelled_round():
    raise InvalidStateError("Can't set_result to a future that is CANCELLED (1)")

async def not_routine():
    raise ValueError("a real bug")

async def main():
    tasks = [asyncio.ensure_future(asyncio.wait_for(asyncio.sleep(5), 0.01)), asyncio.ensure_future(cancelled_round())]
    tasks.append(asyncio.ensure_future(not_routine()))
    abandoned = asyncio.get_running_loop().create_future()
    abandoned.set_exception(asyncio.CancelledError())
    await asyncio.sleep(0.2)
    del tasks, abandoned
    gc.collect()

asyncio.run(main())
averager = logging.getLogger("hivemind.averaging.averager")
try:
    try:
        raise asyncio.CancelledError()
    except BaseException as error:
        raise RuntimeError(f"Unable to run All-Reduce: {error}")
except RuntimeError as cut_off:
    averager.exception(cut_off)
"""


def test_routine_unretrieved_task_errors_are_one_line_and_others_keep_their_traceback():
    result = run_command([PYTHON, "-c", UNRETRIEVED_PROBE], timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert "INFO a request timed out after its caller had stopped waiting for it" in lines, result.stdout
    assert "INFO an averaging round finished after its step was cancelled: result dropped" in lines, result.stdout
    assert "INFO a part of an averaging round was abandoned when the round was cut off" in lines, result.stdout
    said = (result.stdout + result.stderr).splitlines()  # hivemind's own handler writes to stderr
    cut_off = [
        line
        for line in said
        if line.endswith("an all-reduce round was cut off at its timeout: a groupmate stopped answering")
    ]
    assert len(cut_off) == 1 and "WARN" in cut_off[0], result.stderr[-2000:]
    assert result.stdout.count("Task exception was never retrieved") == 1, result.stdout  # the real bug's
    assert result.stdout.count("Traceback") == 1 and "ValueError: a real bug" in result.stdout
