"""Allowlist authorization for a moderated swarm (sahajBERT): a token server over TLS and a hivemind authorizer.

A peer sends its username, password and RSA public key to the authorization server; if the user is on the
allowlist (and their access has not expired) the server returns an ``AccessToken`` naming the user and the
peer's public key, with an expiration time, signed by the server's RSA key. Peers run
``AllowlistTokenAuthorizer`` (a hivemind ``TokenAuthorizerBase``): every DHT request and response carries the
sender's token and is signed with the sender's key, so DHT nodes refuse peers without a valid, unexpired token
issued by this server, and replays (hivemind keeps nonces and a one-minute clock window).

The server for a public run:
* speaks HTTPS only (passwords travel inside TLS): its certificate and key come from files, e.g. one from a
  public CA, or a self-signed one made by ``make_self_signed_certificate`` that peers trust with ``--auth-ca``;
* keeps its token-signing key in a file, so a restart leaves every issued token valid;
* refuses a username or client address for a while after repeated failed logins (``FailedLoginLimiter``).

What hivemind 1.1 enforces, and what it does not: only DHT RPCs are authorized. Averaging (matchmaking, the
all-reduce, state downloads) runs over libp2p stream handlers that check no token: anyone who can dial a peer and
names the handler (``<prefix>::<averager class>.rpc_join_group``; the prefix is ``<run id>_grad_averager``) may
ask to join its group. Without a token a peer cannot read the DHT, where groups are announced, but a run id is
public (it is in the join command). So the server also hands authorized peers a *run secret*, and every hivemind
prefix of a moderated run is :func:`averaging_run_id` -- the run id plus a tag derived from that secret. A peer
without it cannot name any averaging handler (libp2p answers "protocols not supported") nor find the DHT keys of
matchmaking and progress. This is a shared secret, not per-request authorization: an authorized peer whose access
is later revoked still knows it until the organiser rotates the server's signing key (which derives it).
Metrics records are RSA-signed per peer and schema-checked (``common.metrics``), so a peer cannot write another
peer's metrics, and malformed records are refused by every DHT node and skipped by the monitor.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import getpass
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple
from urllib.parse import urlparse

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizerBase, TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from common.errors import ConfigError, DataError, PeerError
from common.hivemind_compat import rsa_private_key_from_der

logger = logging.getLogger(__name__)

TOKEN_PATH = "/token"
SCRYPT_PARAMETERS = {"n": 2**14, "r": 8, "p": 1}
REQUEST_TIMEOUT_SECONDS = 10.0
RUN_SECRET_CONTEXT = b"dedloc averaging run secret"


class AccessDenied(PeerError):
    """The authorization server refused this peer (not allowlisted, wrong password, expired access)."""


class TooManyFailures(AccessDenied):
    """Too many failed logins for this username or from this address: refused without checking the password."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


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


class FailedLoginLimiter:
    """Counts failed logins per username and per client address in a sliding window; once either reaches its
    limit, further attempts for it are refused without checking the password until the oldest failure leaves the
    window. Memory is bounded: at most ``max_tracked`` usernames and addresses are remembered (oldest forgotten)."""

    def __init__(
        self,
        per_username: int = 5,
        per_address: int = 20,
        window_seconds: float = 300.0,
        max_tracked: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits = {"user": per_username, "address": per_address}
        self.window_seconds, self.max_tracked, self.clock = window_seconds, max_tracked, clock
        self.failures: "collections.OrderedDict[tuple, collections.deque]" = collections.OrderedDict()
        self.lock = threading.Lock()

    def _recent(self, key: tuple, now: float) -> collections.deque:
        times = self.failures.get(key, collections.deque())
        while times and times[0] <= now - self.window_seconds:
            times.popleft()
        return times

    def check(self, username: str, address: str) -> None:
        """Raise ``TooManyFailures`` if this username or address is locked out now."""
        now = self.clock()
        with self.lock:
            for kind, value in (("user", username), ("address", address)):
                times = self._recent((kind, value), now)
                if len(times) >= self.limits[kind]:
                    retry_after = times[0] + self.window_seconds - now
                    what = f"user {username!r}" if kind == "user" else f"address {address}"
                    raise TooManyFailures(
                        f"too many failed logins for {what}: try again in {retry_after:.0f} s", retry_after
                    )

    def record_failure(self, username: str, address: str) -> None:
        now = self.clock()
        with self.lock:
            for key in (("user", username), ("address", address)):
                times = self._recent(key, now)
                times.append(now)
                self.failures[key] = times
                self.failures.move_to_end(key)
            while len(self.failures) > self.max_tracked:
                self.failures.popitem(last=False)

    def record_success(self, username: str) -> None:
        with self.lock:
            self.failures.pop(("user", username), None)


class AuthorizationService:
    """The server's decision logic: check the allowlist and password, then sign a token for the public key."""

    def __init__(
        self,
        allowlist: Dict[str, AllowlistEntry],
        private_key: RSAPrivateKey,
        token_lifetime: timedelta,
        limiter: Optional[FailedLoginLimiter] = None,
    ):
        self.allowlist, self.private_key, self.token_lifetime = allowlist, private_key, token_lifetime
        self.limiter = limiter if limiter is not None else FailedLoginLimiter()

    @property
    def public_key(self) -> RSAPublicKey:
        return self.private_key.get_public_key()

    @property
    def run_secret(self) -> bytes:
        """What authorized peers mix into every averaging prefix (:func:`averaging_run_id`). Derived from the
        signing key, so it survives restarts with the key and changes when the organiser rotates the key."""
        return hmac.new(self.private_key.to_bytes(), RUN_SECRET_CONTEXT, hashlib.sha256).digest()

    def issue(self, username: str, password: str, peer_public_key: bytes, address: str = "local") -> AccessToken:
        """A token for ``peer_public_key``; ``address`` is the client's, for the failed-login limits."""
        self.limiter.check(username, address)
        entry = self.allowlist.get(username)
        if entry is None:
            self.limiter.record_failure(username, address)
            raise AccessDenied(f"user {username!r} is not on this run's allowlist; ask the organisers to add you")
        if not verify_password(password, entry.password_hash):
            self.limiter.record_failure(username, address)
            raise AccessDenied(f"wrong password for user {username!r}")
        self.limiter.record_success(username)
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
    timeout = REQUEST_TIMEOUT_SECONDS  # a client that stalls (mid-handshake or mid-request) is dropped

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != TOKEN_PATH:
            self._reply(404, {"error": f"unknown path {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length))
            token = self.service.issue(
                str(request["username"]),
                str(request["password"]),
                base64.b64decode(request["public_key"]),
                address=self.client_address[0],
            )
        except TooManyFailures as error:
            logger.warning(f"refused a token request from {self.client_address[0]}: {error}")
            self._reply(429, {"error": str(error)}, {"Retry-After": str(max(1, round(error.retry_after)))})
            return
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
                "run_secret": base64.b64encode(self.service.run_secret).decode(),
            },
        )

    def _reply(self, status: int, body: dict, headers: Optional[Dict[str, str]] = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        logger.debug(format % args)


@dataclass(frozen=True)
class TLSFiles:
    """The server's certificate (PEM, may hold a chain) and its private key (PEM)."""

    certificate: Path
    key: Path

    def context(self) -> ssl.SSLContext:
        for path in (self.certificate, self.key):
            if not Path(path).is_file():
                raise ConfigError(
                    f"TLS file not found: {path} (make a self-signed pair: scripts/auth_server.py make-certificate)"
                )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(str(self.certificate), str(self.key))
        except (ssl.SSLError, ValueError) as error:
            raise ConfigError(
                f"cannot use {self.certificate} with {self.key} as the server's TLS pair: {error}"
            ) from None
        return context


class _QuietHTTPSServer(ThreadingHTTPServer):
    """Logs a client that fails or drops the TLS handshake (an untrusted certificate, a port scan) as one line,
    where the standard server prints a traceback to stderr."""

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        logger.info(f"connection from {client_address[0]} ended before a request: {error!r}")


class AuthServer:
    """The authorization server over HTTPS (loopback by default), serving from a background thread."""

    def __init__(self, service: AuthorizationService, tls: TLSFiles, host: str = "127.0.0.1", port: int = 0):
        handler = type("BoundTokenHandler", (_TokenHandler,), {"service": service})
        context = tls.context()
        self.httpd = _QuietHTTPSServer((host, port), handler)
        # the handshake runs on the handler's first read, in the request's own thread: a client that stalls in
        # it cannot hold up the accept loop
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="auth-server", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"https://{host}:{port}"

    def start(self) -> "AuthServer":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_self_signed_certificate(certificate: Path, key: Path, hosts: Sequence[str], days: int = 365) -> None:
    """A self-signed certificate for ``hosts`` (names or IP addresses) and its key, for a local demo or a run whose
    peers get the certificate file from the organiser (``--auth-ca``). The key file is readable by its owner only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise ConfigError("a certificate needs at least one host name or address")
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    private_key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    now = datetime.now(timezone.utc)
    built = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(private_key, hashes.SHA256())
    )
    key_bytes = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_private_file(Path(key), key_bytes)
    Path(certificate).write_bytes(built.public_bytes(serialization.Encoding.PEM))


def _write_private_file(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (created so from the start, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as stream:
        stream.write(data)
    os.replace(temporary, path)


def load_or_create_signing_key(path: Path) -> RSAPrivateKey:
    """The server's token-signing key from ``path`` (created on first start): tokens outlive a server restart."""
    path = Path(path)
    if not path.exists():
        key = RSAPrivateKey()
        _write_private_file(path, key.to_bytes())
        logger.info(f"created the token-signing key {path}")
        return key
    try:
        return rsa_private_key_from_der(path.read_bytes())
    except Exception as error:  # cryptography raises several types for a damaged file
        raise ConfigError(f"{path} is not a token-signing key ({type(error).__name__})") from None


@dataclass(frozen=True)
class TokenReply:
    token: AccessToken
    server_public_key: RSAPublicKey
    run_secret: bytes


def client_tls_context(server_url: str, ca_file: Optional[str]) -> ssl.SSLContext:
    """Verify the server's certificate against ``ca_file`` (a self-signed server's own certificate) or, without
    it, against this machine's trusted CAs. Plain ``http://`` is refused: the password would travel in clear."""
    if urlparse(server_url).scheme != "https":
        raise ConfigError(f"the authorization server must be reached over https:// (got {server_url})")
    if ca_file is not None and not Path(ca_file).is_file():
        raise ConfigError(f"--auth-ca file not found: {ca_file}")
    try:
        return ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as error:
        raise ConfigError(f"--auth-ca {ca_file} is not a PEM certificate: {error}") from None


def request_token(
    server_url: str, username: str, password: str, public_key: RSAPublicKey, ca_file: Optional[str] = None
) -> TokenReply:
    """Ask the server for a token; its refusals become one-line ``AccessDenied`` errors."""
    context = client_tls_context(server_url, ca_file)
    body = json.dumps(
        {"username": username, "password": password, "public_key": base64.b64encode(public_key.to_bytes()).decode()}
    ).encode()
    request = urllib.request.Request(
        server_url.rstrip("/") + TOKEN_PATH, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS, context=context) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read()).get("error", error.reason)
        except ValueError:
            message = error.reason
        raise AccessDenied(f"authorization server refused {username!r}: {message}") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, ssl.SSLCertVerificationError):
            raise PeerError(
                f"authorization server {server_url} presented a certificate this peer does not trust "
                f"({error.reason.verify_message}): pass the server's certificate file with --auth-ca"
            ) from None
        raise PeerError(f"authorization server {server_url} is unreachable: {error.reason}") from None
    except OSError as error:
        raise PeerError(f"authorization server {server_url} is unreachable: {error}") from None
    return TokenReply(
        token=AccessToken.FromString(base64.b64decode(reply["token"])),
        server_public_key=RSAPublicKey.from_bytes(base64.b64decode(reply["server_public_key"])),
        run_secret=base64.b64decode(reply["run_secret"]),
    )


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
        ca_file: Optional[str] = None,
    ):
        super().__init__(local_private_key)
        self.server_url, self.username, self.password, self.ca_file = server_url, username, password, ca_file
        self.server_public_key, self.refresh_margin = server_public_key, refresh_margin
        self._lifetime_at_issue = refresh_margin
        self.run_secret: Optional[bytes] = None

    def fetch_token(self) -> AccessToken:
        """Blocking token request; call once before starting the DHT so refusals surface as clear errors."""
        reply = request_token(self.server_url, self.username, self.password, self.local_public_key, self.ca_file)
        token = reply.token
        if self.server_public_key is None:
            self.server_public_key = reply.server_public_key  # trust on first use; pin it by passing the key
        self.run_secret = reply.run_secret
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


def authorize(server_url: Optional[str], ca_file: Optional[str] = None) -> Optional[AllowlistTokenAuthorizer]:
    """The authorizer every role of a moderated run needs (None for an open run). The first token is fetched here,
    so refusals end the process with one line before any model, data or DHT is built. ``ca_file``: the
    certificate to trust for the server (its own, if self-signed); None trusts this machine's CAs."""
    if server_url is None:
        return None
    client_tls_context(server_url, ca_file)  # a wrong URL scheme or CA file fails before any prompt
    username, password = credentials()
    authorizer = AllowlistTokenAuthorizer(server_url, username, password, ca_file=ca_file)
    authorizer.fetch_token()
    return authorizer


def averaging_run_id(run_id: str, authorizer: Optional[AuthorizerBase]) -> str:
    """The run id hivemind builds every averaging prefix and progress key from. In a moderated run it carries a tag
    derived from the run secret that only authorized peers receive, so an outsider cannot name the averaging
    handlers of the run's peers (see this module's docstring); an open run uses the run id itself."""
    secret = getattr(authorizer, "run_secret", None)
    if not secret:
        return run_id
    return f"{run_id}_{hmac.new(secret, run_id.encode(), hashlib.sha256).hexdigest()[:24]}"
