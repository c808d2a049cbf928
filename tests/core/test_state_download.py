"""Downloading the swarm's state gives up after a bounded time with one line; a peer that cannot be reached is one
INFO line, not an ERROR with a traceback; addresses libp2p cannot route ("routing: not found") are named at
start-up."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from common.dht import announce_swarm_step, read_announced_swarm_step, unrouted_addresses_problem
from common.errors import PeerError
from common.hivemind_patches.policies import _download_state
from tests.helpers import PYTHON, ROOT, assert_no_processes_left, run_script

TINY = str(ROOT / "configs/albert/tiny.yaml")
PEER_ID = "QmQ6acdJ7VhbtgoXCRF6qiWLLtJQQFMzdNE4MaLQizCQ7U"  # any well-formed peer id


class FakeAverager:
    """Stands in for hivemind's state averager: each download raises, returns nothing, or loads ``epoch``."""

    def __init__(self, owner, outcomes):
        self.owner, self.outcomes, self.calls = owner, list(outcomes), 0

    def load_state_from_peers(self, timeout):
        assert 0 < timeout <= self.owner.load_state_timeout
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else self.outcomes_default
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            self.owner.local_epoch = outcome


def fake_optimizer(outcomes, swarm_epoch, default=None):
    optimizer = SimpleNamespace(local_epoch=0, load_state_timeout=0.2, grad_averager=None)
    optimizer.tracker = SimpleNamespace(global_epoch=swarm_epoch)
    optimizer.state_averager = FakeAverager(optimizer, outcomes)
    optimizer.state_averager.outcomes_default = default
    return optimizer


def capture(logger_name: str):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(logger_name).addHandler(handler)
    return records, handler


def never() -> bool:
    return False


def test_a_failing_download_gives_up_at_the_deadline_with_one_line_per_attempt():
    optimizer = fake_optimizer([], swarm_epoch=0, default=TimeoutError())
    records, handler = capture("common.hivemind_patches.policies")
    started = time.monotonic()
    try:
        with pytest.raises(PeerError) as raised:
            _download_state(optimizer, deadline=2.5, stop_requested=never, kwargs={})
    finally:
        logging.getLogger("common.hivemind_patches.policies").removeHandler(handler)
    elapsed = time.monotonic() - started
    assert 2.5 <= elapsed < 4.0  # backoff 1 s, then 2 s cut to what is left of the deadline
    message = str(raised.value)
    assert "\n" not in message and "within 2.5 s" in message and "last: TimeoutError" in message
    assert "initial peers" in message and "collaboration.load_state_deadline" in message
    warnings = [record for record in records if record.levelno == logging.WARNING]
    assert len(warnings) == optimizer.state_averager.calls - 1 >= 2  # one line per failed attempt but the last
    assert all(record.exc_info is None and "\n" not in record.getMessage() for record in warnings)
    assert not [record for record in records if record.levelno >= logging.ERROR]


def test_staying_behind_the_swarm_counts_as_a_failed_attempt():
    # hivemind returns without loading when no peer served state; behind a swarm at step 7 that is a failure
    optimizer = fake_optimizer([], swarm_epoch=7, default=None)
    with pytest.raises(
        PeerError, match="no peer served a state newer than global step 0 .the swarm is at global step 7"
    ):
        _download_state(optimizer, deadline=1.5, stop_requested=never, kwargs={})


def test_a_fresh_swarm_returns_at_once_and_a_later_success_ends_the_retries():
    fresh = fake_optimizer([None], swarm_epoch=0)
    _download_state(fresh, deadline=60, stop_requested=never, kwargs={})
    assert fresh.state_averager.calls == 1 and fresh.local_epoch == 0

    late = fake_optimizer([TimeoutError(), None, 9], swarm_epoch=9)  # fails, loads nothing, then gets step 9
    started = time.monotonic()
    _download_state(late, deadline=60, stop_requested=never, kwargs={})
    assert late.state_averager.calls == 3 and late.local_epoch == 9
    assert time.monotonic() - started < 5  # waited 1 s + 2 s between the attempts


def test_a_newer_state_still_behind_the_swarm_is_downloaded_again():
    # the first attempt brought step 5 while the swarm went on to step 9: not done yet
    optimizer = fake_optimizer([5, 9], swarm_epoch=9)
    assert _download_state(optimizer, deadline=60, stop_requested=never, kwargs={}) == 9
    assert optimizer.state_averager.calls == 2 and optimizer.local_epoch == 9


def test_the_step_an_auxiliary_peer_announces_outlives_the_trainers_records():
    """Every trainer crashed and their progress records expired: hivemind's tracker knows only this peer's own
    step, while an auxiliary peer still announces step 7. The checkpoint of step 5 is behind it; once nothing newer
    was served for the holders-gone wait the peer goes on at step 7 with one WARNING line."""
    optimizer = fake_optimizer([5], swarm_epoch=5, default=None)  # the checkpoint, then nothing newer
    records, handler = capture("common.hivemind_patches.policies")
    try:
        swarm = _download_state(
            optimizer, deadline=30, stop_requested=never, kwargs={}, announced_step=lambda: 7, holders_gone_after=1.0
        )
    finally:
        logging.getLogger("common.hivemind_patches.policies").removeHandler(handler)
    assert swarm == 7 and optimizer.state_averager.local_epoch == 7
    assert optimizer.state_averager.calls == 2  # the checkpoint, then one attempt a second later
    messages = [record.getMessage() for record in records if record.levelno == logging.WARNING]
    assert "the newest state served is global step 5 (the swarm is at global step 7)" in messages[0]
    assert "the peers that held it left; continuing at global step 7" in messages[-1]


def test_an_announced_step_one_ahead_is_caught_up_with_at_once():
    optimizer = fake_optimizer([5], swarm_epoch=5)
    assert _download_state(optimizer, deadline=30, stop_requested=never, kwargs={}, announced_step=lambda: 6) == 6
    assert optimizer.state_averager.calls == 1


def test_an_announced_swarm_step_is_read_back_per_run():
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    dht = hivemind.DHT(start=True, record_validators=[RSASignatureValidator()])
    try:
        assert read_announced_swarm_step(dht, "run_a") == -1
        announce_swarm_step(dht, "run_a", 7, lifetime=60)
        announce_swarm_step(dht, "run_b", 3, lifetime=60)
        deadline = time.monotonic() + 10
        while read_announced_swarm_step(dht, "run_a") != 7:
            assert time.monotonic() < deadline, "the announced step was never read back"
            time.sleep(0.1)
        assert read_announced_swarm_step(dht, "run_b") == 3
        announce_swarm_step(dht, "run_a", 8, lifetime=60)  # the same peer's newer announcement replaces its older
        deadline = time.monotonic() + 10
        while read_announced_swarm_step(dht, "run_a") != 8:
            assert time.monotonic() < deadline, "the newer announcement was never read back"
            time.sleep(0.1)
    finally:
        dht.shutdown()


def test_a_stop_request_ends_the_retries():
    optimizer = fake_optimizer([], swarm_epoch=0, default=TimeoutError())
    stop_at = time.monotonic() + 0.5
    started = time.monotonic()
    _download_state(optimizer, deadline=60, stop_requested=lambda: time.monotonic() > stop_at, kwargs={})
    assert time.monotonic() - started < 2 and optimizer.state_averager.calls == 1


def test_an_unreachable_state_source_is_one_info_line_and_other_download_errors_stay_errors():
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    records, handler = capture("hivemind.averaging.averager")
    averager_logger = logging.getLogger("hivemind.averaging.averager")

    def _load_state_from_peers(
        error: Exception,
    ) -> None:  # named like hivemind's download, where the record comes from
        try:
            raise error
        except Exception as caught:
            averager_logger.exception(f"Failed to download state from QmPeer - {repr(caught)}")

    try:
        _load_state_from_peers(ControlFailure("Connect failed. msg=routing: not found"))
        _load_state_from_peers(TimeoutError())
        _load_state_from_peers(RuntimeError("received a state of the wrong size"))
    finally:
        averager_logger.removeHandler(handler)
    unreachable, silent, broken = records
    for record in unreachable, silent:
        assert record.levelno == logging.INFO and record.exc_info is None
    assert unreachable.getMessage() == (
        "could not download state from peer QmPeer (Connect failed. msg=routing: not found); asking the next peer"
    )
    assert "no data within the request timeout" in silent.getMessage()
    assert broken.levelno == logging.ERROR and broken.exc_info is not None  # never hidden


# A peer that says it shares the run's state (hivemind's "all_averagers" record) and then never sends it: each
# download attempt of a joining trainer times out, which hivemind 1.1.12 retries forever.
SILENT_PEER = """
import asyncio, sys, time
from typing import AsyncIterator
import hivemind, torch
from hivemind.averaging import DecentralizedAverager
from hivemind.proto import averaging_pb2

class TrainingStateAverager(DecentralizedAverager):  # handlers are named after the class: a trainer asks for this one
    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        await asyncio.sleep(3600)
        yield averaging_pb2.DownloadData()

dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
averager = TrainingStateAverager([torch.zeros(4)], dht=dht, prefix=sys.argv[1] + "_state_averager", start=True)
print(dht.get_visible_maddrs()[0], flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_whose_only_peer_never_serves_state_exits_2_with_one_line(tmp_path):
    run_id, deadline = "silent_state", 10
    peer = subprocess.Popen(
        [PYTHON, "-c", SILENT_PEER, run_id, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        address = peer.stdout.readline().strip()
        assert "/p2p/" in address, "the silent peer did not start"
        result = run_script(
            "scripts/train.py",
            "--config",
            TINY,
            "task.max_documents=500",
            "training.max_global_steps=1",  # were the download to pass as "nothing to load", the run ends soon
            "collaboration.expected_peers=1",
            f"collaboration.run_id={run_id}",
            "collaboration.load_state_timeout=1",
            f"collaboration.load_state_deadline={deadline}",
            f"training.output_dir={tmp_path / 'trainer'}",
            "--initial-peers",
            address,
            timeout=240,
        )
    finally:
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(30)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"could not download the swarm's state from any peer within {deadline} s" in errors[0]
    assert "Traceback" not in result.stderr
    assert "Failed to load state from peers" not in result.stderr  # hivemind's own retry loop never ran
    lines = result.stderr.splitlines()
    attempts = [line for line in lines if "state download attempt" in line]
    assert len(attempts) >= 3 and all(" WARN" in line for line in attempts), result.stderr[-3000:]
    assert not [line for line in lines if " ERROR " in line or "[ERROR]" in line], result.stderr[-3000:]
    gave_up_after = float(re.search(r"attempts in ([0-9.]+) s", errors[0]).group(1))
    assert deadline <= gave_up_after < deadline + 2
    assert_no_processes_left(tmp_path)


def test_joining_through_addresses_libp2p_does_not_route_is_named():
    problem = unrouted_addresses_problem([f"/ip4/192.0.2.2/tcp/4000/p2p/{PEER_ID}"])
    assert problem is not None and "192.0.2.2" in problem and "routing: not found" in problem
    assert "network.host_maddrs=[/ip4/127.0.0.1/tcp/0]" in problem
    for fine in (
        [f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}"],
        [f"/ip4/10.0.0.7/tcp/4000/p2p/{PEER_ID}"],
        [
            f"/ip4/192.0.2.2/tcp/4000/p2p/{PEER_ID}",
            f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}",
        ],  # one routable way in is enough
        [f"/dns4/example.org/tcp/4000/p2p/{PEER_ID}"],
        [],
    ):
        assert unrouted_addresses_problem(fine) is None, fine


# Three p2pd daemons on one address of the given range (inside a fresh network namespace): the third dials the
# second by peer id after both joined through the first. Prints what opening a stream said.
ROUTING_PROBE = """
import asyncio, sys
from hivemind.p2p import P2P

async def main(prefix):
    first = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    entry = [m for m in await first.get_visible_maddrs() if str(m).startswith("/ip4/" + prefix)]
    second = await P2P.create(initial_peers=entry, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    third = await P2P.create(initial_peers=entry, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    await asyncio.sleep(1)
    try:
        await third.call_binary_stream_handler(second.peer_id, "no_such_handler")
    except Exception as error:
        print(error)
    for peer in (third, second, first):
        await peer.shutdown()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize(
    "address, routed", [("192.0.2.9/24", False), ("198.51.100.9/24", False), ("10.99.0.9/8", True)]
)
def test_libp2p_finds_peers_by_id_only_outside_reserved_ranges(address, routed):
    # the fact behind unrouted_addresses_problem: if a new p2pd routes these ranges, the warning must go
    prefix = address.split("/")[0].rsplit(".", 1)[0] + "."
    script = f"ip link set lo up && ip addr add {address} dev lo && {PYTHON} -c '{ROUTING_PROBE}' {prefix}"
    result = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=180)
    said = result.stdout.strip()
    assert said, result.stderr[-2000:]
    assert ("routing: not found" not in said) == routed, said
    if routed:
        assert "protocols not supported" in said  # the stream reached the peer, which has no such handler
    blocked = unrouted_addresses_problem([f"/ip4/{address.split('/')[0]}/tcp/1/p2p/{PEER_ID}"]) is not None
    assert blocked != routed
