"""Allowlist authorization for a moderated swarm (sahajBERT): an HTTP token server and a hivemind authorizer.

A peer sends its username, password and RSA public key to the authorization server; if the user is on the
allowlist (and their access has not expired) the server returns an ``AccessToken`` naming the user and the
peer's public key, with an expiration time, signed by the server's RSA key. Peers run
``AllowlistTokenAuthorizer`` (a hivemind ``TokenAuthorizerBase``): every DHT request and response carries the
sender's token and is signed with the sender's key, so DHT nodes refuse peers without a valid, unexpired token
issued by this server, and replays (hivemind keeps nonces and a one-minute clock window).

What hivemind 1.1 leaves open: only DHT RPCs are authorized. Gradient/state averaging (all-reduce, state
download) runs over libp2p streams that are not token-checked, so a peer that learns the other peers'
addresses can still connect to them directly. What we close: without a token a peer cannot read or write the
DHT, which is where matchmaking keys, progress and peer addresses live, so it cannot *find* an averaging group;
metrics records are RSA-signed per peer and schema-checked (``common.metrics``), so a peer cannot write another
peer's metrics, and malformed records are refused by every DHT node and skipped by the monitor.
"""

from __future__ import annotations

import asyncio
import base64
import getpass
import hashlib
import hmac
import json
import logging
import os
import secrets
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Optional, Tuple

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from common.errors import ConfigError, DataError, PeerError

logger = logging.getLogger(__name__)

TOKEN_PATH = "/token"
SCRYPT_PARAMETERS = {"n": 2**14, "r": 8, "p": 1}
REQUEST_TIMEOUT_SECONDS = 10.0


class AccessDenied(PeerError):
    """The authorization server refused this peer (not allowlisted, wrong password, expired access)."""


def hash_password(password: str, salt: Optional[bytes] = None) -> str:
    """``scrypt$<salt hex>$<hash hex>``: what the allowlist stores instead of the password."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **SCRYPT_PARAMETERS)
    return f"scrypt${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    scheme, salt_hex, digest_hex = stored.split("$")
    if scheme != "scrypt":
        return False
    digest = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt_hex), **SCRYPT_PARAMETERS)
    return hmac.compare_digest(digest.hex(), digest_hex)


@dataclass(frozen=True)
class AllowlistEntry:
    username: str
    password_hash: str
    access_expires: Optional[datetime] = None  # after this, the user gets no new tokens


def load_allowlist(path: Path) -> Dict[str, AllowlistEntry]:
    """JSON: ``{"users": [{"username", "password_hash", "access_expires" (ISO 8601 UTC, optional)}]}``."""
    try:
        raw = json.loads(Path(path).read_text())
        entries = {}
        for user in raw["users"]:
            expires = user.get("access_expires")
            entries[user["username"]] = AllowlistEntry(
                username=user["username"],
                password_hash=user["password_hash"],
                access_expires=datetime.fromisoformat(expires).astimezone(timezone.utc) if expires else None,
            )
        return entries
    except FileNotFoundError:
        raise DataError(f"allowlist file not found: {path}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise DataError(f"malformed allowlist {path}: {type(error).__name__}: {error}") from None


def save_allowlist(entries: Dict[str, AllowlistEntry], path: Path) -> None:
    users = [
        {
            "username": entry.username,
            "password_hash": entry.password_hash,
            "access_expires": entry.access_expires.isoformat() if entry.access_expires else None,
        }
        for entry in entries.values()
    ]
    Path(path).write_text(json.dumps({"users": users}, indent=2) + "\n")


def _token_payload(token: AccessToken) -> bytes:
    return f"{token.username} {token.public_key.hex()} {token.expiration_time}".encode()


def token_expiration(token: AccessToken) -> datetime:
    return datetime.fromisoformat(token.expiration_time)


def is_token_signed_and_current(token: AccessToken, server_public_key: RSAPublicKey) -> bool:
    try:
        if token_expiration(token) <= datetime.now(timezone.utc):
            return False
    except ValueError:
        return False
    return server_public_key.verify(_token_payload(token), token.signature)


class AuthorizationService:
    """The server's decision logic: check the allowlist and password, then sign a token for the public key."""

    def __init__(self, allowlist: Dict[str, AllowlistEntry], private_key: RSAPrivateKey, token_lifetime: timedelta):
        self.allowlist, self.private_key, self.token_lifetime = allowlist, private_key, token_lifetime

    @property
    def public_key(self) -> RSAPublicKey:
        return self.private_key.get_public_key()

    def issue(self, username: str, password: str, peer_public_key: bytes) -> AccessToken:
        entry = self.allowlist.get(username)
        if entry is None:
            raise AccessDenied(f"user {username!r} is not on this run's allowlist; ask the organisers to add you")
        if not verify_password(password, entry.password_hash):
            raise AccessDenied(f"wrong password for user {username!r}")
        now = datetime.now(timezone.utc)
        if entry.access_expires is not None and entry.access_expires <= now:
            raise AccessDenied(f"access for user {username!r} expired on {entry.access_expires.isoformat()}")
        try:
            RSAPublicKey.from_bytes(peer_public_key)
        except Exception:  # cryptography raises several types for a malformed key
            raise AccessDenied("the peer's public key is malformed") from None
        expires = now + self.token_lifetime
        if entry.access_expires is not None:
            expires = min(expires, entry.access_expires)
        token = AccessToken(username=username, public_key=peer_public_key, expiration_time=expires.isoformat())
        token.signature = self.private_key.sign(_token_payload(token))
        return token


class _TokenHandler(BaseHTTPRequestHandler):
    service: AuthorizationService  # set on the per-server subclass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != TOKEN_PATH:
            self._reply(404, {"error": f"unknown path {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length))
            token = self.service.issue(
                str(request["username"]), str(request["password"]), base64.b64decode(request["public_key"])
            )
        except AccessDenied as error:
            logger.info(f"refused a token request: {error}")
            self._reply(403, {"error": str(error)})
            return
        except (KeyError, ValueError, TypeError) as error:
            self._reply(400, {"error": f"malformed token request: {type(error).__name__}"})
            return
        logger.info(f"issued a token to {token.username!r} until {token.expiration_time}")
        self._reply(
            200,
            {
                "token": base64.b64encode(token.SerializeToString()).decode(),
                "server_public_key": base64.b64encode(self.service.public_key.to_bytes()).decode(),
            },
        )

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        logger.debug(format % args)


class AuthServer:
    """The authorization server over HTTP (loopback by default), serving from a background thread."""

    def __init__(self, service: AuthorizationService, host: str = "127.0.0.1", port: int = 0):
        handler = type("BoundTokenHandler", (_TokenHandler,), {"service": service})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="auth-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "AuthServer":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def request_token(
    server_url: str, username: str, password: str, public_key: RSAPublicKey
) -> Tuple[AccessToken, RSAPublicKey]:
    """Ask the server for a token; its refusals become one-line ``AccessDenied`` errors."""
    body = json.dumps(
        {"username": username, "password": password, "public_key": base64.b64encode(public_key.to_bytes()).decode()}
    ).encode()
    request = urllib.request.Request(
        server_url.rstrip("/") + TOKEN_PATH, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read()).get("error", error.reason)
        except ValueError:
            message = error.reason
        raise AccessDenied(f"authorization server refused {username!r}: {message}") from None
    except (urllib.error.URLError, OSError) as error:
        raise PeerError(f"authorization server {server_url} is unreachable: {error}") from None
    token = AccessToken.FromString(base64.b64decode(reply["token"]))
    return token, RSAPublicKey.from_bytes(base64.b64decode(reply["server_public_key"]))


class AllowlistTokenAuthorizer(TokenAuthorizerBase):
    """hivemind authorizer whose tokens come from the authorization server and are checked against its key."""

    def __init__(
        self,
        server_url: str,
        username: str,
        password: str,
        server_public_key: Optional[RSAPublicKey] = None,
        refresh_margin: timedelta = timedelta(minutes=5),
        local_private_key: Optional[RSAPrivateKey] = None,
    ):
        super().__init__(local_private_key)
        self.server_url, self.username, self.password = server_url, username, password
        self.server_public_key, self.refresh_margin = server_public_key, refresh_margin
        self._lifetime_at_issue = refresh_margin

    def fetch_token(self) -> AccessToken:
        """Blocking token request; call once before starting the DHT so refusals surface as clear errors."""
        token, server_key = request_token(self.server_url, self.username, self.password, self.local_public_key)
        if self.server_public_key is None:
            self.server_public_key = server_key  # trust on first use; pin it by passing server_public_key
        if not self.is_token_valid(token):
            raise AccessDenied(
                f"the token from {self.server_url} is not signed by the pinned server key or has "
                f"already expired (expiration {token.expiration_time}; check this machine's clock)"
            )
        self._local_access_token = token
        self._lifetime_at_issue = token_expiration(token) - datetime.now(timezone.utc)
        logger.info(f"authorized as {self.username!r} until {token.expiration_time}")
        return token

    async def get_token(self) -> AccessToken:
        return await asyncio.get_running_loop().run_in_executor(None, self.fetch_token)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.server_public_key is not None and is_token_signed_and_current(access_token, self.server_public_key)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        margin = min(self.refresh_margin, self._lifetime_at_issue / 4)  # short-lived tokens: refresh late, not always
        return token_expiration(access_token) - datetime.now(timezone.utc) < margin


USERNAME_VARIABLE, PASSWORD_VARIABLE = "DEDLOC_USERNAME", "DEDLOC_PASSWORD"


def credentials() -> Tuple[str, str]:
    """Username and password from $DEDLOC_USERNAME / $DEDLOC_PASSWORD, or a prompt in a terminal."""
    username = os.environ.get(USERNAME_VARIABLE) or (input("username: ").strip() if sys.stdin.isatty() else "")
    password = os.environ.get(PASSWORD_VARIABLE) or (getpass.getpass("password: ") if sys.stdin.isatty() else "")
    if not username or not password:
        raise ConfigError(f"no credentials: set {USERNAME_VARIABLE} and {PASSWORD_VARIABLE} or run in a terminal")
    return username, password


def authorize(server_url: Optional[str]) -> Optional[AllowlistTokenAuthorizer]:
    """The authorizer every role of a moderated run needs (None for an open run). The first token is fetched here,
    so refusals end the process with one line before any model, data or DHT is built."""
    if server_url is None:
        return None
    username, password = credentials()
    authorizer = AllowlistTokenAuthorizer(server_url, username, password)
    authorizer.fetch_token()
    return authorizer
