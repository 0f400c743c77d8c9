"""Small file helpers shared by every writer: atomic text writes and plain-text tables."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

__all__ = ["atomic_write_text", "format_table"]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename, so no half-written file is left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A psql-style text table (stable, diff-friendly)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    out = [sep, line(cells[0]), sep] + [line(r) for r in cells[1:]] + [sep]
    return "\n".join(out)
