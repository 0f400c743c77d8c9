"""Integer kernels of the RMS norm, the L2 normalization and the L2 vector norm (``docs/march.md`` §13.7.1, §13.7.2).

* ``int_rms_norm`` is the layer norm's kernel (§13.7) without the mean: ``c = q · 2**P``, ``V = sum(c**2) +
  eps_term``, the mantissa rsqrt, ``u ~ c / sqrt(V) · 2**23``, ``y = rhe(u · gain + bias, T)``. Its constants are
  the layer norm's: ``gain = rhe(sqrt(N) · gamma / s_out · 2**(T - 23))`` and ``eps_term = rhe(N · eps · 2**(2P) /
  s_in**2)`` (``rms_norm``); ``F.normalize`` (``x / ||x||``) is the same kernel with ``gamma = 1 / sqrt(N)`` and
  ``eps²`` for ``eps`` (:func:`normalize_constants`).
* ``int_vector_norm``: ``S = sum(q**2)`` (exact int64), its mantissa ``m = S · 2**-2k`` in ``[2**22, 2**24)``,
  ``t = rhe(m · S(m), 23) ~ sqrt(m) · 2**11`` by the rsqrt mantissa table ``S(m) ~ 2**34 / sqrt(m)``, then
  ``y = sat(rhe(t · M, shift + 11 - k))`` with ``(M, shift)`` the 31-bit multiplier of ``s_in / s_out``
  (``quantlens.march.rules.vector_norm``); ``S = 0`` gives 0 and a total shift below 0 saturates.
"""

from __future__ import annotations

import math

import torch

from quantlens.errors import QuantLensError
from quantlens.kernels.int_ops import (
    MANTISSA_BITS,
    LayerNormConstants,
    int_layer_norm,
    layer_norm_constants,
    mantissa_lookup,
    normalize_mantissa,
)
from quantlens.kernels.int_rounding import bit_length, rshift_rhe_var
from quantlens.kernels.tables import rsqrt_mantissa_table
from quantlens.march import QuantDType

__all__ = ["rms_norm_constants", "normalize_constants", "int_rms_norm", "int_vector_norm", "VECTOR_NORM_ROOT_BITS"]

#: int_vector_norm: ``t ~ sqrt(m) · 2**VECTOR_NORM_ROOT_BITS``, the square root of the sum's mantissa
VECTOR_NORM_ROOT_BITS = 11
RSQRT_TO_ROOT = 23  # m · S(m) ~ sqrt(m) · 2**34; rhe by 2**23 leaves sqrt(m) · 2**11


def rms_norm_constants(s_in: float, s_out: float, in_dtype: QuantDType, num_elements: int,
                       gamma: torch.Tensor | None, eps: float) -> LayerNormConstants:
    """The layer norm's constants (§13.7) with no beta: ``y = x / sqrt(mean(x**2) + eps) · gamma``."""
    return layer_norm_constants(s_in, s_out, in_dtype, num_elements, gamma, None, eps)


def normalize_constants(s_in: float, s_out: float, in_dtype: QuantDType, num_elements: int,
                        eps: float) -> LayerNormConstants:
    """``y = x / sqrt(sum(x**2) + eps**2)`` (``F.normalize``, p = 2): the RMS norm's constants with ``gamma =
    1 / sqrt(N)`` (so the gain is ``1 / s_out``) and ``eps**2 / N`` for its eps."""
    n = int(num_elements)
    gamma = torch.full((n,), 1.0 / math.sqrt(n), dtype=torch.float64)
    return layer_norm_constants(s_in, s_out, in_dtype, n, gamma, None, float(eps) ** 2 / n)


def int_rms_norm(q: torch.Tensor, normalized_ndim: int, gain: torch.Tensor, bias: torch.Tensor, eps_term: int,
                 frac_bits: int, shift: int, out_dtype: QuantDType) -> torch.Tensor:
    """Integer RMS norm over the last ``normalized_ndim`` dims: :func:`int_layer_norm` with ``mu = 0``."""
    return int_layer_norm(q, normalized_ndim, gain, bias, eps_term, frac_bits, shift, out_dtype, center=False)


def int_vector_norm(q: torch.Tensor, dims: list[int] | None, keepdim: bool, multiplier: int, shift: int,
                    out_dtype: QuantDType) -> torch.Tensor:
    """Integer ``||x||_2`` over ``dims`` (all when ``None`` or empty): see the module docstring."""
    x = q.to(torch.int64)
    dims = list(range(x.dim())) if not dims else [int(d) for d in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    if count and count * (1 << 30) >= (1 << 62):
        raise QuantLensError(f"int_vector_norm over {count} elements could overflow its 64-bit sum of squares; "
                             "take the norm over fewer elements.")
    s = (x * x).sum(dim=dims, keepdim=bool(keepdim)) if x.dim() else x * x
    v = s.clamp(min=1)
    k = torch.div(bit_length(v) - (MANTISSA_BITS - 1), 2, rounding_mode="floor")
    mant, over = normalize_mantissa(v, 2 * k, 1 << (MANTISSA_BITS - 2))
    k = k + over.to(torch.int64)
    r = mantissa_lookup(rsqrt_mantissa_table(), mant)
    t = rshift_rhe_var(mant * r, RSQRT_TO_ROOT)  # < 2**24: mant < 2**24, r <= 2**23 + small
    total = int(shift) + VECTOR_NORM_ROOT_BITS - k
    y = rshift_rhe_var(t * int(multiplier), total.clamp(min=0))  # t * M < 2**55
    y = torch.where(total < 0, torch.full_like(y, out_dtype.qmax), y)
    y = torch.where(s == 0, torch.zeros_like(y), y)
    return y.clamp_(out_dtype.qmin, out_dtype.qmax)
