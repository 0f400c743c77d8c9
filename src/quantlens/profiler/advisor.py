"""Abnormal-layer advisor: rules over the per-layer comparison, each finding with advice.

One rule is one small function ``rule(ctx) -> list[Finding]`` registered in :data:`RULES`; the thresholds are
module constants, documented in ``docs/profiler.md`` and repeated in the report header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from quantlens.kernels import TABLE_OP_IO
from quantlens.march.opset import IR_OPS, Category, op_def
from quantlens.quantization.consistency import MAX_LEVEL as MAX_CONSISTENCY_LEVEL
from quantlens.march import QuantDType
from quantlens.profiler.compare import LayerComparison, LayerRow

__all__ = ["Finding", "AdvisorContext", "RULES", "register_rule", "advise", "THRESHOLDS"]

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
#: convert: how many op sites a consistency-level suggestion names (the first ones, in execution order)
CONSISTENCY_SITES_SHOWN = 4

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
RULES: dict[str, Rule] = {}


def register_rule(name: str) -> Callable[[Rule], Rule]:
    def deco(func: Rule) -> Rule:
        RULES[name] = func
        return func

    return deco


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def _absmax(*values: float | None) -> float | None:
    vals = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return max(vals) if vals else None


def _quantizes(row: LayerRow) -> bool:
    """The op rounds its own output (not a passthrough, a fused member or a float op)."""
    return row.raw_min is not None and row.scale is not None


def _finding(rule: str, row: LayerRow, info: str, advice: str) -> Finding:
    return Finding(rule, row.op_name, row.analy_op_type, info, advice)


@register_rule("input_asymmetric")
def input_asymmetric(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        lo, hi = row.input_min, row.input_max
        if row.boundary != "input" or lo is None or hi is None or (lo == 0 and hi == 0):
            continue
        if lo >= 0 or hi <= 0:
            out.append(_finding(
                "input_asymmetric", row,
                f"model input range [{_g(lo)}, {_g(hi)}] is asymmetric about 0: symmetric quantization uses only "
                "half of the integer levels",
                "normalize the input symmetrically (e.g. x*2-1 for [0,1] data, or mean/std), then "
                "QuantStub(scale=1/128) fits [-1, 1)",
            ))
    return out


@register_rule("input_range_int8")
def input_range_int8(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = _absmax(row.input_min, row.input_max)
        if row.boundary == "input" and row.quant_dtype == "qint8" and amax is not None and amax >= INT8_RANGE_LIMIT:
            out.append(_finding(
                "input_range_int8", row,
                f"model input |x| up to {_g(amax)}: an int8 step of {_g(amax / 127)} loses every detail below it",
                f"use qint16 for '{row.op_name}' (ModuleNameQconfigSetter({{'{row.op_name}': "
                "QConfig(output=QuantSpec('qint16'))})) or normalize the input to about [-1, 1]",
            ))
    return out


@register_rule("scale_coverage")
def scale_coverage(ctx: AdvisorContext) -> list[Finding]:
    """The output scale leaves data outside its range by more than one step; classify the error."""
    out = []
    for row in ctx.comparison:
        if not _quantizes(row) or row.quant_dtype not in ("qint8", "qint16"):
            continue
        need = _absmax(row.raw_min, row.raw_max)
        if need is None or not (math.isfinite(row.raw_min) and math.isfinite(row.raw_max)):
            continue  # no finite data: the nan_inf rule reports it
        dt, s = QuantDType.parse(row.quant_dtype), row.scale
        below, above = dt.qmin * s - row.raw_min, row.raw_max - dt.qmax * s
        if below <= s and above <= s:
            continue
        kind = row.raw_error_kind or "clipping"
        info = (f"{kind}-dominated: data range [{_g(row.raw_min)}, {_g(row.raw_max)}] exceeds the {dt.value} range "
                f"[{_g(dt.qmin * s)}, {_g(dt.qmax * s)}] of scale {_g(s)}; {_g(100 * (row.clipped_ratio or 0))}% "
                "of the values saturate")
        need = need / dt.qmax
        if kind == "clipping":
            advice = (f"the scale is too small for this data: calibrate on representative data, check that calibration "
                      f"ran with fake quant state CALIBRATION, or fix the scale to cover it "
                      f"(FixedScaleObserver.with_args(scale={need:.6g}))")
        else:
            advice = "few values saturate and rounding dominates: int16 for this op keeps both range and resolution"
        out.append(_finding("scale_coverage", row, info, advice))
    return out


@register_rule("op_error")
def op_error(ctx: AdvisorContext) -> list[Finding]:
    """The op itself (fed the baseline's input) loses precision: a bad layer, clipping or rounding."""
    out = []
    heads: dict[str, str] = {}
    for row in ctx.comparison:
        if row.fused_into:
            heads.setdefault(row.fused_into, row.op_name)
    for row in ctx.comparison:
        v = row.same_input_sqnr
        if v is None or math.isnan(v) or v >= SAME_INPUT_SQNR_LIMIT or row.quant_dtype == "float":
            continue
        kind = row.error_kind or "rounding"
        if (row.acc_saturated_ratio or 0) > ACC_SATURATION_LIMIT:
            advice = (f"the int32 accumulator of '{row.op_name}' saturates (see accumulator_saturation): int16 "
                      "weights would make it worse; shorten the reduction or use int8 activations at its input")
        elif kind == "clipping":
            advice = "clipping-dominated: widen the output range (calibration data, fixed scale) before trying int16"
        elif kind == "rounding":
            advice = (f"rounding-dominated: int16 output for '{row.op_name}' (an 'activation' row for it in the "
                      "sensitive-op setter's table, or ModuleNameQconfigSetter)")
        else:
            owner = heads.get(row.op_name, row.op_name)
            advice = (f"rounding inside the op dominates (its weights, inputs quantized at the op, or a lookup "
                      f"table): int16 weights for '{owner}' (a 'weight' row in the sensitive-op setter's table); for a "
                      "lookup table, int16 input/output or a narrower input range")
        out.append(_finding("op_error", row,
                            f"same-input SQNR {v:.1f} dB < {SAME_INPUT_SQNR_LIMIT:g} dB ({kind}-dominated, "
                            f"{_g(row.same_input_in_scale)} output steps)", advice))
    return out


@register_rule("int8_range_needs_int16")
def int8_range_needs_int16(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = _absmax(row.base_min, row.base_max, row.raw_min, row.raw_max)
        if (row.quant_dtype == "qint8" and _quantizes(row) and row.boundary != "input" and amax is not None
                and INT8_RANGE_LIMIT < amax <= INT16_RANGE_LIMIT):
            out.append(_finding(
                "int8_range_needs_int16", row,
                f"|x| up to {_g(amax)} on int8: the step {_g(amax / 127)} exceeds 1.0",
                f"try qint16 for '{row.op_name}' (its range fits int16 with a step of {_g(amax / 32767)})",
            ))
    return out


@register_rule("range_too_large")
def range_too_large(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = _absmax(row.base_min, row.base_max, row.raw_min, row.raw_max, row.input_min, row.input_max)
        if row.quant_dtype in ("qint8", "qint16") and amax is not None and amax > INT16_RANGE_LIMIT:
            out.append(_finding(
                "range_too_large", row,
                f"total data range |x| up to {_g(amax)} is too large even for int16 (step {_g(amax / 32767)})",
                "bound the value in the model (clamp the input of a reciprocal/exp, normalize), or keep this op float",
            ))
    return out


@register_rule("nan_inf")
def nan_inf(ctx: AdvisorContext) -> list[Finding]:
    """Where NaN/Inf first appears in each model."""
    out, seen = [], set()
    for row in ctx.comparison:
        sides = {"both": ("baseline", "analysis")}.get(row.nonfinite, (row.nonfinite,) if row.nonfinite else ())
        new = [s for s in sides if s not in seen]
        if new:
            seen.update(new)
            out.append(_finding(
                "nan_inf", row, f"NaN/Inf first appears here in the {' and '.join(new)} model",
                "check this op's inputs (division by zero, log of <= 0, overflow) and the model input; the "
                "metrics of every later layer are NaN",
            ))
    return out


@register_rule("dequant_not_high_precision")
def dequant_not_high_precision(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        if row.boundary != "output" or row.quant_dtype not in ("qint8", "qint16"):
            continue
        producer = row.producer or "the op before it"
        ptype = ctx.comparison[row.producer].analy_op_type if row.producer in {r.op_name for r in ctx.comparison} else ""
        op = op_def(ptype)
        if op is not None and op.gemm and op.weight_args:  # conv, transposed conv, linear
            advice = (f"give '{producer}' an int32 high-precision output: QConfig(output=QuantSpec('qint32')) "
                      "(the default templates do this when a conv/linear feeds only DeQuantStubs)")
        else:
            advice = f"end the network on a conv/linear with int32 output, or use qint16 for '{producer}'"
        out.append(_finding("dequant_not_high_precision", row,
                            f"the DeQuantStub receives a {row.quant_dtype} tensor from '{producer}' "
                            "(not high precision)", advice))
    return out


@register_rule("fake_quant_disabled")
def fake_quant_disabled(ctx: AdvisorContext) -> list[Finding]:
    if ctx.fake_quant_state not in ("float", "calibration"):
        return []
    return [Finding("fake_quant_disabled", "(model)", "-",
                    f"the analysis model is in fake quant state '{ctx.fake_quant_state}': it does not quantize, so "
                    "the comparison shows no quantization error",
                    "call set_fake_quantize(model, FakeQuantState.VALIDATION) after calibration")]


# -- deployed stages (export: pre_export model vs qat IR; convert: qat IR vs quantized IR) ---------------------
def _deployed(ctx: AdvisorContext) -> bool:
    return ctx.analysis_type in ("export", "convert")


def _over_limit(ctx: AdvisorContext, field: str, limit: float):
    """``(row, ratio)`` for the rows of a deployed-stage analysis whose integer statistic ``field`` (a fraction
    of elements) exceeds ``limit``."""
    if not _deployed(ctx):
        return
    for row in ctx.comparison:
        ratio = getattr(row, field)
        if ratio is not None and ratio > limit:
            yield row, ratio


def _pct(ratio: float | None) -> str:
    return _g(100 * (ratio or 0.0)) + "%"


@register_rule("table_error")
def table_error(ctx: AdvisorContext) -> list[Finding]:
    """pre_export: a lookup table that rounds to other output levels than the float op + output fake quant."""
    if ctx.analysis_type != "pre_export":
        return []
    from quantlens.quantization.pre_export import TABLE_OPS

    out = []
    for row in ctx.comparison:
        v = row.same_input_sqnr
        if row.analy_op_type not in TABLE_OPS or v is None or math.isnan(v) or v >= TABLE_SQNR_LIMIT:
            continue
        span = _absmax(row.base_min, row.base_max)
        levels = f"; the output uses about {_g(round((row.base_max - row.base_min) / row.scale) + 1)} levels " \
                 f"of {row.quant_dtype} scale {_g(row.scale)}" if span is not None and row.scale else ""
        out.append(_finding(
            "table_error", row,
            f"the lookup table differs from the float op on the same input: SQNR {v:.1f} dB < "
            f"{TABLE_SQNR_LIMIT:g} dB, up to {_g(row.same_input_in_scale)} output steps{levels}",
            f"the output grid of '{row.op_name}' is too coarse where the function is steep, so one-step "
            "differences of the table are large: a finer output scale (calibrate it, or fix it to the output "
            "range / qmax), int16 output, or an int8 input (its 256-entry table equals the float op exactly)",
        ))
    return out


@register_rule("accumulator_saturation")
def accumulator_saturation(ctx: AdvisorContext) -> list[Finding]:
    """A conv/linear/matmul of the quantized IR whose exact int32 sum overflows: saturated once (§6)."""
    out = []
    for row, ratio in _over_limit(ctx, "acc_saturated_ratio", ACC_SATURATION_LIMIT):
        out.append(_finding(
            "accumulator_saturation", row,
            f"{_pct(ratio)} of the int32 accumulators of '{row.op_name}' saturate: the exact sum of its integer "
            "products (bias included) exceeds the int32 range, which the float fake quant model never limits",
            f"shorten the reduction or the operands of '{row.op_name}': int8 instead of int16 activations at its "
            "input (int16 x int8 products reach 2**22, so 512 extreme terms overflow), smaller weights (weight "
            "decay, a wider layer split in two and added), or normalize its input; check the weight scale is not "
            "stretched by a few outlier weights",
        ))
    return out


@register_rule("requant_saturation")
def requant_saturation(ctx: AdvisorContext) -> list[Finding]:
    """The IR op saturates outputs (qmin/qmax) that the baseline's fake quant kept inside the range."""
    out = []
    for row, ratio in _over_limit(ctx, "requant_saturated_ratio", REQUANT_SATURATION_LIMIT):
        out.append(_finding(
            "requant_saturation", row,
            f"{_pct(ratio)} of the outputs of '{row.op_name}' (same input) sit at the {row.quant_dtype} limit where "
            "the baseline's value was at least two steps inside the range: the IR saturates beyond what the fake "
            "quant clipped",
            "compare the op's requantize parameters (multiplier, shift) and the scales it was converted with to the "
            "baseline's fake quant scales; an accumulator or rescale overflow upstream of the requantize, or a "
            "stage that changed the scale after calibration (re-export and re-convert from the calibrated model)",
        ))
    return out


@register_rule("table_input_clipped")
def table_input_clipped(ctx: AdvisorContext) -> list[Finding]:
    """A table whose input sits at the input type's limit where the table still changes: the table was built
    for a narrower input range than the data (the limit is the range it was built for; a flat end is fine)."""
    out = []
    for row, ratio in _over_limit(ctx, "table_input_clipped_ratio", TABLE_CLIP_LIMIT):
        out.append(_finding(
            "table_input_clipped", row,
            f"{_pct(ratio)} of the inputs of table '{row.op_name}' are at the limit code of its input range, where "
            "the function is not flat: the real inputs lie beyond the range the table was built for",
            f"widen the input scale of '{row.op_name}' (its producer's output scale: calibrate on representative "
            "data, or a FixedScaleObserver covering the data), or int16 for that input; a clamp before the op "
            "makes the clipping explicit in the float model too",
        ))
    return out


@register_rule("export_path_differs")
def export_path_differs(ctx: AdvisorContext) -> list[Finding]:
    """export: the qat IR computes an op differently from the torch model on the same input."""
    if ctx.analysis_type != "export":
        return []
    out = []
    for row in ctx.comparison:
        verdict, v = row.same_input_lsb_verdict, row.same_input_sqnr
        if verdict:
            if verdict == "bit-exact":
                continue
            what = f"same-input result {verdict} ({row.same_input_lsb_hist})"
        elif v is not None and not math.isnan(v) and v < EXPORT_FLOAT_NOISE_SQNR:
            what = f"same-input SQNR {v:.1f} dB (< {EXPORT_FLOAT_NOISE_SQNR:g} dB: beyond float32 noise)"
        else:
            continue
        out.append(_finding(
            "export_path_differs", row,
            f"the exported op differs from the torch model on the same input: {what}",
            "the code under torch.export takes another path than the eager model: look for "
            "torch.compiler.is_exporting() / torch.jit.is_tracing() / torch.fx checks, library code with an "
            "export-specific branch or decomposition, or state captured as a constant at export; make both paths "
            "compute the same (or export the eager path)",
        ))
    return out


@register_rule("nonfinite_to_integer")
def nonfinite_to_integer(ctx: AdvisorContext) -> list[Finding]:
    """NaN/Inf reaching the quantized IR's integers: NaN has no code (it becomes an arbitrary one), Inf the limit."""
    if ctx.analysis_type != "convert":
        return []
    rows = [row for row in ctx.comparison if row.nonfinite_to_int > 0]
    # where they enter: the model inputs' quantize sites; else (a baseline value that turned NaN inside the
    # network, handed on to every later site's same-input run) the first such site
    entries = [row for row in rows if row.boundary == "input"] or rows[:1]
    out = []
    for row in entries:
        if row.nonfinite_to_int > 0:
            out.append(_finding(
                "nonfinite_to_integer", row,
                f"{row.nonfinite_to_int} NaN/Inf values enter the integer stage at '{row.op_name}': quantize maps "
                "NaN to an arbitrary code (0 here) and +-Inf to the type's limit, silently",
                "remove the NaN/Inf before the QuantStub (clean or clamp the input data, torch.nan_to_num in the "
                "float preprocessing), or fix the float op upstream that produces them (division by zero, log of "
                "<= 0, overflow)",
            ))
    return out


# -- consistency level (convert): which ConsistencyStrategy level removes the mismatches found ------------------
#: the IR ops whose integer rule rescales their inputs to the output scale (§10): exact with shared scales
_RESCALING_ELEMENTWISE = frozenset({"add", "sub", "cat"})


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


def _op_category(name: str):
    ir = IR_OPS.get(name)
    if ir is not None:
        return ir.category
    op = op_def(name)
    return None if op is None else (Category.TABLE if op.table else op.category)


def _mismatch_causes(row: LayerRow, default_qpp: bool) -> list[str]:
    """The causes (keys of :data:`_CAUSES`) of one row's same-input mismatch, cheapest level first."""
    op = row.analy_op_type
    category = _op_category(op) or _op_category(row.base_op_type)
    causes = ["requant16"] if row.quant_dtype == "qint16" and default_qpp and category is not Category.TABLE else []
    if op in _RESCALING_ELEMENTWISE or (op not in IR_OPS and row.base_op_type in _RESCALING_ELEMENTWISE):
        causes.append("elementwise")
    elif category is Category.TABLE or op in TABLE_OP_IO:
        causes.append("table")
    elif category is Category.GEMM:
        if row.same_input_lsb_verdict == "within 1 LSB":  # more is not the accumulation (saturation rules)
            causes.append("gemm")
    else:
        causes.append("other")
    return causes


def _sites(rows: list[LayerRow]) -> str:
    shown = ", ".join(f"'{r.op_name}' ({r.analy_op_type})" for r in rows[:CONSISTENCY_SITES_SHOWN])
    more = len(rows) - CONSISTENCY_SITES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


@register_rule("consistency_level")
def consistency_level(ctx: AdvisorContext) -> list[Finding]:
    """convert: the op sites whose own kernel is not bit-exact, grouped by the ``ConsistencyStrategy`` level that
    removes the mismatch; only levels above the model's own are suggested (a mismatch the model's level should
    already remove points to level 4, which is bit-exact by construction). At level 4 any mismatch is a bug."""
    if ctx.analysis_type != "convert":
        return []
    info = ctx.consistency
    current = -1 if info is None or info.level is None else info.level
    default_qpp = info is None or info.qpp != "high_precision"
    built = "off" if current < 0 else f"level {current}"
    inexact = [r for r in ctx.comparison if r.same_input_lsb_verdict not in ("", "bit-exact")]
    if current >= MAX_CONSISTENCY_LEVEL:
        mismatched = inexact or [r for r in ctx.comparison if r.lsb_verdict not in ("", "bit-exact")]
        if not mismatched:
            return []
        first = ctx.comparison.first_diverged or mismatched[0]
        return [_finding(
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
        if level <= current:  # the model's level should already remove it: level 4 is bit-exact by construction
            if key == "requant16":
                continue
            level, why = MAX_CONSISTENCY_LEVEL, (f"consistency {built} should already remove this; "
                                                 f"{_BIT_EXACT_WHY}")
        retrain = ("needs retraining: levels 1-4 change what the QAT forward computes, so prepare and QAT-train "
                   "(fine-tune) the model again with it, then export and convert") if level >= 1 else \
            ("no retraining needed: prepare again with it, load the trained weights (or calibrate), export and "
             "convert; rows still inexact afterwards point to the higher levels")
        out.append(_finding(
            "consistency_level", rows[0],
            f"{len(rows)} op sites not bit-exact on the same input (model built with consistency {built}): "
            f"{cause.what}: {_sites(rows)}",
            f"ConsistencyStrategy.set_consistency_level({level}) before prepare: {why}; {retrain}",
        ))
    return out


def advise(ctx: AdvisorContext, rules: dict[str, Rule] | None = None) -> list[Finding]:
    """Every finding of every rule, rule by rule in registry order, rows in execution order."""
    findings: list[Finding] = []
    for rule in (rules or RULES).values():
        findings.extend(rule(ctx))
    return findings
