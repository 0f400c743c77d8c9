"""What the commands share: the ``--debug`` option, the console, path checks."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantlens.cli.exits import UsageError

__all__ = ["parent", "console", "esc", "existing_file", "existing_dir"]


def parent() -> argparse.ArgumentParser:
    """Options every command takes (``quantlens CMD --debug`` as well as ``quantlens --debug CMD``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", dest="sub_debug", action="store_true", help="show the full traceback of an error")
    return p


def console():
    """The commands' console: no syntax highlighting; 120 columns when the output is not a terminal."""
    import sys

    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


def esc(value) -> str:
    """``value`` as literal text for rich (op names and dtypes such as ``conv2d[qint8]`` are not markup)."""
    from rich.markup import escape

    return escape(str(value))


def existing_file(path: str, what: str, suffixes: tuple[str, ...] = ()) -> Path:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{what} {path!r} does not exist or is not a file.")
    if suffixes and p.suffix not in suffixes:
        raise UsageError(f"{what} {path!r} should end with {' or '.join(suffixes)}.")
    return p


def existing_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{what} {path!r} does not exist or is not a folder.")
    return p
