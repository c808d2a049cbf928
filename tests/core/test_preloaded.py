"""A peer forked from the preloaded process (common/preloaded.py) is the process its command would have started:
its arguments, folder, environment, log, process group, title and exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from common.preloaded import COMMON_MODULES, PreloadedLauncher
from tests.helpers import ROOT, needs_network_namespaces

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import setproctitle
    if sys.argv[1] == "report":
        json.dump({
            "argv": sys.argv, "cwd": os.getcwd(), "marker": os.environ.get("PRELOADED_TEST_MARKER"),
            "leads_group": os.getpgrp() == os.getpid(), "stdin": sys.stdin.read(),
            "title": setproctitle.getproctitle(), "main": __name__,
        }, open(sys.argv[2], "w"))
        print("written to the log")
        sys.exit(3)
    if sys.argv[1] == "namespace":
        open(sys.argv[2], "w").write(os.readlink("/proc/self/ns/net"))
        sys.exit(0)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    raise ValueError("a script's own error")
    """
)


@pytest.fixture
def launcher(tmp_path):
    started = PreloadedLauncher(tmp_path / "launcher", ["json"], dict(os.environ), ROOT)
    try:
        yield started
    finally:
        started.close()


def test_a_forked_script_gets_its_arguments_folder_environment_log_group_and_exit_code(tmp_path, launcher):
    script, report, log = tmp_path / "peer.py", tmp_path / "report.json", tmp_path / "peer.log"
    script.write_text(SCRIPT)
    environment = {**os.environ, "PRELOADED_TEST_MARKER": "seen"}
    argv = [sys.executable, str(script), "report", str(report)]
    process = launcher.start(argv, tmp_path, environment, log)
    # the title is set before the pid is handed out: ps and pgrep see the peer's own command at once
    assert psutil.Process(process.pid).cmdline()[1:] in (argv[1:], " ".join(argv).split()[1:])
    assert process.wait(timeout=30) == 3 and process.poll() == 3
    seen = json.loads(report.read_text())
    assert seen == {
        "argv": [str(script), "report", str(report)],
        "cwd": str(tmp_path),
        "marker": "seen",
        "leads_group": True,
        "stdin": "",
        "title": " ".join(argv),
        "main": "__main__",
    }
    assert log.read_text() == "written to the log\n"


def test_signals_and_errors_end_a_forked_script_as_they_end_a_started_one(tmp_path, launcher):
    script = tmp_path / "peer.py"
    script.write_text(SCRIPT)
    sleeper = launcher.start([sys.executable, str(script), "sleep"], tmp_path, dict(os.environ), tmp_path / "a.log")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.5)
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    failing = launcher.start([sys.executable, str(script), "fail"], tmp_path, dict(os.environ), tmp_path / "b.log")
    assert failing.wait(timeout=30) == 1
    assert "ValueError: a script's own error" in (tmp_path / "b.log").read_text()


def test_peers_get_sigterm_when_the_preloaded_process_ends(tmp_path, launcher):
    script = tmp_path / "peer.py"
    script.write_text(SCRIPT)
    sleeper = launcher.start([sys.executable, str(script), "sleep"], tmp_path, dict(os.environ), tmp_path / "a.log")
    launcher.server.kill()
    assert sleeper.wait(timeout=30) == -signal.SIGTERM  # what the launcher reports once the replies end
    deadline = time.monotonic() + 30
    while psutil.pid_exists(sleeper.pid) and psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "a peer outlived its preloaded process"
        time.sleep(0.1)


LOCK_HOLDER = textwrap.dedent(
    """
    import sys, time
    from hivemind.utils.mpfuture import MPFuture
    if not MPFuture._update_lock.acquire(timeout=10):
        sys.exit(5)
    print("holding", flush=True)
    if sys.argv[1] == "hold":
        time.sleep(60)
    """
)


@pytest.mark.timeout(120)
def test_a_peer_killed_holding_a_hivemind_lock_does_not_block_the_next_one(tmp_path):
    """hivemind creates multiprocessing locks at import (``MPFuture._update_lock`` and three more): peers forked
    from one preloaded process get locks of their own, as peers that import hivemind themselves have."""
    launcher = PreloadedLauncher(tmp_path / "launcher", ["hivemind"], dict(os.environ), ROOT)
    try:
        assert launcher.renewed_semaphores >= 4
        script, holder_log = tmp_path / "holder.py", tmp_path / "holder.log"
        script.write_text(LOCK_HOLDER)
        holder = launcher.start([sys.executable, str(script), "hold"], tmp_path, dict(os.environ), holder_log)
        deadline = time.monotonic() + 60
        while "holding" not in (holder_log.read_text() if holder_log.exists() else ""):
            assert holder.poll() is None and time.monotonic() < deadline, holder_log.read_text()
            time.sleep(0.1)
        holder.kill()
        assert holder.wait(timeout=30) == -signal.SIGKILL
        after = launcher.start([sys.executable, str(script), "release"], tmp_path, dict(os.environ), tmp_path / "b")
        assert after.wait(timeout=60) == 0, (tmp_path / "b").read_text()
    finally:
        launcher.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_peers_modules_import_without_starting_a_thread(tmp_path):
    """A fork copies only the forking thread; a lock another thread held would stay held in every peer."""
    launcher = PreloadedLauncher(tmp_path, [*COMMON_MODULES, "albert.task", "swav.task"], dict(os.environ), ROOT)
    try:
        assert launcher.threads_after_imports == 1 and launcher.unrenewable_semaphores == []
    finally:
        launcher.close()


@needs_network_namespaces
def test_a_peer_for_an_emulated_host_runs_in_its_network_namespace(tmp_path, launcher):
    script, seen = tmp_path / "peer.py", tmp_path / "namespace.txt"
    script.write_text(SCRIPT)
    name = f"dedloc-preload-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        argv = [sys.executable, str(script), "namespace", str(seen)]
        process = launcher.start(argv, tmp_path, dict(os.environ), tmp_path / "peer.log", network_namespace=name)
        assert process.wait(timeout=30) == 0, (tmp_path / "peer.log").read_text()
        expected = subprocess.run(
            ["ip", "netns", "exec", name, "readlink", "/proc/self/ns/net"], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert seen.read_text() == expected != os.readlink("/proc/self/ns/net")
        missing = launcher.start(argv, tmp_path, dict(os.environ), tmp_path / "missing.log", network_namespace="none")
        assert missing.wait(timeout=30) == 1  # a namespace that does not exist: the peer fails, with its reason
        assert "/run/netns/none" in (tmp_path / "missing.log").read_text()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
