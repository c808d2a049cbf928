"""Digests of the state a peer serves, so that a peer downloading it can check what it assembled.

A donor serves its state through hivemind's state download RPC: metadata (a small dict) with the first message,
then every tensor serialized with the averager's state compression and cut into 64 KiB parts. Here the donor adds
to that metadata one digest per serialized tensor (its compression, dtype, shape and bytes: exactly what the
receiver reassembles from the parts), and the receiver recomputes them over what it assembled before it
deserializes anything. The donor computes the digests over a snapshot of its state, once per served state: the
snapshot and its digests are kept while the state's step (the metadata) and its tensors' in-place versions stay
the same, so concurrent and later requests in that step are served the same bytes, which hashing once covers.
A state whose metadata names no step (an averager that is not a training state averager) is snapshotted and
hashed per request, since nothing says when it changed. The wiring into hivemind is
``common.hivemind_compat.verify_state_downloads``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

# the metadata key of the digests; a peer without it speaks another protocol and its state is refused
STATE_DIGEST_KEY = "state_digests_blake2b128"
DIGEST_BYTES = 16


def tensor_digest(serialized: runtime_pb2.Tensor) -> bytes:
    """BLAKE2b-128 of one serialized tensor: header (compression, dtype, shape, byte count) and its bytes."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    header = f"{serialized.compression}|{serialized.dtype}|{tuple(serialized.size)}|{len(serialized.buffer)}|"
    digest.update(header.encode())
    digest.update(serialized.buffer)
    return digest.digest()


@dataclass
class ServedState:
    """A donor's snapshot of its state and the digests of that snapshot as it goes on the wire."""

    key: Optional[tuple]
    tensors: Tuple[torch.Tensor, ...]
    digests: List[bytes]


def _snapshot_key(serialized_metadata: bytes, metadata: Any, tensors: Sequence[torch.Tensor]) -> Optional[tuple]:
    if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
        return None
    # in-place updates (optimizer steps, loading averaged or downloaded tensors) bump a tensor's version
    versions = tuple((tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.dtype) for tensor in tensors)
    return serialized_metadata, versions


def served_state(
    previous: Optional[ServedState],
    serialized_metadata: bytes,
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    infos: Optional[Sequence[CompressionInfo]],
    compression: CompressionBase,
) -> ServedState:
    """The snapshot to serve for this state: ``previous`` while the state is unchanged, else a new one."""
    key = _snapshot_key(serialized_metadata, metadata, tensors)
    if key is not None and previous is not None and previous.key == key:
        return previous
    with torch.no_grad():
        snapshot = tuple(tensor.detach().cpu().clone().requires_grad_(tensor.requires_grad) for tensor in tensors)
    if infos is None:  # what hivemind's rpc_download_state assumes then
        infos = [CompressionInfo.from_tensor(tensor, key=index) for index, tensor in enumerate(snapshot)]
    digests = [
        tensor_digest(compression.compress(tensor, info, allow_inplace=False)) for tensor, info in zip(snapshot, infos)
    ]
    return ServedState(key, snapshot, digests)


def with_digests(metadata: Any, digests: List[bytes]) -> dict:
    """The donor's metadata with its digests added (hivemind's states always send a dict)."""
    if not isinstance(metadata, dict):
        raise TypeError(
            f"a served state's metadata must be a dict to carry its digests, not {type(metadata).__name__}"
        )
    return {**metadata, STATE_DIGEST_KEY: digests}


def state_problem(metadata: Any, serialized_tensors: Sequence[runtime_pb2.Tensor]) -> Optional[str]:
    """Why a downloaded state must not be used (a few words), or None when every tensor matches its digest."""
    digests = metadata.get(STATE_DIGEST_KEY) if isinstance(metadata, dict) else None
    if not isinstance(digests, (list, tuple)) or not all(isinstance(digest, bytes) for digest in digests):
        return "it came without digests: a peer of another protocol version"
    if len(serialized_tensors) != len(digests):
        return f"{len(serialized_tensors)} tensors arrived where the donor's digests list {len(digests)}"
    for index, (serialized, digest) in enumerate(zip(serialized_tensors, digests)):
        if tensor_digest(serialized) != digest:
            shape = list(serialized.size)
            return (
                f"tensor {index} of {len(digests)} (shape {shape}, {len(serialized.buffer)} bytes) does not match "
                "its digest"
            )
    return None


def without_digests(metadata: dict) -> dict:
    """The metadata as the donor's averager produced it, for hivemind's own loading code."""
    return {key: value for key, value in metadata.items() if key != STATE_DIGEST_KEY}
