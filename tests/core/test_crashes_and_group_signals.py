"""Near-simultaneous crashes of trainers (half of them, or all), and SIGTERM to a monitor's whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.config import CollaborationConfig
from common.swarm import LocalSwarm
from tests.helpers import ROOT, assert_no_processes_left, read_jsonl

TINY = str(ROOT / "configs/albert/tiny.yaml")
MATCHMAKING_TIME, AVERAGING_TIMEOUT = 1.5, 20.0  # as in the tiny_overrides fixture, which the test checks
# hivemind keeps a peer's progress record this long; the state download's holders-gone wait is as long
PROGRESS_EXPIRATION = CollaborationConfig.progress_expiration
ERROR_MARKERS = (" ERROR ", "[ERROR]", "Traceback", "Task was destroyed")


def step_times(peer_dir: Path) -> dict:
    """Global step -> when this peer finished it (its own step log; a peer can skip a step, see below)."""
    return {record["step"]: record["time"] for record in read_jsonl(peer_dir / "steps.jsonl")}


def longest_interval(times: dict) -> float:
    ends = sorted(times.values())
    return max(later - earlier for earlier, later in zip(ends, ends[1:]))


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_survivors_step_within_the_averaging_bound_after_two_of_four_trainers_crash(tmp_path, tiny_overrides):
    """SIGKILL 2 of 4 trainers within a second, mid-step. Each of the survivors' next two global steps must end
    within averaging_timeout + matchmaking_time + margin of the crash (the first) and of the previous step (the
    second). A round whose group holds a crashed peer waits for the part that peer was to average until the
    averaging timeout cuts it off (the survivors then step on their own gradients); a new group forms within
    matchmaking_time; the margin is the time the survivors need to accumulate a whole target batch by themselves,
    at most (n / survivors) = 2 times the longest step the four peers took together in this same run (so a loaded
    machine stretches the bound as it stretches the steps)."""
    assert f"collaboration.matchmaking_time={MATCHMAKING_TIME}" in tiny_overrides
    assert f"collaboration.averaging_timeout={AVERAGING_TIMEOUT:.0f}" in tiny_overrides
    trainers, crashed, survivors = 4, ["trainer2", "trainer3"], ["trainer0", "trainer1"]
    overrides = [
        *tiny_overrides,
        "training.max_global_steps=12",
        "collaboration.target_batch_size=256",
        f"collaboration.expected_peers={trainers}",
        "monitor.checkpoint_every_steps=0",
    ]
    with LocalSwarm(TINY, tmp_path, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor")
        for index in range(trainers):
            swarm.start("trainer", f"trainer{index}")
        # three steps of all four after the first (which includes the start-up)
        wait_until(lambda: len(step_times(tmp_path / "trainer0")) >= 4, 400, "four global steps")
        longest_step_of_four = longest_interval(step_times(tmp_path / "trainer0"))
        time.sleep(min(longest_step_of_four / 2, 5.0))  # mid-accumulation
        for name in crashed:
            assert swarm.peers[name].alive(), f"{name} ended before the crash: {swarm.peers[name].log_tail()}"
            os.killpg(swarm.peers[name].process.pid, signal.SIGKILL)  # the peer and its DHT, averagers and p2pd
        crashed_at = time.time()
        swarm.stop_many(crashed, graceful=False)  # reaps them
        assert swarm.wait(survivors, timeout=600), "the survivors did not finish"
        exit_codes = {name: swarm.peers[name].process.returncode for name in survivors}
        swarm.stop("monitor")
    assert exit_codes == {name: 0 for name in survivors}, exit_codes
    assert_no_processes_left(tmp_path)

    bound = AVERAGING_TIMEOUT + MATCHMAKING_TIME + trainers / len(survivors) * longest_step_of_four
    for name in survivors:
        times = step_times(tmp_path / name)
        after = sorted(step for step, finished in times.items() if finished > crashed_at)
        assert len(after) >= 2, f"{name} finished fewer than two steps after the crash: {after}"
        first, second = after[:2]
        waits = [times[first] - crashed_at, times[second] - times[first]]
        assert max(waits) <= bound, f"{name}: steps {first} and {second} took {waits} s (bound {bound:.1f} s)"
        print(
            f"{name}: step {first} ended {waits[0]:.1f} s after the crash, step {second} {waits[1]:.1f} s after "
            f"step {first} (bound {bound:.1f} s)"
        )
        # a survivor that falls a step behind its partner (still in a cut-off round, say) catches up by loading the
        # swarm's state: it skips that step in its own log, never goes back
        logged = [record["step"] for record in read_jsonl(tmp_path / name / "steps.jsonl")]
        assert logged == sorted(set(logged)), f"{name}'s global step went backwards or repeated: {logged}"
        assert json.loads((tmp_path / name / "summary.json").read_text())["global_steps"] == 12


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_newcomers_go_on_from_the_last_checkpoint_when_every_trainer_crashed(tmp_path, tiny_overrides):
    """SIGKILL every trainer at once; the auxiliary peer, which follows the global step but shares no state, keeps
    announcing the swarm's step, so no peer can serve a state of that step. Newcomers join once the crashed
    trainers' progress records have expired (collaboration.progress_expiration, 60 s), so that only the auxiliary
    peer's announcement tells them the step. They must not wait for that state forever: after as long again of
    downloads that served nothing that new, they go on at the swarm's step from the
    newest state served, the monitor's last checkpoint. Their first step must end within that wait +
    averaging_timeout + matchmaking_time + a margin for start-up and one batch (60 s); the auxiliary peer and the
    monitor then stop on SIGTERM within seconds and log no error."""
    overrides = [
        *tiny_overrides,
        "collaboration.target_batch_size=256",
        "collaboration.expected_peers=2",
        "monitor.checkpoint_every_steps=5",
    ]
    crashed, newcomers = ["t0", "t1"], ["n0", "n1"]
    checkpoints = tmp_path / "monitor" / "checkpoints"
    with LocalSwarm(TINY, tmp_path, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor")
        swarm.start("auxiliary", "aux0")
        for name in crashed:
            swarm.start("trainer", name, ["training.max_global_steps=40"])
        wait_until(lambda: any(checkpoints.glob("step_*.pt")), 400, "a checkpoint of the monitor")
        checkpointed = int(next(checkpoints.glob("step_*.pt")).name[5:12])

        def reached() -> int:
            return max(max(step_times(tmp_path / name), default=-1) for name in crashed)

        # the swarm at least two steps past the checkpoint, so that the checkpoint alone does not let a newcomer
        # catch up (hivemind lets a peer one step behind take the swarm's step); the next checkpoint two steps away
        wait_until(lambda: reached() >= checkpointed + 2, 300, f"global step {checkpointed + 2}")
        for name in crashed:
            os.killpg(swarm.peers[name].process.pid, signal.SIGKILL)
        swarm.stop_many(crashed, graceful=False)
        reached = reached()
        assert [path.name for path in checkpoints.glob("step_*.pt")] == [f"step_{checkpointed:07d}.pt"]
        time.sleep(PROGRESS_EXPIRATION + 5.0)
        joined = time.time()
        for name in newcomers:
            swarm.start("trainer", name, [f"training.max_global_steps={reached + 4}"])
        assert swarm.wait(newcomers, timeout=400), "the newcomers did not finish"
        exit_codes = {name: swarm.peers[name].process.returncode for name in newcomers}
        stopping = time.monotonic()
        swarm.stop_many(["aux0", "monitor"], grace_seconds=30.0)
        stop_seconds = time.monotonic() - stopping
        exit_codes.update({name: swarm.peers[name].process.returncode for name in ("aux0", "monitor")})
    assert exit_codes == dict.fromkeys([*newcomers, "aux0", "monitor"], 0), exit_codes
    assert_no_processes_left(tmp_path)
    assert stop_seconds < 15.0, f"the auxiliary peer and the monitor took {stop_seconds:.1f} s to stop"

    logs = {name: (tmp_path / name / "peer.log").read_text(errors="replace") for name in [*newcomers, "aux0"]}
    assert any("the peers that held it left" in logs[name] for name in newcomers), logs["n0"][-3000:]
    for name in newcomers:
        assert f"from the newest state served (global step {checkpointed})" in logs[name] or (
            "the peers that held it left" not in logs[name]  # it took the state of a newcomer that went on first
        ), f"{name} did not start from the checkpoint of step {checkpointed}"
        first_step, first_end = min(step_times(tmp_path / name).items())
        # a step that only a crashed peer saw end is not the swarm's (its end was never announced): it may be redone
        assert first_step >= reached, f"{name}'s first step {first_step} is behind the swarm's step {reached}"
        bound = PROGRESS_EXPIRATION + AVERAGING_TIMEOUT + MATCHMAKING_TIME + 60.0
        waited = first_end - joined
        assert waited <= bound, f"{name}'s first step ended {waited:.0f} s after it joined (bound {bound:.0f} s)"
        print(f"{name}: first step {first_step} ended {waited:.1f} s after joining (swarm had reached {reached})")
    noise = [line for line in logs["aux0"].splitlines() if any(marker in line for marker in ERROR_MARKERS)]
    assert not noise, "\n".join(noise)


def process_group_members(pgid: int) -> list:
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True).stdout
    members = []
    for line in listing.splitlines():
        pid, group, state, command = line.split(None, 3)
        if int(group) == pgid and not state.startswith("Z"):
            members.append(f"{pid} {command}")
    return members


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_monitor_exits_quickly_and_cleanly_on_sigterm_to_its_process_group(tmp_path, tiny_overrides):
    """``kill -TERM -- -PGID`` (a service manager stopping the monitor's cgroup or process group) also ends its DHT
    and averager processes and p2pd at once; the monitor must not wait for answers from them."""
    overrides = [*tiny_overrides, "monitor.checkpoint_every_steps=2"]  # with its state averager process too
    with LocalSwarm(TINY, tmp_path, overrides) as swarm:
        monitor = swarm.start_first_peer("monitor", "monitor")
        wait_until(lambda: "monitor running" in monitor.log_path.read_text(errors="replace"), 120, "monitor start")
        group = monitor.process.pid  # the launcher starts each peer in its own session
        members = process_group_members(group)
        assert len(members) >= 4, f"expected the monitor, its DHT and averager processes and p2pd: {members}"
        assert any("p2pd" in member for member in members), members
        signalled = time.monotonic()
        os.killpg(group, signal.SIGTERM)
        try:
            monitor.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the monitor was still stopping 15 s after SIGTERM to its process group: {monitor.log_tail()}"
            )
        seconds = time.monotonic() - signalled
        wait_until(lambda: not process_group_members(group), 10, "the end of every process of the monitor's group")
    assert monitor.process.returncode == 0, (monitor.process.returncode, monitor.log_tail(10))
    assert_no_processes_left(tmp_path)
    log = monitor.log_path.read_text(errors="replace").splitlines()
    stopping = log[next(index for index, line in enumerate(log) if "received SIGTERM" in line) :]
    noise = [line for line in stopping if any(marker in line for marker in ERROR_MARKERS)]
    assert not noise, "\n".join(noise)
    print(f"monitor exited {seconds:.1f} s after SIGTERM to its process group")


def test_shutting_down_an_averager_that_already_ended_is_one_warning_line():
    import logging

    from common.hivemind_compat import ENDED_AVERAGER  # the policy's filter is installed by tests/conftest.py

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    averager_logger.addHandler(handler)

    def shutdown(message: str) -> None:  # named like hivemind's averager method, where the record comes from
        averager_logger.exception(message)

    try:
        shutdown(ENDED_AVERAGER)
        shutdown("Averager shutdown failed for another reason")
    finally:
        averager_logger.removeHandler(handler)
    ended, other = records
    assert ended.levelno == logging.WARNING and ended.exc_info is None
    assert ended.getMessage() == "an averager process had already ended when the peer shut it down"
    assert other.levelno == logging.ERROR  # never hidden
