"""Trainer peer: ``python scripts/train.py --config CONFIG [--initial-peers ...] [key=value ...]``."""

from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.trainer import run_trainer


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_role_arguments("trainer")
    setup_logging(args.name)
    run_trainer(args.config, args.config_path, args.name, stop)


if __name__ == "__main__":
    main()
