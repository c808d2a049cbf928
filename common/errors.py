"""User-facing errors: one line, naming the problem, never a traceback."""

from __future__ import annotations

import errno
import functools
import logging
import os
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


# errors of a file system the user can fix: a folder without write permission, a read-only mount, a full disk
USER_FIXABLE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def file_system_problem(error: BaseException) -> str | None:
    """The one-line message for an OSError the user can fix (it names the file), None for any other error."""
    if isinstance(error, OSError) and error.errno in USER_FIXABLE_ERRNOS and error.filename is not None:
        return (
            f"cannot write or read {error.filename}: {error.strerror} (check the folder's permissions and free space)"
        )
    return None


def exit_on_user_error(main: F) -> F:
    """Wrap an entry point: a UserError ends the process with one line on stderr and exit code 2.

    The process then exits with ``os._exit``: a hivemind thread or child left hanging by a failure must
    not keep a finished peer alive (the launcher kills the rest of the process group).
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        code = 0
        try:
            main(*args, **kwargs)
        except UserError as error:
            message = " ".join(str(error).split())
            sys.stderr.write(f"error: {message}\n")
            code = 2
        except KeyboardInterrupt:
            code = 130
        except OSError as error:
            problem = file_system_problem(error)
            if problem is None:
                logging.getLogger(main.__module__).exception("unexpected error")
                code = 1
            else:
                sys.stderr.write(f"error: {problem}\n")
                code = 2
        except SystemExit as exit_request:
            code = exit_request.code if isinstance(exit_request.code, int) else 1
        except BaseException:
            logging.getLogger(main.__module__).exception("unexpected error")
            code = 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    return wrapper  # type: ignore[return-value]
