"""Join a sahajBERT-style authorized run as a volunteer trainer (client mode by default):

  python scripts/volunteer.py --config configs/sahajbert/paper.yaml --auth-server https://HOST:PORT \
      [--auth-ca auth.crt] --initial-peers /ip4/.../p2p/... [--name NAME] [--server-mode] [key=value overrides]

The monitor of a moderated run prints this command with its addresses filled in. Credentials come from
$DEDLOC_USERNAME / $DEDLOC_PASSWORD or a prompt. Refusals (not allowlisted, wrong password, expired access,
unreachable server) end with one line naming the problem. The display name defaults to the username.
"""

from common.auth import authorize
from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.trainer import run_trainer


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_role_arguments("volunteer", volunteer=True)  # loads the identity the token is issued for
    setup_logging(args.name)
    authorizer = authorize(
        args.auth_server, args.auth_ca
    )  # refusals surface here, before the model, data or DHT are built
    name = args.name if args.name_given else authorizer.username
    run_trainer(args.config, args.config_path, name, stop, authorizer)


if __name__ == "__main__":
    main()
