"""Monitor peer (first peer of a run): ``python scripts/monitor.py --config configs/albert/tiny.yaml``.

In a moderated run add ``--auth-server https://HOST:PORT`` (and ``--auth-ca CERT`` if its certificate is
self-signed); credentials come from $DEDLOC_USERNAME / $DEDLOC_PASSWORD or a prompt."""

import _bootstrap  # noqa: F401  (repository root on sys.path)

from common.auth import authorize
from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.peer import parse_role_arguments
from common.roles.monitor import run_monitor


@exit_on_user_error
def main() -> None:
    stop = StopFlag().install()
    args = parse_role_arguments("monitor", moderated=True)
    setup_logging(args.name)
    run_monitor(args.config, args.config_path, stop, authorize(args.auth_server, args.auth_ca))


if __name__ == "__main__":
    main()
