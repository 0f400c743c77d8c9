"""Advice that names a setting, in the words of the reader: Python or a CONFIG file.

An error raised deep in the library ("export with a dynamic batch") reaches two kinds of readers: a Python user
who calls ``export(..., dynamic_batch=True)`` and a command-line user who writes ``dynamic_batch = True`` in the
CONFIG file that ``quantlens analyze`` reads (or passes ``--out``, where the CLI chooses the folder itself). Each
setting an error may advise is declared once in :data:`SETTINGS`, with how each reader changes it;
:func:`setting` renders it for the reader of the current context, which the CLI sets with
:func:`speaking_to` (``"config"``) around every command. The default reader is a Python user.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Setting", "SETTINGS", "setting", "speaking_to", "AUDIENCES"]

AUDIENCES = ("python", "config")


@dataclass(frozen=True)
class Setting:
    """One setting a message may advise. ``python`` and ``config`` are format strings of ``{value}``: how a Python
    user and a CONFIG user (``quantlens analyze/fix/sensitivity CONFIG.py``) change it, where they are."""

    name: str
    python: str
    config: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("dynamic_batch", "`export(..., dynamic_batch={value})`",
            "`dynamic_batch = {value}` in the CONFIG file"),
    Setting("check_result_dir", "`prepare(..., check_result_dir={value})`",
            "the --out folder (the command line writes it there)"),
    Setting("allow_no_stubs", "`prepare(..., allow_no_stubs={value})`",
            "`allow_no_stubs = {value}` in the CONFIG file"),
)}

_READER: contextvars.ContextVar[str] = contextvars.ContextVar("quantlens_reader", default="python")


def setting(name: str, value: Any) -> str:
    """How the current reader sets ``name`` to ``value`` (``value`` as written in Python: ``True``, ``FOLDER``)."""
    entry = SETTINGS[name]
    form = entry.config if _READER.get() == "config" else entry.python
    return form.format(value=value)


@contextlib.contextmanager
def speaking_to(reader: str) -> Iterator[None]:
    """Advice raised inside this block names the settings as ``reader`` (one of :data:`AUDIENCES`) changes them."""
    if reader not in AUDIENCES:
        raise ValueError(f"speaking_to({reader!r}): expected one of {AUDIENCES}")
    token = _READER.set(reader)
    try:
        yield
    finally:
        _READER.reset(token)
