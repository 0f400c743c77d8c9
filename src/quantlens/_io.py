"""Small file helpers shared by every writer: atomic text writes and plain-text tables."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from quantlens.errors import DiskFullError

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_bytes", "format_table"]


#: the errors of a write that ran out of space (a full disk, a quota, a file-size limit)
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: below this many free bytes, a failed write is taken as a full disk whatever the writer said (torch's zip writer
#: reports one as ``RuntimeError: ... unexpected pos 704 vs 598``)
_LOW_SPACE = 1 << 20


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], fsync: bool = False,
                 size: int | None = None) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it over ``path``.

    Every writer of quantlens goes through here, so no half-written file is ever left: on any error the
    temporary file is removed and ``path`` is untouched. A write that runs out of space raises
    :class:`~quantlens.errors.DiskFullError` naming the folder, the file, the bytes needed (``size``, where the
    caller knows it) and the bytes free.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; the file gets what open() would have given it
        if fsync:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = _no_space(exc, path, size or written)
        if full is not None:
            raise full from exc
        raise
    return path


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _no_space(exc: BaseException, path: Path, needed: int) -> DiskFullError | None:
    """The :class:`DiskFullError` that ``exc`` (raised by a write of ``path``) stands for, or None."""
    if not isinstance(exc, (OSError, RuntimeError)):
        return None
    folder = path.parent
    free = _free_bytes(folder)
    if not ((isinstance(exc, OSError) and exc.errno in _NO_SPACE) or (free is not None and free < _LOW_SPACE)):
        return None
    need = f"{needed} bytes needed" if needed else "its size is not known before writing"
    have = "free space unknown" if free is None else f"{free} bytes free"
    return DiskFullError(
        f"no space left to write {path.name} in {folder} ({need}, {have}): free space on that disk (or quota), or write into a folder on another disk "
        "(out_dir=, --out). Nothing half-written was left there.",
        folder=str(folder), path=str(path), needed=needed or None, free=free)


def writable_dir_problem(path: str | os.PathLike) -> str | None:
    """Why files cannot be written into the folder ``path`` (created on the first write when missing), or
    None when they can. Checks only: creates nothing."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return (f"{path} is a symbolic link to {os.readlink(path)}, which does not exist (a dangling link): create "
                "that folder, or remove the link")
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a folder"
    probe = path
    while not probe.exists():  # the folder is made on the first write: its nearest existing ancestor must allow it
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file, so the folder {path} cannot be created"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" + ("" if probe == path else f", so the folder {path} cannot be created")
    return None


def _umask() -> int:
    """The process umask: from /proc where it can be read, else by setting it and straight back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) atomically."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), size=len(data))


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = False) -> Path:
    """Write ``data`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), fsync=fsync, size=len(data))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A psql-style text table (stable, diff-friendly)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    out = [sep, line(cells[0]), sep] + [line(r) for r in cells[1:]] + [sep]
    return "\n".join(out)


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """``tensors`` (and ``metadata``) in the safetensors format, byte-identical for the same inputs.

    safetensors writes its JSON header from a hash map, so the order of its entries (the metadata's keys above
    all) varies from call to call. The header is rewritten with sorted keys, padded with spaces to its former
    length (the format allows trailing spaces): the data offsets, relative to the end of the header, stay valid."""
    import json

    from safetensors.torch import save

    blob = save(tensors, metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > n:  # cannot happen (the same entries, compact): keep safetensors' own bytes
        return blob
    return blob[:8] + text + b" " * (n - len(text)) + blob[8 + n:]

