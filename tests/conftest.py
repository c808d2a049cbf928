"""Shared fixtures: repository paths, and a guard that no test leaves hivemind daemons behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.config import load_config  # noqa: E402  (needs the repository on sys.path)

# How far fp16 wire compression may leave trainers apart (2 x lr with LAMB; the reasoning is in tiny.yaml).
FP16_TOLERANCE = load_config(str(ROOT / "configs/albert/tiny.yaml")).collaboration.agreement_tolerance

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def run_script(*arguments: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a repository script as a user would, capturing its output."""
    return subprocess.run([PYTHON, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def assert_no_processes_left(run_dir: Path) -> None:
    """No process (peer, DHT, p2pd) still mentions this run's folder."""
    listing = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    assert not listing.strip(), f"processes left behind:\n{listing}"


@pytest.fixture
def tiny_overrides(tmp_path):
    """Fast settings for multi-peer tests of the tiny ALBERT config."""
    return [
        "monitor.wandb_mode=disabled", "monitor.refresh_seconds=0.5", "training.log_every_seconds=5",
        "collaboration.matchmaking_time=1.5", "collaboration.averaging_timeout=20",
        "task.max_documents=3000",
    ]
