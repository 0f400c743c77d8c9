"""The exception types quantlens raises for problems the user can fix: bad input, unsupported models, a full disk."""

from __future__ import annotations

from typing import Any

__all__ = ["QuantLensError", "DiskFullError", "NotWritableError", "QuantLensWarning"]


class QuantLensError(Exception):
    """A problem the user can fix: the message says what was wrong, where, what was expected and how to fix it."""


class QuantLensWarning(UserWarning):
    """A warning of quantlens itself (a library's own warnings keep their category: the command line prints them as
    that library's, not as quantlens' findings)."""


class DiskFullError(QuantLensError):
    """A file could not be written for lack of space (a full disk or quota). The message names the folder, the file,
    the bytes needed where known and the bytes free; nothing half-written is left. ``result`` holds what the call
    had computed before it wrote its files (a comparison, a sensitivity result), so a full disk loses no
    computation: ``except DiskFullError as e: table = e.result``."""

    def __init__(self, message: str, *, folder: str, path: str, needed: int | None, free: int | None):
        super().__init__(message)
        self.folder, self.path, self.needed, self.free = folder, path, needed, free
        self.result: Any = None

    def keeping(self, result: Any) -> DiskFullError:
        """This error, holding ``result`` (what was computed before the write failed)."""
        self.result = result
        return self


class NotWritableError(QuantLensError, PermissionError):
    """A file or folder could not be written where it belongs: a read-only folder or disk, a file where a folder
    belongs (or a folder where a file does), no permission. The message names the path, the cause and the fix;
    nothing half-written is left. A ``PermissionError`` too (``errno`` is the cause's), so code that catches
    ``OSError`` around a write keeps working."""

    def __init__(self, message: str, *, path: str, errno: int | None = None):
        super().__init__(errno, message)
        self.message, self.path = message, path

    def __str__(self) -> str:  # (OSError's would read "[Errno 30] ...")
        return self.message
