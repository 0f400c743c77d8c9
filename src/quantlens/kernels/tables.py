"""Lookup tables of the march (``docs/march.md`` §13): their formats, construction and integer evaluation.

Two formats:

* :class:`Table256`: 256 entries, one per int8 input code, evaluated as a gather;
* :class:`SegmentedTable`: for wider inputs (int16, and the 17-bit softmax differences). The input domain is cut
  into segments; each segment holds ``E + 1`` entries sampled every ``2**p`` input codes (``p`` per segment), and
  the output is the integer linear interpolation between neighbouring entries, rounded half to even.

Entries are integers and are the normative content of a table: the evaluation (``lookup``) is pure integer
arithmetic, identical in ``pre_export`` and in the integer simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from quantlens.errors import QuantLensError
from quantlens.kernels.int_rounding import rshift_rhe_var
from quantlens.march.rules import LN_FRAC_BITS

__all__ = [
    "Table256",
    "SegmentedTable",
    "lut256_lookup",
    "segmented_lookup",
    "build_table256",
    "build_segmented_table",
    "minimax_segments",
    "recip_mantissa_table",
    "rsqrt_mantissa_table",
    "ln_mantissa_table",
    "MANTISSA_BITS",
    "MANTISSA_INTERVALS",
    "SEGMENTS",
    "INTERVALS",
    "FRAC_BITS",
    "default_frac_bits",
    "BISECTION_STEPS",
]

#: segments of a function table built with the curvature strategy (the domain ends are the outer bounds).
SEGMENTS = 8
#: interpolation intervals per segment; a segment holds INTERVALS + 1 entries.
INTERVALS = 64
#: extra fractional bits of a function table's entries (entries are at the output scale times 2**-FRAC_BITS).
FRAC_BITS = 8
#: entries are int32: values outside the output range are kept (they interpolate correctly up to the
#: saturation point), only clamped to the int32 range.
_ENTRY_MIN, _ENTRY_MAX = -(2**31), 2**31 - 1
#: halvings of the error target when placing segment bounds.
BISECTION_STEPS = 24

#: a float64 function of float64 input codes, returning the real output divided by the output scale
#: (i.e. in output steps), for example ``lambda q: torch.sigmoid(q * s_in) / s_out``.
OutputFn = Callable[[torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------------------
# 256-entry tables


@dataclass(frozen=True)
class Table256:
    """A 256-entry table: input code ``v`` (in ``[-offset, 255 - offset]``) reads ``entries[v + offset]``.

    Elementwise ops on int8 inputs use ``offset = 128`` (``entries[q + 128]``); the softmax exp table is indexed
    by the difference ``d = q - max(q)`` in ``[-255, 0]`` and uses ``offset = 255``.
    """

    entries: torch.Tensor  # int64 [256]
    offset: int = 128
    out_min: int = -128
    out_max: int = 127

    def __post_init__(self):
        if tuple(self.entries.shape) != (256,):
            raise QuantLensError(f"Table256 needs 256 entries, got shape {tuple(self.entries.shape)}.")

    def lookup(self, v: torch.Tensor) -> torch.Tensor:
        return lut256_lookup(v, self.entries, self.offset)

    @property
    def size(self) -> int:
        return 256


def lut256_lookup(v: torch.Tensor, entries: torch.Tensor, offset: int = 128) -> torch.Tensor:
    """``entries[v + offset]`` (a gather); ``v`` must lie in ``[-offset, 255 - offset]`` (int8 codes do)."""
    idx = v.to(torch.int64, copy=True).add_(int(offset))
    in_range = v.dtype in (torch.int8, torch.uint8) and (v.dtype == torch.int8) == (int(offset) == 128)
    if not in_range and idx.numel():  # int8 codes with offset 128 (uint8 with 0) are in range by their type
        lo, hi = (int(t) for t in torch.aminmax(idx))
        if lo < 0 or hi > 255:
            raise QuantLensError(
                f"A 256-entry table was indexed with codes outside [{-offset}, {255 - offset}]; its input is not "
                "int8."
            )
    return torch.take(entries.to(device=idx.device, dtype=torch.int64), idx)


def build_table256(fn: OutputFn, out_min: int, out_max: int, offset: int = 128) -> Table256:
    """``entries[i] = sat(rhe(fn(i - offset)))`` for ``i = 0..255``; ``fn`` is in output steps, float64."""
    codes = torch.arange(256, dtype=torch.float64) - offset
    values = fn(codes).to(torch.float64)
    entries = torch.round(values).clamp(out_min, out_max)
    entries = torch.nan_to_num(entries, nan=0.0)
    return Table256(entries.to(torch.int64), offset, out_min, out_max)


# ------------------------------------------------------------------------------------------------------------
# segmented tables


@dataclass(frozen=True)
class SegmentedTable:
    """A segmented table with linear interpolation (``docs/march.md`` §13.3).

    * ``bounds``: int64 ``[K + 1]``, strictly increasing. Segment ``k`` covers input codes
      ``[bounds[k], bounds[k + 1])``; the domain is ``[bounds[0], bounds[K] - 1]``.
    * ``shifts``: int64 ``[K]``; segment ``k`` samples every ``2**shifts[k]`` codes, with
      ``(bounds[k + 1] - bounds[k]) <= E * 2**shifts[k]``.
    * ``entries``: int64 ``[K, E + 1]``; ``entries[k, j]`` is the output at code ``bounds[k] + j * 2**shifts[k]``,
      in units of ``2**-frac_bits`` output steps.
    * ``out_min``, ``out_max``: the output saturates to this range.
    * ``tails``: int64 ``[2]``, the outputs for codes below and above the domain (the function's constant tails),
      or ``None``: codes outside are clamped to the domain (the mantissa tables, whose inputs never are).
    """

    bounds: torch.Tensor
    shifts: torch.Tensor
    entries: torch.Tensor
    frac_bits: int
    out_min: int
    out_max: int
    tails: torch.Tensor | None = None

    def __post_init__(self):
        k = self.shifts.numel()
        if self.bounds.numel() != k + 1 or self.entries.dim() != 2 or self.entries.shape[0] != k:
            raise QuantLensError("SegmentedTable: bounds [K+1], shifts [K] and entries [K, E+1] do not agree.")
        lengths = self.bounds[1:] - self.bounds[:-1]
        if bool((lengths <= 0).any()):
            raise QuantLensError("SegmentedTable: bounds must be strictly increasing.")
        if bool((lengths > self.intervals * torch.bitwise_left_shift(torch.ones_like(self.shifts), self.shifts)).any()):
            raise QuantLensError("SegmentedTable: a segment is longer than its entries cover.")

    @property
    def num_segments(self) -> int:
        return int(self.shifts.numel())

    @property
    def intervals(self) -> int:
        return int(self.entries.shape[1]) - 1

    @property
    def domain(self) -> tuple[int, int]:
        return int(self.bounds[0]), int(self.bounds[-1]) - 1

    @property
    def size(self) -> int:
        return int(self.entries.numel())

    def lookup(self, v: torch.Tensor) -> torch.Tensor:
        return segmented_lookup(
            v, self.bounds, self.shifts, self.entries, self.frac_bits, self.out_min, self.out_max, self.tails
        )


def segmented_lookup(
    v: torch.Tensor,
    bounds: torch.Tensor,
    shifts: torch.Tensor,
    entries: torch.Tensor,
    frac_bits: int,
    out_min: int,
    out_max: int,
    tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """Evaluate a segmented table on integer codes ``v`` (any shape); returns int64.

    Codes below (above) the domain give ``tails[0]`` (``tails[1]``); without tails they are clamped to the
    domain. Inside, ``k`` is the segment holding ``v``; ``o = v - bounds[k]``, ``j = o >> p``,
    ``r = o - (j << p)``, and the result is
    ``sat(rshift_rhe(entries[k, j] * (2**p - r) + entries[k, j + 1] * r, p + frac_bits))``.
    """
    dev = v.device
    bounds = bounds.to(device=dev, dtype=torch.int64)
    shifts = shifts.to(device=dev, dtype=torch.int64)
    entries = entries.to(device=dev, dtype=torch.int64)
    lo, hi = bounds[0], bounds[-1] - 1
    x = torch.minimum(torch.maximum(v.to(torch.int64), lo), hi)
    seg = torch.searchsorted(bounds[1:-1].contiguous(), x.reshape(-1).contiguous(), right=True).reshape(x.shape)
    p = shifts[seg]
    o = x - bounds[seg]
    j = torch.bitwise_right_shift(o, p)
    r = o - torch.bitwise_left_shift(j, p)
    width = entries.shape[1]
    flat = entries.reshape(-1)
    e0 = flat[seg * width + j]
    e1 = flat[seg * width + j + 1]
    step = torch.bitwise_left_shift(torch.ones_like(p), p)
    acc = e0 * (step - r) + e1 * r
    y = rshift_rhe_var(acc, p + int(frac_bits)).clamp(int(out_min), int(out_max))
    if tails is not None:
        tails = tails.to(device=dev, dtype=torch.int64)
        v = v.to(torch.int64)
        y = torch.where(v < lo, tails[0], torch.where(v > hi, tails[1], y))
    return y


def _constant_tails(y: torch.Tensor) -> tuple[int, int]:
    """Indices ``(first, last)`` of the domain: ``y`` is constant on ``[0, first - 1]`` and on
    ``[last + 1, n - 1]`` (maximal constant runs at both ends; at least one code stays in the domain)."""
    diff = (y[1:] != y[:-1]).nonzero().reshape(-1)
    if diff.numel() == 0:
        return 0, 0  # a constant: a one-code domain
    first, last = int(diff[0]) + 1, int(diff[-1])  # first code after the left run, last before the right run
    return first, max(first, last)


def _interp_error(vals: np.ndarray, ideal: np.ndarray, b: int, p: int, end: int, out_min: float,
                  out_max: float) -> float:
    """Max |float interpolation - saturated function| on codes [b, end) (offsets from the domain start) for a
    segment at ``b`` with step ``2**p``. ``vals``: the sampled function; ``ideal``: ``vals`` saturated."""
    o = np.arange(0, end - b, dtype=np.int64)
    j = o >> p
    r = (o - (j << p)).astype(np.float64)
    h = float(1 << p)
    left = vals[b + (j << p)]
    right = vals[b + ((j + 1) << p)]
    interp = np.clip((left * (h - r) + right * r) / h, out_min, out_max)
    return float(np.abs(interp - ideal[b:end]).max())


def _greedy_segments(error, length, segments, intervals, p_max, eps):
    bounds, shifts = [0], []
    b = 0
    while b < length:
        if len(shifts) == segments:
            return None
        p = p_max
        while p > 0 and error(b, p, min(b + (intervals << p), length)) > eps:
            p -= 1
        end = min(b + (intervals << p), length)
        shifts.append(p)
        bounds.append(end)
        b = end
    return bounds, shifts


def minimax_segments(
    fn: OutputFn, lo: int, hi: int, out_min: float, out_max: float, segments: int = SEGMENTS,
    intervals: int = INTERVALS, frac_bits: int = FRAC_BITS,
) -> tuple[list[int], list[int]]:
    """Segment bounds and step shifts on the integer domain ``[lo, hi]`` (``docs/march.md`` §13.3).

    Greedy from the left: each segment takes the largest step ``2**p`` whose float interpolation error (against
    the function saturated to ``[out_min, out_max]``, on every code of the segment) is at most ``eps``, and then
    spans its full reach ``E * 2**p`` (the last one ends at ``hi + 1``). ``eps`` is the smallest value, found by
    bisection (``BISECTION_STEPS`` halvings from the one-segment error), for which at most ``segments``
    segments reach ``hi``. Steep or bending parts of the curve therefore get short segments. The samples are
    taken as the entries will hold them (saturated to the int32 entry range), so the search sees what the
    table computes, apart from integer rounding.
    """
    length = hi - lo + 1
    p_max = 0
    while (intervals << p_max) < length:
        p_max += 1
    if p_max == 0:
        return [lo, hi + 1], [0]
    codes = torch.arange(lo, lo + length + (intervals << p_max) + 1, dtype=torch.float64)
    vals = torch.nan_to_num(fn(codes).to(torch.float64), nan=0.0, posinf=_ENTRY_MAX, neginf=_ENTRY_MIN)
    vals = vals.clamp(_ENTRY_MIN / 2.0**frac_bits, _ENTRY_MAX / 2.0**frac_bits).numpy()
    ideal = np.clip(vals, out_min, out_max)
    cache: dict[tuple[int, int], float] = {}

    def error(b: int, p: int, end: int) -> float:
        if (b, p) not in cache:
            cache[(b, p)] = _interp_error(vals, ideal, b, p, end, out_min, out_max)
        return cache[(b, p)]

    upper = error(0, p_max, length)
    best = _greedy_segments(error, length, segments, intervals, p_max, upper)
    low = 0.0
    for _ in range(BISECTION_STEPS):
        mid = (low + upper) / 2
        found = _greedy_segments(error, length, segments, intervals, p_max, mid)
        if found is None:
            low = mid
        else:
            upper, best = mid, found
    bounds, shifts = best
    return [lo + b for b in bounds], shifts


def default_frac_bits(out_min: int, out_max: int) -> int:
    """``F = min(8, 30 - bitlen(max(|out_min|, |out_max|)))``: 8 for int8/int16 outputs (the output range times
    ``2**F`` keeps a factor 2 of headroom in the int32 entries); 6 for the ``[0, 2**23]`` softmax exp table."""
    return min(FRAC_BITS, 30 - max(abs(int(out_min)), abs(int(out_max))).bit_length())


def build_segmented_table(
    fn: OutputFn,
    in_min: int,
    in_max: int,
    out_min: int,
    out_max: int,
    *,
    segments: int = SEGMENTS,
    intervals: int = INTERVALS,
    frac_bits: int | None = None,
) -> SegmentedTable:
    """A function table on the integer input range ``[in_min, in_max]`` (``docs/march.md`` §13.3).

    ``frac_bits`` defaults to :func:`default_frac_bits`.

    1. Domain and tails: the ideal outputs ``Y(q) = sat(rhe(fn(q)))`` are computed for every code. ``Y`` is
       constant on a maximal run at each end of the input range; the domain ``[lo, hi]`` is what lies between
       (at least one code), and ``tails = [Y(in_min), Y(in_max)]`` are the exact outputs outside it.
    2. Bounds and steps: :func:`minimax_segments` on ``[lo, hi]``.
    3. ``entries[k, j] = sat_int32(rhe(fn(b_k + j * 2**p_k) * 2**F))`` for ``j = 0 .. E`` (samples past the
       segment's end, or outside the output range, are kept: they interpolate correctly up to saturation).
    """
    if frac_bits is None:
        frac_bits = default_frac_bits(out_min, out_max)
    codes = torch.arange(in_min, in_max + 1, dtype=torch.float64)
    ideal = torch.nan_to_num(torch.round(fn(codes).to(torch.float64)), nan=0.0).clamp(out_min, out_max)
    i_lo, i_hi = _constant_tails(ideal)
    lo, hi = in_min + i_lo, in_min + i_hi
    tails = torch.tensor([int(ideal[0]), int(ideal[-1])], dtype=torch.int64)
    bounds, shifts = minimax_segments(fn, lo, hi, out_min, out_max, segments, intervals, frac_bits)
    rows = []
    scale = float(2**frac_bits)
    for b0, p in zip(bounds[:-1], shifts):
        xs = b0 + torch.arange(intervals + 1, dtype=torch.float64) * float(1 << p)
        e = torch.round(fn(xs).to(torch.float64) * scale)
        e = torch.nan_to_num(e, nan=0.0, posinf=_ENTRY_MAX, neginf=_ENTRY_MIN).clamp(_ENTRY_MIN, _ENTRY_MAX)
        rows.append(e.to(torch.int64))
    return SegmentedTable(
        torch.tensor(bounds, dtype=torch.int64), torch.tensor(shifts, dtype=torch.int64), torch.stack(rows),
        frac_bits, out_min, out_max, tails,
    )


# ------------------------------------------------------------------------------------------------------------
# mantissa tables (constants of the march)


def _rhe_div(num: int, den: int) -> int:
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    return q


_CONST_CACHE: dict[str, SegmentedTable] = {}


#: mantissas of the normalized reciprocal and rsqrt are 24-bit: the tables read their top bits and interpolate.
MANTISSA_BITS = 24
#: intervals per segment of the two mantissa tables.
MANTISSA_INTERVALS = 512


def recip_mantissa_table() -> SegmentedTable:
    """``R(m) ~ 2**46 / m`` for 24-bit mantissas ``m`` in ``[2**23, 2**24)`` (``docs/march.md`` §13.1).

    One segment, step ``2**14``, 513 entries ``rhe(2**46 / (2**23 + j * 2**14))`` (exact integer arithmetic), no
    fractional bits; values in ``[2**22, 2**23]``.
    """
    if "recip" not in _CONST_CACHE:
        xs = [(1 << 23) + (j << 14) for j in range(MANTISSA_INTERVALS + 1)]
        entries = torch.tensor([[_rhe_div(1 << 46, x) for x in xs]], dtype=torch.int64)
        _CONST_CACHE["recip"] = SegmentedTable(
            torch.tensor([1 << 23, 1 << 24]), torch.tensor([14]), entries, 0, 1 << 22, 1 << 23
        )
    return _CONST_CACHE["recip"]


def rsqrt_mantissa_table() -> SegmentedTable:
    """``S(m) ~ 2**34 / sqrt(m)`` for mantissas ``m`` in ``[2**22, 2**24)`` (``docs/march.md`` §13.1).

    Two segments, ``[2**22, 2**23)`` with step ``2**13`` and ``[2**23, 2**24)`` with step ``2**14``, 513 entries
    each, ``rhe(2**34 / sqrt(x)) = (isqrt(2**70 // x) + 1) // 2`` (exact), no fractional bits; values in
    ``[2**22, 2**23]``.
    """
    if "rsqrt" not in _CONST_CACHE:
        rows = []
        for start, p in ((1 << 22, 13), (1 << 23, 14)):
            rows.append(
                [(math.isqrt((1 << 70) // (start + (j << p))) + 1) // 2 for j in range(MANTISSA_INTERVALS + 1)]
            )
        _CONST_CACHE["rsqrt"] = SegmentedTable(
            torch.tensor([1 << 22, 1 << 23, 1 << 24]), torch.tensor([13, 14]),
            torch.tensor(rows, dtype=torch.int64), 0, 1 << 22, 1 << 23,
        )
    return _CONST_CACHE["rsqrt"]


def ln_mantissa_table() -> SegmentedTable:
    """``LN(m) ~ ln(m · 2**-23) · 2**24`` for 24-bit mantissas ``m`` in ``[2**23, 2**24)`` (``docs/march.md``
    §13.6.1, the log_softmax's ``ln`` of its exp sum).

    One segment, step ``2**14``, 513 entries ``rhe(log1p(j / 512) · 2**24)`` (float64), no fractional bits; values in
    ``[0, LN(2**24)]``, the last entry being ``rhe(ln 2 · 2**24) = 11629080``.
    """
    if "ln" not in _CONST_CACHE:
        entries = [round(math.log1p(j / MANTISSA_INTERVALS) * float(1 << LN_FRAC_BITS))
                   for j in range(MANTISSA_INTERVALS + 1)]
        _CONST_CACHE["ln"] = SegmentedTable(
            torch.tensor([1 << 23, 1 << 24]), torch.tensor([14]), torch.tensor([entries], dtype=torch.int64), 0, 0,
            entries[-1],
        )
    return _CONST_CACHE["ln"]
