"""Where a measurement ran: the machine, the code and the load, as the experiment scripts write them beside
their figures."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[2]


def machine_description() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores ({model}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def git_commit() -> str:
    """The checkout's commit, saying so when tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return (head.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def load_average() -> str:
    return "/".join(f"{value:.1f}" for value in os.getloadavg())


def process_group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in a process group (a peer with its DHT, averagers and p2pd)."""
    total = 0
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                total += process.memory_info().rss
        except (psutil.Error, ProcessLookupError, OSError):
            continue
    return total / 2**20
