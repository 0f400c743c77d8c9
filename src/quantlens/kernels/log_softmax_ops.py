"""Integer kernel of ``log_softmax`` (``docs/march.md`` §13.6.1): the softmax's exp table and exact sum, the ``ln``
of that sum by its 24-bit mantissa and exponent, and one rounded shift onto the output grid.

``log_softmax(x) = (x - max) - ln(sum(exp(x - max)))``, on input codes ``q`` at ``s_x``:

* ``d = q - max(q)``, ``e = E(d)`` (the softmax exp table, ``~ exp(d · s_x) · 2**X``), ``S = sum(e)`` (§13.6);
* ``S ~ m · 2**k`` (``m`` in ``[2**23, 2**24)``, §13.1), so ``ln(S · 2**-X) = ln(m · 2**-23) + (k + 23 - X) · ln 2``:
  ``L = LN(m) + (k + 23 - X) · LN2``, at ``2**-24`` (the ln mantissa table ``LN``, ``LN2 = rhe(ln 2 · 2**24)``);
* ``y = sat(rshift_rhe(d · M_x - L · M_l, T))``, the multipliers and shift of ``quantlens.march.rules.log_softmax``.

Every ``d <= 0`` and ``L >= 0`` (``S >= E(0) = 2**X``), so ``y <= 0``.
"""

from __future__ import annotations

import torch

from quantlens.kernels.int_ops import MANTISSA_BITS, exp_bits, exp_row_sums, mantissa_lookup, sum_mantissa
from quantlens.kernels.int_rounding import rshift_rhe_var
from quantlens.kernels.tables import SegmentedTable, Table256, ln_mantissa_table
from quantlens.march import QuantDType

__all__ = ["int_log_softmax", "log_sum_exp", "LN2_FIXED"]

#: ``rhe(ln 2 · 2**24)``: the ln mantissa table's last entry, ``LN(2**24)``
LN2_FIXED = 11629080
#: ``|d · M_x - L · M_l| < 2**61`` (``quantlens.march.rules.log_softmax``): the rounded shift's short formula
_ACC_BOUND = float(1 << 61)


def log_sum_exp(s: torch.Tensor, x_bits: int) -> torch.Tensor:
    """``L ~ ln(S · 2**-X) · 2**24`` (int64) of exp sums ``S`` (float64 integers in ``[2**X, 2**40)``):
    ``LN(m) + (k + 23 - X) · LN2`` with ``(m, k) = sum_mantissa(S)``; ``0 <= L < 2**29``."""
    mant, k = sum_mantissa(s)
    return mantissa_lookup(ln_mantissa_table(), mant) + (k + (MANTISSA_BITS - 1 - x_bits)) * LN2_FIXED


def int_log_softmax(
    q: torch.Tensor, dim: int, exp_table: Table256 | SegmentedTable, multiplier: int, ln_multiplier: int,
    shift: int, out_dtype: QuantDType,
) -> torch.Tensor:
    """Integer log_softmax along ``dim`` (``docs/march.md`` §13.6.1). ``q``: input codes; returns output codes.

    ``d = q - max(q)``; ``S = sum(E(d))``; ``L = log_sum_exp(S)``; ``y = sat(rshift_rhe(d · M_x - L · M_l, T))``.
    """
    q, amax, _, s, _ = exp_row_sums(q, dim, exp_table, "log_softmax")
    ln_s = log_sum_exp(s, exp_bits(out_dtype))
    d = q.to(torch.int64) - amax
    # |d| < 2**16 with M_x <= 2**44, and L < 2**29 with M_l <= 2**31: both products stay below 2**60
    acc = d.mul_(int(multiplier)).sub_(ln_s * int(ln_multiplier))
    return rshift_rhe_var(acc, int(shift), bound=_ACC_BOUND).clamp_(out_dtype.qmin, out_dtype.qmax)
