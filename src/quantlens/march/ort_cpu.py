"""The rules of onnxruntime's CPU int8 kernels: the spec half of the ORT_CPU target (``docs/march_ort.md``).

What onnxruntime's CPU execution provider computes for a QDQ model after its default graph optimizations, stated
as functions from scales, zero points and constants to each fused kernel's parameters. The kernels that execute
them on integer codes are :mod:`quantlens.kernels.ort_cpu`; ``tests/test_ort_cpu_rules.py`` holds every rule
against the real runtime, op by op, bit for bit.

Conventions (every value is what the runtime holds, in the dtype it holds it):

* scales are float32; ``fl(.)`` is rounding to float32, and every rule below says in which order the runtime
  rounds (``fl(fl(s_x * s_w) / s_y)`` is not ``fl(s_x * s_w / s_y)``);
* zero points and codes are the runtime's: on x86 an int8 activation's QuantizeLinear/DequantizeLinear pair is
  rewritten to uint8 before fusion (code + 128, zero point + 128; :data:`X86_ACTIVATION_SHIFT`), so the fused
  kernels see uint8 activations and int8 weights; the float constants of QLinearAdd/QLinearMul depend on that;
* rounding is half to even (the CPU's default mode) everywhere.
"""

from __future__ import annotations

import math
import os
from enum import Enum

import torch

from quantlens.errors import QuantLensError

__all__ = [
    "KernelVariant", "detect_variant", "parse_variant", "X86_ACTIVATION_SHIFT", "gemm_multiplier",
    "add_constants", "mul_multiplier", "global_average_multiplier", "lookup_table", "mlas_logistic",
    "leaky_relu", "LOGISTIC_RANGE", "softmax_table", "softmax_output_scale",
]

#: x86: an int8 activation Q/DQ pair runs as uint8, ``code + 128`` with ``zero_point + 128`` (onnxruntime's
#: QDQS8ToU8 transform runs before fusion because its x86 kernels take uint8 activations)
X86_ACTIVATION_SHIFT = 128


class KernelVariant(str, Enum):
    """The CPU's kernel for uint8 x int8 dot products (MLAS picks it from the CPU's features, no option overrides it).

    * ``VNNI`` (AVX512-VNNI, AVX-VNNI, AMX): ``vpdpbusd``-class instructions sum the products exactly in int32;
    * ``AVX2`` (AVX2, or AVX512 without VNNI): ``vpmaddubsw`` adds each two adjacent products along the reduction
      axis and saturates that pair sum to int16 before the int32 sum (the u8s8 overflow).
    """

    VNNI = "vnni"
    AVX2 = "avx2"


def parse_variant(value: "KernelVariant | str") -> KernelVariant:
    """A :class:`KernelVariant` from itself or its value; anything else is a clear error."""
    try:
        return KernelVariant(value)
    except ValueError:
        raise QuantLensError(f"Unknown onnxruntime CPU kernel variant {value!r}; expected one of "
                             f"{[v.value for v in KernelVariant]}.") from None


_VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def detect_variant(cpuinfo: str | None = None) -> KernelVariant:
    """The kernel variant of this machine's CPU: ``VNNI`` when its flags name a VNNI (or AMX int8) unit, else
    ``AVX2``. Reads ``/proc/cpuinfo`` (or the text given); elsewhere numpy's view of the CPU's features."""
    if cpuinfo is None and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpuinfo = f.read()
    if cpuinfo is not None:
        flags = set()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                flags.update(value.split())
        return KernelVariant.VNNI if flags & _VNNI_FLAGS else KernelVariant.AVX2
    from numpy._core._multiarray_umath import __cpu_features__  # (no public API; numpy's dispatch reads it)

    return KernelVariant.VNNI if __cpu_features__.get("AVX512VNNI") else KernelVariant.AVX2


def _f32(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32)


def gemm_multiplier(s_x, s_w, s_y) -> torch.Tensor:
    """QLinearConv / QLinearMatMul / QGemm: the float32 multiplier of the int32 accumulator,
    ``fl(fl(s_x * s_w) / s_y)``, per output channel when ``s_w`` is."""
    return (_f32(s_x) * _f32(s_w)) / _f32(s_y)


def add_constants(s_a, z_a: int, s_b, z_b: int, s_c, z_c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QLinearAdd: ``(r_a, r_b, f)`` with ``r_a = fl(s_a / s_c)``, ``r_b = fl(s_b / s_c)`` and
    ``f = fl(z_c - fl(fl(r_a * z_a) + fl(r_b * z_b)))``; the output is ``sat(RNE(fma(a, r_a, fma(b, r_b, f))))``
    on the input codes (the zero points are folded into ``f``)."""
    r_a, r_b = _f32(s_a) / _f32(s_c), _f32(s_b) / _f32(s_c)
    f = _f32(float(z_c)) - (r_a * _f32(float(z_a)) + r_b * _f32(float(z_b)))
    return r_a, r_b, f


def mul_multiplier(s_a, s_b, s_c) -> torch.Tensor:
    """QLinearMul: ``fl(fl(s_a * s_b) / s_c)``; the output is ``sat(RNE(fl(fl(p * r) + z_c)))`` with
    ``p = (a - z_a)(b - z_b)`` exact."""
    return (_f32(s_a) * _f32(s_b)) / _f32(s_c)


def global_average_multiplier(s_x, s_y, count: int) -> torch.Tensor:
    """QLinearGlobalAveragePool: ``fl(s_x / fl(s_y * N))`` applied to ``sum(x) - z_x * N`` (int32), ``N`` the
    elements averaged. The runtime refuses a multiplier outside ``[2**-32, 256)`` or ``N >= 2**24``."""
    if count >= 1 << 24:
        raise QuantLensError(f"QLinearGlobalAveragePool averages {count} elements; onnxruntime allows fewer than 2**24.")
    m = _f32(s_x) / (_f32(s_y) * _f32(float(count)))
    if not (2.0**-32 <= float(m) < 256.0):
        raise QuantLensError(f"QLinearGlobalAveragePool's multiplier {float(m)} (s_x / (s_y * {count})) is outside "
                             "onnxruntime's [2**-32, 256).")
    return m


#: MLAS clamps the logistic's input to this range (the rational approximation is exact to float32 there)
LOGISTIC_RANGE = 18.0
# the rational approximation MLAS shares with Eigen: p(x) = x * P(x^2), q(x) = Q(x^2), odd powers of P then even of Q
_LOGISTIC_P = (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03,
               2.48287947061529e-01)
_LOGISTIC_Q = (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03,
               1.16817656904453e-01, 9.93151921023180e-01)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl(a * b + c)`` rounded once (a fused multiply-add in float32) for float32 tensors.

    The product of two float32 values is exact in float64; the sum is rounded to float64 *to odd* (its last bit
    set when inexact), which makes the final rounding to float32 the one correct rounding of the exact value."""
    a64, b64, c64 = a.to(torch.float64), b.to(torch.float64), c.to(torch.float64)
    p = a64 * b64
    s = p + c64
    # TwoSum: the exact error of s
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    bits = s.view(torch.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact_even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def mlas_logistic(x: torch.Tensor) -> torch.Tensor:
    """The logistic function as onnxruntime's CPU kernels compute it (the FMA form of MLAS's rational
    approximation, what a QLinearSigmoid table samples): float32 in, float32 out."""
    x = x.to(torch.float32).clamp(-LOGISTIC_RANGE, LOGISTIC_RANGE)
    x2 = x * x
    p = _f32(_LOGISTIC_P[0]).expand_as(x2)
    p = fma32(x2, p, _f32(_LOGISTIC_P[1]).expand_as(x2))
    for c in _LOGISTIC_P[2:]:
        p = fma32(p, x2, _f32(c).expand_as(x2))
    p = p * x
    q = fma32(x2, _f32(_LOGISTIC_Q[0]).expand_as(x2), _f32(_LOGISTIC_Q[1]).expand_as(x2))
    for c in _LOGISTIC_Q[2:]:
        q = fma32(q, x2, _f32(c).expand_as(x2))
    return ((p / q) + 0.5).clamp(0.0, 1.0)


def leaky_relu(alpha: float):
    """QLinearLeakyRelu's function: ``x`` where ``x >= 0``, else ``fl(alpha * x)``."""
    a = _f32(alpha)
    return lambda x: torch.where(x >= 0, x, a * x)


def lookup_table(fn, s_x, z_x: int, s_y, z_y: int, qmin: int, qmax: int) -> torch.Tensor:
    """The 256-entry table of a QLinear lookup op (Sigmoid, LeakyRelu, and Concat's requantize of an input on
    another grid), indexed by ``code - qmin``: ``table[i] = Q(fn(fl(s_x * (code_i - z_x))))``, ``Q`` the
    QuantizeLinear rule (``fl(v / s_y)``, half to even, ``+ z_y``, saturated)."""
    codes = torch.arange(qmin, qmax + 1, dtype=torch.int32)
    d = _f32(s_x) * (codes - z_x).to(torch.float32)
    v = fn(d).to(torch.float32) / _f32(s_y)
    return (torch.round(v.clamp(qmin - z_y, qmax - z_y)) + z_y).to(torch.int32)


def softmax_table(s_x, length: int) -> torch.Tensor:
    """QLinearSoftmax's float32 table over the 256 uint8 codes, for rows of ``length`` elements:
    ``table[i] = fl(exp((i - 255 + b) * s_x))`` in float64, ``b = max(0, ln(FLT_MAX / length) - 5) / s_x`` (a shift
    that keeps the row's sum finite; softmax does not depend on it). A row uses the table shifted so that its
    largest code reads entry 255; the input's zero point plays no part."""
    s = float(_f32(s_x))
    shift = max(0.0, math.log(float(torch.finfo(torch.float32).max) / length) - 5.0) / s
    i = torch.arange(256, dtype=torch.float64)
    return torch.exp((i - 255 + shift) * s).to(torch.float32)


def softmax_output_scale(s_y) -> torch.Tensor:
    """QLinearSoftmax's output multiplier: ``floor(1 / s_y)`` in float32 (the output scale is taken as its
    reciprocal's integer part: exact for ``s_y = 1/256``)."""
    return torch.floor(_f32(1.0) / _f32(s_y))
