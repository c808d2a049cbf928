"""Auxiliary peer (CPU, no data, helps average): ``python scripts/aux_peer.py --config ... --initial-peers ...``.

In a moderated run add ``--auth-server https://HOST:PORT`` (and ``--auth-ca CERT`` if its certificate is
self-signed); credentials come from $DEDLOC_USERNAME / $DEDLOC_PASSWORD or a prompt."""

import _bootstrap  # noqa: F401  (repository root on sys.path)

from common.errors import exit_on_user_error
from common.peer import run_moderated_role
from common.roles.auxiliary import run_auxiliary


@exit_on_user_error
def main() -> None:
    run_moderated_role("auxiliary", run_auxiliary)


if __name__ == "__main__":
    main()
