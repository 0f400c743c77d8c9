"""The one number format of every report (text, CSV, HTML): the reports and the pages both read it, so neither
imports the other for it."""

from __future__ import annotations

import math

__all__ = ["fmt"]


def fmt(value) -> str:
    """Stable number formatting for every report: 7 significant digits, '' for missing values."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.7g}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
    return str(value)
