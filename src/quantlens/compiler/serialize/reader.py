"""``load``: read an IR module written by ``save``, refusing what is not one.

The checks run cheapest and safest first: the file type (never open a FIFO or a device), the safetensors header's
bounds, the quantlens header's magic and versions, the tensor offsets (truncation), then the checksum over header
and constants, and last :mod:`.validate` on the header. Every failure is a ``QuantLensError`` naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import torch

from quantlens.compiler.ir import IR_VERSION, Module
from quantlens.compiler.serialize.schema import CHECKSUM_KEY, FORMAT_VERSION, MAGIC, METADATA_KEY, file_checksum
from quantlens.compiler.serialize.validate import InvalidHeader, module_from_header
from quantlens.errors import QuantLensError

_MAX_HEADER_BYTES = 256 * 1024 * 1024


def load(path: str | os.PathLike) -> Module:
    """Read an IR module written by ``save``.

    Raises ``QuantLensError`` naming the file, and nothing else, when it is missing, not a regular file (a FIFO,
    a device), truncated or otherwise damaged (the checksum over header and constants does not match, or the
    header does not describe a valid graph), not a quantlens IR file, or written in another format version.
    """
    path = Path(path)
    try:
        return _load(path)
    except QuantLensError:
        raise
    except OSError as exc:
        raise QuantLensError(f"Cannot load '{path}': it cannot be read ({exc.strerror or exc}).") from exc
    except Exception as exc:  # noqa: BLE001 - load raises QuantLensError only, whatever the file holds
        raise _damaged(path, f"it cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _load(path: Path) -> Module:
    header, text = _read_header(path)
    constants = _read_constants(path, text)
    try:
        return module_from_header(header, constants)
    except (InvalidHeader, QuantLensError) as exc:
        raise _damaged(path, f"its header is invalid: {exc}") from exc


def _damaged(path: Path, what: str) -> QuantLensError:
    return QuantLensError(
        f"Cannot load '{path}': {what}. Expected a quantlens IR file written by quantlens.compiler.save "
        f"(a safetensors file with a '{METADATA_KEY}' metadata header, magic '{MAGIC}', format version "
        f"{FORMAT_VERSION}). The file may be damaged or incomplete; save the module again."
    )


_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular(path: Path, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise QuantLensError(f"Cannot load '{path}': it is a folder, expected a quantlens IR file.")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise QuantLensError(
            f"Cannot load '{path}': it is {kind}, expected a regular quantlens IR file written by "
            "quantlens.compiler.save. load reads regular files only (it never waits on a pipe or a device)."
        )


def _read_header(path: Path) -> tuple[dict, str]:
    """The quantlens header (checked for magic and versions) and its text, as the file holds it."""
    st_header, size, n = _read_safetensors_header(path)
    metadata = _quantlens_metadata(path, st_header)
    text = metadata[METADATA_KEY]
    header = _parse_quantlens_header(path, text)
    _check_magic_and_versions(path, header)
    _check_metadata_entries(path, metadata)
    _check_tensor_offsets(path, st_header, size - 8 - n)
    return header, text


def _read_safetensors_header(path: Path) -> tuple[dict, int, int]:
    """The safetensors JSON header, the file size and the header length ``n`` (the 8-byte prefix).

    The file type is checked before the file is opened (opening a FIFO would block) and again on the file opened;
    the header length must fit the file before the header is read.
    """
    try:
        info = os.stat(path)  # the file type first: opening a FIFO would block
    except FileNotFoundError:
        raise QuantLensError(f"Cannot load '{path}': no such file.") from None
    _check_regular(path, info.st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())  # the file opened may not be the file stat'ed
        _check_regular(path, info.st_mode)
        size = info.st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _damaged(path, f"the file is {size} bytes long, too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n < 2 or n > _MAX_HEADER_BYTES:
            raise _not_ours(path, size, n)
        if n > size - 8:
            raise _damaged(path, f"it is truncated: its safetensors header announces {n} bytes, the file holds "
                                 f"{size - 8} after the 8-byte length")
        raw = handle.read(n)
    try:
        st_header = json.loads(raw.decode("utf-8"))
        if not isinstance(st_header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _damaged(path, f"its safetensors header is not valid JSON ({exc})") from exc
    return st_header, size, n


def _quantlens_metadata(path: Path, st_header: dict) -> dict:
    """The safetensors metadata, which must hold a quantlens header (else: not a quantlens file)."""
    metadata = st_header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise QuantLensError(
            f"Cannot load '{path}': it is a safetensors file without a quantlens IR header (no '{METADATA_KEY}' "
            "entry in its metadata), e.g. a plain weights file. Expected a file written by "
            "quantlens.compiler.save; load weights with safetensors instead."
        )
    return metadata


def _parse_quantlens_header(path: Path, text: Any) -> dict:
    """The quantlens header: a strict JSON object (no NaN / Infinity)."""
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        header = json.loads(text, parse_constant=_no_constant)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:
        raise _damaged(path, f"its '{METADATA_KEY}' header is not valid JSON ({exc})") from exc
    return header


def _check_magic_and_versions(path: Path, header: dict) -> None:
    """The magic, then the file format version (exactly this quantlens's), then the IR version (not newer)."""
    magic = header.get("magic")
    if magic != MAGIC:
        raise QuantLensError(
            f"Cannot load '{path}': its header magic is {str(magic)[:80]!r}, expected {MAGIC!r}. The file was not "
            "written by quantlens.compiler.save."
        )
    _check_format_version(path, header.get("format_version"))
    ir_version = header.get("ir_version")
    if type(ir_version) is not int or ir_version < 1:
        raise _damaged(path, f"its ir_version is {str(ir_version)[:80]!r}, expected an integer >= 1")
    if ir_version > IR_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it holds IR version {ir_version}, and this quantlens knows IR versions up to "
            f"{IR_VERSION}. Upgrade quantlens, or export and save the model again with this version."
        )


def _check_format_version(path: Path, version: Any) -> None:
    if type(version) is not int or version < 1:
        raise _damaged(path, f"its format_version is {str(version)[:80]!r}, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it was written in IR file format version {version}, and this quantlens reads "
            f"version {FORMAT_VERSION}. Upgrade quantlens, or save the module again with this version."
        )
    if version < FORMAT_VERSION:
        raise QuantLensError(
            f"Cannot load '{path}': it was written in IR file format version {version} by an older quantlens, and "
            f"this quantlens reads version {FORMAT_VERSION} only (since version 2 one checksum covers the header "
            "as well as the constants, so a damaged header cannot load as another model). Export and save the "
            "model again with this quantlens."
        )


def _check_metadata_entries(path: Path, metadata: dict) -> None:
    """The metadata holds the header and the checksum, and nothing else."""
    if not isinstance(metadata.get(CHECKSUM_KEY), str):
        raise _damaged(path, f"its metadata has no '{CHECKSUM_KEY}' checksum")
    extra = sorted(set(metadata) - {METADATA_KEY, CHECKSUM_KEY})
    if extra:  # save writes these two entries only; the checksum cannot vouch for others
        raise _damaged(path, f"its metadata has entries save does not write: {[str(k)[:40] for k in extra[:5]]}")


def _check_tensor_offsets(path: Path, st_header: dict, data_size: int) -> None:
    """Tensor entries must lie inside the file: catches truncation before safetensors maps the file."""
    end = 0
    for key, entry in st_header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor entry {str(key)[:80]!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if end > data_size:
        raise _damaged(path, f"it is truncated: its tensors need {end} data bytes, the file holds {data_size}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


def _not_ours(path: Path, size: int, n: int) -> QuantLensError:
    with open(path, "rb") as handle:
        start = handle.read(64)
    if start.lstrip()[:1] in (b"{", b"["):
        kind = "a JSON/text file"
    elif all(32 <= b < 127 or b in (9, 10, 13) for b in start):
        kind = "a text file"
    else:
        kind = "not a safetensors file (or a truncated one)"
    return QuantLensError(
        f"Cannot load '{path}': {kind}; its first 8 bytes announce a {n}-byte header but the file has {size} bytes. "
        f"Expected a quantlens IR file written by quantlens.compiler.save (safetensors with a '{METADATA_KEY}' "
        f"header, magic '{MAGIC}')."
    )


def _read_constants(path: Path, text: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file, once the checksum over the header text and the tensors matches."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            constants = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for broken files
        raise _damaged(path, f"its tensor data cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from exc
    if metadata.get(METADATA_KEY) != text:  # safetensors and json read the safetensors header differently
        raise _damaged(path, "its safetensors header is ambiguous (safetensors reads another quantlens header)")
    if metadata.get(CHECKSUM_KEY) != file_checksum(text, constants):
        raise _damaged(path, "its checksum does not match its contents (the header or the tensor data changed)")
    return constants
