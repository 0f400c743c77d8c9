"""What every advisor rule shares: the thresholds (documented in ``docs/profiler.md`` and repeated in the report
header), a finding, what a rule reads (:class:`AdvisorContext`) and the small helpers of the rules' texts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from quantlens._registry import make_registry
from quantlens.kernels import TABLE_OP_IO
from quantlens.march.opset import IR_OPS, Category, op_def
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.metrics import SAME_INPUT_SQNR_LIMIT

__all__ = ["Finding", "Severity", "AdvisorContext", "Rule", "registrar", "THRESHOLDS", "OpRole", "op_role", "row_category",
           "ROUNDING_STEPS", "ROUNDING_VERDICTS", "CHANNEL_GAP_DB", "INT8_RANGE_LIMIT", "INT16_RANGE_LIMIT",
           "SAME_INPUT_SQNR_LIMIT", "ACC_SATURATION_LIMIT", "REQUANT_SATURATION_LIMIT", "TABLE_CLIP_LIMIT",
           "EXPORT_FLOAT_NOISE_SQNR", "TABLE_SQNR_LIMIT"]

#: an int8 range beyond this makes the int8 step exceed 1.0 (127 steps of 1.0 ~ 128): ask for int16
INT8_RANGE_LIMIT = 128.0
#: beyond this even an int16 step exceeds 1.0: the range itself is the problem
INT16_RANGE_LIMIT = 32768.0
# SAME_INPUT_SQNR_LIMIT (metrics, defined once: also the per-channel share's limit): a same-input SQNR below it (dB)
# means the op itself loses precision (int8 on well-scaled data gives ~35-45)

#: per_tensor_weight_channels: the worst channel this far (dB) below the whole output's SQNR is per-channel damage
CHANNEL_GAP_DB = 10.0

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

#: deployed stages: a same-input difference up to this many output steps is rounding (what a consistency level
#: removes); beyond it the integer op computes something else (a table, a requantize, a saturation)
ROUNDING_STEPS = 1.0
#: the same-input verdicts of ``compare.lsb_report`` that rounding explains (``ROUNDING_STEPS``)
ROUNDING_VERDICTS = frozenset({"within 1 LSB"})

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
    "rounding difference (steps)": ROUNDING_STEPS,
    "per-channel gap (dB)": CHANNEL_GAP_DB,
}


class Severity(str, Enum):
    """How a finding counts: ``problem`` is something to fix (``quantlens analyze`` / ``compare`` exit 1 on it);
    ``advice`` is a way to do better where the model behaves as it was built to (a GEMM within 1 LSB of the QAT
    model at consistency off: what that level defines), listed but not counted as a problem."""

    PROBLEM = "problem"
    ADVICE = "advice"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Finding:
    rule: str
    op_name: str
    op_type: str
    info: str
    advice: str
    severity: Severity = Severity.PROBLEM

    @property
    def is_problem(self) -> bool:
        return self.severity is Severity.PROBLEM


@dataclass
class AdvisorContext:
    comparison: LayerComparison
    analysis_type: str
    fake_quant_state: str | None  # of the analysis model (None: not a prepared model)
    #: the consistency level the models were built with (``model_access.ConsistencyInfo``; None: not known)
    consistency: Any = None
    #: op site -> its int32 bias's saturation (``profiler.bias_check.bias_saturation`` of the analysis model)
    bias: dict = field(default_factory=dict)
    #: the float baseline as the user runs it parts from its traced forward (``profiler.eager_check``); None: it
    #: does not, or it was not checked (the baseline is no float torch model)
    eager: Any = None

    def bias_saturated(self, op_name: str) -> bool:
        entry = self.bias.get(op_name)
        return entry is not None and entry.saturated > 0


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


def finding(rule: str, row: LayerRow, info: str, advice: str, severity: Severity = Severity.PROBLEM) -> Finding:
    """A finding of ``rule`` at the op site of ``row``."""
    return Finding(rule, row.op_name, row.op_type, info, advice, severity)


def row_category(row: LayerRow) -> Category | None:
    """The op set's category of a row's op (the analysis op, else the baseline's): an IR op's, or a torch op's
    (``TABLE`` for an op pre_export computes by a table)."""
    for name in (row.analy_op_type, row.base_op_type):
        ir = IR_OPS.get(name)
        if ir is not None:
            return ir.category
        op = op_def(name)
        if op is not None:
            return Category.TABLE if op.table else op.category
    return None


class OpRole(str, Enum):
    """What an op is, for advice: only an op with weights gets weight advice, only a table op table advice."""

    WEIGHTED = "weighted"  #: conv / linear / embedding: its own quantized weight
    TABLE = "table"  #: a nonlinear op the NPU computes by a lookup table
    GEMM = "gemm"  #: a product of two activations (matmul, attention): no weight
    ELEMENTWISE = "elementwise"  #: add/mul/...: integer arithmetic on rescaled inputs
    OTHER = "other"


def op_role(row: LayerRow) -> OpRole:
    """The :class:`OpRole` of a row, from the op set (never from op names)."""
    for name in (row.analy_op_type, row.base_op_type):
        op = op_def(name)
        if op is not None and op.weight_args:
            return OpRole.WEIGHTED
    if row.analy_op_type in TABLE_OP_IO:
        return OpRole.TABLE
    category = row_category(row)
    return {Category.TABLE: OpRole.TABLE, Category.GEMM: OpRole.GEMM, Category.LOOKUP: OpRole.WEIGHTED,
            Category.ELEMENTWISE: OpRole.ELEMENTWISE}.get(category, OpRole.OTHER)
