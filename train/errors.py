"""Errors a user can act on, and the one place that turns them into a one-line message.

Modules raise subclasses of :class:`UsageError` (the input is wrong: a field, a file, a flag --
exit code 2) or :class:`RunError` (the run cannot go on: disk full, a locked output, a
non-finite loss -- exit code 1). Their message names the field or file and says what to do.
Every command entry (``draftsmith ...`` and ``python recipes/X.py``) is wrapped by
:func:`cli_main`, which prints ``error: <message>`` and returns the exit code; ``--debug`` (or
``DRAFTSMITH_DEBUG=1``) shows the traceback instead.

Example:
    class DataFileError(UsageError): ...

    def main(argv=None) -> int:
        return cli_main(_main, argv)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "RunError", "UsageError", "cli_main", "exit_code"]

EXIT_USAGE = 2
EXIT_RUNTIME = 1


class UsageError(ValueError):
    """Bad input (config field, data file, flag, checkpoint path): exit code 2."""


class RunError(RuntimeError):
    """The run cannot continue (disk full, locked output, non-finite loss): exit code 1."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code for a known error, or None for an unexpected one (a bug: traceback)."""
    from .config import ConfigError
    from .safety import DiskSpaceError, OutputLockedError

    if isinstance(exc, (UsageError, ConfigError)):
        return EXIT_USAGE
    if isinstance(exc, (RunError, DiskSpaceError, OutputLockedError)):
        return EXIT_RUNTIME
    return None


def _debug(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("DRAFTSMITH_DEBUG", "") not in ("", "0")


def cli_main(fn: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """Run ``fn(argv)`` and turn known errors into ``error: ...`` plus an exit code.

    ``--debug`` is removed from ``argv`` before ``fn`` sees it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        return fn(argv)
    except Exception as exc:
        code = exit_code(exc)
        if code is None or debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return code
