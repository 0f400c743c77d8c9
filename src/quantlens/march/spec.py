"""The integer NPU architecture ("march") that quantlens targets.

This module is the executable half of ``docs/march.md``: every number that the fake quant, the lookup tables
and the integer simulator share lives here, and nowhere else. Change the spec and this file together.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterator

from quantlens.errors import QuantLensError
from quantlens.march.ort_cpu import KernelVariant, detect_variant, parse_variant

#: version of docs/march.md that this module implements.
SPEC_VERSION = 6

__all__ = [
    "SPEC_VERSION", "QuantDType", "RoundingMode", "Qpp", "QppSpec", "CostModel", "MarchSpec", "March", "set_march",
    "get_march", "get_variant", "using_march", "march_named",
]


class QuantDType(str, Enum):
    """Integer storage types of the march. All have zero point 0: the signed ones are symmetric, ``quint8``
    (``[0, 255]``) holds a non-negative activation of a march with ``unsigned_activations`` (``March.ORT_CPU``)."""

    qint8 = "qint8"
    qint16 = "qint16"
    qint32 = "qint32"
    quint8 = "quint8"

    # (plain dict lookups: the simulator reads these per op, and an Enum's ``.value`` is a descriptor call)
    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def qmin(self) -> int:
        return _QMIN[self]

    @property
    def qmax(self) -> int:
        return _QMAX[self]

    @classmethod
    def of_range(cls, qmin: int, qmax: int) -> "QuantDType":
        """The type whose codes are exactly ``[qmin, qmax]`` (a fake quant's bounds); none is a clear error."""
        for dtype in cls:
            if _QMIN[dtype] == qmin and _QMAX[dtype] == qmax:
                return dtype
        raise QuantLensError(f"No quantized dtype has the range [{qmin}, {qmax}]; expected one of "
                             f"{[(d.value, _QMIN[d], _QMAX[d]) for d in cls]}.")

    @classmethod
    def parse(cls, value: "QuantDType | str") -> "QuantDType":
        """Accept ``QuantDType.qint8``, ``"qint8"`` or ``"int8"``; anything else is a clear error."""
        if isinstance(value, QuantDType):
            return value
        text = str(value).replace("torch.", "")
        if not text.startswith("q"):
            text = "q" + text
        try:
            return cls(text)
        except ValueError:
            raise QuantLensError(
                f"Unknown quantized dtype {value!r}. Expected one of {[d.value for d in cls]} "
                "(or 'int8'/'int16'/'int32'/'uint8')."
            ) from None


_BITS = {QuantDType.qint8: 8, QuantDType.qint16: 16, QuantDType.qint32: 32, QuantDType.quint8: 8}
_QMIN = {d: -(1 << (b - 1)) for d, b in _BITS.items()}
_QMAX = {d: (1 << (b - 1)) - 1 for d, b in _BITS.items()}
_QMIN[QuantDType.quint8], _QMAX[QuantDType.quint8] = 0, 255


class RoundingMode(str, Enum):
    """How a real value becomes an integer. The march uses one mode for quantize and requantize alike."""

    HALF_TO_EVEN = "half_to_even"


class Qpp(str, Enum):
    """Requantize precision profile ("qpp"): the NPU's cheap default arithmetic, or the high-precision one that
    costs more cycles (``docs/march.md`` §8)."""

    DEFAULT = "default"
    HIGH_PRECISION = "high_precision"

    @classmethod
    def parse(cls, value: "Qpp | str | bool") -> "Qpp":
        """Accept a ``Qpp``, its value (``"default"``/``"high_precision"``) or a bool (``True``: high precision)."""
        if isinstance(value, Qpp):
            return value
        if isinstance(value, bool):
            return cls.HIGH_PRECISION if value else cls.DEFAULT
        try:
            return cls(str(value))
        except ValueError:
            raise QuantLensError(f"Unknown qpp {value!r}. Expected one of {[q.value for q in cls]}.") from None


@dataclass(frozen=True)
class QppSpec:
    """The arithmetic of one requantize precision profile (``docs/march.md`` §8, §10)."""

    #: requantize multipliers are integers in ``[2**(multiplier_bits-1), 2**multiplier_bits)`` (§8.1).
    multiplier_bits: int
    #: extra fractional bits kept by the rescaled terms of add/sub before their final rounding (§10); 0: each
    #: term is rounded to whole output steps and the rounded terms are summed.
    elementwise_frac_bits: int


@dataclass(frozen=True)
class CostModel:
    """Cycle costs of the march's units (``docs/march.md`` §15), read by ``quantlens.compiler.cost``.

    A *vector pass* processes ``vector_lanes`` elements per cycle; a requantize costs ``requant_passes_*``
    passes per element (0 when the multiplier is exactly 1)."""

    #: NPU clock in MHz (cycles per microsecond).
    clock_mhz: float = 1000.0
    #: GEMM MACs per cycle, int8 x int8.
    macs_per_cycle_int8: int = 1024
    #: GEMM MACs per cycle when one operand is int16 (int8 x int16; bilinear's int16 weights).
    macs_per_cycle_int16: int = 256
    #: elements per cycle of one vector pass (add, compare, select, move, pooling sums, boundary (de)quantize).
    vector_lanes: int = 64
    #: table lookups per cycle (§13), all table ops.
    table_lookups_per_cycle: int = 16
    #: vector passes of one requantize per element: a pure power-of-two multiplier (a rounding shift) ...
    requant_passes_shift: int = 1
    #: ... a multiplier of at most 16 bits (one 16x32 multiply with its rounding shift, qpp DEFAULT) ...
    requant_passes_default: int = 2
    #: ... and a wider one (32x32 -> 64-bit multiply, 64-bit rounding shift, qpp HIGH_PRECISION).
    requant_passes_high_precision: int = 4
    #: NPU cycles per output element of an op on the host (the partition, §12): the host CPU's float op, counted
    #: on the NPU's clock (a few scalar-vector float ops per element on an application core).
    host_cycles_per_element: float = 4.0
    #: NPU cycles of one hand-over between the NPU and the host (a dequantize whose value a host op reads, or a
    #: quantize of a host result): the synchronisation and the transfer's latency, whatever its size.
    crossing_cycles: int = 2000


@dataclass(frozen=True)
class MarchSpec:
    """The numeric contract of one integer NPU architecture (see ``docs/march.md``)."""

    name: str
    activation_dtypes: tuple[QuantDType, ...]
    weight_dtypes: tuple[QuantDType, ...]
    accumulator_dtype: QuantDType
    high_precision_output_dtype: QuantDType
    rounding: RoundingMode
    #: smallest scale an observer may produce; guards all-zero tensors.
    min_scale: float
    #: requantize multipliers of the high-precision profile are integers in [2**(bits-1), 2**bits); kept for
    #: compatibility (spec v4 readers): ``qpp(Qpp.HIGH_PRECISION).multiplier_bits`` is the source of truth.
    requant_multiplier_bits: int
    #: largest right shift a requantize may use.
    max_requant_shift: int
    #: whether a conv/linear/matmul may take int16 on both operands.
    allow_int16_x_int16_gemm: bool
    #: F of the high-precision add/sub (§10); kept for compatibility, like ``requant_multiplier_bits``.
    elementwise_frac_bits: int = 8
    #: the two requantize precision profiles (§8); the source of truth for the multiplier width and F.
    default_qpp: QppSpec = QppSpec(multiplier_bits=16, elementwise_frac_bits=0)
    high_precision_qpp: QppSpec = QppSpec(multiplier_bits=31, elementwise_frac_bits=8)
    #: cycle costs (§15).
    cost: CostModel = CostModel()
    #: requantize multipliers are float32 numbers applied in float32 (a CPU runtime's kernels), not the integer
    #: multiplier and rounding shift of §8 (``docs/march_ort.md``).
    float_requantize: bool = False
    #: an activation whose observer saw no negative value takes ``quint8`` (``[0, 255]``, zero point 0): a ReLU
    #: before it is then the requantize's clamp, which a runtime fuses into its integer kernel.
    unsigned_activations: bool = False
    #: whether the march computes table ops (softmax, GELU, layer norm ...) in integer; without, they run on the
    #: host in float between a dequantize and a quantize.
    tables: bool = True
    #: bits of a channel exponent (§3.1): an activation may take per-channel scales ``s · 2**-k_c`` with
    #: ``0 <= k_c < 2**bits`` (its consumers shift it onto one grid); 0: per-tensor activation scales only.
    channel_exponent_bits: int = 0

    def qpp(self, q: "Qpp | str") -> QppSpec:
        """The arithmetic of requantize precision profile ``q`` (§8)."""
        return self.high_precision_qpp if Qpp.parse(q) is Qpp.HIGH_PRECISION else self.default_qpp

    def scale_from_range(self, min_val: float, max_val: float, dtype: QuantDType) -> float:
        """Scale of a symmetric quantizer covering ``[min_val, max_val]``: ``max(|min|, |max|) / qmax``.

        The result is rounded to float32 (scales are stored as float32) and is at least ``min_scale``.
        """
        if not (math.isfinite(min_val) and math.isfinite(max_val)):
            raise QuantLensError(
                f"Cannot derive a {dtype.value} scale from a non-finite range [{min_val}, {max_val}]. "
                "An observer saw NaN/Inf; check the model input or the op that produced it."
            )
        absmax = max(abs(min_val), abs(max_val))
        scale = max(absmax / dtype.qmax, self.min_scale)
        return float(_to_float32(scale))


def _to_float32(value: float) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


_QL1 = MarchSpec(
    name="ql1",
    activation_dtypes=(QuantDType.qint8, QuantDType.qint16),
    weight_dtypes=(QuantDType.qint8, QuantDType.qint16),
    accumulator_dtype=QuantDType.qint32,
    high_precision_output_dtype=QuantDType.qint32,
    rounding=RoundingMode.HALF_TO_EVEN,
    min_scale=2.0**-24,
    requant_multiplier_bits=31,
    max_requant_shift=62,
    allow_int16_x_int16_gemm=False,
    channel_exponent_bits=2,
)
#: QL1's numbers where the runtime has none of its own (the requantize profiles and cost model are QL1's, unused)
_ORT_CPU = replace(_QL1, name="ort_cpu", activation_dtypes=(QuantDType.qint8, QuantDType.quint8),
                   weight_dtypes=(QuantDType.qint8,), float_requantize=True, unsigned_activations=True, tables=False,
                   channel_exponent_bits=0)


class March(Enum):
    """Integer architectures quantlens knows. ``QL1`` (the default) is the seed's NPU (``docs/march.md``);
    ``ORT_CPU`` is onnxruntime's CPU execution of a QDQ model, its fused int8 kernels and their kernel variant
    (``docs/march_ort.md``)."""

    QL1 = _QL1
    ORT_CPU = _ORT_CPU

    @property
    def spec(self) -> MarchSpec:
        return self.value


_current_march: March = March.QL1
_current_variant: "KernelVariant | None" = None


def march_named(name: str) -> March:
    """The march whose spec is named ``name`` (an IR's or a prepared model's ``march``, e.g. ``"ql1"``)."""
    return _parse_march(name)


def _parse_march(march: "March | str") -> March:
    if isinstance(march, str):
        by_name = {m.spec.name: m for m in March}
        found = by_name.get(march.lower()) or March.__members__.get(march.upper())
        if found is None:
            raise QuantLensError(f"Unknown march {march!r}. Known: {[m.name for m in March]}.")
        return found
    if not isinstance(march, March):
        raise QuantLensError(f"set_march expects a quantlens.March, got {type(march).__name__}.")
    return march


def set_march(march: "March | str", variant: "KernelVariant | str | None" = None) -> None:
    """Select the target architecture. Call it before ``prepare``.

    ``variant`` (``March.ORT_CPU`` only): the CPU kernel variant whose arithmetic the integer model reproduces,
    ``"vnni"`` or ``"avx2"`` (:class:`~quantlens.march.ort_cpu.KernelVariant`); by default the one this machine's
    CPU runs (:func:`~quantlens.march.ort_cpu.detect_variant`), so one machine can predict what another computes."""
    global _current_march, _current_variant
    march = _parse_march(march)
    if variant is not None and march is not March.ORT_CPU:
        raise QuantLensError(f"set_march: a kernel variant ({variant!r}) belongs to March.ORT_CPU, not {march.name}.")
    if march is March.ORT_CPU:
        variant = detect_variant() if variant is None else parse_variant(variant)
    _current_march, _current_variant = march, variant


def get_march() -> March:
    """The architecture selected with :func:`set_march` (``March.QL1`` by default)."""
    return _current_march


def get_variant() -> "KernelVariant | None":
    """The CPU kernel variant of ``March.ORT_CPU`` selected with :func:`set_march` (``None`` for another march)."""
    return _current_variant


@contextlib.contextmanager
def using_march(march: "March | str", variant: "KernelVariant | str | None" = None) -> Iterator[None]:
    """Within the block, :func:`get_march` is ``march`` (an IR's own march while it is converted or run); the
    selected march comes back after it."""
    global _current_march, _current_variant
    saved = _current_march, _current_variant
    set_march(march, variant)
    try:
        yield
    finally:
        _current_march, _current_variant = saved
