"""User-facing errors: one line, naming the problem, never a traceback."""
from __future__ import annotations

import functools
import logging
import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class UserError(Exception):
    """A problem the user can fix (bad config, missing data, unreachable peers, ...).

    Entry points catch it and print ``error: <message>`` as a single line, exiting with code 2.
    """


class ConfigError(UserError):
    """The configuration file or an override is invalid."""


class DataError(UserError):
    """Input data is missing, unreadable or unreachable."""


class PeerError(UserError):
    """The swarm cannot be joined: bad or unreachable initial peers, all-client-mode swarm, ..."""


def exit_on_user_error(main: F) -> F:
    """Wrap an entry point so a UserError ends the process with one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            logging.shutdown()
            message = " ".join(str(error).split())
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            sys.exit(2)

    return wrapper  # type: ignore[return-value]
