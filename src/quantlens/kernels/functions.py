"""The real functions that the march's elementwise tables sample (``docs/march.md`` §13.2, §13.4), in float64.

Which op type uses which function is declared once, in the table-op registry
(:data:`quantlens.quantization.table_registry.TABLE_OP_SPECS`); :func:`real_function` reads it. This module holds
the functions whose real definition differs from the torch op on some inputs (the out-of-domain rules of
§13.4: ``1/0``, ``sqrt`` and ``log`` of negative numbers ...). They are evaluated in float64 and defined on every
input, so a table entry is never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import torch

from quantlens.errors import QuantLensError

__all__ = ["ELEMENTWISE_OPS", "real_function", "int16_uses_table", "reciprocal_fn", "sqrt_fn", "rsqrt_fn",
           "log_fn", "pow_fn"]


def _registry():
    # the registry names the override classes of quantlens.quantization, which import this package: read it
    # when first needed (this package is fully imported by then)
    from quantlens.quantization.table_registry import TABLE_OP_SPECS

    return TABLE_OP_SPECS


class _ElementwiseOps(Sequence):
    """The elementwise table op types (one table per site), read from the registry when first used."""

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, spec in _registry().items() if spec.elementwise)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, Sequence)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


#: op types computed by one elementwise table (reciprocal with an int16 input uses the mantissa rule instead).
ELEMENTWISE_OPS = _ElementwiseOps()


def reciprocal_fn(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` with ``1/0 = +inf``: the table saturates it to the output maximum (``docs/march.md`` §13.5)."""
    return torch.where(x == 0, torch.full_like(x, math.inf), 1.0 / x)


_reciprocal = reciprocal_fn


def sqrt_fn(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)``, and 0 for ``x < 0`` (§13.4)."""
    return torch.sqrt(x.clamp(min=0.0))


def rsqrt_fn(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)``, and ``+inf`` (the output maximum) for ``x <= 0`` (§13.4)."""
    return torch.where(x > 0, torch.rsqrt(torch.where(x > 0, x, 1.0)), math.inf)


def log_fn(x: torch.Tensor) -> torch.Tensor:
    """``log(x)``, and ``-inf`` (the output minimum) for ``x <= 0`` (§13.4)."""
    return torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.0)), -math.inf)


def pow_fn(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``x ** c`` for a constant ``c``. An integer ``c`` is defined for every ``x`` (``0 ** c = +inf`` for
    ``c < 0``); a non-integer ``c`` reads ``max(x, 0)`` (§13.4)."""
    c = float(exponent)
    if c != math.floor(c):
        x = x.clamp(min=0.0)
    return torch.pow(x, c)


def int16_uses_table(op_type: str) -> bool:
    """Whether an int16 input of elementwise op ``op_type`` gets a segmented table (``False``: reciprocal, which
    uses the mantissa rule, §13.5)."""
    spec = _registry().get(op_type)
    return spec is None or spec.int16 == "segmented"


def real_function(op_type: str, **params) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f`` of an elementwise table op as a float64 function (``docs/march.md`` §13.4), from the table-op
    registry. ``params``: the ones the op's registry entry reads from the call (``approximate`` for gelu, ``beta``
    and ``threshold`` for softplus, ``exponent`` for pow, ``alpha`` for elu)."""
    spec = _registry().get(op_type)
    if spec is None or not spec.elementwise:
        known = [name for name, s in _registry().items() if s.elementwise]
        raise QuantLensError(f"No lookup-table function for op type {op_type!r}; known: {known}.")
    return spec.real_function(**params)
