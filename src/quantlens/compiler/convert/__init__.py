"""``convert``: qat IR -> quantized IR (integer-only; quantize/dequantize only at the model boundary).

Every value of the qat IR that lies on an integer grid (the output of a ``fake_quant``, or data moved by a
passthrough op) becomes an integer value with a known ``(dtype, scale)``. Each compute op is matched with the
fake quant that ends its output chain (through passthrough ops such as the fused ReLU), and becomes one integer
kernel that accumulates exactly and requantizes straight to that fake quant's scale (``docs/march.md`` §6-§10).
A conv/linear whose output reaches a model output without a fake quant keeps the int32 high-precision output.

Converters live in one registry, ``CONVERTERS``, keyed by qat IR op (:mod:`.state`), filled by one module per op
family: :mod:`.gemm`, :mod:`.arithmetic`, :mod:`.pools`, :mod:`.movement`, :mod:`.tables`. Their integer
parameters come from the spec's rules (``quantlens.march.rules``), which the fake quant's emulation calls too.
"""

from __future__ import annotations

from quantlens.compiler.convert import arithmetic, gemm, movement, pools, tables  # noqa: F401 (fill CONVERTERS)
from quantlens.compiler.convert.movement import passthrough
from quantlens.compiler.convert.ort_cpu import ORT_CPU_CONVERTERS
from quantlens.compiler.convert.state import CONVERTERS, PASSTHROUGH_OPS, Converter, converter, qpp_of
from quantlens.compiler.ir import Module
from quantlens.compiler.onnx.runtime_match import check_fusion
from quantlens.compiler.provenance import SOURCE_DIGEST_KEY, ir_digest
from quantlens.errors import QuantLensError
from quantlens.march import March, using_march

#: a march's name (the IR's ``meta["march"]``) -> its converters; a march not named here converts with QL1's
_MARCH_CONVERTERS = {March.ORT_CPU.spec.name: ORT_CPU_CONVERTERS}

__all__ = ["convert", "CONVERTERS", "PASSTHROUGH_OPS", "qpp_of"]


def convert(qat_ir: Module) -> Module:
    """Convert a qat IR (from ``export``) to the integer-only quantized IR; the input module is not modified.

    The quantized IR's meta records the qat IR's digest (``meta["source_ir_digest"]``,
    :func:`quantlens.compiler.provenance.ir_digest`): a pair of the two is checked to belong together.

    A qat IR of ``March.ORT_CPU`` (its ``meta["march"]``) converts with that march's rules, whatever march is selected
    now, and the result is checked against onnxruntime: the fused kernels it assumed must be those the runtime runs
    for ``to_onnx``'s file (:func:`quantlens.compiler.onnx.runtime_match.check_fusion`)."""
    if not isinstance(qat_ir, Module) or qat_ir.kind != "qat":
        raise QuantLensError(
            "convert expects the qat IR returned by quantlens.compiler.export (kind 'qat'), got "
            f"{getattr(qat_ir, 'kind', type(qat_ir).__name__)!r}."
        )
    march = qat_ir.meta.get("march", March.QL1.spec.name)
    with using_march(march, qat_ir.meta.get("march_variant")):  # the IR's march, whatever set_march says now
        state = Converter(qat_ir, _MARCH_CONVERTERS.get(march, CONVERTERS))
        graph = state.run()
    quantized = Module("quantized", graph, list(qat_ir.input_leaves), qat_ir.input_spec, qat_ir.output_spec,
                       meta={**qat_ir.meta, "qpp": state.qpp.value, SOURCE_DIGEST_KEY: ir_digest(qat_ir)})
    if march == March.ORT_CPU.spec.name:  # the kernels assumed must be the ones the runtime runs
        check_fusion(qat_ir, quantized)
    return quantized


for _op in sorted(PASSTHROUGH_OPS - CONVERTERS.keys()):  # pad, fill, the scatters have their own converters
    converter(_op)(passthrough)
for _op in sorted(PASSTHROUGH_OPS - ORT_CPU_CONVERTERS.keys()):  # data movement: the same under every march
    ORT_CPU_CONVERTERS[_op] = CONVERTERS[_op]
