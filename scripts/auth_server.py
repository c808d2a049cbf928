"""sahajBERT authorization server: an allowlist and signed, expiring access tokens for peers, over HTTPS.

  python scripts/auth_server.py add-user --allowlist allowlist.json --username alice \
      [--access-expires 2026-12-31T00:00:00+00:00]
      (password from $DEDLOC_PASSWORD or a prompt; only its scrypt hash is stored)
  python scripts/auth_server.py make-certificate --cert auth.crt --key auth.key --host 127.0.0.1 [--host NAME ...]
      (a self-signed pair for a local demo, or for a run whose peers get auth.crt from the organiser)
  python scripts/auth_server.py serve --allowlist allowlist.json --cert auth.crt --key auth.key \
      [--signing-key token_signing.key] [--host 127.0.0.1] [--port 8765] [--token-minutes 60]

Peers pass --auth-server https://HOST:PORT, plus --auth-ca auth.crt when the certificate is self-signed. The
token-signing key lives in a file (created on first start), so a restart leaves issued tokens valid; the run secret
that tags every averaging prefix derives from it. After 5 failed logins for a username (20 from an address) within
5 minutes, further attempts are refused for the rest of that window.
"""

import argparse
import getpass
import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

from common.auth import (
    AllowlistEntry,
    AuthorizationService,
    AuthServer,
    TLSFiles,
    hash_password,
    load_allowlist,
    load_or_create_signing_key,
    make_self_signed_certificate,
    save_allowlist,
)
from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import StopFlag, setup_logging

logger = logging.getLogger("auth_server")
PASSWORD_VARIABLE = "DEDLOC_PASSWORD"


def add_user(args: argparse.Namespace) -> None:
    path = Path(args.allowlist)
    entries = load_allowlist(path) if path.exists() else {}
    password = os.environ.get(PASSWORD_VARIABLE) or getpass.getpass(f"password for {args.username}: ")
    if not password:
        raise ConfigError("the password must not be empty")
    expires = None
    if args.access_expires:
        try:
            expires = datetime.fromisoformat(args.access_expires).astimezone(timezone.utc)
        except ValueError:
            raise ConfigError(f"--access-expires must be an ISO 8601 time (got {args.access_expires!r})") from None
    entries[args.username] = AllowlistEntry(args.username, hash_password(password), expires)
    save_allowlist(entries, path)
    logger.info(f"{args.username!r} is on the allowlist {path} ({len(entries)} users)")


def make_certificate(args: argparse.Namespace) -> None:
    make_self_signed_certificate(Path(args.cert), Path(args.key), args.host, days=args.days)
    logger.info(f"wrote the self-signed certificate {args.cert} (for {', '.join(args.host)}) and its key {args.key}")


def serve(args: argparse.Namespace) -> None:
    if args.token_minutes <= 0:
        raise ConfigError("--token-minutes must be > 0")
    stop = StopFlag().install()
    signing_key = Path(args.signing_key or Path(args.allowlist).with_name("token_signing.key"))
    service = AuthorizationService(
        load_allowlist(Path(args.allowlist)),
        load_or_create_signing_key(signing_key),
        timedelta(minutes=args.token_minutes),
    )
    server = AuthServer(service, TLSFiles(Path(args.cert), Path(args.key)), args.host, args.port).start()
    logger.info(
        f"authorization server for {len(service.allowlist)} users at {server.url}, signing with {signing_key} "
        f"(peers pass --auth-server {server.url}, and --auth-ca {args.cert} if it is self-signed)"
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add-user", help="add or update an allowlisted user")
    add.add_argument("--allowlist", required=True)
    add.add_argument("--username", required=True)
    add.add_argument("--access-expires", default=None, help="ISO 8601 time after which the user gets no tokens")
    certificate = commands.add_parser("make-certificate", help="write a self-signed TLS certificate and its key")
    certificate.add_argument("--cert", required=True, help="certificate file to write (PEM; give it to peers)")
    certificate.add_argument("--key", required=True, help="private key file to write (PEM; keep it secret)")
    certificate.add_argument(
        "--host", action="append", required=True, help="a name or IP address peers use to reach the server"
    )
    certificate.add_argument("--days", type=int, default=365)
    run = commands.add_parser("serve", help="serve tokens over HTTPS")
    run.add_argument("--allowlist", required=True)
    run.add_argument("--cert", required=True, help="the server's TLS certificate (PEM)")
    run.add_argument("--key", required=True, help="the server's TLS private key (PEM)")
    run.add_argument(
        "--signing-key", default=None, help="token-signing key file, created if absent (default: beside the allowlist)"
    )
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8765)
    run.add_argument("--token-minutes", type=float, default=60.0, help="lifetime of an access token")
    args = parser.parse_args()
    setup_logging("auth_server")
    {"add-user": add_user, "make-certificate": make_certificate, "serve": serve}[args.command](args)


if __name__ == "__main__":
    main()
