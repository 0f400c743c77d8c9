"""The command line's exit codes and its usage error: a leaf every command imports (the package imports the
commands, so they cannot import these from it)."""

from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "UsageError"]

#: 0 ok, 1 the analysis found problems (advisor findings, a diverged op), 2 usage or bad input, or a stage that failed
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command-line input (a missing file, a wrong combination of options): exit 2."""
