"""The advisor's rules for the stages after the torch model: ``pre_export``'s lookup tables, the integer
arithmetic of ``export``/``convert`` (accumulators, requantize, tables), an exported op that takes another path,
and NaN/Inf reaching the integers."""

from __future__ import annotations

import math

from quantlens.profiler.advisor.base import (
    ACC_SATURATION_LIMIT,
    EXPORT_FLOAT_NOISE_SQNR,
    REQUANT_SATURATION_LIMIT,
    ROUNDING_VERDICTS,
    TABLE_CLIP_LIMIT,
    TABLE_SQNR_LIMIT,
    AdvisorContext,
    Finding,
    OpRole,
    Rule,
    abs_max,
    finding,
    num,
    op_role,
    registrar,
)

#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)


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
    return num(100 * (ratio or 0.0)) + "%"


@_rule("table_error")
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
        span = abs_max(row.base_min, row.base_max)
        levels = f"; the output uses about {num(round((row.base_max - row.base_min) / row.scale) + 1)} levels " \
                 f"of {row.quant_dtype} scale {num(row.scale)}" if span is not None and row.scale else ""
        out.append(finding(
            "table_error", row,
            f"the lookup table differs from the float op on the same input: SQNR {v:.1f} dB < "
            f"{TABLE_SQNR_LIMIT:g} dB, up to {num(row.same_input_in_scale)} output steps{levels}",
            f"the output grid of '{row.op_name}' is too coarse where the function is steep, so one-step "
            "differences of the table are large: a finer output scale (calibrate it, or fix it to the output "
            "range / qmax), int16 output, or an int8 input (its 256-entry table equals the float op exactly)",
        ))
    return out


@_rule("accumulator_saturation")
def accumulator_saturation(ctx: AdvisorContext) -> list[Finding]:
    """A conv/linear/matmul of the quantized IR whose exact int32 sum overflows: saturated once (§6)."""
    out = []
    for row, ratio in _over_limit(ctx, "acc_saturated_ratio", ACC_SATURATION_LIMIT):
        out.append(finding(
            "accumulator_saturation", row,
            f"{_pct(ratio)} of the int32 accumulators of '{row.op_name}' saturate: the exact sum of its integer "
            "products (bias included) exceeds the int32 range, which the float fake quant model never limits",
            f"shorten the reduction or the operands of '{row.op_name}': int8 instead of int16 activations at its "
            "input (int16 x int8 products reach 2**22, so 512 extreme terms overflow), smaller weights (weight "
            "decay, a wider layer split in two and added), or normalize its input; check the weight scale is not "
            "stretched by a few outlier weights",
        ))
    return out


@_rule("requant_saturation")
def requant_saturation(ctx: AdvisorContext) -> list[Finding]:
    """The IR op saturates outputs (qmin/qmax) that the baseline's fake quant kept inside the range."""
    out = []
    for row, ratio in _over_limit(ctx, "requant_saturated_ratio", REQUANT_SATURATION_LIMIT):
        out.append(finding(
            "requant_saturation", row,
            f"{_pct(ratio)} of the outputs of '{row.op_name}' (same input) sit at the {row.quant_dtype} limit where "
            "the baseline's value was at least two steps inside the range: the IR saturates beyond what the fake "
            "quant clipped",
            "compare the op's requantize parameters (multiplier, shift) and the scales it was converted with to the "
            "baseline's fake quant scales; an accumulator or rescale overflow upstream of the requantize, or a "
            "stage that changed the scale after calibration (re-export and re-convert from the calibrated model)",
        ))
    return out


@_rule("table_input_clipped")
def table_input_clipped(ctx: AdvisorContext) -> list[Finding]:
    """A table whose input sits at the input type's limit where the table still changes: the table was built
    for a narrower input range than the data (the limit is the range it was built for; a flat end is fine)."""
    out = []
    for row, ratio in _over_limit(ctx, "table_input_clipped_ratio", TABLE_CLIP_LIMIT):
        out.append(finding(
            "table_input_clipped", row,
            f"{_pct(ratio)} of the inputs of table '{row.op_name}' are at the limit code of its input range, where "
            "the function is not flat: the real inputs lie beyond the range the table was built for",
            f"widen the input scale of '{row.op_name}' (its producer's output scale: calibrate on representative "
            "data, or a FixedScaleObserver covering the data), or int16 for that input; a clamp before the op "
            "makes the clipping explicit in the float model too",
        ))
    return out


@_rule("export_path_differs")
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
        out.append(finding(
            "export_path_differs", row,
            f"the exported op differs from the torch model on the same input: {what}",
            "the code under torch.export takes another path than the eager model (not a torch.compiler."
            "is_exporting() / is_compiling() branch: quantlens runs every traced forward with those true, as export "
            "does): look for checks on fake tensors (torch._guards.detect_fake_mode), torch.jit.is_tracing() or "
            "torch.fx proxies, library code with an export-specific decomposition, or state captured as a constant "
            "at export; make both paths compute the same (or export the eager path)",
        ))
    return out


@_rule("nonfinite_to_integer")
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
            out.append(finding(
                "nonfinite_to_integer", row,
                f"{row.nonfinite_to_int} NaN/Inf values enter the integer stage at '{row.op_name}': quantize maps "
                "NaN to an arbitrary code (0 here) and +-Inf to the type's limit, silently",
                "remove the NaN/Inf before the QuantStub (clean or clamp the input data, torch.nan_to_num in the "
                "float preprocessing), or fix the float op upstream that produces them (division by zero, log of "
                "<= 0, overflow)",
            ))
    return out


#: convert: what the integer op computes, by op kind, and where to look when it is more than rounding away from the
#: baseline on the same input (the mechanism; retraining cannot remove such a difference)
_MECHANISM = {
    OpRole.WEIGHTED: ("the int32 accumulator and the per-channel requantize (multiplier, shift) of '{op}'",
                      "check the bias and weight scales it was converted with (an int32 bias saturated by a tiny "
                      "weight scale: pruned or all-zero channels), and the requantize parameters against the "
                      "baseline's fake quant scales"),
    OpRole.GEMM: ("the int32 accumulator and the requantize of '{op}' (a product of two activations)",
                  "check both inputs' scales and the requantize parameters against the baseline's fake quant "
                  "scales"),
    OpRole.TABLE: ("the lookup table of '{op}' (its entries, and the input range it was built for)",
                   "the table differs from the baseline's on the same input codes: rebuild it from the calibrated "
                   "model (pre_export, then export and convert again), and check its input scale covers the data "
                   "(table_input_clipped)"),
    OpRole.ELEMENTWISE: ("the input rescale and the requantize of '{op}' (its multipliers and shifts)",
                         "check the scales of its inputs and output against the baseline's fake quant scales (a stage "
                         "that changed a scale after calibration: export and convert again from the calibrated "
                         "model)"),
    OpRole.OTHER: ("the integer rule of '{op}'",
                   "compare the op's integer rule (docs/march.md) with the baseline on the failing elements"),
}


@_rule("integer_op_differs")
def integer_op_differs(ctx: AdvisorContext) -> list[Finding]:
    """convert: an integer op more than rounding away from the baseline on the same input, not already explained
    by a saturation or table-clipping finding: the finding names the integer mechanism of that kind of op, never a
    retraining level (the ``consistency_level`` rule covers rounding differences only)."""
    if ctx.analysis_type != "convert":
        return []
    out = []
    for row in ctx.comparison:
        if row.same_input_lsb_verdict in ("", "bit-exact") or row.same_input_lsb_verdict in ROUNDING_VERDICTS:
            continue
        if (row.acc_saturated_ratio or 0) > ACC_SATURATION_LIMIT or \
                (row.requant_saturated_ratio or 0) > REQUANT_SATURATION_LIMIT or \
                (row.table_input_clipped_ratio or 0) > TABLE_CLIP_LIMIT:
            continue  # the saturation / clipping rules name it
        if ctx.bias_saturated(row.op_name):
            continue  # bias_saturation names it
        kind = op_role(row)
        where, advice = _MECHANISM[kind]
        out.append(finding(
            "integer_op_differs", row,
            f"on the same input the integer op is {row.same_input_lsb_verdict} of the baseline, up to "
            f"{num(row.same_input_in_scale)} output steps ({row.same_input_lsb_hist}): more than rounding, so no "
            f"consistency level or retraining removes it; the mechanism: {where.format(op=row.op_name)}",
            advice,
        ))
    return out
