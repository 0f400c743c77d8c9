"""Normalisation of IR attrs that torch gives as one value or one per spatial dim (kernel sizes, strides,
scale factors), shared by the converter families."""

from __future__ import annotations

from typing import Any


def _pair(value: Any, n: int) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in (values * n if len(values) == 1 else values)]


def _pair_f(value: Any) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * 2 if len(values) == 1 else values
