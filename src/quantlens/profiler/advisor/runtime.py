"""The advisor's rules for the ``onnxruntime`` pair (the qat IR against its ONNX file run by onnxruntime).

onnxruntime runs the whole graph, so there is no same-input error: a rule finds the op sites where the accumulated
error jumps beyond rounding while the op's producer was still within it, and names what onnxruntime does there
for that kind of op: a GEMM summed in another order or fused into an integer kernel that saturates, or a table op
written as the float function it emulates."""

from __future__ import annotations

from quantlens.profiler.advisor.base import (
    ROUNDING_VERDICTS,
    AdvisorContext,
    Finding,
    OpKind,
    Rule,
    finding,
    num,
    op_kind,
    registrar,
)

#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)

_WITHIN = frozenset({"", "bit-exact"}) | ROUNDING_VERDICTS

#: what onnxruntime does differently at an op of each kind, and what to do about it
_RUNTIME = {
    OpKind.WEIGHTED: (
        "onnxruntime fused this op with its Q/DQ neighbours into an integer kernel (QLinearConv, QGemm, "
        "MatMulInteger, ConvInteger...: their u8s8 products saturate on x86 CPUs without VNNI), or sums it in "
        "another order so a value at a half step rounds the other way",
        "write the file with to_onnx's default form (Cast -> Mul dequantize, which onnxruntime fuses into no "
        "integer kernel) rather than standard_qdq=True, and check the graph onnxruntime ran "
        "(SessionOptions.optimized_model_filepath) for those kernels; a one-step difference at a half step is "
        "float32 summation order and not a fault"),
    OpKind.GEMM: (
        "onnxruntime computes this product of two activations in float32 (or an integer MatMul kernel if it fused "
        "Q/DQ around it)",
        "use to_onnx's default form and check the optimized graph for MatMulInteger / QLinearMatMul"),
    OpKind.TABLE: (
        "the NPU computes this op by a lookup table, but the ONNX file has the float function it emulates here "
        "(to_onnx writes a table exactly as a Gather over its input codes unless the site is outside what the exact "
        "export covers: a per-channel input scale, a constant it cannot read)",
        "give the op a per-tensor input scale so to_onnx can write its table exactly, or compare the quantized IR "
        "(the bit-exact simulator) with the qat IR instead: QuantAnalysis(qat_ir, convert(qat_ir), 'convert')"),
}
_DEFAULT = ("onnxruntime computes this op differently from the qat IR",
            "compare the ONNX node at this op site with the IR node (to_onnx keeps the IR's value names)")


@_rule("onnxruntime_op_differs")
def onnxruntime_op_differs(ctx: AdvisorContext) -> list[Finding]:
    """onnxruntime: the op sites where the accumulated error jumps beyond rounding while their producer's was within
    it (the op where onnxruntime starts to compute something else), with what onnxruntime does there."""
    if ctx.analysis_type != "onnxruntime":
        return []
    verdicts = {row.op_name: row.lsb_verdict for row in ctx.comparison}
    out = []
    for row in ctx.comparison:
        if row.lsb_verdict in _WITHIN or verdicts.get(row.producer, "") not in _WITHIN:
            continue
        what, advice = _RUNTIME.get(op_kind(row), _DEFAULT)
        out.append(finding(
            "onnxruntime_op_differs", row,
            f"onnxruntime's result is {row.lsb_verdict} of the qat IR here (up to {num(row.atol_in_scale)} output "
            f"steps, {row.lsb_hist}) while its input was within rounding: {what}", advice))
    return out
