"""Auxiliary peer (CPU, no data, helps average): ``python scripts/aux_peer.py --config ... --initial-peers ...``."""
import _bootstrap  # noqa: F401  (repository root on sys.path)

from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.auxiliary import run_auxiliary


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_role_arguments("auxiliary")
    setup_logging(args.name)
    run_auxiliary(args.config, args.config_path, stop)


if __name__ == "__main__":
    main()
