"""A peer's identity: its libp2p peer id, from an RSA key kept in its output folder.

One key serves three purposes, so they always agree: it is the libp2p identity (the peer id others dial and
see), it signs the peer's metrics records in the DHT (so the monitor can tell whose record it is without
trusting any field of it), and it is the key an authorization server issues a moderated peer's token for.
Kept in a file, it makes a restarted volunteer the same contributor. The display name is only a label: two
volunteers who both call themselves ``alice`` stay two contributors with two peer ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from common.errors import ConfigError
from common.hivemind_compat import rsa_private_key_from_der

logger = logging.getLogger(__name__)

IDENTITY_FILE = "identity.key"
_OWNER_MARKER = re.compile(rb"\[owner:(.+?)\]")  # how hivemind's RSASignatureValidator embeds a public key


@dataclass(frozen=True)
class PeerIdentity:
    private_key: RSAPrivateKey
    peer_id: str  # base58, as hivemind and libp2p print it
    path: Path

    def default_name(self, role: str) -> str:
        """A readable label derived from the peer id (its tail: every RSA peer id starts with ``Qm``)."""
        return f"{role}-{self.peer_id[-6:]}"


def load_identity(path: str | Path) -> PeerIdentity:
    """Read the key at ``path``, creating it (readable by its owner only) if it does not exist yet."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = RSAPrivateKey()
        serialized = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(serialized)
        logger.info(f"created a new peer identity in {path}")
    try:
        data = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if data.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = rsa_private_key_from_der(data.data)
    except Exception as error:  # protobuf and cryptography raise many types for a damaged file
        raise ConfigError(
            f"network.identity_path {path} is not a peer identity key ({type(error).__name__}); "
            f"delete it to start as a new contributor"
        ) from None
    return PeerIdentity(private_key=key, peer_id=peer_id_of(key.get_public_key()), path=path)


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key: the SHA-256 multihash of its protobuf encoding, in base58."""
    der = serialization.load_ssh_public_key(public_key.to_bytes()).public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def peer_id_of_record_owner(subkey: bytes) -> str | None:
    """The peer id behind a signed DHT subkey (``[owner:ssh-rsa ...]``); None if the subkey names no owner."""
    match = _OWNER_MARKER.search(subkey)
    if match is None:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(match.group(1)))
    except ValueError:
        return None
