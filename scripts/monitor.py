"""Monitor peer (first peer of a run): ``python scripts/monitor.py --config configs/albert/tiny.yaml``.

In a moderated run add ``--auth-server URL`` (credentials from $DEDLOC_USERNAME / $DEDLOC_PASSWORD or a prompt)."""
import argparse

import _bootstrap  # noqa: F401  (repository root on sys.path)

from common.auth import authorize
from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.monitor import run_monitor


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--auth-server", default=None, help="URL of scripts/auth_server.py (moderated runs)")
    own, rest = parser.parse_known_args()
    args = parse_role_arguments("monitor", rest)
    setup_logging(args.name)
    run_monitor(args.config, args.config_path, stop, authorize(own.auth_server))


if __name__ == "__main__":
    main()
