"""The advisor's ``consistency_level`` rule (``convert``): which ``ConsistencyStrategy`` level removes the
same-input mismatches found, op sites grouped by cause."""

from __future__ import annotations

from dataclasses import dataclass

from quantlens.kernels import TABLE_OP_IO
from quantlens.march.opset import IR_OPS, Category, ops_in
from quantlens.profiler.advisor.base import (
    AdvisorContext,
    Finding,
    Rule,
    Severity,
    finding,
    registrar,
    row_category,
)

# a row beyond rounding computes something else (a table built for another range, a saturation, a wrong
# requantize), which no consistency level removes: the ``integer_op_differs`` rule names its mechanism instead
from quantlens.profiler.advisor.deployed import ROUNDING_VERDICTS
from quantlens.profiler.compare import LayerRow
from quantlens.quantization.consistency import MAX_LEVEL as MAX_CONSISTENCY_LEVEL

#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)

#: convert: how many op sites a consistency-level suggestion names (the first ones, in execution order)
CONSISTENCY_SITES_SHOWN = 4
#: the IR ops whose integer rule rescales their inputs to the output scale (§10): exact with shared scales
_RESCALING_ELEMENTWISE = ops_in(rescales_inputs=True)


@dataclass(frozen=True)
class _Cause:
    """One reason for same-input mismatches and the consistency level that removes it."""

    level: int
    what: str  # what the listed op sites have in common
    why: str  # why the level removes it


_CAUSES = {
    "requant16": _Cause(0, "int16 outputs requantized with the cheap 16-bit multiplier (qpp default)",
                        "level 0 converts with the high-precision requantize everywhere (qpp high_precision)"),
    "elementwise": _Cause(2, "add/sub/cat, whose integer rule rescales each input to the output scale",
                          "level 2 gives the inputs and the output of every add/sub/cat one shared (power-of-two) "
                          "scale, so the kernel does not rescale at all (level 1 only makes the QAT forward round "
                          "like the add rule)"),
    "table": _Cause(3, "lookup-table ops (softmax, gelu, layer_norm, sigmoid, ...), whose tables round "
                       "differently from the float op + fake quant",
                    "level 3 computes the same lookup tables in the QAT forward (straight-through gradients)"),
    "gemm": _Cause(1, "GEMMs (conv/linear/matmul) within 1 LSB on the same input: the QAT model accumulates in "
                      "float, the kernel exactly in int32",
                   "from level 1 the QAT model in VALIDATION accumulates exactly on the integers too"),
    "other": _Cause(1, "integer rules the QAT model computes in float",
                    "from level 1 the QAT model computes the integer rules (pools, clamp, mul, ...) like the kernels"),
}
#: why the top level is suggested for a mismatch the model's own level should already remove
_BIT_EXACT_WHY = (f"level {MAX_CONSISTENCY_LEVEL} computes every integer rule exactly, in training as in VALIDATION "
                  "(bit-exact)")


def _mismatch_causes(row: LayerRow, default_qpp: bool) -> list[str]:
    """The causes (keys of :data:`_CAUSES`) of one row's same-input mismatch, cheapest level first."""
    op = row.analy_op_type
    category = row_category(row)
    cheap16 = row.quant_dtype == "qint16" and default_qpp and category is not Category.TABLE
    if row.same_input_lsb_verdict not in ROUNDING_VERDICTS:
        # the cheap 16-bit multiplier of an int16 output is off by a few steps at most (§8)
        return ["requant16"] if cheap16 and row.same_input_lsb_verdict == "within 4 LSB" else []
    causes = ["requant16"] if cheap16 else []
    if op in _RESCALING_ELEMENTWISE or (op not in IR_OPS and row.base_op_type in _RESCALING_ELEMENTWISE):
        causes.append("elementwise")
    elif category is Category.TABLE or op in TABLE_OP_IO:
        causes.append("table")
    elif category is Category.GEMM:
        causes.append("gemm")
    else:
        causes.append("other")
    return causes


def _defined_by_level(level: int, baseline_rules: str | None) -> frozenset[str]:
    """The causes (keys of :data:`_CAUSES`) whose same-input mismatch is exactly what consistency ``level``
    defines, because the baseline does not compute that integer rule while the quantized IR does:

    * ``"none"`` (the qat IR: float + fake quant at every level): the GEMMs' exact sums, the requantize (the cheap
      multiplier of int16 outputs too) and the other integer rules; add/sub/cat at level 1 only (from level 2 their
      shared scale makes the integer add equal the float one, so a mismatch there is not the level's);
    * ``"rounded"`` (a QAT forward below level 4): the GEMMs, whose float32 sum is rounded to integers.

    Lookup tables are in the qat IR too, so their mismatches are never the level's."""
    if level < 1 or baseline_rules not in ("none", "rounded"):
        return frozenset()
    if baseline_rules == "rounded":
        return frozenset({"gemm"})
    return frozenset({"requant16", "gemm", "other"} | ({"elementwise"} if level == 1 else set()))


def _is_defined(row: LayerRow, default_qpp: bool, defined: frozenset[str]) -> bool:
    """Whether every cause of the row's same-input mismatch is one the level defines (a row without a known
    cause, e.g. a GEMM more than 1 LSB off, never is)."""
    causes = set(_mismatch_causes(row, default_qpp))
    return bool(causes) and causes <= defined


def _sites(rows: list[LayerRow]) -> str:
    shown = ", ".join(f"'{r.op_name}' ({r.op_type})" for r in rows[:CONSISTENCY_SITES_SHOWN])
    more = len(rows) - CONSISTENCY_SITES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _runtime_march(ctx: AdvisorContext) -> list[Finding]:
    """A March.ORT_CPU model: its quantized IR is the runtime's arithmetic (float32 multipliers, its lookup tables
    and softmax), which no consistency level emulates (prepare refuses levels 1-4 under that march), so the ops
    that differ from the QAT model on the same input are said to be the runtime's, with what is exact."""
    inexact = [r for r in ctx.comparison if r.same_input_lsb_verdict not in ("", "bit-exact")]
    if not inexact:
        return []
    return [finding(
        "consistency_level", inexact[0],
        f"{len(inexact)} op sites compute the runtime's arithmetic (March.ORT_CPU: onnxruntime's float32 requantize, "
        f"its lookup tables and softmax) where the QAT model computes float and rounds once: {_sites(inexact)}",
        "no consistency level applies under March.ORT_CPU (its levels 1-4 emulate QL1's rules and prepare refuses "
        "them); what the deployed model computes is the quantized IR, which the 'onnxruntime' pair holds against the "
        "session op by op (docs/march_ort.md); where the loss matters, promote or remedy the op site itself",
        severity=Severity.ADVICE,
    )]


@_rule("consistency_level")
def consistency_level(ctx: AdvisorContext) -> list[Finding]:
    """convert: the op sites whose own kernel is not bit-exact, grouped by the ``ConsistencyStrategy`` level that
    removes the mismatch; only levels above the model's own are suggested (a mismatch the model's level should
    already remove points to level 4, which is bit-exact by construction). At level 4 any mismatch is a bug.
    Against a baseline that does not compute the level's integer rules (the qat IR at levels 1-4), the rows that
    differ by exactly those rules are what the level defines and are not reported (:func:`_defined_by_level`)."""
    if ctx.analysis_type != "convert":
        return []
    info = ctx.consistency
    if info is not None and info.march == "ort_cpu":
        return _runtime_march(ctx)
    current = -1 if info is None or info.level is None else info.level
    default_qpp = info is None or info.qpp != "high_precision"
    built = "off" if current < 0 else f"level {current}"
    # a baseline without the level's integer rules (the qat IR) differs from the quantized IR by exactly them:
    # those rows (and what they change downstream) are what the level defines, not a fault to fix
    defined = _defined_by_level(current, getattr(info, "baseline_rules", None))
    inexact = [r for r in ctx.comparison if r.same_input_lsb_verdict not in ("", "bit-exact")
               and not _is_defined(r, default_qpp, defined)]
    if current >= MAX_CONSISTENCY_LEVEL:
        mismatched = inexact or ([] if defined else
                                 [r for r in ctx.comparison if r.lsb_verdict not in ("", "bit-exact")])
        if not mismatched:
            return []
        first = ctx.comparison.first_diverged or mismatched[0]
        return [finding(
            "consistency_level", first,
            f"the model was built with consistency level {current}, so the quantized IR should equal the QAT model "
            f"bit for bit, yet {len(mismatched)} op sites are not bit-exact: {_sites(mismatched)}; first diverged "
            f"op: '{ctx.comparison.first_diverged.op_name if ctx.comparison.first_diverged else '(none)'}', first "
            f"inexact op: '{ctx.comparison.first_inexact.op_name if ctx.comparison.first_inexact else '(none)'}'",
            f"this is a quantlens bug: report it with this analysis (abnormal_layer_advisor.txt, "
            f"compare_per_layer_out.txt) and the first diverged op '{first.op_name}'; no consistency level above "
            f"{current} exists",
        )]
    groups: dict[str, list[LayerRow]] = {}
    for row in inexact:
        for key in _mismatch_causes(row, default_qpp):
            groups.setdefault(key, []).append(row)
    out = []
    for key in sorted(groups, key=lambda k: (_CAUSES[k].level, list(_CAUSES).index(k))):
        cause, rows = _CAUSES[key], groups[key]
        level, why = cause.level, cause.why
        # above the model's own level the rows differ as that level defines (advice); at or below it they should
        # not differ at all (a problem)
        severity = Severity.ADVICE
        if level <= current:
            severity = Severity.PROBLEM  # the model's level should already remove it: level 4 is bit-exact by construction
            if key == "requant16":
                continue
            level, why = MAX_CONSISTENCY_LEVEL, (f"consistency {built} should already remove this; "
                                                 f"{_BIT_EXACT_WHY}")
        retrain = ("needs retraining: levels 1-4 change what the QAT forward computes, so prepare and QAT-train "
                   "(fine-tune) the model again with it, then export and convert") if level >= 1 else \
            ("no retraining needed: prepare again with it, load the trained weights (or calibrate), export and "
             "convert; rows still inexact afterwards point to the higher levels")
        out.append(finding(
            "consistency_level", rows[0],
            f"{len(rows)} op sites not bit-exact on the same input (model built with consistency {built}): "
            f"{cause.what}: {_sites(rows)}",
            f"ConsistencyStrategy.set_consistency_level({level}) before prepare: {why}; {retrain}", severity,
        ))
    return out
