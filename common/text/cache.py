"""Derived data (tokenized examples, token blocks) cached on disk under a name that hashes its inputs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Dict

import torch

logger = logging.getLogger(__name__)


def cache_key(*parts: object) -> str:
    """A short stable digest of ``parts`` (their ``str``): the same inputs name the same cache on any machine."""
    return hashlib.blake2b(json.dumps([str(part) for part in parts]).encode(), digest_size=8).hexdigest()


def load_or_build_examples(path: Path, build: Callable[[], Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """``torch.load(path)``, or ``build()`` saved there first. A cache that cannot be read (a truncated copy, a
    disk error, another program's file under its name) is derived data: it is rebuilt, with one warning."""
    if path.exists():
        try:
            return torch.load(path, weights_only=True)
        except Exception as error:  # whatever unpickling a damaged file raises: the inputs are still there
            logger.warning(f"the cached examples {path} are unreadable ({type(error).__name__}): rebuilding them")
    examples = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    # one temporary file per process: peers building the same cache at once each rename their own, atomically,
    # so none reads a half-written cache and none finds its temporary file already renamed by another
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(examples, temporary)
    temporary.replace(path)
    return examples
