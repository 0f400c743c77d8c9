"""Quantize, fake-quantize and requantize exactly as ``docs/march.md`` specifies.

The fake quant used in calibration and QAT, and the integer simulator, both call these functions, so there is
one implementation of each rule:

* quantize:   ``q = clamp(round_half_to_even(x / s), qmin, qmax)`` computed in float32;
* fake quant: ``dequantize(quantize(x))  = q * s`` (float32);
* requantize: ``y = saturate(rshift_round_half_to_even(acc * M, shift))`` in int64, where ``M * 2**-shift``
  approximates a real multiplier.

``fake_quant`` (:mod:`quantlens.march.fake_quant`, re-exported here) is a ``torch.library`` custom op
(``torch.ops.quantlens.fake_quant``) so that it survives ``torch.export`` as one node, with a straight-through
gradient for QAT.
"""

from __future__ import annotations

import math
import struct
import threading

import torch

from quantlens.errors import QuantLensError
from quantlens.march.fake_quant import broadcast_scale, fake_quant, fake_quant_range
from quantlens.march.spec import Qpp, QuantDType, get_march

__all__ = [
    "fake_quant",
    "fake_quant_range",
    "quantize",
    "dequantize",
    "quantize_multiplier",
    "rshift_round_half_to_even",
    "requantize",
    "RequantizeParams",
    "requantize_params",
    "apply_requantize",
    "saturate",
    "rescaled_sum",
    "constant_addend",
    "clamp_codes",
    "constant_code",
    "interpolation_weights",
    "channel_affine_params",
]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: QuantDType, axis: int | None = None,
             storage: torch.dtype = torch.int64) -> torch.Tensor:
    """Real values to integers in the dtype's range, held in ``storage`` (int64 by default; the simulator asks for
    int8/int16: the same values, without an int64 intermediate)."""
    s = broadcast_scale(scale.to(torch.float32), x, -1 if axis is None else axis)
    return torch.div(x.to(torch.float32), s).round_().clamp_(dtype.qmin, dtype.qmax).to(storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Integers back to float32 reals."""
    s = broadcast_scale(scale.to(torch.float32), q, -1 if axis is None else axis)
    return q.to(torch.float32) * s


def saturate(x: torch.Tensor, dtype: QuantDType) -> torch.Tensor:
    """Clamp integers to the dtype's range (the march saturates, it never wraps)."""
    return torch.clamp(x, dtype.qmin, dtype.qmax)


def quantize_multiplier(real: float, qpp: Qpp = Qpp.DEFAULT) -> tuple[int, int]:
    """Represent a positive real multiplier as ``M * 2**-shift`` with ``M`` in ``[2**(b-1), 2**b)``, ``b`` the
    multiplier width of requantize precision profile ``qpp`` (16 by default, 31 for ``Qpp.HIGH_PRECISION``).

    ``M = round_half_to_even(real * 2**shift)``; if rounding reaches ``2**b`` the shift drops by one.
    """
    spec = get_march().spec
    bits = spec.qpp(qpp).multiplier_bits
    if not (real > 0 and math.isfinite(real)):
        raise QuantLensError(f"A requantize multiplier must be positive and finite, got {real!r}.")
    exponent = math.floor(math.log2(real))
    shift = (bits - 1) - exponent
    mult = round(real * 2.0**shift)  # Python's round() is half-to-even
    if mult >= 1 << bits:
        mult //= 2
        shift -= 1
    if shift < 0 or shift > spec.max_requant_shift:
        raise QuantLensError(
            f"Requantize multiplier {real!r} needs shift {shift}, outside [0, {spec.max_requant_shift}] of "
            f"march {spec.name}. The scales involved differ by too many orders of magnitude; check the observers."
        )
    return int(mult), int(shift)


def rshift_round_half_to_even(x: torch.Tensor, shift: "int | torch.Tensor", *,
                              bound: "float | None" = None) -> torch.Tensor:
    """``x / 2**shift`` rounded half to even, on int64 tensors. ``shift`` may be a tensor broadcast against ``x``
    (per-channel requantize).

    With ``f = x >> k`` (floor), remainder ``r = x - f·2**k`` and ``h = 2**(k-1)``: ``(r + h - 1 + (f & 1)) >> k``
    is 1 exactly when ``r > h``, or ``r == h`` and ``f`` is odd (``docs/march.md`` §8.2); it cannot overflow.

    ``bound`` (speed only, same result): a known bound on ``|x|``. Below ``2**53`` the float64 path below is taken
    without looking at the data; below ``2**62`` the sum is formed on ``x`` itself, ``(x + h - 1 + (f & 1)) >> k``
    (adding ``f·2**k`` back cannot overflow there), in fewer passes.
    """
    x = x.to(torch.int64)
    if not isinstance(shift, torch.Tensor) and shift == 0:
        return x
    if (bound is not None and bound < 2**53) or (bound is None and x.numel() >= 4096
                                                 and int(x.abs().max()) < 2**53):
        # Same result, faster on large tensors: x is exact in float64, x·2**-shift is exact (a power of two), and
        # torch.round rounds half to even.
        scale = 2.0 ** -shift if not isinstance(shift, torch.Tensor) else torch.pow(2.0, -shift.to(torch.float64))
        return torch.round(x.to(torch.float64) * scale).to(torch.int64)
    if not isinstance(shift, torch.Tensor):
        if bound is not None and bound <= 2**62 and 0 < shift <= 62:  # |x| + 2**(k-1) < 2**63
            return _rshift_rhe_short(x, shift)
        floor = torch.bitwise_right_shift(x, shift)
        rem = x - torch.bitwise_left_shift(floor, shift)
        up = torch.bitwise_right_shift(rem + ((1 << (shift - 1)) - 1) + torch.bitwise_and(floor, 1), shift)
        return floor + up
    shift = shift.to(torch.int64)
    floor = torch.bitwise_right_shift(x, shift)
    rem = x - torch.bitwise_left_shift(floor, shift)
    half_minus_one = torch.bitwise_left_shift(torch.ones_like(shift), (shift - 1).clamp(min=0)) - 1
    up = torch.bitwise_right_shift(rem + half_minus_one + torch.bitwise_and(floor, 1), shift)
    return floor + torch.where(shift > 0, up, 0)


def _rshift_rhe_short(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``rshift_round_half_to_even`` for ``|x| < 2**62`` and ``0 < shift <= 62``: ``(x + h - 1 + (f & 1)) >> k``
    with ``f = x >> k`` equals ``f + ((r + h - 1 + (f & 1)) >> k)`` (``x = f·2**k + r``) and stays below 2**63."""
    up = torch.bitwise_right_shift(x, shift)
    up.bitwise_and_(1).add_(x).add_((1 << (shift - 1)) - 1)
    return up.bitwise_right_shift_(shift)


def requantize(
    acc: torch.Tensor, multiplier: "int | torch.Tensor", shift: "int | torch.Tensor", dtype: QuantDType, *,
    bound: "float | None" = None, storage: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Scale an int32 accumulator by ``multiplier * 2**-shift`` and saturate to ``dtype`` (int64 result).
    ``multiplier``/``shift`` may be tensors broadcast against ``acc`` (per-channel).

    Fast path, same result: with ``b`` the bit length of the largest multiplier (``M < 2**b``), ``|acc| <
    2**(53 - b)`` gives ``|acc * M| < 2**53``, so ``acc * (M * 2**-shift)`` is exact in float64 (``M * 2**-shift``
    is exact: ``M`` has ``b <= 53`` bits and the scaling is a power of two) and ``torch.round`` (half to even)
    rounds it exactly as ``rshift_round_half_to_even`` would. A 31-bit (high-precision) multiplier allows
    ``|acc| < 2**22``; a 16-bit (default) one ``|acc| < 2**37``, which every saturated int32 accumulator meets.

    Speed only, same result: ``bound``, a known bound on ``|acc|`` (it replaces the data's maximum in the fast
    path's test); ``storage``, the integer dtype of the result (the saturated values, exactly).
    :func:`requantize_params` prepares the parameters once for repeated calls (:func:`apply_requantize`).
    """
    return apply_requantize(acc, requantize_params(multiplier, shift, dtype), bound=bound, storage=storage)


class RequantizeParams:
    """The parameters of :func:`requantize`, prepared once: ``multiplier``/``shift`` (ints or int64 tensors),
    the output ``dtype``, ``real = M * 2**-shift`` (float64, exact) and the fast path's ``exact_bound``; ``real32``:
    ``real`` in float32 where that is exact (else None), for accumulators below ``exact_bound32``."""

    __slots__ = ("multiplier", "shift", "dtype", "real", "exact_bound", "real32", "exact_bound32")

    def __init__(self, multiplier, shift, dtype: QuantDType, real, exact_bound: int):
        self.multiplier, self.shift, self.dtype, self.real, self.exact_bound = (
            multiplier, shift, dtype, real, exact_bound)
        # 2**(53 - b) >> 29 is 2**(24 - b): the float32 bound of the same multiplier bits (at least 1)
        self.real32, self.exact_bound32 = _float32_of(real), max(1, exact_bound >> 29)


def _float32_of(real: "float | torch.Tensor") -> "float | torch.Tensor | None":
    """``real`` as float32, where that is the same value (a multiplier below 2**24, a normal exponent)."""
    if isinstance(real, torch.Tensor):
        r32 = real.to(torch.float32)
        return r32 if torch.equal(r32.to(torch.float64), real) else None
    return real if struct.unpack("f", struct.pack("f", real))[0] == real else None


def requantize_params(multiplier: "int | torch.Tensor", shift: "int | torch.Tensor",
                      dtype: QuantDType) -> RequantizeParams:
    if isinstance(multiplier, torch.Tensor) or isinstance(shift, torch.Tensor):
        m = torch.as_tensor(multiplier).to(torch.int64)
        sh = shift.to(torch.int64) if isinstance(shift, torch.Tensor) else int(shift)
        real = m.to(torch.float64) * torch.pow(2.0, -torch.as_tensor(sh, dtype=torch.float64))
    else:
        m, sh = int(multiplier), int(shift)
        real = float(m) * 2.0 ** -sh
    return RequantizeParams(m, sh, dtype, real, _exact_bound(m) if not isinstance(m, torch.Tensor) or m.numel()
                            else 1)


def apply_requantize(acc: torch.Tensor, p: RequantizeParams, *, bound: "float | None" = None,
                     storage: torch.dtype = torch.int64, consume: bool = False) -> torch.Tensor:
    """:func:`requantize` with prepared parameters. ``consume`` (speed only): ``acc`` is a float64 temporary of
    the caller's, which may be overwritten."""
    amax = float(bound) if bound is not None else None
    if acc.numel():
        if amax is None or amax >= p.exact_bound:
            data = float(acc.abs().max() if acc.is_floating_point() else acc.to(torch.int64).abs().max())
            amax = data if amax is None else min(amax, data)
        y = None
        if amax < p.exact_bound32 and p.real32 is not None and not storage.is_floating_point:
            # |acc · M| < 2**24: the product is exact in float32 too (half the bytes of the float64 path)
            real, y = p.real32, acc.to(torch.float32, copy=True)
        elif amax < p.exact_bound:
            real = p.real
            if consume and acc.dtype == torch.float64:
                y = acc
            elif storage.is_floating_point:
                y = acc.to(torch.float64, copy=True)
            else:  # (the result is copied out into the integer storage type below)
                y = _float64_scratch(acc)
        if y is not None:  # (float32 or float64 above: the same steps)
            if isinstance(real, torch.Tensor) and _broadcast_shape(y.shape, real.shape) != y.shape:
                y = y * real
            else:
                y.mul_(real)
            return y.round_().clamp_(p.dtype.qmin, p.dtype.qmax).to(storage)
    else:
        amax = 0.0
    acc = acc.to(torch.int64)
    multiplier = p.multiplier
    prod = acc * multiplier
    if isinstance(multiplier, torch.Tensor):
        mmax = float(multiplier.abs().max()) if multiplier.numel() else 0.0
    else:
        mmax = abs(float(multiplier))
    # a bound on |acc · M| in Python ints (amax from float64: widened by its possible rounding, 2**-53 relative)
    exact = (int(amax) + (int(amax) >> 50) + 1) * int(mmax)
    y = rshift_round_half_to_even(prod, p.shift, bound=exact if exact <= 2**62 else None)
    return saturate(y, p.dtype).to(storage)


_SCRATCH = threading.local()
#: float64 temporaries of this many bytes come from a reused per-thread buffer (the buffer stays as large as the
#: largest such temporary seen: one activation's worth)
_SCRATCH_MIN_BYTES, _SCRATCH_MAX_BYTES = 1 << 20, 1 << 28


def _float64_scratch(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``t`` (contiguous), in a buffer this thread reuses while the copy is needed only until the
    caller's next call. glibc gives allocations above 32 MB fresh pages every time (its mmap threshold stops
    growing there), and on a large GEMM output the page faults of that temporary cost more than the requantize's
    arithmetic: the simulator's conv at batch 128 spent half its time there."""
    n = t.numel()
    if not _SCRATCH_MIN_BYTES <= n * 8 <= _SCRATCH_MAX_BYTES or t.device.type != "cpu":
        return t.to(torch.float64, copy=True)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float64)
    return buf[:n].view(t.shape).copy_(t)


def _broadcast_shape(a: "torch.Size", b: "torch.Size") -> tuple:
    """``torch.broadcast_shapes(a, b)`` for two concrete shapes, without its symbolic-shape machinery (which costs
    more than a small kernel); raises like it when they do not broadcast."""
    if a == b:
        return tuple(a)
    n = max(len(a), len(b))
    out = []
    for x, y in zip((1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise RuntimeError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
    return tuple(out)


def _exact_bound(multiplier: "int | torch.Tensor", digits: int = 53) -> int:
    """``2**(digits - b)``, ``b`` the most significant bits of a multiplier (its bit length without its trailing
    zeros, which only scale by a power of two): below it ``x · M`` is exact in float64, or in float32 with
    ``digits=24``. (``M = 2**15``, an unchanged scale, has 1: any int8 or int16 value times it is exact in float32.)"""
    values = multiplier.reshape(-1).tolist() if isinstance(multiplier, torch.Tensor) else [multiplier]
    bits = max((_odd_part(int(m)).bit_length() for m in values), default=0)
    return 2 ** max(0, digits - bits)


def _odd_part(m: int) -> int:
    """``|m|`` without its trailing zero bits (0 for 0)."""
    m = abs(m)
    return m >> ((m & -m).bit_length() - 1) if m else 0


def rescaled_sum(
    terms: "list[tuple[torch.Tensor, int, int, int]]", addend: "int | torch.Tensor", dtype: QuantDType,
    frac_bits: int, *, storage: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``docs/march.md`` §10: ``sat(rshift_rhe(Σ sign_i · rshift_rhe(q_i · M_i, shift_i − F) + addend, F))``.
    A ``shift_i`` may be an int64 tensor broadcast against ``q_i`` (a shift per output channel, §3.1).

    Each term ``(q_i, M_i, shift_i, sign_i)`` is rescaled to the output scale keeping ``F = frac_bits`` extra
    fractional bits (8 for the high-precision profile, 0 for the default one: each term is then rounded to whole
    output steps); the sum (plus ``addend``, already in those units) is rounded once (F = 0: not at all).
    ``storage`` (speed only): the integer dtype of the result.
    """
    frac = int(frac_bits)
    if frac < 0:
        raise QuantLensError(f"rescaled_sum: frac_bits must be >= 0, got {frac_bits!r}.")
    for q, mult, shift, sign in terms:
        if int(torch.as_tensor(shift).min()) < frac:
            raise QuantLensError(
                f"An add/sub input is rescaled with shift {shift}, below the {frac} fractional bits the sum keeps: "
                "its scale is too large next to the output scale for the march to rescale it. Check the observers "
                "of this op's inputs."
            )
    # a shift per channel (an output in channel-exponent form, §3.1) takes the int64 rule
    work = None if any(isinstance(t[2], torch.Tensor) for t in terms) else _rescale_dtype(terms, addend, frac)
    if work is not None:
        # Same result in float64: |q·M| < 2**53 is exact (the bound of _exact_bound: |q| < 2**22 for a 31-bit M,
        # 2**37 for a 16-bit one), scaling by powers of two is exact, torch.round is half to even, and the
        # int32-bounded terms and their sum (plus an int32 addend) are exact. Likewise in float32 where every
        # |q·M| and the sum stay below 2**24 (_rescale_dtype). (In place on fresh tensors; a term whose bound
        # |q|·M·2**(F - shift) is below 2**31 - 1 needs no int32 clamp, and takes its sign with the factor:
        # rounding half to even is symmetric.)
        total = None
        for q, mult, shift, sign in terms:
            factor = int(mult) * 2.0 ** (frac - int(shift))
            clamp = _STORAGE_MAGNITUDE.get(q.dtype, 2**63) * abs(factor) > 2**31 - 1
            t = q.to(work, copy=True).mul_(-factor if sign < 0 and not clamp else factor).round_()
            if clamp:
                t.clamp_(-(2**31), 2**31 - 1)
                if sign < 0:
                    t.neg_()
            if total is None:
                total = t
            else:
                shape = _broadcast_shape(total.shape, t.shape)
                if shape == total.shape:
                    total.add_(t)
                else:
                    total = t.add_(total) if shape == t.shape else total + t
        if total is None:
            total = torch.zeros((), dtype=work)
        if float(addend) != 0.0:
            total = total + float(addend) if total.dim() == 0 else total.add_(float(addend))
        if frac:
            total.mul_(2.0**-frac).round_()
        return total.clamp_(dtype.qmin, dtype.qmax).to(storage)
    total = torch.zeros((), dtype=torch.int64) + addend
    for q, mult, shift, sign in terms:
        t = torch.clamp(rshift_round_half_to_even(q.to(torch.int64) * int(mult), shift - frac), -(2**31), 2**31 - 1)
        total = total + (t if sign > 0 else -t)
    return saturate(rshift_round_half_to_even(total, frac), dtype).to(storage)


#: the largest magnitude of each integer storage dtype (a static bound on |q|, no pass over the data).
_STORAGE_MAGNITUDE = {torch.int8: 2**7, torch.int16: 2**15, torch.int32: 2**31, torch.uint8: 2**8 - 1,
                      torch.bool: 1}


def _rescale_dtype(terms: "list[tuple[torch.Tensor, int, int, int]]", addend: "int | torch.Tensor",
                   frac: int) -> "torch.dtype | None":
    """The float dtype :func:`rescaled_sum` computes in exactly: float32 where, from the terms' storage types
    alone, every ``|q·M| < 2**24`` and the rounded terms with the addend sum to below ``2**24`` (an int8 add with
    16-bit multipliers: half the bytes of float64); float64 where every ``|q·M| < 2**53`` (:func:`_exact_bound`);
    None: neither (the int64 rule)."""
    if not all(_magnitude_bound(q, mult) for q, mult, *_ in terms):
        return None
    total = abs(float(addend))
    for q, mult, shift, _ in terms:
        magnitude = _STORAGE_MAGNITUDE.get(q.dtype)
        if magnitude is None or magnitude * _odd_part(int(mult)) >= 2**24:  # (trailing zeros: exact scaling)
            return torch.float64
        total += magnitude * abs(int(mult)) * 2.0 ** (frac - int(shift)) + 0.5  # (+ 0.5: the rounding)
    return torch.float32 if total < 2**24 else torch.float64


def _magnitude_bound(q: torch.Tensor, mult: int) -> bool:
    """``max |q| < _exact_bound(mult)``: from the storage dtype when that suffices, else from the data."""
    if not q.numel():
        return True
    bound = _exact_bound(mult)
    if _STORAGE_MAGNITUDE.get(q.dtype, 2**63) < bound:
        return True
    return int(q.to(torch.int64).abs().max()) < bound


# -- the integer parameters convert derives from constants (docs/march.md §10, §10.1, §10.3, §11) -------------


def _rhe(v: float) -> int:
    """``v`` rounded half to even (Python's ``round``), exact on the float64 value."""
    return int(round(v))


def constant_addend(k: float, s_out: float, frac_bits: int) -> int:
    """§10 ``x ± k``: the constant enters the sum as ``rhe(k · 2**F / s_out)``, in units of ``2**-F`` output
    steps (``F = frac_bits``, the add rule's fractional bits of the profile), computed in float64."""
    frac = int(frac_bits)
    value = float(k) * 2.0**frac / float(s_out)
    if not math.isfinite(value) or abs(value) >= 2**31:
        raise QuantLensError(
            f"The constant {k!r} added at output scale {s_out!r} is {value:.4g} steps of 2**-{frac}: outside the "
            "int32 range of the sum. The output scale is far too small for this constant; check the add's observer."
        )
    return _rhe(value)


def clamp_codes(lo: float | None, hi: float | None, s_in: float) -> tuple[int, int]:
    """§10 clamp / hardtanh / relu6: the bounds as integers of the input grid rounded outward, ``floor(min / s_in)``
    and ``ceil(max / s_in)``; a missing or infinite bound is the int32 extreme (``clamp(min=0, max=inf)``: no upper
    bound). They only bound the integers before the requantize; the output codes of the bounds
    (:func:`constant_code` on the output grid) clamp the result."""
    low = -(2**31) if lo is None or float(lo) == -math.inf else max(-(2**31), math.floor(float(lo) / float(s_in)))
    high = 2**31 - 1 if hi is None or float(hi) == math.inf else min(2**31 - 1, math.ceil(float(hi) / float(s_in)))
    return low, high


def constant_code(value: float, scale: float, dtype: QuantDType) -> int:
    """§11: a constant written into an integer tensor (masked_fill, a constant pad, ``x[...] = v``) is
    ``sat(rhe(v / s))`` on that tensor's grid; ``±inf`` saturates to ``qmax``/``qmin``, NaN is written as 0."""
    v = float(value) / float(scale)
    if math.isnan(v):
        return 0
    if math.isinf(v):
        return dtype.qmax if v > 0 else dtype.qmin
    return int(min(max(_rhe(v), dtype.qmin), dtype.qmax))


def interpolation_weights(size_in: int, size_out: int, align_corners: bool) -> torch.Tensor:
    """§10.1: ``[size_out, size_in]`` int16 weights (sum 256 per row) of 1-D linear interpolation: torch's float
    weights for the same sizes, times 256, rounded half to even; each row's rounding residue goes to its largest
    weight (the first of equal ones)."""
    eye = torch.eye(size_in, dtype=torch.float64).reshape(size_in, 1, size_in)
    weights = torch.nn.functional.interpolate(eye, size=size_out, mode="linear", align_corners=align_corners)
    w = weights.reshape(size_in, size_out).t()  # [out, in]
    q = torch.round(w * 256).to(torch.int64)
    residue = 256 - q.sum(dim=1)
    q[torch.arange(size_out), w.argmax(dim=1)] += residue
    return q.to(torch.int16)


def channel_affine_params(a: torch.Tensor, b: torch.Tensor, s_x: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """§10.3 BatchNorm on its own, ``y = a_c·x + b_c``, as a depthwise 1x1 GEMM: ``(w, bias, s_w)`` with
    ``s_w = |a|/127`` (1 where ``a = 0``), int8 ``w = rhe(a / s_w)`` (±127) and int32 ``bias = sat(rhe(b / (s_x ·
    s_w)))``; the accumulator's scale is ``s_x · s_w``. Float64 throughout."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    s_w = torch.where(a == 0, torch.ones_like(a), a.abs() / 127.0)
    w = torch.round(a / s_w).to(torch.int8)
    bias = torch.clamp(torch.round(b / (float(s_x) * s_w)), -(2**31), 2**31 - 1).to(torch.int32)
    return w, bias, s_w
