"""Where a peer's start-up time goes, from process start to its first contributed micro-batch.

A volunteer's session is only useful once it contributes, and short sessions are common (most of a real
collaboration's sessions last minutes), so start-up time decides how much of the volunteered time is used.
Each phase is marked when it ends; the breakdown is logged once, with the first contributed micro-batch, and
written to ``startup.json`` in the peer's output folder (for measurements across runs).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List, Optional, Tuple

import psutil

logger = logging.getLogger(__name__)

STARTUP_FILE = "startup.json"

_phases: List[Tuple[str, float]] = []
_output_dir: Optional[Path] = None
_reported = False


def mark(phase: str) -> None:
    """Record that ``phase`` ended now (phases are consecutive: each lasts from the previous mark)."""
    _phases.append((phase, time.time()))


def write_to(output_dir: Path) -> None:
    """Where to save the breakdown once it is complete."""
    global _output_dir
    _output_dir = output_dir


def breakdown() -> dict:
    """Seconds per phase, in order, the total since the process started, and the unix time each phase (last)
    ended, which lines peers' start-ups up against each other."""
    # when this process was created: before any import, or when a preloaded launcher forked it (common/preloaded.py)
    process_started = psutil.Process().create_time()
    previous, phases, ended_at = process_started, {}, {}
    for phase, ended in _phases:
        phases[phase] = phases.get(phase, 0.0) + ended - previous
        ended_at[phase] = ended
        previous = ended
    return {
        "phases": {name: round(seconds, 3) for name, seconds in phases.items()},
        "total": previous - process_started,
        "ended_at": ended_at,
    }


def first_contribution() -> None:
    """Called after every contributed micro-batch; only the first completes (and reports) the breakdown."""
    global _reported
    if _reported:
        return
    _reported = True
    mark("first micro-batch")
    result = breakdown()
    parts = " | ".join(f"{name} {seconds:.1f} s" for name, seconds in result["phases"].items())
    logger.info(f"start-up: first micro-batch contributed {result['total']:.1f} s after process start ({parts})")
    if _output_dir is not None:
        (_output_dir / STARTUP_FILE).write_text(json.dumps(result, indent=2))
