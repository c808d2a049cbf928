"""Monitor peer (first peer of a run): ``python scripts/monitor.py --config configs/albert/tiny.yaml``.

It records the run's history, saves the checkpoints late joiners start from and serves the dashboard (the
monitor section of common/config.py). ``--help`` lists its options (``--auth-server`` for a moderated run)."""

from common.errors import exit_on_user_error
from common.peer import run_moderated_role
from common.roles.monitor import run_monitor


@exit_on_user_error
def main() -> None:
    run_moderated_role("monitor", run_monitor)


if __name__ == "__main__":
    main()
