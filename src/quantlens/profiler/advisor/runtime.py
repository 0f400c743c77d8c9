"""The advisor's rules for the ``onnxruntime`` pair (the qat IR against its ONNX file run by onnxruntime).

onnxruntime runs the whole graph, so there is no same-input error: a rule finds the op sites where the accumulated
error jumps (beyond rounding on a bit-exact input, or far beyond what the input carried), and names what
onnxruntime does there for that kind of op: a GEMM summed in another order or fused into an integer kernel that saturates, or a table op
written as the float function it emulates."""

from __future__ import annotations

from quantlens.profiler.advisor.base import (
    ROUNDING_VERDICTS,
    AdvisorContext,
    Finding,
    OpRole,
    Rule,
    finding,
    num,
    op_role,
    registrar,
)

#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)

_WITHIN = frozenset({"", "bit-exact"}) | ROUNDING_VERDICTS

#: what onnxruntime does differently at an op of each kind, and what to do about it
_RUNTIME = {
    OpRole.WEIGHTED: (
        "onnxruntime fused this op with its Q/DQ neighbours into an integer kernel (QLinearConv, QGemm, "
        "MatMulInteger, ConvInteger...: their u8s8 products saturate on x86 CPUs without VNNI), or sums it in "
        "another order so a value at a half step rounds the other way",
        "write the file with to_onnx's default form (Cast -> Mul dequantize, which onnxruntime fuses into no "
        "integer kernel) rather than standard_qdq=True, and check the graph onnxruntime ran "
        "(SessionOptions.optimized_model_filepath) for those kernels; a one-step difference at a half step is "
        "float32 summation order and not a fault"),
    OpRole.GEMM: (
        "onnxruntime computes this product of two activations in float32 (or an integer MatMul kernel if it fused "
        "Q/DQ around it)",
        "use to_onnx's default form and check the optimized graph for MatMulInteger / QLinearMatMul"),
    OpRole.TABLE: (
        "the NPU computes this op by a lookup table, but the ONNX file has the float function it emulates here "
        "(to_onnx writes a table exactly as a Gather over its input codes unless the site is outside what the exact "
        "export covers: a per-channel input scale, a constant it cannot read)",
        "give the op a per-tensor input scale so to_onnx can write its table exactly, or compare the quantized IR "
        "(the bit-exact simulator) with the qat IR instead: QuantAnalysis(qat_ir, convert(qat_ir), 'convert')"),
}
_DEFAULT = ("onnxruntime computes this op differently from the qat IR",
            "compare the ONNX node at this op site with the IR node (to_onnx keeps the IR's value names)")


#: an op whose accumulated error (in its output steps) is this many times its input's has not only inherited it:
#: a normalization amplifies a one-step input difference by tens of steps, a wrong scale or weight by thousands
JUMP_FACTOR = 64.0


def _source(rows: dict, row):
    """The row of the op that computed ``row``'s input: its producer, followed back through rows without a
    verdict (data movement, float ops: they carry their input's error); None for a model input."""
    seen = set()
    producer = rows.get(row.producer)
    while producer is not None and not producer.lsb_verdict and producer.op_name not in seen:
        seen.add(producer.op_name)
        producer = rows.get(producer.producer)
    return producer


def _jumps(row, source) -> bool:
    if row.lsb_verdict in _WITHIN:
        return False
    if source is None:  # a model input (the same on both sides), else an input no row describes: cannot judge
        return row.boundary == "input"
    if source.lsb_verdict == "bit-exact":
        return True  # exactly the qat IR's input, something else out
    inherited = max(1.0, source.atol_in_scale or 0.0)
    return (row.atol_in_scale or 0.0) > JUMP_FACTOR * inherited


@_rule("onnxruntime_op_differs")
def onnxruntime_op_differs(ctx: AdvisorContext) -> list[Finding]:
    """onnxruntime: the op sites where onnxruntime starts to compute something else: beyond rounding on an input
    that is bit-exact, or an error ``JUMP_FACTOR`` times what its input carried (one-step differences that an op
    amplifies, as a LayerNorm does, are not reported), with what onnxruntime does there for that kind of op."""
    if ctx.analysis_type != "onnxruntime":
        return []
    rows = {row.op_name: row for row in ctx.comparison}
    out = []
    for row in ctx.comparison:
        source = _source(rows, row)
        if not _jumps(row, source):
            continue
        what, advice = _RUNTIME.get(op_role(row), _DEFAULT)
        came = "the model input" if source is None else "a bit-exact input" if source.lsb_verdict == "bit-exact" else \
            f"an input {num(source.atol_in_scale)} steps off"
        out.append(finding(
            "onnxruntime_op_differs", row,
            f"onnxruntime's result is {row.lsb_verdict} of the qat IR here (up to {num(row.atol_in_scale)} output "
            f"steps, {row.lsb_hist}) from {came}: {what}", advice))
    return out
