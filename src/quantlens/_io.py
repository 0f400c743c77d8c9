"""Small file helpers shared by every writer: atomic text writes and plain-text tables."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from quantlens.errors import DiskFullError, NotWritableError, QuantLensError

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_bytes", "format_table", "write_error", "check_writable"]


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:  # nothing was written yet
        worded = write_error(exc, path, size or 0)
        if worded is None:
            raise
        raise worded from None
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
        worded = write_error(exc, path, size or written)
        if worded is not None:
            raise worded from exc
        raise
    return path


#: the errors of a write refused where it goes: a read-only disk, no permission, a file where a folder belongs
#: (ENOTDIR, EEXIST from mkdir) or a folder where a file belongs (EISDIR)
_NOT_WRITABLE = {errno.EROFS: "is on a read-only disk", errno.EACCES: "is not writable (permission denied)",
                 errno.EPERM: "is not writable (operation not permitted)",
                 errno.ENOTDIR: "lies under a path that is a file, not a folder",
                 errno.EEXIST: "cannot be made: a file of that name is in the way",
                 errno.EISDIR: "is a folder where a file belongs"}


def write_error(exc: BaseException, path: str | os.PathLike, needed: int = 0) -> QuantLensError | None:
    """The error in words that ``exc``, raised by a write of ``path``, stands for: a :class:`DiskFullError` for a
    full disk, a :class:`NotWritableError` for a read-only folder, a file where a folder belongs, no permission;
    None for anything else (which propagates as it is)."""
    path = Path(path)
    if isinstance(exc, QuantLensError):
        return None
    full = _no_space(exc, path, needed)
    if full is not None and isinstance(exc, OSError) and exc.strerror:
        full.args = (f"{full} The system said: {exc.strerror}.",)
    if full is not None or not isinstance(exc, OSError) or exc.errno not in _NOT_WRITABLE:
        return full
    where = Path(exc.filename) if exc.filename else path
    return NotWritableError(
        f"cannot write {path.name} in {path.parent}: {where} {_NOT_WRITABLE[exc.errno]}. Write into a writable folder (out_dir=, --out), or "
        "make that one writable. Nothing half-written was left there.", path=str(path), errno=exc.errno)


_ELSEWHERE = "write into a writable folder (out_dir=, --out), or make that one writable"


def check_writable(folder: str | os.PathLike, what: str, fix: str = _ELSEWHERE) -> None:
    """Refuse, before any work, a ``folder`` that cannot take ``what``'s files: not writable, in the way of a file,
    or on a disk with (almost) no space left. ``fix``: how to fix it, for the message. Creates nothing."""
    folder = Path(folder)
    problem = writable_dir_problem(folder)
    if problem is not None:
        raise NotWritableError(f"{what}: {folder} cannot hold its files: {problem}. To fix it, {fix}.",
                               path=str(folder), errno=errno.EROFS if _read_only(folder) else errno.EACCES)
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = _free_bytes(probe)
    if free is not None and free < _LOW_SPACE:
        raise DiskFullError(f"{what}: no space left to write into {folder} ({free} bytes free). To fix it, free "
                            f"space on that disk (or quota), or {fix}. Nothing was written.", folder=str(folder),
                            path=str(folder), needed=None, free=free)


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
        why = "is on a read-only disk" if _read_only(probe) else "is not writable"
        return f"{probe} {why}" + ("" if probe == path else f", so the folder {path} cannot be created")
    return None


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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

    blob = save(_unshared(tensors), metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) > n:  # cannot happen (the same entries, compact): keep safetensors' own bytes
        return blob
    return blob[:8] + text + b" " * (n - len(text)) + blob[8 + n:]



def _unshared(tensors: dict) -> dict:
    """``tensors`` with each one that shares memory with an earlier entry copied: safetensors refuses shared
    storage, and a model's state dict has it wherever weights are tied (an embedding and its LM head, BART's
    encoder and decoder embeddings). Each name keeps its own values; loading writes them back through every alias."""
    import torch

    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
        out[name] = t
    return out
