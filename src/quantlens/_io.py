"""Small file helpers shared by every writer: atomic text writes and plain-text tables."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_bytes", "format_table"]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], fsync: bool = False) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it over ``path``.

    Every writer of quantlens goes through here, so no half-written file is ever left: on any error the
    temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = False) -> Path:
    """Write ``data`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), fsync=fsync)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A psql-style text table (stable, diff-friendly)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    out = [sep, line(cells[0]), sep] + [line(r) for r in cells[1:]] + [sep]
    return "\n".join(out)
