"""The ONNX converters of ``to_onnx``: one registry, ``ONNX_CONVERTERS``, keyed by IR op (the one job of this module).

A converter ``fn(b, node)`` writes the ONNX nodes of one IR node into the :class:`~.onnx_builder._Builder` ``b``;
register one with ``@onnx_converter("op", ...)``. Sections: fake quant (QDQ pairs, folded constants), GEMM,
elementwise, normalisation and softmax, reductions and pooling, data movement. The mapping table is in
``docs/ir.md``; :mod:`.onnx_export` is the driver.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx_builder import _Builder, _onnx_dtype
from quantlens.compiler.onnx_tables import EXACT_TABLE_EXPORTS
from quantlens.kernels import TABLE_OP_IO
from quantlens.march.opset import IR_OPS, Category

__all__ = ["ONNX_CONVERTERS", "onnx_converter"]


# -- registry ------------------------------------------------------------------------------------------------------
ONNX_CONVERTERS: dict[str, Callable[["_Builder", Node], None]] = {}


def onnx_converter(*ops: str):
    def register(fn):
        for op in ops:
            ONNX_CONVERTERS[op] = fn
        return fn

    return register


_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


# -- fake quant ---------------------------------------------------------------------------------------------------
#: (qmin, qmax) -> the QuantizeLinear output type that holds exactly that range.
_QDQ_TYPES = {(-128, 127): "int8", (-32768, 32767): "int16", (0, 255): "uint8", (0, 65535): "uint16"}


def _container(qmin: int, qmax: int) -> str | None:
    """The integer dtype that stores codes in [qmin, qmax] for a folded constant (None: none fits)."""
    for dtype in ("int8", "uint8", "int16", "uint16", "int32"):
        info = torch.iinfo(getattr(torch, dtype))
        if info.min <= qmin and qmax <= info.max:
            return dtype
    return None


def _scale_tensor(b: _Builder, node: Node) -> torch.Tensor:
    name = node.inputs[1]
    if name not in b.graph.constants:
        raise b.error(node, f"its scale '{name}' is not a constant",
                      "Export from a calibrated or trained model in VALIDATION state (frozen scales).")
    return b.graph.constants[name].detach().to(torch.float32)


def _broadcast_scale(scale: torch.Tensor, rank: int, axis: int) -> torch.Tensor:
    if axis < 0 or scale.numel() == 1:
        return scale.reshape(())
    shape = [1] * rank
    shape[axis] = -1
    return scale.reshape(shape)


@onnx_converter("fake_quant")
def _fake_quant(b: _Builder, node: Node) -> None:
    x, _ = node.inputs
    out = node.outputs[0]
    qmin, qmax, axis = int(node.attrs["qmin"]), int(node.attrs["qmax"]), int(node.attrs.get("axis", -1))
    scale = _scale_tensor(b, node)
    per_axis = axis >= 0 and scale.numel() > 1
    if x in b.graph.constants:
        _folded_fake_quant(b, node, b.graph.constants[x], scale, qmin, qmax, axis, per_axis)
        return
    rank = b.rank(x)
    if per_axis and rank is None:
        raise b.error(node, "the rank of its input is unknown", "Export again; every value should carry a shape.")
    qtype = _QDQ_TYPES.get((qmin, qmax))
    xf = b.cast(x, "float32")  # the fake quant computes in float32, like quantlens::fake_quant
    if qtype is None:  # e.g. int32: QuantizeLinear has no such output type; write the fake quant's arithmetic
        s = b.init(_broadcast_scale(scale, rank or 0, axis).to(torch.float32), f"{out}/scale")
        q = b.add("Div", [xf, s], f"{out}/div", dtype="float32", rank=rank)
        q = b.add("Round", [q], f"{out}/round", dtype="float32", rank=rank)
        lo, hi = b.scalar(float(qmin), "float32", f"{out}/qmin"), b.scalar(float(qmax), "float32", f"{out}/qmax")
        q = b.add("Clip", [q, lo, hi], f"{out}/clip", dtype="float32", rank=rank)
        y = b.add("Mul", [q, s], out if b.dtype(x) in (None, "float32") else f"{out}/mul", dtype="float32", rank=rank)
        if y != out:
            b.add("Cast", [y], out, dtype=b.dtype(x), rank=rank, to=_onnx_dtype(b.dtype(x)))
        return
    scale_name = node.inputs[1]
    scale_dim = b.graph.constants[scale_name].dim()
    if per_axis:
        s = b.value(scale_name) if scale_dim == 1 else b.init(scale.reshape(-1), f"{out}/scale")
        zp = b.init(torch.zeros((scale.numel(),), dtype=getattr(torch, qtype)), f"{out}/zero_point")
        attrs = {"axis": axis}
    else:
        s = b.value(scale_name) if scale_dim == 0 else b.init(scale.reshape(()), f"{out}/scale")
        zp = b.init(torch.zeros((), dtype=getattr(torch, qtype)), f"{out}/zero_point")
        attrs = {}
    if b.dtype(s) != "float32":
        s = b.cast(s, "float32")
    q = b.add("QuantizeLinear", [xf, s, zp], f"{out}/q", dtype=qtype, rank=rank, **attrs)
    y = b.dequantize(q, scale, zp, axis if per_axis else -1, rank,
                     out if b.dtype(x) in (None, "float32") else f"{out}/dq", scale_name=s)
    if y != out:
        b.add("Cast", [y], out, dtype=b.dtype(x), rank=rank, to=_onnx_dtype(b.dtype(x)))


def _folded_fake_quant(b: _Builder, node: Node, x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int,
                       axis: int, per_axis: bool) -> None:
    out = node.outputs[0]
    expected = torch.ops.quantlens.fake_quant(x, scale, qmin, qmax, axis)
    container = _container(qmin, qmax)
    if container is not None and x.dtype == torch.float32:
        s = _broadcast_scale(scale, x.dim(), axis)
        q = torch.div(x.to(torch.float32), s).round().clamp(qmin, qmax)
        info = torch.iinfo(getattr(torch, container))
        q_int = q.to(torch.float64).clamp(info.min, info.max).to(getattr(torch, container))
        if torch.equal(q_int.to(torch.float32) * s, expected):  # the dequantization reproduces the fake quant
            qname = b.init(q_int, f"{out}/quantized")
            zp = None
            if container != "int32" and b.standard_qdq:
                zp_shape = (scale.numel(),) if per_axis else ()
                zp = b.init(torch.zeros(zp_shape, dtype=getattr(torch, container)), f"{out}/zero_point")
            b.dequantize(qname, scale, zp, axis if per_axis else -1, x.dim(), out)
            return
    b.add("Identity", [b.init(expected, f"{out}/folded")], out, dtype=str(expected.dtype).replace("torch.", ""),
          rank=expected.dim())


# -- GEMM ------------------------------------------------------------------------------------------------------------
def _pair(value: Any, n: int) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in (values * n if len(values) == 1 else values)]


@onnx_converter("conv2d", "conv1d")
def _conv(b: _Builder, node: Node) -> None:
    n = 2 if node.op == "conv2d" else 1
    a = node.attrs
    if isinstance(a.get("padding"), str):
        raise b.error(node, f"string padding {a['padding']!r}", "Use explicit integer padding in the model.")
    pads = _pair(a.get("padding", 0), n)
    inputs = [b.value(i) for i in node.inputs if i]
    b.add("Conv", inputs, node.outputs[0], strides=_pair(a.get("stride", 1), n), pads=pads + pads,
          dilations=_pair(a.get("dilation", 1), n), group=int(a.get("groups", 1)))


@onnx_converter("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(b: _Builder, node: Node) -> None:
    """``ConvTranspose``: the weight layout ``[in, out / groups, k...]`` is ONNX's; torch's padding crops both
    ends (``pads``), ``output_padding`` adds at the end."""
    n = 2 if node.op == "conv_transpose2d" else 1
    a = node.attrs
    pads = _pair(a.get("padding", 0), n)
    inputs = [b.value(i) for i in node.inputs if i]
    b.add("ConvTranspose", inputs, node.outputs[0], strides=_pair(a.get("stride", 1), n), pads=pads + pads,
          output_padding=_pair(a.get("output_padding", 0), n), dilations=_pair(a.get("dilation", 1), n),
          group=int(a.get("groups", 1)))


@onnx_converter("linear")
def _linear(b: _Builder, node: Node) -> None:
    """``Gemm(x, W, b, transB=1)``; an N-D input is flattened to 2-D around it (``Reshape -> Gemm -> Reshape``)."""
    x, w = b.value(node.inputs[0]), b.value(node.inputs[1])
    bias = b.value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    out = node.outputs[0]
    inputs = [x, w] + ([bias] if bias else [])
    x_shape, out_shape = b.shape(node.inputs[0]), b.shape(out)
    if x_shape is not None and len(x_shape) == 2:
        b.add("Gemm", inputs, out, transB=1)
        return
    if x_shape is None or out_shape is None or len(x_shape) < 1 or x_shape[-1] < 0 or \
            list(out_shape[:-1]).count(-1) > 1:
        raise b.error(node, f"input shape {x_shape} / output shape {out_shape} cannot be flattened to 2-D",
                      "Export with static shapes (dynamic_batch=False).")
    dtype = b.dtype(node.inputs[0])
    if len(x_shape) == 1:
        flat_shape, back_shape = [1, x_shape[0]], list(out_shape)
    else:
        flat_shape, back_shape = [-1, x_shape[-1]], list(out_shape)
    inputs[0] = b.add("Reshape", [x, b.ints(flat_shape, f"{out}/flat_shape")], f"{out}/flat", dtype=dtype, rank=2)
    y = b.add("Gemm", inputs, f"{out}/gemm", transB=1, dtype=b.out_dtype(node), rank=2)
    b.add("Reshape", [y, b.ints(back_shape, f"{out}/shape")], out)


@onnx_converter("matmul")
def _matmul(b: _Builder, node: Node) -> None:
    b.add("MatMul", [b.value(i) for i in node.inputs], node.outputs[0])


@onnx_converter("sdpa")
def _sdpa(b: _Builder, node: Node) -> None:
    a = node.attrs
    if a.get("dropout_p") not in (None, 0, 0.0):
        raise b.error(node, f"dropout_p={a['dropout_p']}", "Export the model in eval mode (dropout off).")
    q, k, v = (b.value(i) for i in node.inputs[:3])
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else None
    out = node.outputs[0]
    q_shape, k_shape = b.shape(node.inputs[0]), b.shape(node.inputs[1])
    if q_shape is None or k_shape is None or q_shape[-1] < 0:
        raise b.error(node, "the query/key shapes are unknown", "Export with static head dimensions.")
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(q_shape[-1]) if scale is None else float(scale)
    rank = len(k_shape)
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    dtype = b.dtype(node.inputs[0]) or "float32"
    kt = b.add("Transpose", [k], f"{out}/key_t", perm=perm, dtype=dtype, rank=rank)
    scores = b.add("MatMul", [q, kt], f"{out}/scores", dtype=dtype, rank=len(q_shape))
    scores = b.add("Mul", [scores, b.scalar(scale, dtype, f"{out}/scale")], f"{out}/scaled", dtype=dtype,
                   rank=len(q_shape))
    neg_inf = None
    if a.get("is_causal"):
        length, source = q_shape[-2], k_shape[-2]
        if length < 0 or source < 0:
            raise b.error(node, "is_causal with a dynamic sequence length", "Export with static sequence lengths.")
        causal = b.init(torch.ones(length, source, dtype=torch.bool).tril(), f"{out}/causal")
        neg_inf = b.scalar(-math.inf, dtype, f"{out}/neg_inf")
        scores = b.add("Where", [causal, scores, neg_inf], f"{out}/causal_scores", dtype=dtype, rank=len(q_shape))
    if mask is not None:
        if b.dtype(mask) == "bool":
            neg_inf = neg_inf or b.scalar(-math.inf, dtype, f"{out}/neg_inf")
            scores = b.add("Where", [b.value(mask), scores, neg_inf], f"{out}/masked", dtype=dtype, rank=len(q_shape))
        else:
            scores = b.add("Add", [scores, b.cast(b.value(mask), dtype)], f"{out}/masked", dtype=dtype,
                           rank=len(q_shape))
    attn = b.add("Softmax", [scores], f"{out}/attn", axis=-1, dtype=dtype, rank=len(q_shape))
    b.add("MatMul", [attn, v], out)


@onnx_converter("embedding")
def _embedding(b: _Builder, node: Node) -> None:
    weight, indices = node.inputs[:2]
    b.add("Gather", [b.value(weight), b.cast(b.value(indices), "int64")], node.outputs[0], axis=0)


# -- elementwise -----------------------------------------------------------------------------------------------------
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}


@onnx_converter(*_BINARY)
def _binary(b: _Builder, node: Node) -> None:
    dtype = b.out_dtype(node)
    a, c = (b.cast(b.value(i), dtype) for i in node.inputs)
    b.add(_BINARY[node.op], [a, c], node.outputs[0])


_UNARY = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "reciprocal": "Reciprocal",
          "sqrt": "Sqrt", "neg": "Neg", "abs": "Abs", "erf": "Erf", "log": "Log"}


@onnx_converter(*_UNARY)
def _unary(b: _Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    if IR_OPS[node.op].category is Category.TABLE:
        x = b.cast(x, b.out_dtype(node))  # torch promotes integer inputs to float
    b.add(_UNARY[node.op], [x], node.outputs[0])


@onnx_converter("rsqrt")
def _rsqrt(b: _Builder, node: Node) -> None:
    x = b.cast(b.value(node.inputs[0]), b.out_dtype(node))
    root = b.add("Sqrt", [x], f"{node.outputs[0]}/sqrt", dtype=b.out_dtype(node), rank=b.rank(node.inputs[0]))
    b.add("Reciprocal", [root], node.outputs[0])


@onnx_converter("silu")
def _silu(b: _Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    sig = b.add("Sigmoid", [x], f"{node.outputs[0]}/sigmoid", dtype=b.dtype(x), rank=b.rank(x))
    b.add("Mul", [x, sig], node.outputs[0])


@onnx_converter("gelu")
def _gelu(b: _Builder, node: Node) -> None:
    approximate = node.attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise b.error(node, f"approximate={approximate!r}", "Use approximate='none' or 'tanh'.")
    b.add("Gelu", [b.value(node.inputs[0])], node.outputs[0], approximate=approximate)


@onnx_converter("softplus")
def _softplus(b: _Builder, node: Node) -> None:
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


def _clip(b: _Builder, node: Node, lo: Any, hi: Any) -> None:
    x = b.value(node.inputs[0])
    dtype = b.dtype(x) or "float32"
    inputs = [x,
              "" if lo is None else b.scalar(lo, dtype, f"{node.outputs[0]}/min"),
              "" if hi is None else b.scalar(hi, dtype, f"{node.outputs[0]}/max")]
    while inputs[-1] == "":
        inputs.pop()
    b.add("Clip", inputs, node.outputs[0])


@onnx_converter("clamp")
def _clamp(b: _Builder, node: Node) -> None:
    _clip(b, node, node.attrs.get("min"), node.attrs.get("max"))


@onnx_converter("hardtanh")
def _hardtanh(b: _Builder, node: Node) -> None:
    _clip(b, node, node.attrs.get("min_val", -1.0), node.attrs.get("max_val", 1.0))


@onnx_converter("pow")
def _pow(b: _Builder, node: Node) -> None:
    exponent = node.attrs["exponent"]
    x = b.cast(b.value(node.inputs[0]), b.out_dtype(node))
    dtype = b.dtype(x) if b.dtype(x) in _FLOAT_DTYPES else ("int64" if isinstance(exponent, int) else "float32")
    b.add("Pow", [x, b.scalar(exponent, dtype, f"{node.outputs[0]}/exponent")], node.outputs[0])


@onnx_converter("hardswish")
def _hardswish(b: _Builder, node: Node) -> None:
    b.add("HardSwish", [b.value(node.inputs[0])], node.outputs[0])  # x * max(0, min(1, x / 6 + 1 / 2)), as torch


@onnx_converter("hardsigmoid")
def _hardsigmoid(b: _Builder, node: Node) -> None:
    b.add("HardSigmoid", [b.value(node.inputs[0])], node.outputs[0], alpha=1.0 / 6.0, beta=0.5)  # torch's constants


@onnx_converter("elu")
def _elu(b: _Builder, node: Node) -> None:
    if float(node.attrs.get("scale", 1.0)) != 1.0 or float(node.attrs.get("input_scale", 1.0)) != 1.0:
        raise b.error(node, "elu with scale or input_scale other than 1 (selu/celu)", "Use F.elu(x, alpha).")
    b.add("Elu", [b.value(node.inputs[0])], node.outputs[0], alpha=float(node.attrs.get("alpha", 1.0)))


def _promote(b: _Builder, names: list[str]) -> list[str]:
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
def _compare(b: _Builder, node: Node) -> None:
    a, c = _promote(b, [b.value(i) for i in node.inputs])
    if node.op == "ne":
        eq = b.add("Equal", [a, c], f"{node.outputs[0]}/eq", dtype="bool", rank=b.rank(node.outputs[0]))
        b.add("Not", [eq], node.outputs[0])
    else:
        b.add(_COMPARE[node.op], [a, c], node.outputs[0])


@onnx_converter("logical_not", "logical_and", "logical_or")
def _logical(b: _Builder, node: Node) -> None:
    op = {"logical_not": "Not", "logical_and": "And", "logical_or": "Or"}[node.op]
    y = b.add(op, [b.cast(b.value(i), "bool") for i in node.inputs],
              node.outputs[0] if b.out_dtype(node) in (None, "bool") else f"{node.outputs[0]}/bool", dtype="bool")
    if y != node.outputs[0]:
        b.add("Cast", [y], node.outputs[0], to=_onnx_dtype(b.out_dtype(node)))


@onnx_converter("where")
def _where(b: _Builder, node: Node) -> None:
    cond, a, c = node.inputs
    dtype = b.out_dtype(node)
    b.add("Where", [b.cast(b.value(cond), "bool"), b.cast(b.value(a), dtype), b.cast(b.value(c), dtype)],
          node.outputs[0])


@onnx_converter("masked_fill")
def _masked_fill(b: _Builder, node: Node) -> None:
    x, mask = node.inputs
    dtype = b.dtype(x) or "float32"
    value = b.scalar(node.attrs["value"], dtype, f"{node.outputs[0]}/value")
    b.add("Where", [b.cast(b.value(mask), "bool"), value, b.value(x)], node.outputs[0])


# -- normalisation, softmax ------------------------------------------------------------------------------------------
@onnx_converter("layer_norm")
def _layer_norm(b: _Builder, node: Node) -> None:
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
def _softmax(b: _Builder, node: Node) -> None:
    op = "Softmax" if node.op == "softmax" else "LogSoftmax"
    b.add(op, [b.value(node.inputs[0])], node.outputs[0], axis=int(node.attrs["dim"]))


# -- reductions and pooling ----------------------------------------------------------------------------------------
def _dims(value: Any) -> list[int] | None:
    if value is None:
        return None
    dims = [int(d) for d in (value if isinstance(value, (list, tuple)) else [value])]
    return dims or None


@onnx_converter("mean", "sum", "amax")
def _reduce(b: _Builder, node: Node) -> None:
    op = {"mean": "ReduceMean", "sum": "ReduceSum", "amax": "ReduceMax"}[node.op]
    x = b.value(node.inputs[0])
    if node.op == "sum":
        x = b.cast(x, b.out_dtype(node))
    dims = _dims(node.attrs.get("dim"))
    inputs = [x] + ([b.ints(dims, f"{node.outputs[0]}/axes")] if dims else [])
    b.add(op, inputs, node.outputs[0], keepdims=int(bool(node.attrs.get("keepdim", False))))


@onnx_converter("max_dim")
def _max_dim(b: _Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    dim, keep = int(node.attrs["dim"]), int(bool(node.attrs.get("keepdim", False)))
    b.add("ReduceMax", [x, b.ints([dim], f"{node.outputs[0]}/axes")], node.outputs[0], keepdims=keep)
    b.add("ArgMax", [x], node.outputs[1], axis=dim, keepdims=keep)


@onnx_converter("argmax")
def _argmax(b: _Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    dim, keep = node.attrs.get("dim"), int(bool(node.attrs.get("keepdim", False)))
    if dim is not None:
        b.add("ArgMax", [x], node.outputs[0], axis=int(dim), keepdims=keep)
        return
    flat = b.add("Reshape", [x, b.ints([-1], f"{node.outputs[0]}/flat")], f"{node.outputs[0]}/flat",
                 dtype=b.dtype(x), rank=1)
    if not keep:
        b.add("ArgMax", [flat], node.outputs[0], axis=0, keepdims=0)
        return
    idx = b.add("ArgMax", [flat], f"{node.outputs[0]}/argmax", axis=0, keepdims=1, dtype="int64", rank=1)
    b.add("Reshape", [idx, b.ints([1] * (b.rank(x) or 0), f"{node.outputs[0]}/shape")], node.outputs[0])


@onnx_converter("topk")
def _topk(b: _Builder, node: Node) -> None:
    a = node.attrs
    b.add("TopK", [b.value(node.inputs[0]), b.ints([a["k"]], f"{node.outputs[0]}/k")], list(node.outputs),
          axis=int(a.get("dim", -1)), largest=int(bool(a.get("largest", True))),
          sorted=int(bool(a.get("sorted", True))))


@onnx_converter("sort")
def _sort(b: _Builder, node: Node) -> None:
    x = node.inputs[0]
    dim = int(node.attrs.get("dim", -1))
    shape = b.shape(x)
    if shape is None or shape[dim] < 0:
        raise b.error(node, "sort along a dynamic dimension", "Export with a static size for that dimension.")
    b.add("TopK", [b.value(x), b.ints([shape[dim]], f"{node.outputs[0]}/k")], list(node.outputs), axis=dim,
          largest=int(bool(node.attrs.get("descending", False))), sorted=1)


def _pool_attrs(b: _Builder, node: Node, n: int) -> dict:
    a = node.attrs
    kernel = _pair(a["kernel_size"], n)
    stride = _pair(a["stride"], n) if a.get("stride") else kernel
    pads = _pair(a.get("padding", 0), n)
    return {"kernel_shape": kernel, "strides": stride, "pads": pads + pads, "ceil_mode": int(bool(a.get("ceil_mode")))}


@onnx_converter("max_pool2d")
def _max_pool(b: _Builder, node: Node) -> None:
    attrs = _pool_attrs(b, node, 2)
    b.add("MaxPool", [b.value(node.inputs[0])], node.outputs[0], dilations=_pair(node.attrs.get("dilation", 1), 2),
          **attrs)


@onnx_converter("avg_pool2d")
def _avg_pool(b: _Builder, node: Node) -> None:
    attrs = _pool_attrs(b, node, 2)
    divisor = node.attrs.get("divisor_override")
    include = int(bool(node.attrs.get("count_include_pad", True)))
    if divisor is None:
        b.add("AveragePool", [b.value(node.inputs[0])], node.outputs[0], count_include_pad=include, **attrs)
        return
    out = node.outputs[0]
    x = b.value(node.inputs[0])
    avg = b.add("AveragePool", [x], f"{out}/avg", count_include_pad=1, dtype=b.dtype(x), rank=b.rank(x), **attrs)
    window = attrs["kernel_shape"][0] * attrs["kernel_shape"][1]
    b.add("Mul", [avg, b.scalar(window / float(divisor), b.dtype(x) or "float32", f"{out}/factor")], out)


@onnx_converter("adaptive_avg_pool2d", "adaptive_avg_pool1d")
def _adaptive_avg_pool(b: _Builder, node: Node) -> None:
    n = 2 if node.op == "adaptive_avg_pool2d" else 1
    x = node.inputs[0]
    out_size = _pair(node.attrs["output_size"], n)
    shape = b.shape(x)
    if out_size == [1] * n:
        b.add("GlobalAveragePool", [b.value(x)], node.outputs[0])
        return
    spatial = list(shape[-n:]) if shape else []
    if len(spatial) != n or any(s <= 0 or s % o for s, o in zip(spatial, out_size)):
        raise b.error(node, f"output size {out_size} does not divide the input size {spatial}",
                      "ONNX has no adaptive pooling; use an output size that divides the input (or avg_pool2d).")
    kernel = [s // o for s, o in zip(spatial, out_size)]
    b.add("AveragePool", [b.value(x)], node.outputs[0], kernel_shape=kernel, strides=kernel)


@onnx_converter("upsample_nearest1d", "upsample_nearest2d", "upsample_bilinear2d")
def _upsample(b: _Builder, node: Node) -> None:
    """``Resize`` on the spatial axes (2, or 2 and 3): nearest is ``asymmetric``/``floor`` (torch's ``nearest``)."""
    a = node.attrs
    out = node.outputs[0]
    n = 1 if node.op.endswith("1d") else 2
    if a.get("output_size"):
        inputs = [b.value(node.inputs[0]), "", "", b.ints(_pair(a["output_size"], n), f"{out}/sizes")]
    elif a.get("scale_factors"):
        factors = _pair_f(a["scale_factors"]) if n == 2 else [float(s) for s in a["scale_factors"]][:1]
        inputs = [b.value(node.inputs[0]), "", b.init(torch.tensor(factors, dtype=torch.float32), f"{out}/scales")]
    else:
        raise b.error(node, "neither output_size nor scale_factors is set", "Give interpolate a size or scale.")
    if node.op.startswith("upsample_nearest"):
        attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    else:
        attrs = {"mode": "linear", "coordinate_transformation_mode":
                 "align_corners" if a.get("align_corners") else "pytorch_half_pixel"}
    b.add("Resize", inputs, out, axes=list(range(2, 2 + n)), **attrs)


@onnx_converter("max_pool1d")
def _max_pool1d(b: _Builder, node: Node) -> None:
    b.add("MaxPool", [b.value(node.inputs[0])], node.outputs[0], dilations=_pair(node.attrs.get("dilation", 1), 1),
          **_pool_attrs(b, node, 1))


@onnx_converter("avg_pool1d")
def _avg_pool1d(b: _Builder, node: Node) -> None:
    include = int(bool(node.attrs.get("count_include_pad", True)))
    b.add("AveragePool", [b.value(node.inputs[0])], node.outputs[0], count_include_pad=include,
          **_pool_attrs(b, node, 1))


@onnx_converter("pixel_shuffle", "pixel_unshuffle")
def _pixel_shuffle(b: _Builder, node: Node) -> None:
    """``pixel_shuffle`` is ``DepthToSpace(CRD)``; ``pixel_unshuffle`` (no ONNX op: ``SpaceToDepth`` is the DCR
    order) is ``Reshape [N, C, H, r, W, r] -> Transpose [0, 1, 3, 5, 2, 4] -> Reshape [N, C·r·r, H, W]``."""
    x, out = node.inputs[0], node.outputs[0]
    shape = b.shape(x)
    if shape is None or len(shape) != 4 or any(d < 0 for d in shape[1:]):
        raise b.error(node, f"input shape {shape}", "Use a 4-D input with static channel and spatial sizes.")
    if node.op == "pixel_shuffle":
        b.add("DepthToSpace", [b.value(x)], out, blocksize=int(node.attrs["upscale_factor"]), mode="CRD")
        return
    r = int(node.attrs["downscale_factor"])
    n, c, h, w = shape
    dtype = b.dtype(x)
    split = b.add("Reshape", [b.value(x), b.ints([n, c, h // r, r, w // r, r], f"{out}/split_shape")],
                  f"{out}/split", dtype=dtype, rank=6)
    moved = b.add("Transpose", [split], f"{out}/moved", perm=[0, 1, 3, 5, 2, 4], dtype=dtype, rank=6)
    b.add("Reshape", [moved, b.ints([n, c * r * r, h // r, w // r], f"{out}/shape")], out)


@onnx_converter("flip")
def _flip(b: _Builder, node: Node) -> None:
    """``Slice`` with step -1 over every flipped dim (starts -1, ends the most negative int64)."""
    dims = [int(d) for d in node.attrs["dims"]]
    out = node.outputs[0]
    if not dims:
        b.add("Identity", [b.value(node.inputs[0])], out)
        return
    b.add("Slice", [b.value(node.inputs[0]), b.ints([-1] * len(dims), f"{out}/starts"),
                    b.ints([-(2**63)] * len(dims), f"{out}/ends"), b.ints(dims, f"{out}/axes"),
                    b.ints([-1] * len(dims), f"{out}/steps")], out)


def _pair_f(value: Any) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * 2 if len(values) == 1 else values


# -- data movement -----------------------------------------------------------------------------------------------
@onnx_converter("reshape")
def _reshape(b: _Builder, node: Node) -> None:
    shape = [int(d) for d in node.attrs["shape"]]
    if shape.count(-1) > 1:
        raise b.error(node, f"target shape {shape} has more than one dynamic dimension",
                      "Export without dynamic_batch, or reshape so that only the batch dimension is dynamic.")
    b.add("Reshape", [b.value(node.inputs[0]), b.ints(shape, f"{node.outputs[0]}/shape")], node.outputs[0],
          allowzero=int(0 in shape))


@onnx_converter("permute")
def _permute(b: _Builder, node: Node) -> None:
    b.add("Transpose", [b.value(node.inputs[0])], node.outputs[0], perm=[int(d) for d in node.attrs["dims"]])


@onnx_converter("cast")
def _cast(b: _Builder, node: Node) -> None:
    b.add("Cast", [b.value(node.inputs[0])], node.outputs[0], to=_onnx_dtype(node.attrs["dtype"]))


@onnx_converter("cat")
def _cat(b: _Builder, node: Node) -> None:
    dtype = b.out_dtype(node)
    b.add("Concat", [b.cast(b.value(i), dtype) for i in node.inputs], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("split")
def _split(b: _Builder, node: Node) -> None:
    sizes = [int(s) for s in node.attrs["sizes"]]
    if any(s < 0 for s in sizes):
        raise b.error(node, "split along the dynamic batch dimension", "Export without dynamic_batch.")
    b.add("Split", [b.value(node.inputs[0]), b.ints(sizes, f"{node.outputs[0]}/sizes")], list(node.outputs),
          axis=int(node.attrs["dim"]))


@onnx_converter("slice")
def _slice(b: _Builder, node: Node) -> None:
    a = node.attrs
    out = node.outputs[0]
    b.add("Slice", [b.value(node.inputs[0]), b.ints([a["start"]], f"{out}/starts"), b.ints([a["end"]], f"{out}/ends"),
                    b.ints([a["dim"]], f"{out}/axes"), b.ints([a.get("step") or 1], f"{out}/steps")], out)


@onnx_converter("select")
def _select(b: _Builder, node: Node) -> None:
    index = b.scalar(int(node.attrs["index"]), "int64", f"{node.outputs[0]}/index")
    b.add("Gather", [b.value(node.inputs[0]), index], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("expand")
def _expand(b: _Builder, node: Node) -> None:
    # ONNX Expand broadcasts both ways: a 1 keeps the input's size, which is how the dynamic batch (-1) passes.
    shape = [1 if int(d) < 0 else int(d) for d in node.attrs["shape"]]
    b.add("Expand", [b.value(node.inputs[0]), b.ints(shape, f"{node.outputs[0]}/shape")], node.outputs[0])


@onnx_converter("gather")
def _gather(b: _Builder, node: Node) -> None:
    x, index = node.inputs
    b.add("GatherElements", [b.value(x), b.cast(b.value(index), "int64")], node.outputs[0],
          axis=int(node.attrs["dim"]))


@onnx_converter("index_select")
def _index_select(b: _Builder, node: Node) -> None:
    x, index = node.inputs
    b.add("Gather", [b.value(x), b.cast(b.value(index), "int64")], node.outputs[0], axis=int(node.attrs["dim"]))


@onnx_converter("index")
def _index(b: _Builder, node: Node) -> None:
    """``x[i0, i1, ...]`` (advanced indexing, "" = a full slice) as Transpose -> GatherND -> Transpose."""
    x, indices = node.inputs[0], node.inputs[1:]
    out = node.outputs[0]
    rank, out_rank = b.rank(x), b.rank(out)
    positions = [d for d, name in enumerate(indices) if name]
    if rank is None or out_rank is None or not positions:
        raise b.error(node, "unknown ranks or no index tensor", "Export again; every value should carry a shape.")
    if any(b.dtype(indices[d]) in ("bool", "uint8") for d in positions):
        raise b.error(node, "boolean mask indexing (data-dependent output shape)",
                      "Use torch.where or multiply by the mask instead of x[mask].")
    rest = [d for d in range(rank) if d not in positions]
    perm = positions + rest
    xv = b.value(x)
    if perm != list(range(rank)):
        xv = b.add("Transpose", [xv], f"{out}/front", perm=perm, dtype=b.dtype(x), rank=rank)
    idx = [b.cast(b.value(indices[d]), "int64") for d in positions]
    if len(idx) > 1:  # broadcast the index tensors against each other: i + 0*j + 0*k ...
        zero = b.scalar(0, "int64", f"{out}/zero")
        total = None
        for i in idx:
            z = b.add("Mul", [i, zero], f"{out}/zeros", dtype="int64")
            total = z if total is None else b.add("Add", [total, z], f"{out}/zeros", dtype="int64")
        idx = [b.add("Add", [i, total], f"{out}/broadcast", dtype="int64") for i in idx]
    axis = b.ints([-1], f"{out}/last")
    stacked = b.add("Concat", [b.add("Unsqueeze", [i, axis], f"{out}/unsqueeze", dtype="int64") for i in idx],
                    f"{out}/indices", axis=-1, dtype="int64")
    n_broadcast = out_rank - len(rest)
    contiguous = positions == list(range(positions[0], positions[0] + len(positions)))
    if contiguous and positions[0] > 0:
        # torch keeps the indexed block in place when the indexed dims are adjacent
        first = positions[0]
        perm2 = [n_broadcast + j for j in range(first)] + list(range(n_broadcast)) + \
                [n_broadcast + j for j in range(first, len(rest))]
        gathered = b.add("GatherND", [xv, stacked], f"{out}/gathered", dtype=b.dtype(x), rank=out_rank)
        b.add("Transpose", [gathered], out, perm=perm2)
    else:
        b.add("GatherND", [xv, stacked], out)


# -- pre_export's table ops: exact where ``onnx_tables`` can write their integer arithmetic (the elementwise tables,
#    softmax, layer_norm); otherwise the float op they emulate runs, and the fake quants around them (QDQ pairs)
#    keep the grid, so ONNX agrees with those tables to within rounding.
@onnx_converter(*TABLE_OP_IO)
def _table_reference(b: _Builder, node: Node) -> None:
    exact = EXACT_TABLE_EXPORTS.get(node.op)
    if exact is not None and exact(b, node):
        return
    io = TABLE_OP_IO[node.op]
    if io.float_op:  # softmax, div, reciprocal: the float op is fixed
        inputs = [node.inputs[i] for i in range(len(io.data))]
        attrs = {"dim": node.attrs["dim"]} if io.float_op == "softmax" else {}
        ONNX_CONVERTERS[io.float_op](b, Node(io.float_op, inputs, list(node.outputs), attrs, node.site))
        return
    ref = node.attrs.get("reference")
    if not ref:
        raise b.error(node, "a table op without its float reference",
                      "Export the qat IR again with this version of quantlens.")
    attrs = {k: v for k, v in ref.items() if k not in ("op", "weight", "bias")}
    inputs = [node.inputs[0]]
    if ref["op"] == "layer_norm":
        inputs += [ref.get("weight", ""), ref.get("bias", "")]
    ONNX_CONVERTERS[ref["op"]](b, Node(ref["op"], inputs, list(node.outputs), attrs, node.site))


# -- pad, standalone batch norm, prelu / leaky_relu, constant writes -----------------------------------------------
_ONNX_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@onnx_converter("pad")
def _pad(b: _Builder, node: Node) -> None:
    """torch's pad list runs from the last dim backwards as (begin, end) pairs; ONNX wants all begins, then all
    ends, from the first dim."""
    x = b.value(node.inputs[0])
    rank = b.rank(node.inputs[0])
    pad = [int(p) for p in node.attrs["pad"]]
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):
        begins[rank - 1 - i], ends[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    out = node.outputs[0]
    inputs = [x, b.ints(begins + ends, f"{out}/pads")]
    if node.attrs["mode"] == "constant":
        inputs.append(b.scalar(float(node.attrs["value"]), b.dtype(node.inputs[0]) or "float32", f"{out}/value"))
    b.add("Pad", inputs, out, mode=_ONNX_PAD_MODES[node.attrs["mode"]])


@onnx_converter("batch_norm")
def _batch_norm(b: _Builder, node: Node) -> None:
    x, weight, bias, mean, var = node.inputs
    channels = b.shape(mean)[0]
    dtype = b.dtype(x) or "float32"
    out = node.outputs[0]
    scale = b.value(weight) if weight else b.init(torch.ones(channels, dtype=getattr(torch, dtype)), f"{out}/ones")
    shift = b.value(bias) if bias else b.init(torch.zeros(channels, dtype=getattr(torch, dtype)), f"{out}/zeros")
    b.add("BatchNormalization", [b.value(x), scale, shift, b.value(mean), b.value(var)], out,
          epsilon=float(node.attrs["eps"]))


@onnx_converter("prelu")
def _prelu(b: _Builder, node: Node) -> None:
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
def _leaky_relu(b: _Builder, node: Node) -> None:
    b.add("LeakyRelu", [b.value(node.inputs[0])], node.outputs[0], alpha=float(node.attrs["negative_slope"]))


@onnx_converter("fill")
def _fill(b: _Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    out = node.outputs[0]
    zero = b.add("Mul", [x, b.scalar(0.0, b.dtype(node.inputs[0]) or "float32", f"{out}/zero")], f"{out}/zeros",
                 dtype=b.dtype(node.inputs[0]))
    b.add("Add", [zero, b.scalar(float(node.attrs["value"]), b.dtype(node.inputs[0]) or "float32", f"{out}/v")], out)


@onnx_converter("select_scatter", "slice_scatter")
def _scatter(b: _Builder, node: Node) -> None:
    """``x[..., i, ...] = src`` as a concat of x's slices before and after the written range and src (step 1)."""
    x, src = node.inputs
    a = node.attrs
    dim, out = int(a["dim"]), node.outputs[0]
    size = b.shape(x)[dim]
    if node.op == "select_scatter":
        start, end = int(a["index"]), int(a["index"]) + 1
        src_v = b.add("Unsqueeze", [b.value(src), b.ints([dim], f"{out}/axis")], f"{out}/src", dtype=b.dtype(src))
    else:
        if (a.get("step") or 1) != 1:
            raise b.error(node, "a strided slice write", "Write contiguous slices (step 1).")
        start, end, src_v = int(a["start"]), int(a["end"]), b.value(src)
    parts = []
    for lo, hi, tag in ((0, start, "before"), (end, size, "after")):
        if hi > lo:
            parts.append((tag, b.add("Slice", [b.value(x), b.ints([lo], f"{out}/{tag}_s"), b.ints([hi], f"{out}/{tag}_e"),
                                               b.ints([dim], f"{out}/{tag}_a")], f"{out}/{tag}", dtype=b.dtype(x))))
    pieces = [p for t, p in parts if t == "before"] + [src_v] + [p for t, p in parts if t == "after"]
    b.add("Concat", pieces, out, axis=dim)
