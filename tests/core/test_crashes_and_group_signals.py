"""SIGTERM to a monitor's whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from common.swarm import LocalSwarm
from tests.helpers import ROOT, assert_no_processes_left

TINY = str(ROOT / "configs/albert/tiny.yaml")
ERROR_MARKERS = (" ERROR ", "[ERROR]", "Traceback", "Task was destroyed")


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.5)


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
