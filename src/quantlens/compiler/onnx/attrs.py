"""Normalisation of IR attrs that torch gives as one value or one per spatial dim (kernel sizes, strides,
scale factors), shared by the converter families."""

from __future__ import annotations

from typing import Any


def int_pair(value: Any, n: int) -> list[int]:
    """An int attr as ``n`` ints (one value repeated per spatial dim), as ONNX attrs list them."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in (values * n if len(values) == 1 else values)]


def float_pair(value: Any) -> list[float]:
    """A float attr as two floats (one value repeated for both spatial dims)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * 2 if len(values) == 1 else values
