"""Atomic, verified checkpoints of a run's state (model, optimizer, scheduler, loss scaler, global step): the
monitor's of a swarm, a baseline run's (single, DDP) of itself. Both are written and verified by this module.

A checkpoint is ``step_<N>.pt`` plus ``step_<N>.pt.sha256``, each written to a temporary file and renamed,
the digest last: a checkpoint without a matching digest is partial or corrupt and is skipped in favour of
the previous good one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import List, Optional

import torch

from common.errors import DataError

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"step_(\d+)\.pt$")
CHECKPOINT_DIR = "checkpoints"  # a baseline run's (single, DDP) checkpoints, inside training.output_dir


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def read_state_file(path: Path, weights_only: bool = False) -> dict:
    """A saved state (a checkpoint, a trainer's ``final_model.pt``) read from ``path``; a missing, torn or corrupt
    file is one DataError line naming it (unpickling errors come in many types)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"state file not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        detail = " ".join(str(error).split())[:160]
        raise DataError(f"{path} is not a readable state file (corrupt or torn: {type(error).__name__}: {detail})")
    if not isinstance(state, dict):
        raise DataError(f"{path} holds a {type(state).__name__}, not a saved state")
    return state


def save_checkpoint(directory: Path, step: int, state: dict, keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    with temporary.open("rb+") as stream:
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    _atomic_write_bytes(path.with_name(path.name + ".sha256"), _sha256(path).encode())
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> List[Path]:
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if CHECKPOINT_PATTERN.search(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_PATTERN.search(path.name).group(1)))


def load_latest_checkpoint(directory: Path) -> Optional[dict]:
    """The newest checkpoint whose digest matches and which loads; corrupt ones are reported and skipped."""
    for path in reversed(list_checkpoints(directory)):
        digest_path = path.with_name(path.name + ".sha256")
        if not digest_path.exists():
            logger.error(f"checkpoint {path.name} is partial (no digest file): using the previous one")
            continue
        if digest_path.read_text().strip() != _sha256(path):
            logger.error(f"checkpoint {path.name} is corrupt (digest mismatch): using the previous one")
            continue
        try:
            state = read_state_file(path)
        except DataError as error:
            logger.error(f"{error}: using the previous checkpoint")
            continue
        logger.info(f"loaded checkpoint {path.name} (global step {state['step']})")
        return state
    return None


def resume_from_checkpoint(backend, directory: Path) -> int:
    """Load the newest good checkpoint in ``directory`` into ``backend``; return its global step (0: none)."""
    state = load_latest_checkpoint(directory)
    if state is None:
        return 0
    backend.load_checkpoint_state(state)
    logger.info(f"resumed from {directory} at global step {state['step']}")
    return int(state["step"])
