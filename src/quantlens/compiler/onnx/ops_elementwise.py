"""ONNX converters: elementwise ops (arithmetic, activations, comparisons, logic, where, masked fill, fill)."""

from __future__ import annotations

from typing import Any

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.registry import onnx_converter
from quantlens.march.opset import IR_OPS, Category

_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}
#: torch's arithmetic on two bool tensors is logic (mask * mask: and, mask + mask: or); ONNX's is float/int only
_BOOL_BINARY = {"add": "Or", "mul": "And"}


@onnx_converter(*_BINARY)
def _binary(b: Builder, node: Node) -> None:
    dtype = b.out_dtype(node)
    a, c = (b.cast(b.value(i), dtype) for i in node.inputs)
    b.add(_BOOL_BINARY.get(node.op, _BINARY[node.op]) if dtype == "bool" else _BINARY[node.op], [a, c],
          node.outputs[0])


_UNARY = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "reciprocal": "Reciprocal",
          "sqrt": "Sqrt", "neg": "Neg", "abs": "Abs", "erf": "Erf", "log": "Log"}


@onnx_converter(*_UNARY)
def _unary(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    if IR_OPS[node.op].category is Category.TABLE:
        x = b.cast(x, b.out_dtype(node))  # torch promotes integer inputs to float
    b.add(_UNARY[node.op], [x], node.outputs[0])


@onnx_converter("rsqrt")
def _rsqrt(b: Builder, node: Node) -> None:
    x = b.cast(b.value(node.inputs[0]), b.out_dtype(node))
    root = b.add("Sqrt", [x], f"{node.outputs[0]}/sqrt", dtype=b.out_dtype(node), rank=b.rank(node.inputs[0]))
    b.add("Reciprocal", [root], node.outputs[0])


@onnx_converter("silu")
def _silu(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    sig = b.add("Sigmoid", [x], f"{node.outputs[0]}/sigmoid", dtype=b.dtype(x), rank=b.rank(x))
    b.add("Mul", [x, sig], node.outputs[0])


@onnx_converter("gelu")
def _gelu(b: Builder, node: Node) -> None:
    approximate = node.attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise b.error(node, f"approximate={approximate!r}", "Use approximate='none' or 'tanh'.")
    b.add("Gelu", [b.value(node.inputs[0])], node.outputs[0], approximate=approximate)


@onnx_converter("softplus")
def _softplus(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    out = node.outputs[0]
    dtype, rank = b.dtype(x) or "float32", b.rank(x)
    beta = float(node.attrs.get("beta", 1.0))
    threshold = float(node.attrs.get("threshold", 20.0))
    bx = x if beta == 1.0 else b.add("Mul", [x, b.scalar(beta, dtype, f"{out}/beta")], f"{out}/bx", dtype=dtype,
                                     rank=rank)
    sp = b.add("Softplus", [bx], f"{out}/softplus", dtype=dtype, rank=rank)
    if beta != 1.0:
        sp = b.add("Div", [sp, b.scalar(beta, dtype, f"{out}/beta")], f"{out}/div", dtype=dtype, rank=rank)
    big = b.add("Greater", [bx, b.scalar(threshold, dtype, f"{out}/threshold")], f"{out}/linear_region",
                dtype="bool", rank=rank)
    b.add("Where", [big, x, sp], out)


def _clip(b: Builder, node: Node, lo: Any, hi: Any) -> None:
    x = b.value(node.inputs[0])
    dtype = b.dtype(x) or "float32"
    inputs = [x,
              "" if lo is None else b.scalar(lo, dtype, f"{node.outputs[0]}/min"),
              "" if hi is None else b.scalar(hi, dtype, f"{node.outputs[0]}/max")]
    while inputs[-1] == "":
        inputs.pop()
    b.add("Clip", inputs, node.outputs[0])


@onnx_converter("clamp")
def _clamp(b: Builder, node: Node) -> None:
    _clip(b, node, node.attrs.get("min"), node.attrs.get("max"))


@onnx_converter("hardtanh")
def _hardtanh(b: Builder, node: Node) -> None:
    _clip(b, node, node.attrs.get("min_val", -1.0), node.attrs.get("max_val", 1.0))


@onnx_converter("pow")
def _pow(b: Builder, node: Node) -> None:
    exponent = node.attrs["exponent"]
    x = b.cast(b.value(node.inputs[0]), b.out_dtype(node))
    dtype = b.dtype(x) if b.dtype(x) in _FLOAT_DTYPES else ("int64" if isinstance(exponent, int) else "float32")
    b.add("Pow", [x, b.scalar(exponent, dtype, f"{node.outputs[0]}/exponent")], node.outputs[0])


@onnx_converter("hardswish")
def _hardswish(b: Builder, node: Node) -> None:
    b.add("HardSwish", [b.value(node.inputs[0])], node.outputs[0])  # x * max(0, min(1, x / 6 + 1 / 2)), as torch


@onnx_converter("hardsigmoid")
def _hardsigmoid(b: Builder, node: Node) -> None:
    b.add("HardSigmoid", [b.value(node.inputs[0])], node.outputs[0], alpha=1.0 / 6.0, beta=0.5)  # torch's constants


@onnx_converter("elu")
def _elu(b: Builder, node: Node) -> None:
    if float(node.attrs.get("scale", 1.0)) != 1.0 or float(node.attrs.get("input_scale", 1.0)) != 1.0:
        raise b.error(node, "elu with scale or input_scale other than 1 (selu/celu)", "Use F.elu(x, alpha).")
    b.add("Elu", [b.value(node.inputs[0])], node.outputs[0], alpha=float(node.attrs.get("alpha", 1.0)))


def _promote(b: Builder, names: list[str]) -> list[str]:
    """Cast comparison operands to one dtype (float wins over integer, as in torch)."""
    dtypes = [b.dtype(n) for n in names]
    if None in dtypes or len(set(dtypes)) == 1:
        return names
    floats = [d for d in dtypes if d in _FLOAT_DTYPES]
    target = floats[0] if floats else "int64"
    if len(set(floats)) > 1:
        target = "float32"
    return [b.cast(n, target) for n in names]


_COMPARE = {"eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}


@onnx_converter(*_COMPARE, "ne")
def _compare(b: Builder, node: Node) -> None:
    a, c = _promote(b, [b.value(i) for i in node.inputs])
    if node.op in ("lt", "le", "gt", "ge") and "bool" in (b.dtype(a), b.dtype(c)):  # ONNX orders numbers only
        a, c = b.cast(a, "int32"), b.cast(c, "int32")
    if node.op == "ne":
        eq = b.add("Equal", [a, c], f"{node.outputs[0]}/eq", dtype="bool", rank=b.rank(node.outputs[0]))
        b.add("Not", [eq], node.outputs[0])
    else:
        b.add(_COMPARE[node.op], [a, c], node.outputs[0])


@onnx_converter("logical_not", "logical_and", "logical_or")
def _logical(b: Builder, node: Node) -> None:
    op = {"logical_not": "Not", "logical_and": "And", "logical_or": "Or"}[node.op]
    y = b.add(op, [b.cast(b.value(i), "bool") for i in node.inputs],
              node.outputs[0] if b.out_dtype(node) in (None, "bool") else f"{node.outputs[0]}/bool", dtype="bool")
    if y != node.outputs[0]:
        b.add("Cast", [y], node.outputs[0], to=onnx_dtype(b.out_dtype(node)))


@onnx_converter("where")
def _where(b: Builder, node: Node) -> None:
    cond, a, c = node.inputs
    dtype = b.out_dtype(node)
    b.add("Where", [b.cast(b.value(cond), "bool"), b.cast(b.value(a), dtype), b.cast(b.value(c), dtype)],
          node.outputs[0])


@onnx_converter("masked_fill")
def _masked_fill(b: Builder, node: Node) -> None:
    x, mask = node.inputs
    dtype = b.dtype(x) or "float32"
    value = b.scalar(node.attrs["value"], dtype, f"{node.outputs[0]}/value")
    b.add("Where", [b.cast(b.value(mask), "bool"), value, b.value(x)], node.outputs[0])


@onnx_converter("prelu")
def _prelu(b: Builder, node: Node) -> None:
    """ONNX PRelu broadcasts the slope numpy-style (from the last dim): a per-channel slope becomes [C, 1, ...]."""
    x, slope = node.inputs
    rank = b.rank(x)
    out = node.outputs[0]
    s = b.value(slope)
    n = b.shape(slope)
    if n and n[0] > 1 and rank and rank > 2:
        s = b.add("Reshape", [s, b.ints([n[0]] + [1] * (rank - 2), f"{out}/slope_shape")], f"{out}/slope",
                  dtype=b.dtype(slope))
    b.add("PRelu", [b.value(x), s], out)


@onnx_converter("leaky_relu")
def _leaky_relu(b: Builder, node: Node) -> None:
    b.add("LeakyRelu", [b.value(node.inputs[0])], node.outputs[0], alpha=float(node.attrs["negative_slope"]))


@onnx_converter("fill")
def _fill(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    out = node.outputs[0]
    zero = b.add("Mul", [x, b.scalar(0.0, b.dtype(node.inputs[0]) or "float32", f"{out}/zero")], f"{out}/zeros",
                 dtype=b.dtype(node.inputs[0]))
    b.add("Add", [zero, b.scalar(float(node.attrs["value"]), b.dtype(node.inputs[0]) or "float32", f"{out}/v")], out)
