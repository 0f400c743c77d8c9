"""The real functions that the march's elementwise tables sample (``docs/march.md`` §13.2), in float64."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError

__all__ = ["ELEMENTWISE_OPS", "real_function"]

#: op types computed by one elementwise table (reciprocal with an int16 input uses the mantissa rule instead).
ELEMENTWISE_OPS = ("sigmoid", "tanh", "exp", "gelu", "silu", "softplus", "reciprocal")


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # 1/0 is +inf: the table saturates it to the output maximum (docs/march.md §13.5).
    return torch.where(x == 0, torch.full_like(x, math.inf), 1.0 / x)


def real_function(op_type: str, **params) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f`` of an elementwise table op as a float64 function. ``params``: ``approximate`` (gelu),
    ``beta`` and ``threshold`` (softplus)."""
    if op_type == "sigmoid":
        return torch.sigmoid
    if op_type == "tanh":
        return torch.tanh
    if op_type == "exp":
        return torch.exp
    if op_type == "silu":
        return F.silu
    if op_type == "gelu":
        approximate = params.get("approximate", "none")
        return lambda x: F.gelu(x, approximate=approximate)
    if op_type == "softplus":
        beta, threshold = float(params.get("beta", 1.0)), float(params.get("threshold", 20.0))
        return lambda x: F.softplus(x, beta=beta, threshold=threshold)
    if op_type == "reciprocal":
        return _reciprocal
    raise QuantLensError(f"No lookup-table function for op type {op_type!r}; known: {list(ELEMENTWISE_OPS)}.")
