"""Integer kernels of the table ops (``docs/march.md`` §13), on integer tensors.

Each op has two halves:

* a *constants* function, run once when ``pre_export`` builds a site (tables, multipliers, shifts), from the
  float32 scales and the op's parameters, in float64;
* an *integer kernel*: pure integer arithmetic on int64 tensors, called by ``pre_export``'s custom ops and by the
  integer simulator alike, so both produce the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantlens.errors import QuantLensError
from quantlens.kernels.int_rounding import bit_length, div_round_half_even, rshift_rhe_var
from quantlens.kernels.tables import (
    SegmentedTable,
    Table256,
    build_segmented_table,
    build_table256,
    recip_mantissa_table,
    rsqrt_mantissa_table,
)
from quantlens.march import Qpp, QuantDType
from quantlens.march.functions import int16_uses_table, real_function
from quantlens.march.numerics import quantize_multiplier, requantize, saturate

__all__ = [
    "SOFTMAX_PROB_BITS",
    "SOFTMAX_EXP_INTERVALS",
    "LN_NORM_BITS",
    "LN_MAX_FRAC_BITS",
    "MAX_SOFTMAX_LENGTH",
    "exp_bits",
    "elementwise_table",
    "softmax_exp_table",
    "softmax_multiplier",
    "exp_table_from",
    "exp_row_sums",
    "sum_mantissa",
    "int_softmax",
    "LayerNormConstants",
    "layer_norm_frac_bits",
    "layer_norm_constants",
    "int_layer_norm",
    "div_multiplier",
    "reciprocal_multiplier",
    "recip_mantissa",
    "int_div",
    "int_reciprocal",
]

#: softmax: intervals per segment of the int16-input exp table (twice a function table's: exp values carry 23
#: bits for int16 outputs).
SOFTMAX_EXP_INTERVALS = 128
#: softmax: probabilities before the output requantize are integers at scale 2**-SOFTMAX_PROB_BITS.
SOFTMAX_PROB_BITS = 31
#: softmax: at most 2**16 elements along the softmax dim (the exp sum stays below 2**40).
MAX_SOFTMAX_LENGTH = 1 << 16
#: layer_norm: the normalized value c / sqrt(V) (in [-1, 1]) is an integer at scale 2**-LN_NORM_BITS.
LN_NORM_BITS = 23
#: layer_norm: at most this many fractional bits in the centred values.
LN_MAX_FRAC_BITS = 8

RECIP_BITS = 46  # R(m) ~ 2**46 / m, m a 24-bit mantissa
RSQRT_BITS = 34  # S(m) ~ 2**34 / sqrt(m)
MANTISSA_BITS = 24  # mantissa bits


def _shift_left_or_right(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``v * 2**-k`` for a per-element ``k``: rounded right shift (``k > 0``) or exact left shift (``k <= 0``)."""
    down = rshift_rhe_var(v, k.clamp(min=0))
    up = torch.bitwise_left_shift(v, (-k).clamp(min=0))
    return torch.where(k > 0, down, up)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """``2.0**n`` (float64, exact) for int64 ``n`` in ``[-1022, 1023]``: the IEEE bits ``(n + 1023) << 52``."""
    return torch.bitwise_left_shift(n.to(torch.int64) + 1023, 52).view(torch.float64)


_MANTISSA_PLANS: dict[int, tuple] = {}


def mantissa_lookup(table: SegmentedTable, m: torch.Tensor) -> torch.Tensor:
    """``table.lookup(m)`` for the one- or two-segment mantissa tables (no tails, no fractional bits), in fewer
    passes, same result: each segment's offset is scaled to the largest step ``2**P`` (``o << (P - p)``), so
    ``j`` and ``r * 2**(P - p)`` come from one shift and mask, and ``rhe(acc * 2**(P - p), P) = rhe(acc, p)``;
    ``acc = (E[j] << P) + (E[j + 1] - E[j]) * r`` (below 2**40: entries <= 2**23, P <= 14)."""
    plan = _MANTISSA_PLANS.get(id(table))
    if plan is None or plan[0] is not table:
        if table.tails is not None or table.frac_bits != 0 or table.num_segments > 2:
            return table.lookup(m)
        big = int(table.shifts.max())
        e = table.entries.to(torch.int64)
        base = torch.bitwise_left_shift(e[:, :-1], big).reshape(-1)
        diff = (e[:, 1:] - e[:, :-1]).reshape(-1)
        plan = (table, big, base, diff, [int(b) for b in table.bounds], [big - int(p) for p in table.shifts],
                e.shape[1] - 1)
        _MANTISSA_PLANS[id(table)] = plan
    _, big, base, diff, bounds, ups, width = plan
    x = m.to(torch.int64).clamp(bounds[0], bounds[-1] - 1)
    if len(ups) == 1:
        o = torch.bitwise_left_shift(x - bounds[0], ups[0])
        j = torch.bitwise_right_shift(o, big)
    else:
        seg = (x >= bounds[1]).to(torch.int64)
        o = torch.bitwise_left_shift(x - (bounds[0] + seg * (bounds[1] - bounds[0])), ups[0] + seg * (ups[1] - ups[0]))
        j = torch.bitwise_right_shift(o, big)
        o = o - torch.bitwise_left_shift(j, big)
        j = j + seg * width
    r = torch.bitwise_and(o, (1 << big) - 1) if len(ups) == 1 else o
    acc = torch.addcmul(base.to(m.device)[j], diff.to(m.device)[j], r)
    return rshift_rhe_var(acc, big, bound=float(1 << 40)).clamp_(table.out_min, table.out_max)


# ------------------------------------------------------------------------------------------------------------
# elementwise


def elementwise_table(
    op_type: str, s_in: float, s_out: float, in_dtype: QuantDType, out_dtype: QuantDType, **params
) -> Table256 | SegmentedTable:
    """The table of an elementwise op (``docs/march.md`` §13.2 / §13.3).

    ``fn(q) = f(q * s_in) / s_out`` in float64 (``q * s_in`` is exact). An int8 input gets a :class:`Table256`,
    an int16 input a :class:`SegmentedTable` on ``[-32768, 32767]``. (``reciprocal`` with an int16 input uses
    the mantissa rule instead: :func:`int_reciprocal`.)
    """
    f = real_function(op_type, **params)
    s_in, s_out = float(s_in), float(s_out)

    def fn(q: torch.Tensor) -> torch.Tensor:
        return f(q.to(torch.float64) * s_in) / s_out

    if in_dtype is QuantDType.qint8:
        return build_table256(fn, out_dtype.qmin, out_dtype.qmax, offset=128)
    if in_dtype is QuantDType.qint16:
        if not int16_uses_table(op_type):
            raise QuantLensError(f"{op_type} with an int16 input uses the mantissa rule, not a table.")
        return build_segmented_table(fn, in_dtype.qmin, in_dtype.qmax, out_dtype.qmin, out_dtype.qmax)
    raise QuantLensError(f"A lookup table needs an int8 or int16 input, got {in_dtype.value}.")


# ------------------------------------------------------------------------------------------------------------
# softmax


def exp_bits(out_dtype: QuantDType) -> int:
    """Softmax exp values are integers at scale ``2**-X``, ``X = 7 + output bits``: 15 (int8), 23 (int16)."""
    return 7 + out_dtype.bits


def softmax_exp_table(s_in: float, in_dtype: QuantDType, out_dtype: QuantDType) -> Table256 | SegmentedTable:
    """``E(d) ~ exp(d * s_in) * 2**X`` for ``d = q - max(q) <= 0`` (``X = exp_bits(out_dtype)``).

    int8 input: ``d`` in ``[-255, 0]``, a :class:`Table256` with offset 255 (``entries[d + 255]``).
    int16 input: ``d`` in ``[-65535, 0]``, a :class:`SegmentedTable` with output range ``[0, 2**X]`` and
    ``SOFTMAX_EXP_INTERVALS`` intervals per segment.
    """
    s_in = float(s_in)
    x_bits = exp_bits(out_dtype)
    one = float(1 << x_bits)

    def fn(d: torch.Tensor) -> torch.Tensor:
        return torch.exp(d.to(torch.float64) * s_in) * one

    if in_dtype is QuantDType.qint8:
        return build_table256(fn, 0, 1 << x_bits, offset=255)
    if in_dtype is QuantDType.qint16:
        return build_segmented_table(fn, -65535, 0, 0, 1 << x_bits, intervals=SOFTMAX_EXP_INTERVALS)
    raise QuantLensError(f"softmax needs an int8 or int16 input, got {in_dtype.value}.")


def softmax_multiplier(s_out: float) -> tuple[int, int]:
    """``(M, shift)`` of the output requantize: ``quantize_multiplier(2**-31 / s_out)``."""
    return quantize_multiplier(2.0**-SOFTMAX_PROB_BITS / float(s_out), Qpp.HIGH_PRECISION)


def normalize_mantissa(v: torch.Tensor, k: torch.Tensor, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m = v * 2**-k`` (rounded), and a rounding up to ``2**24`` renormalized to ``low`` with ``k + step``."""
    mant = _shift_left_or_right(v, k)
    over = mant == (1 << MANTISSA_BITS)
    mant = torch.where(over, torch.full_like(mant, low), mant)
    return mant, over


def exp_table_from(bounds: torch.Tensor, shifts: torch.Tensor, entries: torch.Tensor, tails: torch.Tensor,
                   frac_bits: int, out_dtype: QuantDType) -> Table256 | SegmentedTable:
    """The softmax exp table from its stored tensors (a site's buffers, a node's constants): empty ``bounds``
    mean the 256-entry int8 table indexed by ``d + 255``."""
    top = 1 << exp_bits(out_dtype)
    if bounds.numel() == 0:
        return Table256(entries.to(torch.int64), 255, 0, top)
    return SegmentedTable(bounds, shifts, entries, int(frac_bits), 0, top, tails)


def exp_row_sums(q: torch.Tensor, dim: int, exp_table: Table256 | SegmentedTable, what: str = "softmax"):
    """The softmax's first steps (``docs/march.md`` §13.6): ``(q, max(q), e, S, dim)`` with ``e = E(q - max(q))``
    and ``S = sum(e)`` (keepdim), both float64 holding exact integers; ``q`` stays int8 or becomes int64, and a 0-d
    ``q`` is taken as one element along dim 0."""
    if q.dtype != torch.int8:
        q = q.to(torch.int64)
    if q.dim() == 0:
        q = q.reshape(1)
        dim = 0
    if q.shape[dim] > MAX_SOFTMAX_LENGTH:
        raise QuantLensError(
            f"Integer {what} supports at most {MAX_SOFTMAX_LENGTH} elements along its dim, got {q.shape[dim]}."
        )
    amax = q.amax(dim=dim, keepdim=True)
    if isinstance(exp_table, Table256) and q.dtype == torch.int8 and exp_table.offset == 255:
        # d + 255 = q - (max - 255) lies in [0, 255] by the int8 type: the gather needs no range check.
        e = torch.take(exp_table.entries.to(q.device, torch.float64), q.to(torch.int64).sub_(amax - 255))
    else:
        q = q.to(torch.int64)
        e = exp_table.lookup(q - amax).to(torch.float64)
    # Exact in float64: 0 <= e <= 2**X <= 2**23 and at most 2**16 elements, so every partial sum of S is an
    # integer below 2**39 (any summation order gives the same S).
    return q, amax, e, e.sum(dim=dim, keepdim=True), dim


def sum_mantissa(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, k)``: ``S ~ m · 2**k`` with the 24-bit mantissa ``m = rhe(S · 2**-k)`` in ``[2**23, 2**24)``,
    ``k = bitlen(S) - 24`` (§13.1; ``m = 2**24`` after rounding becomes ``2**23`` with ``k + 1``), for float64
    ``S`` holding an integer in ``[1, 2**53)``."""
    # bitlen(S) is frexp's exponent b (S = f * 2**b, f in [0.5, 1)); m = rhe(S * 2**-k) with k = b - 24 is
    # rhe(f * 2**24) (a power-of-two scaling, exact; a left shift when k <= 0).
    frac, b = torch.frexp(s)
    mant = torch.round(frac * float(1 << MANTISSA_BITS)).to(torch.int64)
    k = b.to(torch.int64) - MANTISSA_BITS
    over = mant == (1 << MANTISSA_BITS)
    return torch.where(over, 1 << (MANTISSA_BITS - 1), mant), k + over.to(torch.int64)


def int_softmax(
    q: torch.Tensor, dim: int, exp_table: Table256 | SegmentedTable, multiplier: int, shift: int,
    out_dtype: QuantDType,
) -> torch.Tensor:
    """Integer softmax along ``dim`` (``docs/march.md`` §13.6). ``q``: input codes; returns output codes.

    ``d = q - max(q)``; ``e = E(d)`` (scale ``2**-X``); ``S = sum(e)``; ``k = bitlen(S) - 24``;
    ``m = S * 2**-k`` (rounded right shift or exact left shift; ``m = 2**24`` becomes ``2**23`` with ``k + 1``);
    ``r = R(m) ~ 2**46 / m``; ``t = rshift_rhe(e * r, 15 + k)`` (``~ e / S * 2**31``);
    ``y = requantize(t, M, shift)``.
    """
    _, _, e, s, _ = exp_row_sums(q, dim, exp_table)
    mant, k = sum_mantissa(s)
    r = mantissa_lookup(recip_mantissa_table(), mant)
    # t = rhe(e * r, k + 15), exact in float64: e <= 2**23 and r <= 2**23 (the table's range), so e * r < 2**46
    # and e * (r * 2**-(k + 15)) is that integer times a power of two (k + 15 >= 7: S >= E(0) = 2**X >= 2**15);
    # torch.round is half to even.
    scale = r.to(torch.float64) * _pow2(-(k + (RECIP_BITS - SOFTMAX_PROB_BITS)))
    t = e.mul_(scale).round_().to(torch.int64)
    return _softmax_requantize(t, int(multiplier), int(shift), out_dtype)


#: a bound on the softmax's t: with m in [2**23, 2**24], S <= (m + 1/2) * 2**k, e <= S and R(m) <= 2**46 / m + 9
#: (node rounding 1/2, interpolation of the convex 2**46 / x over steps of 2**14 at most 2**28 * 2**-22 / 8 = 8,
#: final rounding 1/2): t <= (m + 1/2) * R(m) / 2**15 + 1/2 < (2**46 + 2**28) / 2**15 + 1 < 2**31 + 2**14.
_SOFTMAX_T_BOUND = (1 << 31) + (1 << 14)


def _softmax_requantize(t: torch.Tensor, multiplier: int, shift: int, out_dtype: QuantDType) -> torch.Tensor:
    """``requantize(t, M, shift)`` for the softmax's ``0 <= t < 2**31 + 2**14`` (same result, fewer passes).

    With ``M < 2**31`` and ``0 < shift <= 62``: ``x = t * M < 2**62 + 2**45`` and ``x + 2**(shift - 1) < 2**63``,
    so ``(x + 2**(shift - 1) - 1 + ((x >> shift) & 1)) >> shift`` (rounding half to even, ``numerics``'s short
    formula) cannot overflow. Other constants take ``requantize``.
    """
    if not (0 < multiplier < (1 << 31) and 0 < shift <= 62):
        return requantize(t, multiplier, shift, out_dtype)
    x = t.mul_(multiplier)
    y = torch.bitwise_right_shift(x, shift).bitwise_and_(1).add_(x).add_((1 << (shift - 1)) - 1)
    return y.bitwise_right_shift_(shift).clamp_(out_dtype.qmin, out_dtype.qmax)


# ------------------------------------------------------------------------------------------------------------
# layer norm


@dataclass(frozen=True)
class LayerNormConstants:
    """Integer constants of one layer_norm site (``docs/march.md`` §13.7)."""

    gain: torch.Tensor  # int64 [N]: rhe(sqrt(N) * gamma / s_out * 2**(T - 23)), |gain| < 2**31
    bias: torch.Tensor  # int64 [N]: sat(rhe(beta / s_out * 2**T), +-2**60)
    eps_term: int  # min(rhe(N * eps * 2**(2P) / s_in**2), 2**61)
    shift: int  # T
    frac_bits: int  # P


def layer_norm_frac_bits(num_elements: int, in_dtype: QuantDType) -> int:
    """``P = min(8, floor((61 - ceil(log2 N)) / 2) - b)``: fractional bits of the centred values, so that
    ``sum(c**2) < 2**61`` (``b`` = input bits). Raises when negative (N too large)."""
    n = int(num_elements)
    log_n = max(0, (n - 1).bit_length())  # ceil(log2 n)
    p = min(LN_MAX_FRAC_BITS, (61 - log_n) // 2 - in_dtype.bits)
    if p < 0:
        raise QuantLensError(
            f"Integer layer_norm over {n} elements with a {in_dtype.value} input would overflow its 64-bit "
            "variance sum; normalize fewer elements or use an int8 input."
        )
    return p


def layer_norm_constants(
    s_in: float, s_out: "float | torch.Tensor", in_dtype: QuantDType, num_elements: int,
    gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float,
) -> LayerNormConstants:
    """Constants of the integer layer_norm from the float32 scales, gamma, beta and eps (float64 arithmetic);
    ``s_out`` per tensor or per normalized element (``s_out[j]``, channel exponents: the same formulas per element).

    ``a = max |sqrt(N) * gamma| / s_out``; ``(_, T) = quantize_multiplier(a * 2**-23)`` (``T = 30`` when all of
    gamma is 0); ``gain = rhe(sqrt(N) * gamma / s_out * 2**(T - 23))``; ``bias = rhe(beta / s_out * 2**T)``.
    """
    n = int(num_elements)
    s_in = float(s_in)
    # s_out per tensor, or per normalized element (channel exponents, docs/march.md §3.1): the gain and bias are
    # per element, so each takes its channel's own output scale
    s_out = torch.as_tensor(s_out).detach().cpu().to(torch.float64).reshape(-1)
    p = layer_norm_frac_bits(n, in_dtype)
    g = torch.ones(n, dtype=torch.float64) if gamma is None else gamma.detach().reshape(-1).cpu().to(torch.float64)
    b = torch.zeros(n, dtype=torch.float64) if beta is None else beta.detach().reshape(-1).cpu().to(torch.float64)
    if g.numel() != n or b.numel() != n:
        raise QuantLensError(f"layer_norm: weight/bias have {g.numel()}/{b.numel()} elements, expected {n}.")
    gn = (math.sqrt(n) * g) / s_out
    a = float(gn.abs().max())
    if a > 0:
        _, shift = quantize_multiplier(a * 2.0**-LN_NORM_BITS, Qpp.HIGH_PRECISION)
    else:
        shift = 30
    gain = torch.round(gn * 2.0 ** (shift - LN_NORM_BITS)).to(torch.int64)
    bias = torch.round(b / s_out * 2.0**shift).clamp(-(2.0**60), 2.0**60).to(torch.int64)
    eps_real = (n * float(eps) * 2.0 ** (2 * p)) / (s_in * s_in)
    eps_term = int(min(round(eps_real), 2**61)) if math.isfinite(eps_real) else 2**61
    return LayerNormConstants(gain, bias, eps_term, shift, p)


def int_layer_norm(
    q: torch.Tensor, normalized_ndim: int, gain: torch.Tensor, bias: torch.Tensor, eps_term: int,
    frac_bits: int, shift: int, out_dtype: QuantDType, center: bool = True,
) -> torch.Tensor:
    """Integer layer_norm over the last ``normalized_ndim`` dims (``docs/march.md`` §13.7); ``center=False``: the
    RMS norm (§13.7.1), the same steps with ``mu = 0``.

    ``mu = rhe(sum(q) * 2**P / N)``; ``c = q * 2**P - mu``; ``V = sum(c**2) + eps_term`` (``V = 0`` counts as
    1); ``k = floor((bitlen(V) - 23) / 2)``; ``m = V * 2**-2k`` in ``[2**22, 2**24)`` (rounded right shift or
    exact left shift; ``m = 2**24`` becomes ``2**22`` with ``k + 1``); ``r = S(m) ~ 2**34 / sqrt(m)``;
    ``u = rshift_rhe(c * r, 11 + k)`` (``~ c / sqrt(V) * 2**23``); ``y = sat(rshift_rhe(u * gain + bias, T))``.
    """
    shape = q.shape
    lead = len(shape) - normalized_ndim
    n = 1
    for size in shape[lead:]:
        n *= size
    p = int(frac_bits)
    bits = _code_bits(q)
    # float64 path, exact: |q| <= 2**(bits - 1), so |sum(q)| <= n * 2**15 and |c| <= (2**bits - 1) * 2**P (mu is a
    # rounded mean of codes, inside their range); with n * 2**(2 * (bits + P)) + eps_term < 2**53 every partial sum
    # of sum(c**2) + eps_term is an integer below 2**53. n < 2**28 keeps the rounded division exact (below).
    if n < (1 << 28) and n * (1 << (2 * (bits + p))) + int(eps_term) < (1 << 53):
        x = q.reshape(*shape[:lead], n).to(torch.float64)
        # mu = rhe(sum * 2**P / n): the float64 quotient is the exact one correctly rounded; an exact tie k + 1/2 is
        # representable, and a non-tie is at least 1 / (2n) > 2**-30 from one while |quotient| < 2**23 errs by at
        # most 2**-30, so torch.round (half to even) rounds both the same.
        mu = torch.round(x.sum(dim=-1, keepdim=True).mul_(float(1 << p)).div_(n)) if center else 0.0
        c = x.mul_(float(1 << p)).sub_(mu)
        v = torch.linalg.vecdot(c, c).unsqueeze(-1).add_(int(eps_term)).clamp_(min=1)
        # bitlen(V) is frexp's exponent b; V * 2**-2k is a power-of-two scaling (exact), torch.round half to even.
        frac, b = torch.frexp(v)
        k = torch.div(b.to(torch.int64) - (MANTISSA_BITS - 1), 2, rounding_mode="floor")
        mant = torch.round(v * _pow2(-2 * k)).to(torch.int64)
        over = mant == (1 << MANTISSA_BITS)
        mant = torch.where(over, 1 << (MANTISSA_BITS - 2), mant)
    else:
        q64 = q.to(torch.int64)
        x = q64.reshape(*shape[:lead], n)
        mu = div_round_half_even(x.sum(dim=-1, keepdim=True) * (1 << p), n) if center else 0
        c = x * (1 << p) - mu
        v = ((c * c).sum(dim=-1, keepdim=True) + int(eps_term)).clamp(min=1)
        k = torch.div(bit_length(v) - (MANTISSA_BITS - 1), 2, rounding_mode="floor")
        mant, over = normalize_mantissa(v, 2 * k, 1 << (MANTISSA_BITS - 2))
        k = k + over.to(torch.int64)
        u = rshift_rhe_var(c * rsqrt_mantissa_table().lookup(mant), k + (RSQRT_BITS - LN_NORM_BITS))
        return _layer_norm_output(u, gain, bias, shift, out_dtype).reshape(shape)
    k = k + over.to(torch.int64)
    r = mantissa_lookup(rsqrt_mantissa_table(), mant)
    # u = rhe(c * r, 11 + k), exact in float64: |c| <= 2**(bits + P) <= 2**24 and r <= 2**23, so |c * r| < 2**47,
    # and c * (r * 2**-(11 + k)) is that integer times a power of two (11 + k >= 0: V >= 1).
    scale = r.to(torch.float64) * _pow2(-(k + (RSQRT_BITS - LN_NORM_BITS)))
    u = c.mul_(scale).round_().to(torch.int64)
    return _layer_norm_output(u, gain, bias, shift, out_dtype).reshape(shape)


def _layer_norm_output(u: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor, shift: int,
                       out_dtype: QuantDType) -> torch.Tensor:
    """``sat(rshift_rhe(u * gain + bias, T))``."""
    dev = u.device
    # |u| <= 2**24 (|c| <= sqrt(V), r <= 2**34 / sqrt(m) + 9), |gain| < 2**31, |bias| <= 2**60: |acc| < 2**61, so
    # the rounded shift takes numerics' short formula (bound 2**62).
    acc = torch.addcmul(bias.to(dev, torch.int64).reshape(-1), u, gain.to(dev, torch.int64).reshape(-1))
    return rshift_rhe_var(acc, int(shift), bound=float(1 << 62)).clamp_(out_dtype.qmin, out_dtype.qmax)


def _code_bits(q: torch.Tensor) -> int:
    """Bits of the input codes' type: 8 for int8 storage, else 16 (int16 codes; wider data takes the int path)."""
    if q.dtype in (torch.int8, torch.uint8):
        return 8
    if q.dtype == torch.int16:
        return 16
    return 64


# ------------------------------------------------------------------------------------------------------------
# reciprocal and div


def div_multiplier(s_x: float, s_y: float, s_out: float) -> tuple[int, int]:
    """``(M, shift)`` of ``int_div``: a 23-bit multiplier, ``M * 2**-shift ~ s_x / (s_y * s_out) * 2**-23``.

    ``(M31, shift31) = quantize_multiplier(s_x / (s_y * s_out) * 2**-23)`` (float64), then
    ``M = rshift_rhe(M31, 8)`` (in ``[2**22, 2**23]``) and ``shift = shift31 - 8``, which must be >= 0.
    """
    m31, shift31 = quantize_multiplier(float(s_x) / (float(s_y) * float(s_out)) * 2.0**-23, Qpp.HIGH_PRECISION)
    if shift31 < 8:
        raise QuantLensError(
            f"div: the scales s_x={s_x}, s_y={s_y}, s_out={s_out} need a multiplier above 2**14; the output scale "
            "is far too small for this division. Check the observers of the division's inputs and output."
        )
    floor, rem = divmod(m31, 256)
    m = floor + (1 if rem > 128 or (rem == 128 and floor % 2 == 1) else 0)
    return m, shift31 - 8


def reciprocal_multiplier(s_in: float, s_out: float) -> tuple[int, int]:
    """``div_multiplier(1, s_in, s_out)``: the reciprocal is ``div`` with numerator code 1 at scale 1."""
    return div_multiplier(1.0, s_in, s_out)


def recip_mantissa(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For integers ``0 < |v| <= 2**15``: ``(r, n)`` with ``1 / |v| ~ r * 2**-(22 + n)``.

    ``n = bitlen(|v|)`` (1 to 16), ``m = |v| << (24 - n)`` in ``[2**23, 2**24)`` (exact), ``r = R(m)``.
    ``v = 0`` is treated as 1 (callers handle zero divisors separately).
    """
    a = v.to(torch.int64).abs().clamp(min=1)
    n = bit_length(a)
    if a.numel() and int(n.max()) > 16:
        raise QuantLensError("recip_mantissa: |v| must be at most 2**15 (an int8 or int16 code).")
    mant = torch.bitwise_left_shift(a, MANTISSA_BITS - n)
    return recip_mantissa_table().lookup(mant), n


def int_div(qx: torch.Tensor, qy: torch.Tensor, multiplier: int, shift: int, out_dtype: QuantDType) -> torch.Tensor:
    """Integer ``x / y`` (``docs/march.md`` §13.5), broadcasting ``qx`` and ``qy``.

    ``(r, n) = recip_mantissa(qy)``; ``t = qx * sign(qy) * r`` (``~ qx / |qy| * 2**(22 + n)``, at most
    ``2**38``); ``y = sat(rshift_rhe(t * M, shift + n - 1))`` with ``(M, shift) = div_multiplier(...)`` (the
    product is at most ``2**61``; a shift above 62 gives 0).
    ``qy = 0``: ``qmax`` if ``qx > 0``, ``qmin`` if ``qx < 0``, 0 if ``qx = 0``.
    """
    qx, qy = qx.to(torch.int64), qy.to(torch.int64)
    r, n = recip_mantissa(qy)  # per divisor, before broadcasting
    t = qx * (torch.sign(qy) * r)
    y = saturate(rshift_rhe_var(t * int(multiplier), (int(shift) - 1 + n).expand_as(t)), out_dtype)
    at_zero = torch.where(qx > 0, out_dtype.qmax, torch.where(qx < 0, out_dtype.qmin, 0)).to(torch.int64)
    return torch.where(qy == 0, at_zero, y)


def int_reciprocal(q: torch.Tensor, multiplier: int, shift: int, out_dtype: QuantDType) -> torch.Tensor:
    """Integer ``1 / x`` by the mantissa rule: ``int_div(1, q)``; ``q = 0`` gives ``qmax``."""
    return int_div(torch.ones_like(q, dtype=torch.int64), q, multiplier, shift, out_dtype)
