"""Shared fixtures: offline hubs, and fast settings for multi-peer tests."""

from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# tests.helpers.TEST_SESSION_VARIABLE: marks what this test process (one per xdist worker) starts
os.environ["DEDLOC_TEST_SESSION"] = str(os.getpid())


def pytest_addoption(parser):
    parser.addoption(
        "--task",
        default="template",
        help="the experiment package tests/tasks/test_contract.py checks, with its configs/<task>/tiny.yaml",
    )
    parser.addoption(
        "--without-patch",
        action="append",
        default=[],
        metavar="NAME",
        help="leave this hivemind patch out (common/hivemind_patches): its regression test must then fail",
    )
    parser.addoption(
        "--cpu-times",
        default=None,
        metavar="PATH",
        help="write each test's wall and CPU seconds (this process and the processes it started and waited for) "
        "as CSV rows to PATH (one file per xdist worker: PATH.<worker>)",
    )


def pytest_configure(config):
    # as every peer does in common.dht.start_dht: before any hivemind process is forked, which inherit the patches
    from common import hivemind_patches

    hivemind_patches.install(without=config.getoption("--without-patch"))


@pytest.fixture
def tiny_overrides(tmp_path):
    """Fast settings for multi-peer tests of the tiny ALBERT config. Outside compute, a small swarm's CPU goes
    mostly to DHT reads: peers read the swarm's progress at most every 0.5 s (hivemind's own default) and the
    monitor the metrics every second (its default)."""
    return [
        "monitor.wandb_mode=disabled",
        "monitor.refresh_seconds=1",
        "collaboration.progress_poll_min_seconds=0.5",
        "training.log_every_seconds=5",
        "collaboration.matchmaking_time=1.5",
        "collaboration.averaging_timeout=20",
        "collaboration.final_averaging_seconds=3",
        "task.max_documents=3000",
    ]


@pytest.fixture
def tiny_ddp_overrides(tiny_overrides):
    """The tiny DDP baseline: 2 workers, each taking 2 micro-batches of 16 samples per global batch of 64."""
    return [
        *tiny_overrides,
        "training.backend=ddp",
        "collaboration.target_batch_size=64",
        "training.local_batch_size=16",
    ]


@pytest.fixture(scope="session")
def preloaded_script(tmp_path_factory):
    """Run a repository script as ``run_script`` does, but forked from one process per test session that imported
    the peers' modules (common/preloaded.py): for the many short runs that end at argument parsing or start-up
    (``--help``, bad input), whose cost is otherwise the 3-8 CPU-seconds of imports. stdout and stderr come back
    together, as ``result.stdout`` and ``result.stderr`` alike. The README's commands run in fresh shells."""
    from common.preloaded import COMMON_MODULES, PreloadedLauncher

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path_factory.mktemp("preloaded")
    launcher = PreloadedLauncher(folder, [*COMMON_MODULES, "albert.task"], dict(os.environ), root)
    numbers = itertools.count()

    def run(*arguments: str, timeout: float = 180) -> subprocess.CompletedProcess:
        command, log = [sys.executable, *arguments], folder / f"run{next(numbers)}.log"
        process = launcher.start(command, root, dict(os.environ), log)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            raise
        output = log.read_text(errors="replace")
        return subprocess.CompletedProcess(command, process.returncode, stdout=output, stderr=output)

    try:
        yield run
    finally:
        launcher.close()


def _timeout_seconds(item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else 0.0


def pytest_collection_modifyitems(config, items):
    """Files with the longest multi-process tests first (their `timeout` markers added up stand in for their cost):
    the suite runs files on parallel workers (pytest-xdist, `--dist loadfile`), and a long file started last would
    keep one worker busy after the others ran out of work (xdist keeps this order only with --no-loadscope-reorder,
    in pyproject.toml's addopts). The order within a file is kept; one process (no xdist worker) keeps the files'
    own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost: dict = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + (_timeout_seconds(item) if item.get_closest_marker("slow") else 0)
    first_seen = {path: index for index, path in reversed(list(enumerate(item.path for item in items)))}
    items.sort(key=lambda item: (-cost[item.path], first_seen[item.path]))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``--cpu-times``: what each test costs the machine. A peer's CPU is counted once the test has waited for it
    (every test stops what it starts); a process nobody waits for (a daemon handed to init) is not counted."""
    path = item.config.getoption("--cpu-times")
    if not path:
        yield
        return
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    wall, cpu = time.monotonic() - wall, _cpu_seconds() - cpu
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    with open(f"{path}.{worker}" if worker else path, "a") as handle:
        handle.write(f"{item.nodeid},{wall:.2f},{cpu:.2f}\n")
