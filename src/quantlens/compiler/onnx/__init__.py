"""``to_onnx``: write the qat IR as a standard ONNX model that onnxruntime runs like the qat IR.

* ``fake_quant`` of an activation becomes ``QuantizeLinear`` (int8 / int16, uint8 / uint16, zero point 0, per
  axis when the IR fake quant is per channel; ONNX ``QuantizeLinear`` rounds half to even, like the march,
  ``docs/march.md`` §4) followed by its dequantization: ``Cast(float32) -> Mul(scale)`` by default, or
  ``DequantizeLinear`` in the opt-in standard QDQ form (``standard_qdq=True``). Both compute ``fl32(q * s)``, the
  fake quant's result, bit for bit; the default form is one that no runtime fuses into integer kernels, so
  onnxruntime's default optimizations keep the qat IR's float arithmetic on every CPU (``docs/ir.md``).
* ``fake_quant`` of a constant (weights, biases) is folded: the integers are stored as an int8/int16/int32
  initializer followed by the same dequantization, whose output equals the fake quant bit for bit (checked at
  export; a float initializer is stored otherwise).
* A fake quant of a non-constant with a range that no ``QuantizeLinear`` type holds (int32 ``[-2**31, 2**31-1]``;
  opset 21 ``QuantizeLinear`` has no int32 output) is written as its float arithmetic:
  ``Mul(Clip(Round(Div(x, s)), qmin, qmax), s)``, which is the fake quant's own definition.
* Every other IR op maps to standard ONNX ops (table in ``docs/ir.md``). An op without a mapping raises
  ``QuantLensError`` naming the op, its op site and the fix.

The package, one job per module: :mod:`.driver` runs the converters over the graph, completes the Q/DQ pairs
of the standard QDQ form, validates the model and writes it atomically (``to_onnx``); :mod:`.builder` is the
graph the converters write into; :mod:`.registry` holds the one converter registry, ``ONNX_CONVERTERS`` keyed by
IR op, with its ``onnx_converter`` decorator. The converters register there from their op family's module:
:mod:`.ops_quant` (fake quant), :mod:`.ops_gemm` (conv, linear, matmul, sdpa, embedding),
:mod:`.ops_elementwise`, :mod:`.ops_host` (host ops, through torch's own exporter), :mod:`.ops_norm` (normalisation, softmax), :mod:`.ops_reduce_pool` (reductions, pooling,
resizing), :mod:`.ops_movement` (reshape, indexing, pad...) and :mod:`.tables` (pre_export's table ops, exact
where their integer arithmetic can be written). Importing this package imports them all, so the registry is full.
"""

from quantlens.compiler.onnx import (  # noqa: F401 - imported to register their converters
    ops_elementwise,
    ops_gemm,
    ops_host,
    ops_movement,
    ops_norm,
    ops_quant,
    ops_reduce_pool,
    tables,
)
from quantlens.compiler.onnx.driver import MIN_OPSET, to_onnx
from quantlens.compiler.onnx.registry import ONNX_CONVERTERS, onnx_converter

__all__ = ["to_onnx", "ONNX_CONVERTERS", "onnx_converter", "MIN_OPSET"]
