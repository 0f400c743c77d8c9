"""What every advisor rule shares: the thresholds (documented in ``docs/profiler.md`` and repeated in the report
header), a finding, what a rule reads (:class:`AdvisorContext`) and the small helpers of the rules' texts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from quantlens._registry import make_registry
from quantlens.profiler.compare import LayerComparison, LayerRow

__all__ = ["Finding", "AdvisorContext", "Rule", "registrar", "THRESHOLDS", "INT8_RANGE_LIMIT", "INT16_RANGE_LIMIT",
           "SAME_INPUT_SQNR_LIMIT", "ACC_SATURATION_LIMIT", "REQUANT_SATURATION_LIMIT", "TABLE_CLIP_LIMIT",
           "EXPORT_FLOAT_NOISE_SQNR", "TABLE_SQNR_LIMIT"]

#: an int8 range beyond this makes the int8 step exceed 1.0 (127 steps of 1.0 ~ 128): ask for int16
INT8_RANGE_LIMIT = 128.0
#: beyond this even an int16 step exceeds 1.0: the range itself is the problem
INT16_RANGE_LIMIT = 32768.0
#: a same-input SQNR below this (dB) means the op itself loses precision (int8 on well-scaled data gives ~35-45)
SAME_INPUT_SQNR_LIMIT = 20.0

#: deployed stages: a fraction of GEMM accumulators beyond int32 above this is reported (any saturation is)
ACC_SATURATION_LIMIT = 0.0
#: deployed stages: a fraction of outputs saturated by the integer op (not by the fake quant) above this
REQUANT_SATURATION_LIMIT = 0.0
#: deployed stages: a fraction of table inputs clipped where the table is not flat above this
TABLE_CLIP_LIMIT = 0.01
#: export: a same-input SQNR below this (dB) on an op without an integer grid is more than float32 noise
EXPORT_FLOAT_NOISE_SQNR = 120.0
#: pre_export: a table site whose same-input SQNR (table vs float op + output fake quant) is below this (dB);
#: healthy tables measure >= 50 dB (int8 output, calibrated) and ~95 dB (int16)
TABLE_SQNR_LIMIT = 40.0

THRESHOLDS = {
    "int8 range limit": INT8_RANGE_LIMIT,
    "int16 range limit": INT16_RANGE_LIMIT,
    "same-input SQNR limit (dB)": SAME_INPUT_SQNR_LIMIT,
    "scale coverage tolerance (steps)": 1.0,
    "accumulator saturation limit (fraction)": ACC_SATURATION_LIMIT,
    "requantize saturation limit (fraction)": REQUANT_SATURATION_LIMIT,
    "table input clip limit (fraction)": TABLE_CLIP_LIMIT,
    "export float noise SQNR (dB)": EXPORT_FLOAT_NOISE_SQNR,
    "pre_export table SQNR limit (dB)": TABLE_SQNR_LIMIT,
}


@dataclass(frozen=True)
class Finding:
    rule: str
    op_name: str
    op_type: str
    info: str
    advice: str


@dataclass
class AdvisorContext:
    comparison: LayerComparison
    analysis_type: str
    fake_quant_state: str | None  # of the analysis model (None: not a prepared model)
    #: the consistency level the models were built with (``model_access.ConsistencyInfo``; None: not known)
    consistency: Any = None


Rule = Callable[[AdvisorContext], list[Finding]]


def registrar(table: dict[str, Rule]) -> Callable[[str], Callable[[Rule], Rule]]:
    """``@registrar(table)("name")`` on a rule adds it to ``table`` under that name (the tables keep the rules
    in the order they are registered, which is the order :func:`advise` runs them); a repeated name is an error."""
    return make_registry("advisor rule", table=table)[1]


def num(v: float | None) -> str:
    """A figure in a finding's text: 6 significant digits, ``-`` when missing."""
    return "-" if v is None else f"{v:.6g}"


def abs_max(*values: float | None) -> float | None:
    """The largest finite ``|v|`` of ``values`` (None when there is none)."""
    vals = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return max(vals) if vals else None


def quantizes(row: LayerRow) -> bool:
    """The op rounds its own output (not a passthrough, a fused member or a float op)."""
    return row.raw_min is not None and row.scale is not None


def finding(rule: str, row: LayerRow, info: str, advice: str) -> Finding:
    """A finding of ``rule`` at the op site of ``row``."""
    return Finding(rule, row.op_name, row.analy_op_type, info, advice)
