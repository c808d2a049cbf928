"""sahajBERT authorization server: an allowlist and signed, expiring access tokens for peers.

  python scripts/auth_server.py add-user --allowlist allowlist.json --username alice \
      [--access-expires 2026-12-31T00:00:00+00:00]
      (password from $DEDLOC_PASSWORD or a prompt; only its scrypt hash is stored)
  python scripts/auth_server.py serve --allowlist allowlist.json [--host 127.0.0.1] [--port 8765] [--token-minutes 60]

The server's signing key lives in memory: after a restart peers simply fetch new tokens.
"""

import argparse
import getpass
import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import _bootstrap  # noqa: F401  (repository root on sys.path)
from hivemind.utils.crypto import RSAPrivateKey

from common.auth import AllowlistEntry, AuthorizationService, AuthServer, hash_password, load_allowlist, save_allowlist
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


def serve(args: argparse.Namespace) -> None:
    if args.token_minutes <= 0:
        raise ConfigError("--token-minutes must be > 0")
    stop = StopFlag().install()
    service = AuthorizationService(
        load_allowlist(Path(args.allowlist)), RSAPrivateKey(), timedelta(minutes=args.token_minutes)
    )
    server = AuthServer(service, args.host, args.port).start()
    logger.info(
        f"authorization server for {len(service.allowlist)} users at {server.url} "
        f"(volunteers pass --auth-server {server.url})"
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
    run = commands.add_parser("serve", help="serve tokens over HTTP")
    run.add_argument("--allowlist", required=True)
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8765)
    run.add_argument("--token-minutes", type=float, default=60.0, help="lifetime of an access token")
    args = parser.parse_args()
    setup_logging("auth_server")
    add_user(args) if args.command == "add-user" else serve(args)


if __name__ == "__main__":
    main()
