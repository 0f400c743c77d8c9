"""The advisor's rules for every analysis type: input ranges, scale coverage, the op's own error, ranges too
large for the quantized type, NaN/Inf, the output's precision, and a model that does not quantize."""

from __future__ import annotations

import math

from quantlens.march import QuantDType
from quantlens.march.opset import op_def
from quantlens.profiler.advisor.base import (
    ACC_SATURATION_LIMIT,
    INT8_RANGE_LIMIT,
    INT16_RANGE_LIMIT,
    SAME_INPUT_SQNR_LIMIT,
    AdvisorContext,
    Finding,
    OpRole,
    Rule,
    abs_max,
    finding,
    num,
    op_role,
    quantizes,
    registrar,
)

#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)


@_rule("input_asymmetric")
def input_asymmetric(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        lo, hi = row.input_min, row.input_max
        if row.boundary != "input" or lo is None or hi is None or (lo == 0 and hi == 0):
            continue
        if lo >= 0 or hi <= 0:
            out.append(finding(
                "input_asymmetric", row,
                f"model input range [{num(lo)}, {num(hi)}] is asymmetric about 0: symmetric quantization uses only "
                "half of the integer levels",
                "normalize the input symmetrically (e.g. x*2-1 for [0,1] data, or mean/std), then "
                "QuantStub(scale=1/128) fits [-1, 1)",
            ))
    return out


@_rule("input_range_int8")
def input_range_int8(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = abs_max(row.input_min, row.input_max)
        if row.boundary == "input" and row.quant_dtype == "qint8" and amax is not None and amax >= INT8_RANGE_LIMIT:
            out.append(finding(
                "input_range_int8", row,
                f"model input |x| up to {num(amax)}: an int8 step of {num(amax / 127)} loses every detail below it",
                f"use qint16 for '{row.op_name}' (ModuleNameQconfigSetter({{'{row.op_name}': "
                "QConfig(output=QuantSpec('qint16'))})) or normalize the input to about [-1, 1]",
            ))
    return out


@_rule("scale_coverage")
def scale_coverage(ctx: AdvisorContext) -> list[Finding]:
    """The output scale leaves data outside its range by more than one step; classify the error."""
    out = []
    for row in ctx.comparison:
        if not quantizes(row) or row.quant_dtype not in ("qint8", "qint16"):
            continue
        need = abs_max(row.raw_min, row.raw_max)
        if need is None or not (math.isfinite(row.raw_min) and math.isfinite(row.raw_max)):
            continue  # no finite data: the nan_inf rule reports it
        dt, s = QuantDType.parse(row.quant_dtype), row.scale
        below, above = dt.qmin * s - row.raw_min, row.raw_max - dt.qmax * s
        if below <= s and above <= s:
            continue
        kind = row.raw_error_kind or "clipping"
        info = (f"{kind}-dominated: data range [{num(row.raw_min)}, {num(row.raw_max)}] exceeds the {dt.value} range "
                f"[{num(dt.qmin * s)}, {num(dt.qmax * s)}] of scale {num(s)}; {num(100 * (row.clipped_ratio or 0))}% "
                "of the values saturate")
        need = need / dt.qmax
        if kind == "clipping":
            advice = (f"the scale is too small for this data: calibrate on representative data, check that calibration "
                      f"ran with fake quant state CALIBRATION, or fix the scale to cover it "
                      f"(FixedScaleObserver.with_args(scale={need:.6g}))")
        else:
            advice = "few values saturate and rounding dominates: int16 for this op keeps both range and resolution"
        out.append(finding("scale_coverage", row, info, advice))
    return out


#: the analysis types whose op error is precision lost to quantization (the later stages' differences are
#: mechanisms: tables, export paths, integer kernels, the runtime; their own rules name them)
_PRECISION_STAGES = ("fake_quant", "pre_export")


def _internal_advice(row, kind: OpRole, owner: str) -> str:
    """What to do about rounding inside the op, by what the op is (weights only for an op with weights)."""
    if kind is OpRole.WEIGHTED:
        return (f"rounding inside the op dominates (its weights or its inputs quantized at the op): int16 weights "
                f"for '{owner}' (a 'weight' row in the sensitive-op setter's table), per-channel weights if they are "
                "per-tensor, or int16 inputs")
    if kind is OpRole.TABLE:
        return (f"the nonlinear op's input or output grid is too coarse: int16 output for '{row.op_name}' (an "
                "'activation' row), a finer input scale (int16 for its producer), or, after pre_export, a table with "
                "more entries or a narrower input range")
    if kind is OpRole.GEMM:
        return (f"'{row.op_name}' multiplies two activations (no weight): int16 for one of its inputs (an "
                "'activation' row for its producer in the sensitive-op setter's table), or int16 output")
    return (f"rounding of the inputs quantized at '{row.op_name}' dominates: int16 for its inputs (their producers) "
            "or its output")


@_rule("op_error")
def op_error(ctx: AdvisorContext) -> list[Finding]:
    """The op itself (fed the baseline's input) loses precision: a bad layer, clipping or rounding. Only for the
    precision stages (``fake_quant``, ``pre_export``; a table of ``pre_export`` has its own rule, ``table_error``),
    and the advice fits the op (:class:`~.base.OpRole`)."""
    if ctx.analysis_type not in _PRECISION_STAGES:
        return []
    out = []
    heads: dict[str, object] = {}  # a fused group's last op -> its first (conv-bn-relu: the conv owns the weight)
    for row in ctx.comparison:
        if row.fused_into:
            heads.setdefault(row.fused_into, row)
    for row in ctx.comparison:
        v = row.same_input_sqnr
        if v is None or math.isnan(v) or v >= SAME_INPUT_SQNR_LIMIT or row.quant_dtype == "float":
            continue
        head = heads.get(row.op_name, row)
        if ctx.bias_saturated(head.op_name):
            continue  # bias_saturation names it (int16 weights would make it worse)
        kind = op_role(head)
        if ctx.analysis_type == "pre_export" and kind is OpRole.TABLE:
            continue  # table_error reads the table's own error
        error = row.error_kind or "rounding"
        if (row.acc_saturated_ratio or 0) > ACC_SATURATION_LIMIT:
            advice = (f"the int32 accumulator of '{row.op_name}' saturates (see accumulator_saturation): int16 "
                      "weights would make it worse; shorten the reduction or use int8 activations at its input")
        elif error == "clipping":
            advice = "clipping-dominated: widen the output range (calibration data, fixed scale) before trying int16"
        elif error == "rounding":
            advice = (f"rounding-dominated: int16 output for '{row.op_name}' (an 'activation' row for it in the "
                      "sensitive-op setter's table, or ModuleNameQconfigSetter)")
        else:
            advice = _internal_advice(row, kind, head.op_name)
        out.append(finding("op_error", row,
                            f"same-input SQNR {v:.1f} dB < {SAME_INPUT_SQNR_LIMIT:g} dB ({error}-dominated, "
                            f"{num(row.same_input_in_scale)} output steps; op role: {kind.value})", advice))
    return out


@_rule("int8_range_needs_int16")
def int8_range_needs_int16(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = abs_max(row.base_min, row.base_max, row.raw_min, row.raw_max)
        if (row.quant_dtype == "qint8" and quantizes(row) and row.boundary != "input" and amax is not None
                and INT8_RANGE_LIMIT < amax <= INT16_RANGE_LIMIT):
            out.append(finding(
                "int8_range_needs_int16", row,
                f"|x| up to {num(amax)} on int8: the step {num(amax / 127)} exceeds 1.0",
                f"try qint16 for '{row.op_name}' (its range fits int16 with a step of {num(amax / 32767)})",
            ))
    return out


@_rule("range_too_large")
def range_too_large(ctx: AdvisorContext) -> list[Finding]:
    out = []
    for row in ctx.comparison:
        amax = abs_max(row.base_min, row.base_max, row.raw_min, row.raw_max, row.input_min, row.input_max)
        if row.quant_dtype in ("qint8", "qint16") and amax is not None and amax > INT16_RANGE_LIMIT:
            out.append(finding(
                "range_too_large", row,
                f"total data range |x| up to {num(amax)} is too large even for int16 (step {num(amax / 32767)})",
                "bound the value in the model (clamp the input of a reciprocal/exp, normalize), or keep this op float",
            ))
    return out


@_rule("nan_inf")
def nan_inf(ctx: AdvisorContext) -> list[Finding]:
    """Where NaN/Inf first appears in each model."""
    out, seen = [], set()
    for row in ctx.comparison:
        sides = {"both": ("baseline", "analysis")}.get(row.nonfinite, (row.nonfinite,) if row.nonfinite else ())
        new = [s for s in sides if s not in seen]
        if new:
            seen.update(new)
            out.append(finding(
                "nan_inf", row, f"NaN/Inf first appears here in the {' and '.join(new)} model",
                "check this op's inputs (division by zero, log of <= 0, overflow) and the model input; the "
                "metrics of every later layer are NaN",
            ))
    return out


@_rule("dequant_not_high_precision")
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
        out.append(finding("dequant_not_high_precision", row,
                            f"the DeQuantStub receives a {row.quant_dtype} tensor from '{producer}' "
                            "(not high precision)", advice))
    return out


@_rule("fake_quant_disabled")
def fake_quant_disabled(ctx: AdvisorContext) -> list[Finding]:
    if ctx.fake_quant_state not in ("float", "calibration"):
        return []
    return [Finding("fake_quant_disabled", "(model)", "-",
                    f"the analysis model is in fake quant state '{ctx.fake_quant_state}': it does not quantize, so "
                    "the comparison shows no quantization error",
                    "call set_fake_quantize(model, FakeQuantState.VALIDATION) after calibration")]


@_rule("bias_saturation")
def bias_saturation(ctx: AdvisorContext) -> list[Finding]:
    """A conv/linear whose int32 bias saturates: ``b / (s_in * s_w[c])`` beyond int32 (``docs/march.md`` §7.2),
    so the op is wrong in those channels at every stage (fake quant, IR, NPU) whatever its output precision."""
    rows = {row.op_name: row for row in ctx.comparison}
    out = []
    for name, entry in ctx.bias.items():
        if entry.saturated == 0 or name not in rows:
            continue
        out.append(finding(
            "bias_saturation", rows[name],
            f"{entry.saturated} of {entry.channels} channels of the int32 bias of '{name}' saturate: |bias / "
            f"(input scale x weight scale)| reaches {num(entry.worst_ratio)} x the int32 limit (a large bias over a "
            "tiny scale product: pruned or near-zero weight channels get a tiny per-channel weight scale)",
            f"give '{name}' a larger scale product: a per-tensor weight scale, or a floor on the per-channel weight "
            "scale (a FixedScaleObserver / a minimum scale for the weight), or remove the pruned channels (their "
            "output is the bias alone: fold it into the next op's bias); int16 weights make it worse (a smaller "
            "weight scale)",
        ))
    return out
