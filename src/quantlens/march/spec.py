"""The integer NPU architecture ("march") that quantlens targets.

This module is the executable half of ``docs/march.md``: every number that the fake quant, the lookup tables
and the integer simulator share lives here, and nowhere else. Change the spec and this file together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from quantlens.errors import QuantLensError

#: version of docs/march.md that this module implements.
SPEC_VERSION = 6

__all__ = [
    "SPEC_VERSION", "QuantDType", "RoundingMode", "Qpp", "QppSpec", "CostModel", "MarchSpec", "March", "set_march",
    "get_march",
]


class QuantDType(str, Enum):
    """Integer storage types of the march. All are symmetric (zero point 0)."""

    qint8 = "qint8"
    qint16 = "qint16"
    qint32 = "qint32"

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
                "(or 'int8'/'int16'/'int32')."
            ) from None


_BITS = {QuantDType.qint8: 8, QuantDType.qint16: 16, QuantDType.qint32: 32}
_QMIN = {d: -(1 << (b - 1)) for d, b in _BITS.items()}
_QMAX = {d: (1 << (b - 1)) - 1 for d, b in _BITS.items()}


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


class March(Enum):
    """Integer NPU architectures quantlens knows. ``QL1`` is the only one, and the default."""

    QL1 = MarchSpec(
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
    )

    @property
    def spec(self) -> MarchSpec:
        return self.value


_current_march: March = March.QL1


def set_march(march: "March | str") -> None:
    """Select the target architecture. Call it before ``prepare``."""
    global _current_march
    if isinstance(march, str):
        try:
            march = March[march.upper()]
        except KeyError:
            raise QuantLensError(
                f"Unknown march {march!r}. Known: {[m.name for m in March]}."
            ) from None
    if not isinstance(march, March):
        raise QuantLensError(f"set_march expects a quantlens.March, got {type(march).__name__}.")
    _current_march = march


def get_march() -> March:
    """The architecture selected with :func:`set_march` (``March.QL1`` by default)."""
    return _current_march
