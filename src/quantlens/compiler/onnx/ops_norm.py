"""ONNX converters: normalisation (layer norm, standalone batch norm), softmax / log-softmax, and the exact
export of the L2 norm table op (``int_vector_norm``)."""

from __future__ import annotations

import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.registry import onnx_converter
from quantlens.compiler.onnx.tables import F64, exact_export, table_constants
from quantlens.kernels.int_ops import MANTISSA_BITS
from quantlens.kernels.norm_ops import RSQRT_TO_ROOT, VECTOR_NORM_ROOT_BITS
from quantlens.kernels.tables import rsqrt_mantissa_table


@onnx_converter("layer_norm")
def _layer_norm(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    shape = [int(d) for d in node.attrs["normalized_shape"]]
    dtype = b.dtype(x) or "float32"
    weight = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] else None
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    scale = b.value(weight) if weight else b.init(torch.ones(shape, dtype=getattr(torch, dtype)),
                                                   f"{node.outputs[0]}/ones")
    inputs = [x, scale] + ([b.value(bias)] if bias else [])
    b.add("LayerNormalization", inputs, node.outputs[0], axis=-len(shape), epsilon=float(node.attrs["eps"]))


@onnx_converter("softmax", "log_softmax")
def _softmax(b: Builder, node: Node) -> None:
    op = "Softmax" if node.op == "softmax" else "LogSoftmax"
    b.add(op, [b.value(node.inputs[0])], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("batch_norm")
def _batch_norm(b: Builder, node: Node) -> None:
    x, weight, bias, mean, var = node.inputs
    channels = b.shape(mean)[0]
    dtype = b.dtype(x) or "float32"
    out = node.outputs[0]
    scale = b.value(weight) if weight else b.init(torch.ones(channels, dtype=getattr(torch, dtype)), f"{out}/ones")
    shift = b.value(bias) if bias else b.init(torch.zeros(channels, dtype=getattr(torch, dtype)), f"{out}/zeros")
    b.add("BatchNormalization", [b.value(x), scale, shift, b.value(mean), b.value(var)], out,
          epsilon=float(node.attrs["eps"]))


@exact_export("int_vector_norm")
def _vector_norm(b: Builder, node: Node) -> bool:
    """``int_vector_norm`` (``kernels.norm_ops``) exactly: the sum of squares and the mantissa normalisation in
    int64, the rsqrt mantissa table and ``t = rhe(m · S(m), 23)`` in float64 (``m · S(m) < 2**48``: exact), and the
    requantize ``rhe(t · M, shift + 11 - k)`` in int64 (``t · M < 2**55``)."""
    constants = table_constants(b, node)
    shape = b.shape(node.inputs[0])
    if constants is None or shape is None:
        return False
    m, shift = (int(v) for v in constants[2].tolist())
    a = node.attrs
    dims = [int(d) for d in a["dim"]] or list(range(len(shape)))
    f = F64(b, node)
    q = f.to_int64(f.codes(b.value(node.inputs[0]), node.inputs[1], int(a["in_qmin"]), int(a["in_qmax"])))
    s = f.op("ReduceSum", f.op("Mul", q, q, dtype="int64"), b.ints(dims, f"{f.out}/axes"),
             keepdims=int(bool(a["keepdim"])), dtype="int64")
    zero, one = f.const(0, "int64"), f.const(1, "int64")
    v = f.op("Max", s, one, dtype="int64")
    k = f.op("Floor", f.op("Div", f.op("Sub", f.bitlen_int64(v), f.const(float(MANTISSA_BITS - 1))), f.const(2.0)))
    two_k = f.to_int64(f.op("Mul", k, f.const(2.0)))
    down = f.rhe_div_int64(v, f.pow2_int64(f.op("Max", two_k, zero, dtype="int64")))
    up = f.op("Mul", v, f.pow2_int64(f.op("Max", f.op("Neg", two_k, dtype="int64"), zero, dtype="int64")),
              dtype="int64")
    mant = f.op("Cast", f.op("Where", f.op("Greater", two_k, zero, dtype="bool"), down, up, dtype="int64"),
                to=onnx_dtype("float64"))
    over = f.op("Equal", mant, f.const(float(1 << MANTISSA_BITS)), dtype="bool")
    mant = f.op("Where", over, f.const(float(1 << (MANTISSA_BITS - 2))), mant)
    k = f.op("Add", k, f.op("Cast", over, to=onnx_dtype("float64")))
    r = f.mantissa_lookup(rsqrt_mantissa_table(), mant)
    t = f.to_int64(f.op("Round", f.op("Mul", f.op("Mul", mant, r), f.const(2.0 ** -RSQRT_TO_ROOT))))
    total = f.to_int64(f.op("Sub", f.const(float(shift + VECTOR_NORM_ROOT_BITS)), k))
    clipped = f.op("Clip", total, zero, f.const(62, "int64"), dtype="int64")
    y = f.rhe_div_int64(f.op("Mul", t, f.const(m, "int64"), dtype="int64"), f.pow2_int64(clipped))
    y = f.op("Where", f.op("Greater", total, f.const(62, "int64"), dtype="bool"), zero, y, dtype="int64")
    y = f.op("Where", f.op("Less", total, zero, dtype="bool"), f.const(int(a["out_qmax"]), "int64"), y, dtype="int64")
    y = f.op("Where", f.op("Equal", s, zero, dtype="bool"), zero, y, dtype="int64")
    f.dequantize(y, node.inputs[2], int(a["out_qmin"]), int(a["out_qmax"]))
    return True
