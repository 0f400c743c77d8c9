"""A trace folder's life: a new trace is written into a sibling staging folder and swapped in when complete,
and only the files quantlens writes there are ever removed or replaced (a user's notes stay)."""

from __future__ import annotations

import glob
import os
import re
import tempfile
from pathlib import Path

from quantlens.errors import QuantLensError
from quantlens.profiler.trace.format import OUTPUTS_FILE, STATISTIC_FILE, TENSORS_DIR, TRACE_FILE

#: the names a trace folder's writers give their files; nothing else in the folder is ever removed
_OWN_TOP = {TRACE_FILE, OUTPUTS_FILE, STATISTIC_FILE}
_OWN_TENSOR = re.compile(r"\d{5,}\.safetensors")
_OWN_TEMP = re.compile(r"\.(\d{5,}\.safetensors|" + "|".join(re.escape(n) for n in sorted(_OWN_TOP))
                       + r")\.\w+\.tmp")


def _own_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(files written by quantlens, other entries) of a trace folder, ``tensors/`` looked into."""
    own, foreign = [], []
    if not folder.is_dir():
        return own, foreign
    for entry in folder.iterdir():
        if entry.name == TENSORS_DIR and entry.is_dir() and not entry.is_symlink():
            for inner in entry.iterdir():
                ours = inner.is_file() and (_OWN_TENSOR.fullmatch(inner.name) or _OWN_TEMP.fullmatch(inner.name))
                (own if ours else foreign).append(inner)
        elif entry.is_file() and (entry.name in _OWN_TOP or _OWN_TEMP.fullmatch(entry.name)):
            own.append(entry)
        else:
            foreign.append(entry)
    return own, foreign


def _remove_own(folder: Path) -> bool:
    """Remove quantlens' files from a trace folder (and the folders left empty); True when it is gone."""
    own, foreign = _own_files(folder)
    for path in own:
        path.unlink(missing_ok=True)
    for path in (folder / TENSORS_DIR, folder):
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    return not folder.exists()


def staging_dir(target: Path) -> Path:
    """An empty sibling folder, of a name unique to this run, for a trace being written (the leftovers of
    interrupted runs are cleared of quantlens' own files; one holding anything else is left alone)."""
    if target.exists() and not target.is_dir():
        raise QuantLensError(f"{target} is a file, not a folder; a trace is a folder there. Move the file away or "
                             "pass another out_dir.")
    _refuse_links(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # leftovers of interrupted runs (the caller holds the out_dir's lock, so no live run owns one): cleared of
    # quantlens' own files; one holding anything else is left alone
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.partial*"):
        if leftover.is_dir() and not leftover.is_symlink():
            _remove_own(leftover)
    # a unique name per run, never one another run could be writing into
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-{os.getpid()}-"))


def remove_staging(staging: Path) -> None:
    """Remove a staging folder's files after a failed run (a full disk gets its space back); what cannot be
    removed is left to the next run's :func:`staging_dir`."""
    try:
        _remove_own(staging)
    except OSError:
        pass


def _refuse_links(target: Path) -> None:
    """A trace folder, its ``tensors/`` or a file quantlens replaces there that is a symbolic link would send the
    trace's files wherever it points, outside the out_dir: refused, before anything is computed."""
    names = [target, target / TENSORS_DIR, *(target / n for n in sorted(_OWN_TOP))]
    link = next((p for p in names if p.is_symlink()), None)
    if link is not None:
        raise QuantLensError(
            f"{link} is a symbolic link (to {os.readlink(link)}); quantlens never writes a trace through a link, which "
            "would put its files outside the out_dir. Remove the link (or replace it by a folder), or pass another "
            "out_dir.")


def swap_in(staging: Path, target: Path) -> None:
    """Move the complete trace in ``staging`` to ``target``. A target holding only quantlens' files is replaced
    by two renames; one with other files too gets the new files moved in (the old index is removed first and
    the new one moved last, so the folder never holds a trace mixed from two runs) and keeps the others."""
    _refuse_links(target)  # (made since the run began)
    own, foreign = _own_files(target)
    if not target.exists() or (not foreign and target.is_dir() and not target.is_symlink()):
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            old.rmdir()
            os.replace(target, old)
        os.replace(staging, target)
        if old is not None:
            _remove_own(old)
        return
    (target / TRACE_FILE).unlink(missing_ok=True)
    new_names = set()
    (target / TENSORS_DIR).mkdir(exist_ok=True)
    for path in sorted((staging / TENSORS_DIR).iterdir()):
        new_names.add(path.name)
        os.replace(path, target / TENSORS_DIR / path.name)
    for path in own:  # the previous trace's files that the new one does not overwrite
        in_tensors = path.parent != target
        if (in_tensors and path.name not in new_names) or path.name == STATISTIC_FILE or \
                _OWN_TEMP.fullmatch(path.name):
            path.unlink(missing_ok=True)
    os.replace(staging / OUTPUTS_FILE, target / OUTPUTS_FILE)
    os.replace(staging / TRACE_FILE, target / TRACE_FILE)
    _remove_own(staging)
