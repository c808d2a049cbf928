"""Join a sahajBERT-style authorized run as a volunteer trainer (client mode by default):

  python scripts/volunteer.py --config configs/sahajbert/paper.yaml --auth-server http://HOST:PORT \
      --initial-peers /ip4/.../p2p/... [--name NAME] [--server-mode] [key=value overrides]

Credentials come from $DEDLOC_USERNAME / $DEDLOC_PASSWORD or a prompt. Refusals (not allowlisted, wrong
password, expired access, unreachable server) end with one line naming the problem.
"""

import argparse

import _bootstrap  # noqa: F401  (repository root on sys.path)

from common.auth import authorize
from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.trainer import run_trainer


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--auth-server", required=True, help="URL of scripts/auth_server.py")
    parser.add_argument(
        "--server-mode",
        action="store_true",
        help="accept inbound connections (only if this machine is reachable; default: client mode)",
    )
    own, rest = parser.parse_known_args()
    setup_logging("volunteer")
    authorizer = authorize(own.auth_server)  # refusals surface here, before the model, data or DHT are built
    args = parse_role_arguments("volunteer", rest)
    name = args.name if args.name != "volunteer" else authorizer.username
    args.config.network.client_mode = not own.server_mode
    run_trainer(args.config, args.config_path, name, stop, authorizer)


if __name__ == "__main__":
    main()
