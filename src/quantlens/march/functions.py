"""The real functions that the march's elementwise tables sample (``docs/march.md`` §13.2, §13.4), in float64.

:data:`TABLE_FUNCTIONS` declares, once, the spec half of each elementwise table op: the float op the prepared
model computes, the real function its tables sample (where the two differ: the out-of-domain rules of §13.4,
``1/0``, ``sqrt`` and ``log`` of negative numbers ...) with the parameters it reads, and what an int16 input gets.
The table-op registry (:data:`quantlens.quantization.table_registry.TABLE_OP_SPECS`) adds the quantization half
(call parameters, site override) to each entry. The functions are evaluated in float64 and defined on every
input, so a table entry is never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.march.opset import OPS

__all__ = ["TableFunction", "TABLE_FUNCTIONS", "ELEMENTWISE_OPS", "real_function", "int16_uses_table",
           "reciprocal_fn", "sqrt_fn", "rsqrt_fn", "log_fn", "pow_fn"]


def reciprocal_fn(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` with ``1/0 = +inf``: the table saturates it to the output maximum (``docs/march.md`` §13.5)."""
    return torch.where(x == 0, torch.full_like(x, math.inf), 1.0 / x)


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


@dataclass(frozen=True)
class TableFunction:
    """The spec half of one elementwise table op (one table per site on one input, §13.4)."""

    op_type: str
    #: the float op of the prepared model, ``torch_op(x, **params)`` (its keyword arguments are the parameters
    #: the tables depend on)
    torch_op: Callable[..., torch.Tensor]
    #: the real function the table samples, ``function(x, **params)`` in float64 (§13.4); ``None``: ``torch_op``
    #: (the two agree on every input)
    function: Callable[..., torch.Tensor] | None = None
    #: what an int16 input gets: ``"segmented"`` (§13.3) or ``"mantissa_reciprocal"`` (§13.5)
    int16: str = "segmented"

    def real_function(self, **params) -> Callable[[torch.Tensor], torch.Tensor]:
        """``f`` of the table (float64), for the given parameters."""
        fn = self.function or self.torch_op
        return lambda x: fn(x, **params)


_FUNCTIONS = [
    # the float op, then (where it differs) the real function with its out-of-domain rule
    TableFunction("sigmoid", lambda x: torch.sigmoid(x)),
    TableFunction("tanh", lambda x: torch.tanh(x)),
    TableFunction("exp", lambda x: torch.exp(x)),
    TableFunction("gelu", lambda x, approximate="none": F.gelu(x, approximate=approximate)),
    TableFunction("silu", lambda x: F.silu(x)),
    TableFunction("softplus", lambda x, beta=1.0, threshold=20.0: F.softplus(x, beta=float(beta),
                                                                             threshold=float(threshold))),
    TableFunction("reciprocal", lambda x: torch.reciprocal(x), lambda x: reciprocal_fn(x),
                  int16="mantissa_reciprocal"),
    TableFunction("sqrt", lambda x: torch.sqrt(x), lambda x: sqrt_fn(x)),
    TableFunction("rsqrt", lambda x: torch.rsqrt(x), lambda x: rsqrt_fn(x)),
    TableFunction("log", lambda x: torch.log(x), lambda x: log_fn(x)),
    TableFunction("pow", lambda x, exponent: torch.pow(x, exponent), pow_fn),
    TableFunction("erf", lambda x: torch.erf(x)),
    TableFunction("hardswish", lambda x: F.hardswish(x)),
    TableFunction("hardsigmoid", lambda x: F.hardsigmoid(x)),
    TableFunction("elu", lambda x, alpha=1.0: F.elu(x, alpha=float(alpha))),
]

#: every elementwise table op type -> its :class:`TableFunction` (in the table-op registry's order)
TABLE_FUNCTIONS: dict[str, TableFunction] = {f.op_type: f for f in _FUNCTIONS}

#: op types computed by one elementwise table (reciprocal with an int16 input uses the mantissa rule instead).
ELEMENTWISE_OPS: tuple[str, ...] = tuple(TABLE_FUNCTIONS)


def int16_uses_table(op_type: str) -> bool:
    """Whether an int16 input of elementwise op ``op_type`` gets a segmented table (``False``: reciprocal, which
    uses the mantissa rule, §13.5; and the table ops that are not elementwise)."""
    entry = TABLE_FUNCTIONS.get(op_type)
    if entry is None:
        op = OPS.get(op_type)
        return op is None or not op.table
    return entry.int16 == "segmented"


def real_function(op_type: str, **params) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f`` of an elementwise table op as a float64 function (``docs/march.md`` §13.4), from
    :data:`TABLE_FUNCTIONS`. ``params``: the ones the op reads from the call (``approximate`` for gelu, ``beta``
    and ``threshold`` for softplus, ``exponent`` for pow, ``alpha`` for elu)."""
    entry = TABLE_FUNCTIONS.get(op_type)
    if entry is None:
        raise QuantLensError(f"No lookup-table function for op type {op_type!r}; known: {list(ELEMENTWISE_OPS)}.")
    return entry.real_function(**params)
