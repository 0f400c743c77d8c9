"""Reading a search's progress file back (``remedies_progress.json``, ``mixed_precision_progress.json``) and
checking its output folder before any work.

A progress file is replayed only when it was written by a search with the same inputs (its ``fingerprint``) and
every field has the type the search reads. A damaged one (not JSON, not an object, a field of another type) is
set aside under a new name, never deleted, with a warning, and the search starts afresh; one written by a
search with other inputs is left to be overwritten, with a warning.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from quantlens._io import writable_dir_problem
from quantlens.errors import QuantLensError, QuantLensWarning

__all__ = ["read_progress", "set_aside", "check_out_dir", "is_number_map"]


def is_number_map(value: Any, kind: type = float) -> bool:
    """Whether ``value`` maps strings to finite numbers (``kind=int``: whole numbers)."""
    if not isinstance(value, dict):
        return False
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if (kind is int and not isinstance(v, int)) or not math.isfinite(v):
            return False
    return True


def set_aside(path: Path) -> Path:
    """Rename ``path`` to ``NAME.damaged`` (``NAME.damaged.1``, ... when taken); returns the new path."""
    target = path.with_name(path.name + ".damaged")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged.{n}")
    os.rename(path, target)
    return target


def read_progress(path: Path, fingerprint: str, fmt: int, problem: Callable[[dict], str | None],
                  stacklevel: int) -> dict | None:
    """The progress data at ``path`` when it was written with ``fingerprint`` in format ``fmt`` and
    ``problem(data)`` finds nothing wrong with its fields; else None (after a warning, and a damaged file set
    aside). ``stacklevel``: the warning's, counted from the caller of this function."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        why = None if isinstance(data, dict) else f"holds a JSON {type(data).__name__}, not an object"
    except UnicodeDecodeError:
        data, why = None, "is not UTF-8 text"
    except ValueError as exc:  # json.JSONDecodeError
        data, why = None, f"is not valid JSON ({exc})"
    except OSError as exc:
        raise QuantLensError(f"cannot read the progress file {path}: {exc.strerror or exc}. Make it readable, or "
                             "remove it to start the search afresh.") from None
    if why is None and (data.get("format") != fmt or data.get("fingerprint") != fingerprint):
        if isinstance(data.get("fingerprint"), str):
            warnings.warn(f"{path}: written by a search with other inputs (model, data, evaluate, evaluation "
                          "data, settings); starting afresh.", category=QuantLensWarning, stacklevel=stacklevel + 1)
            return None
        why = "has no fingerprint"
    if why is None:
        why = problem(data)
    if why is None:
        return data
    moved = set_aside(path)
    warnings.warn(f"{path} is damaged ({why}); set aside as {moved.name} and the search starts afresh.",
                  category=QuantLensWarning, stacklevel=stacklevel + 1)
    return None


def check_out_dir(out: Path, who: str) -> None:
    """Refuse an output folder the search cannot write into (a file, a read-only folder), before any work; create
    it otherwise."""
    problem = writable_dir_problem(out)
    if problem is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = f"{out} cannot be created ({exc.strerror or exc})"
    if problem is not None:
        raise QuantLensError(f"{who}: cannot write its files into out_dir: {problem}. Give out_dir a folder that "
                             "can be written (or --out on the command line).")
