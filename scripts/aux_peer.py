"""Auxiliary peer (CPU, no data, helps average): ``python scripts/aux_peer.py --config ... --initial-peers ...``.

With ``--auth-server https://HOST:PORT`` it joins a moderated run; ``--help`` lists the other options."""

from common.errors import exit_on_user_error
from common.peer import run_moderated_role
from common.roles.auxiliary import run_auxiliary


@exit_on_user_error
def main() -> None:
    run_moderated_role("auxiliary", run_auxiliary)


if __name__ == "__main__":
    main()
