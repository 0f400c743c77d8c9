"""The one exception type quantlens raises for bad input or unsupported models."""

__all__ = ["QuantLensError"]


class QuantLensError(Exception):
    """A problem the user can fix: the message says what was wrong, where, what was expected and how to fix it."""
