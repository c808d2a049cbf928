"""Stable seeds: the same inputs give the same seed on every machine and Python version (no ``hash()``)."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts`` with BLAKE2b."""
    text = "\x1f".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
