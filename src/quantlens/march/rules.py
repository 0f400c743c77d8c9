"""The integer rule of each op family: from scales and constants to an integer kernel's parameters.

``docs/march.md`` states each rule; this module is its one implementation. Both places that need a kernel's
parameters call it: ``convert`` (reading the scales from the qat IR) and the fake quant's integer emulation
(``quantization.emulation``, reading them from its fake quants), so a rule changed here changes both, and the
kernels (``quantlens.kernels``) only execute what they are given.

Conventions:

* a scale is a float32 tensor (0-d, ``[1]`` or per channel ``[C]``) or a Python float; every rule computes in
  float64 from the float32 values (a product of two float32 scales is exact in float64);
* every function returns the kernel's parameters as a plain dict (the quantized IR stores them as node attrs);
  the requantize part is always ``{"multiplier": [M...], "shift": [shift...], "out_dtype": "qint8"|...}``;
* ``qpp`` is the requantize precision profile (``docs/march.md`` §8), ``qdtype`` the output's
  :class:`~quantlens.march.spec.QuantDType`.

To change an op's integer rule: change its function here and its pinned values in ``tests/test_rules.py``.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from quantlens.errors import QuantLensError
from quantlens.march.numerics import (
    channel_affine_params,
    clamp_codes,
    constant_addend,
    constant_code,
    quantize_multiplier,
)
from quantlens.march.spec import Qpp, QuantDType, get_march

__all__ = [
    "max_channel_exponent", "exponent_scales", "channel_exponents", "common_grid", "channel_shift",
    "exponent_factors", "fold_exponents", "folded_rows",
    "multiplier", "requantize", "move", "accumulator_scale", "gemm", "add", "cat", "add_constant",
    "constant_addend_codes", "average_by_window", "scale_by_constant", "mul", "average", "clamp", "sign_op", "bilinear", "channel_affine", "prelu", "fill_code",
    "BILINEAR_WEIGHT_BITS", "vector_norm", "LN_FRAC_BITS", "log_softmax",
]

Scale = Union[torch.Tensor, float]

#: the bilinear interpolation weights' fixed point (2**-8 per axis, two axes): ``docs/march.md`` §11
BILINEAR_WEIGHT_BITS = 16


def _f64(scale: Scale) -> torch.Tensor:
    """A scale as a float64 tensor (exact from float32)."""
    return torch.as_tensor(scale).detach().to(torch.float64)


def _first(scale: Scale) -> float:
    """The one value of a per-tensor scale, as a Python float (exact from float32)."""
    return float(_f64(scale).reshape(-1)[0])


# -- §3.1: channel exponents ----------------------------------------------------------------------------------------
def max_channel_exponent() -> int:
    """``K = 2**bits - 1``, the largest channel exponent of the march (§3.1); 0 where it has none."""
    bits = get_march().spec.channel_exponent_bits
    return (1 << bits) - 1 if bits > 0 else 0


def exponent_scales(scale: torch.Tensor) -> torch.Tensor:
    """§3.1: an observer's per-channel scales ``s_c`` -> ``s · 2**-k_c``, ``s = max_c s_c``, ``k_c`` the largest
    integer in ``[0, K]`` with ``s · 2**-k_c >= s_c`` (no channel is clipped; each keeps its step within a factor
    2, down to ``2**-K`` of the widest). Exact in float32 (a power-of-two scaling of ``s``)."""
    big_k = max_channel_exponent()
    if big_k == 0:
        raise QuantLensError(f"March {get_march().spec.name} has no channel exponents (docs/march.md §3.1): give the "
                             "activation a per-tensor scale.")
    s = scale.detach().to(torch.float64).reshape(-1)
    top = s.max()
    k = torch.floor(torch.log2(top / s)).clamp(0, big_k)
    k = torch.where(top * torch.pow(2.0, -k) < s, k - 1, k)  # log2's rounding must never clip a channel
    k = torch.minimum(k, torch.floor(torch.log2(top / get_march().spec.min_scale)).clamp(min=0))
    return (top * torch.pow(2.0, -k)).to(torch.float32).reshape(scale.shape)


def channel_exponents(scale: Scale) -> tuple[float, list[int]]:
    """§3.1: ``(s, [k_c])`` of per-channel scales in exponent form (``s_c = s · 2**-k_c``, ``s`` the largest);
    refused when a ratio is not such a power of two (a per-channel activation scale the march cannot shift)."""
    s = _f64(scale).reshape(-1)
    top = float(s.max())
    k = torch.round(torch.log2(top / s))
    big_k = max_channel_exponent()
    if not bool(((k >= 0) & (k <= big_k) & (top * torch.pow(2.0, -k) == s)).all()):
        raise QuantLensError(
            f"convert: a per-channel activation scale that is not in channel-exponent form s·2**-k, 0 <= k <= {big_k} "
            f"(docs/march.md §3.1; scales {s[:4].tolist()}...): the march has no rule for it. Quantize the activation "
            "per tensor, or with QuantSpec(channel_exponents=True).")
    return top, [int(v) for v in k.tolist()]


def common_grid(scale: torch.Tensor) -> torch.Tensor:
    """§3.1: the scale of the common grid of exponent-form codes, ``s · 2**-K`` (``s`` the widest channel's, the
    largest); tensor ops only, so it holds while exporting. The one expression of it: the fake quant's readers
    (``FakeQuantize.read_grid``) and convert's ``channel_shift`` both take it."""
    return scale.amax() * 2.0 ** -max_channel_exponent()


def channel_shift(scale: Scale) -> dict:
    """§3.1: the left shift per channel that brings exponent-form codes onto the common grid ``s · 2**-K``:
    ``{"left_shifts": [K - k_c], "out_dtype": "qint16"}`` (``|q| · 2**K <= 2**(7 + K)`` fits int16 for ``K <= 8``),
    and that grid's scale."""
    _, k = channel_exponents(scale)
    big_k = max_channel_exponent()
    return ({"left_shifts": [big_k - v for v in k], "out_dtype": QuantDType.qint16.value},
            float(common_grid(torch.as_tensor(scale))))


def exponent_factors(scale: torch.Tensor) -> torch.Tensor:
    """§3.1: the factors ``2**-k_c = s_c / s`` of per-channel scales in exponent form (tensor ops, exact: a ratio
    of powers of two times the same ``s``), as float32 ``[C]``."""
    s = scale.detach().reshape(-1).to(torch.float32)
    return s / s.amax()


def fold_exponents(row_scales: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """§3.1: the weight scale ``S[o, c] = s_w[o] · 2**k_c`` of a linear that reads exponent-form codes along its
    input features with the exponents folded into its weight (its codes ``round(W[o, c] · 2**-k_c / s_w[o])``, so
    the GEMM multiplies int8 codes as they are and accumulates at ``s · s_w[o]``); ``row_scales`` ``[O]`` are the
    per-row scales of ``W · diag(2**-k)``, ``factors`` the input's ``2**-k_c`` (:func:`exponent_factors`).
    Float32 ``[O, C]``, exact (power-of-two multiples)."""
    rows = row_scales.detach().reshape(-1, 1).to(torch.float32)
    return rows / factors.detach().reshape(1, -1).to(torch.float32)


def folded_rows(weight_scale: Scale, input_scale: Scale) -> torch.Tensor:
    """§3.1: the row scales ``s_w[o]`` of a folded weight scale ``[O, C]`` (:func:`fold_exponents`), checked
    against the exponents of the input it multiplies; refused when the two do not fold (the weight was folded for
    other exponents: calibrate or export again)."""
    w = _f64(weight_scale)
    _, k = channel_exponents(input_scale)
    factors = torch.pow(2.0, -torch.tensor(k, dtype=torch.float64))
    if w.dim() != 2 or w.shape[1] != factors.numel():
        raise QuantLensError(f"convert: a folded weight scale must be [out, in] with in = {factors.numel()} input "
                             f"channels, got {tuple(w.shape)} (docs/march.md §3.1).")
    rows = w * factors.reshape(1, -1)
    if not bool((rows == rows[:, :1]).all()):
        raise QuantLensError(
            "convert: a linear's weight was folded for channel exponents other than its input's (docs/march.md "
            "§3.1): its scale is not s_w[o] · 2**k_c for the input's k_c. Run a forward of the prepared model "
            "after the last calibration (its weights refold), then export again.")
    return rows[:, 0].to(torch.float32)


# -- §8: requantize -------------------------------------------------------------------------------------------
def multiplier(real: float, qpp: Qpp) -> tuple[int, int]:
    """``(M, shift)`` of one real multiplier in profile ``qpp`` (§8.1). A multiplier outside the default
    profile's range (``2**-47 <= m < 2**16 - 1/2``) takes the 31-bit one for that requantize (the wide multiplier;
    the cost model charges it as high precision)."""
    if qpp is Qpp.DEFAULT:
        try:
            return quantize_multiplier(real, qpp)
        except QuantLensError:
            pass
    return quantize_multiplier(real, Qpp.HIGH_PRECISION)


def requantize(real: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§8: one real multiplier per tensor (``[]`` / ``[1]``) or per channel (``[C]``) ->
    ``{"multiplier": [M...], "shift": [shift...], "out_dtype": qdtype}``."""
    reals = real.reshape(-1).tolist() if isinstance(real, torch.Tensor) else [float(real)]
    pairs = [multiplier(float(m), qpp) for m in reals]
    return {"multiplier": [p[0] for p in pairs], "shift": [p[1] for p in pairs], "out_dtype": qdtype.value}


def move(src_scale: Scale, dst_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§8: integers on the ``src_scale`` grid moved to the ``dst_scale`` grid: ``s_src / s_dst``."""
    return requantize(_f64(src_scale) / _f64(dst_scale), qdtype, qpp)


# -- §6: GEMMs ----------------------------------------------------------------------------------------------------
def accumulator_scale(x_scale: Scale, w_scale: Scale) -> torch.Tensor:
    """The int32 accumulator's scale ``s_x · s_w`` (float64: the product of two float32 scales is exact)."""
    return _f64(x_scale) * _f64(w_scale)


def gemm(x_scale: Scale, w_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp,
         factor: float = 1.0) -> dict:
    """§6: conv / linear / matmul requantize their exact accumulator by ``s_x · s_w · factor / s_out`` (per
    output channel for a per-channel weight); ``factor`` is a positive scalar multiply after the GEMM (attention's
    ``1/sqrt(d)``) folded into the multiplier."""
    return requantize(accumulator_scale(x_scale, w_scale) * factor / _f64(out_scale), qdtype, qpp)


# -- §10: add, sub, cat, x ± k, x · k, x · y ------------------------------------------------------------------
#: §10 a saturating input: its ratio ``s_i / s_out`` moves code 1 past the int32 range (a 0 / finfo.min mask's grid
#: added to scores): it enters with ``M = 2**31 - 1`` and no shift, so 0 adds nothing and any other code saturates
#: the int32 term, and the sum to the output's end (the fake quant of ``x + finfo.min`` is the lowest code too).
_SATURATING_PAIR = (2**31 - 1, 0)


def _rescale_pairs(in_scales: list[Scale], out_scale: Scale, qpp: Qpp, frac_bits: int = 0) -> list[tuple[int, int]]:
    s_out = _first(out_scale)
    pairs = []
    for s in in_scales:
        ratio = _first(s) / s_out
        saturating = ratio * 2.0**frac_bits >= 2.0**31
        pairs.append((_SATURATING_PAIR[0], frac_bits) if saturating else multiplier(ratio, qpp))
    return pairs


def add(in_scales: list[Scale], out_scale: Scale, qdtype: QuantDType, qpp: Qpp, out_axis: int | None = None) -> dict:
    """§10 add / sub: each input rescaled by ``s_i / s_out`` (per-tensor scales, float64 division of the float32
    scales) into ``F`` extra fractional bits of profile ``qpp``, summed, rounded once:
    ``{"multipliers", "shifts", "frac_bits", "out_dtype"}``. An input whose ratio moves code 1 past the int32 range
    saturates (``_SATURATING_PAIR``). An output in channel-exponent form (§3.1, per channel along ``out_axis``):
    the pairs are those of ``s_i / s`` and channel ``c`` rescales with ``shift_i - k_c`` (``out_exponents``)."""
    frac = get_march().spec.qpp(qpp).elementwise_frac_bits
    exponents = None
    if _f64(out_scale).numel() > 1:
        if out_axis is None:
            raise QuantLensError("add: a per-channel output scale needs its channel axis.")
        out_scale, exponents = channel_exponents(out_scale)
    pairs = _rescale_pairs(in_scales, out_scale, qpp, frac)
    attrs = {"multipliers": [p[0] for p in pairs], "shifts": [p[1] for p in pairs],
             "frac_bits": frac, "out_dtype": qdtype.value}
    if exponents is not None:
        if any(p[1] - max(exponents) < frac for p in pairs):
            raise QuantLensError("add: an input's scale is too large next to the output's finest channel scale to "
                                 "rescale it (shift below F); check the observers of this op's inputs.")
        attrs.update(out_exponents=exponents, out_axis=int(out_axis))
    return attrs


def cat(in_scales: list[Scale], out_scale: Scale, qdtype: QuantDType, qpp: Qpp, dim: int) -> dict:
    """§10 cat: each input requantized alone by ``s_i / s_out`` (no sum, no ``F``)."""
    pairs = _rescale_pairs(in_scales, out_scale, qpp)
    return {"multipliers": [p[0] for p in pairs], "shifts": [p[1] for p in pairs], "out_dtype": qdtype.value,
            "dim": dim}


def add_constant(x_scale: Scale, k: float, out_scale: Scale, qdtype: QuantDType, qpp: Qpp, negate: bool) -> dict:
    """§10 ``±x + k`` for a scalar constant ``k``: ``x`` rescaled as in :func:`add`, ``k`` entering as
    ``rhe(k · 2**F / s_out)`` in the sum's ``F`` fractional bits, so the result is rounded once; ``negate``
    subtracts ``x`` (``k - x``)."""
    attrs = add([x_scale], out_scale, qdtype, qpp)
    attrs.update(addend=constant_addend(k, _first(out_scale), attrs["frac_bits"]), negate=negate)
    return attrs


def constant_addend_codes(k: torch.Tensor, out_scale: Scale, qpp: Qpp) -> tuple[torch.Tensor, torch.Tensor]:
    """§10 ``x ± K`` for a constant tensor ``K`` (a relative-position bias, a 0 / finfo.min mask): ``K`` enters the
    sum like a scalar addend, as int32 codes ``sat32(rhe(K · 2**F / s_out))`` on the grid ``s_out / 2**F``, an
    input of :func:`add` whose multiplier is exactly ``2**-F``. A -3.4e38 fill saturates to the int32 minimum, and
    the sum to the output's lowest code. Returns ``(codes, scale)``."""
    frac = get_march().spec.qpp(qpp).elementwise_frac_bits
    s_out = torch.tensor(_first(out_scale), dtype=torch.float64)
    steps = torch.round(k.detach().to(torch.float64) * 2.0**frac / s_out)  # torch.round: half to even
    codes = steps.clamp(QuantDType.qint32.qmin, QuantDType.qint32.qmax).to(torch.int32)
    return codes, (s_out / 2.0**frac).to(torch.float32)


def scale_by_constant(k: float, x_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§10 ``x · k`` (and ``x / (1/k)``) for a nonzero scalar ``k``: one requantize by ``|k| · s_x / s_out``,
    the sign in ``negative``."""
    if k == 0:
        raise QuantLensError("multiplication by 0 has no integer rule (the result is a constant 0).")
    m = abs(k) * _first(x_scale) / _first(out_scale)
    return {**requantize(torch.tensor(m, dtype=torch.float64), qdtype, qpp), "negative": k < 0}


def mul(x_scale: Scale, y_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§10 ``x · y`` of two tensors: the exact integer product requantized by ``s_x · s_y / s_out``."""
    return requantize(_f64(x_scale) * _f64(y_scale) / _f64(out_scale), qdtype, qpp)


# -- §10.2: sums and averages ---------------------------------------------------------------------------------
def average(x_scale: Scale, count: int, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§10.2 sum / mean / average pools: the exact integer sum of ``count`` codes requantized by
    ``s_x / (count · s_out)`` (``count`` 1 for a sum)."""
    return requantize(_f64(x_scale) / (count * _f64(out_scale)), qdtype, qpp)


def average_by_window(x_scale: Scale, divisors: list[int], out_scale: Scale, qdtype: QuantDType,
                      qpp: Qpp) -> dict:
    """§10.2 an average pool whose windows hold different counts (``count_include_pad=False`` at the border,
    ``ceil_mode`` windows that overhang): the exact window sums, each requantized by ``s_x / (d · s_out)`` for its
    window's divisor ``d``: one multiplier per distinct divisor, ``{"divisor_values", "multiplier", "shift"}``."""
    values = sorted({int(d) for d in divisors})
    reals = torch.tensor([_first(x_scale) / (d * _first(out_scale)) for d in values], dtype=torch.float64)
    return {"divisor_values": values, **requantize(reals, qdtype, qpp)}


# -- §10.1, §10.3, §10.4, §11: elementwise and resize ---------------------------------------------------------
def clamp(lo: float | None, hi: float | None, x_scale: Scale, out_scale: Scale, qdtype: QuantDType,
          qpp: Qpp) -> dict:
    """Clamp / hardtanh / relu6 (§10): the integers bounded by the bounds' input codes rounded outward
    (``clamp_codes``), requantized by ``s_x / s_out``, then clamped to the bounds' output codes (``constant_code``):
    ``{"lo", "hi", "out_lo", "out_hi", **requantize}``. The output codes make it the fake quant's
    ``fq_out(clamp(x, min, max))`` for any bounds (rounding is monotonic), on the grid or not."""
    codes_lo, codes_hi = clamp_codes(lo, hi, _first(x_scale))
    s_out = float(_first(out_scale))
    out_lo = qdtype.qmin if lo is None else constant_code(float(lo), s_out, qdtype)
    out_hi = qdtype.qmax if hi is None else constant_code(float(hi), s_out, qdtype)
    return {"lo": codes_lo, "hi": codes_hi, "out_lo": out_lo, "out_hi": out_hi,
            **move(x_scale, out_scale, qdtype, qpp)}


def sign_op(x_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """``|q|`` and ``-q`` are exact on integers; the result is requantized by ``s_x / s_out``."""
    return move(x_scale, out_scale, qdtype, qpp)


def bilinear(x_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§11 bilinear resize: ``A_h · q · A_wᵀ`` with weights in 2**-8 fixed point per axis (exact), then one
    requantize by ``s_x · 2**-16 / s_out``."""
    return requantize(_f64(x_scale) * 2.0**-BILINEAR_WEIGHT_BITS / _f64(out_scale), qdtype, qpp)


def channel_affine(a: torch.Tensor, b: torch.Tensor, x_scale: Scale, out_scale: Scale, qdtype: QuantDType,
                   qpp: Qpp) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """§10.3 a per-channel affine ``a·x + b`` (BatchNorm on its own) as a depthwise 1x1 GEMM: int8 weights
    ``±127`` at ``s_w = |a|/127``, an int32 bias at ``s_x·s_w``, one per-channel requantize. Returns
    ``(weight codes, bias codes, {"channel_dim": 1, **requantize})``."""
    s_x = _f64(x_scale).reshape(-1)[0]
    w_q, bias_q, s_w = channel_affine_params(a.to(torch.float64), b.to(torch.float64), float(s_x))
    attrs = {"channel_dim": 1, **requantize(s_x * s_w / _f64(out_scale), qdtype, qpp)}
    return w_q, bias_q, attrs


def prelu(alpha: torch.Tensor, x_scale: Scale, out_scale: Scale, qdtype: QuantDType, qpp: Qpp) -> dict:
    """§10.4 ``x >= 0 ? x : α·x`` for slopes ``alpha`` (float64, one or per channel): the ``q >= 0`` requantize
    ``s_x / s_out``, and per slope the multiplier of ``|α|·s_x/s_out`` with the sign folded into the integers."""
    s_x = _f64(x_scale).reshape(-1)[0]
    s_out = _f64(out_scale)
    # α = 0: the sign 0 zeroes the integers; any valid multiplier will do
    neg = [multiplier(float(abs(v) * s_x / s_out), qpp) if v != 0 else multiplier(1.0, qpp)
           for v in alpha.tolist()]
    pos = requantize(s_x / s_out, qdtype, qpp)
    return {**pos, "neg_multiplier": [m for m, _ in neg], "neg_shift": [s for _, s in neg],
            "neg_sign": [1 if v > 0 else -1 if v < 0 else 0 for v in alpha.tolist()], "channel_dim": 1}


def vector_norm(x_scale: Scale, out_scale: Scale, qdtype: QuantDType) -> dict:
    """§13.7.2 ``||x||_2``: the square root of the exact sum of squared codes (a mantissa rsqrt) is requantized by
    ``s_x / s_out`` with the 31-bit multiplier (the root carries 23 bits): ``{"multiplier", "shift", "out_dtype"}``
    with one int each."""
    m, shift = quantize_multiplier(_first(x_scale) / _first(out_scale), Qpp.HIGH_PRECISION)
    return {"multiplier": m, "shift": shift, "out_dtype": qdtype.value}


#: §13.6.1 log_softmax: natural logarithms (the ln mantissa table, ln 2, the exp sum's ln) are integers at scale
#: ``2**-LN_FRAC_BITS``
LN_FRAC_BITS = 24
#: §13.6.1 log_softmax: ``M_x <= 2**44`` and ``M_l <= 2**31`` keep ``|d · M_x| < 2**60`` (``|d| < 2**16``) and
#: ``L · M_l < 2**60`` (``L < 2**29``), so their difference stays within the rounded shift's ``2**61``
_LOG_SOFTMAX_X_BITS, _LOG_SOFTMAX_LN_BITS = 44, 31


def log_softmax(x_scale: Scale, out_scale: Scale, qdtype: QuantDType) -> dict:
    """§13.6.1 ``log_softmax``: ``y = sat(rshift_rhe(d · M_x − L · M_l, T))`` with ``d = q − max(q)`` (input
    codes) and ``L ~ ln(sum(exp(d · s_x))) · 2**24``. ``M_x = rhe(s_x / s_out · 2**T)``, ``M_l = rhe(2**-24 /
    s_out · 2**T)``, one shift ``T``: the largest with ``M_x <= 2**44``, ``M_l <= 2**31`` and ``T <= 62``.
    Returns ``{"multiplier": M_x, "ln_multiplier": M_l, "shift": T, "out_dtype"}``."""
    s_x, s_out = _first(x_scale), _first(out_scale)
    real_x, real_ln = s_x / s_out, 2.0**-LN_FRAC_BITS / s_out
    if not (real_x > 0 and math.isfinite(real_x) and math.isfinite(real_ln)):
        raise QuantLensError(f"log_softmax: scales s_x={s_x}, s_out={s_out} give no multiplier.")
    # r = f · 2**e with f in [0.5, 1): r · 2**(B - e) = f · 2**B rounds to at most 2**B
    shift = min(_LOG_SOFTMAX_X_BITS - math.frexp(real_x)[1], _LOG_SOFTMAX_LN_BITS - math.frexp(real_ln)[1], 62)
    m_x, m_ln = round(real_x * 2.0**shift), round(real_ln * 2.0**shift)  # exact products, half to even
    if shift < 0 or m_x == 0 or m_ln == 0:
        raise QuantLensError(
            f"log_softmax: the input scale {s_x:.6g} and output scale {s_out:.6g} differ by too many orders of "
            "magnitude for its two multipliers; check the observers of its input and output."
        )
    return {"multiplier": m_x, "ln_multiplier": m_ln, "shift": shift, "out_dtype": qdtype.value}


def fill_code(value: float, x_scale: Scale, qdtype: QuantDType) -> int:
    """§11 a constant written into a quantized tensor (masked_fill, constant pad): its code on the tensor's grid,
    saturated."""
    return constant_code(float(value), _first(x_scale), qdtype)
