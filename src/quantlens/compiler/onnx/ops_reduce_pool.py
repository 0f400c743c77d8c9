"""ONNX converters: reductions (mean, sum, max, argmax, top-k, sort), pooling and resizing (upsample)."""

from __future__ import annotations

from typing import Any

import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.attrs import float_pair, int_pair
from quantlens.compiler.onnx.builder import Builder
from quantlens.compiler.onnx.registry import onnx_converter


def _dims(value: Any) -> list[int] | None:
    if value is None:
        return None
    dims = [int(d) for d in (value if isinstance(value, (list, tuple)) else [value])]
    return dims or None


@onnx_converter("mean", "sum", "amax")
def _reduce(b: Builder, node: Node) -> None:
    op = {"mean": "ReduceMean", "sum": "ReduceSum", "amax": "ReduceMax"}[node.op]
    x = b.value(node.inputs[0])
    if node.op == "sum":
        x = b.cast(x, b.out_dtype(node))
    dims = _dims(node.attrs.get("dim"))
    inputs = [x] + ([b.ints(dims, f"{node.outputs[0]}/axes")] if dims else [])
    b.add(op, inputs, node.outputs[0], keepdims=int(bool(node.attrs.get("keepdim", False))))


@onnx_converter("cumsum")
def _cumsum(b: Builder, node: Node) -> None:
    x = b.cast(b.value(node.inputs[0]), b.out_dtype(node))
    b.add("CumSum", [x, b.scalar(int(node.attrs["dim"]), "int64", f"{node.outputs[0]}/axis")], node.outputs[0])


@onnx_converter("max_dim")
def _max_dim(b: Builder, node: Node) -> None:
    x = b.value(node.inputs[0])
    dim, keep = int(node.attrs["dim"]), int(bool(node.attrs.get("keepdim", False)))
    b.add("ReduceMax", [x, b.ints([dim], f"{node.outputs[0]}/axes")], node.outputs[0], keepdims=keep)
    b.add("ArgMax", [x], node.outputs[1], axis=dim, keepdims=keep)


@onnx_converter("argmax")
def _argmax(b: Builder, node: Node) -> None:
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
def _topk(b: Builder, node: Node) -> None:
    a = node.attrs
    b.add("TopK", [b.value(node.inputs[0]), b.ints([a["k"]], f"{node.outputs[0]}/k")], list(node.outputs),
          axis=int(a.get("dim", -1)), largest=int(bool(a.get("largest", True))),
          sorted=int(bool(a.get("sorted", True))))


@onnx_converter("sort")
def _sort(b: Builder, node: Node) -> None:
    x = node.inputs[0]
    dim = int(node.attrs.get("dim", -1))
    shape = b.shape(x)
    if shape is None or shape[dim] < 0:
        raise b.error(node, "sort along a dynamic dimension", "Export with a static size for that dimension.")
    b.add("TopK", [b.value(x), b.ints([shape[dim]], f"{node.outputs[0]}/k")], list(node.outputs), axis=dim,
          largest=int(bool(node.attrs.get("descending", False))), sorted=1)


def _pool_attrs(b: Builder, node: Node, n: int) -> dict:
    a = node.attrs
    kernel = int_pair(a["kernel_size"], n)
    stride = int_pair(a["stride"], n) if a.get("stride") else kernel
    pads = int_pair(a.get("padding", 0), n)
    return {"kernel_shape": kernel, "strides": stride, "pads": pads + pads, "ceil_mode": int(bool(a.get("ceil_mode")))}


@onnx_converter("max_pool2d")
def _max_pool(b: Builder, node: Node) -> None:
    attrs = _pool_attrs(b, node, 2)
    b.add("MaxPool", [b.value(node.inputs[0])], node.outputs[0], dilations=int_pair(node.attrs.get("dilation", 1), 2),
          **attrs)


@onnx_converter("avg_pool2d")
def _avg_pool(b: Builder, node: Node) -> None:
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
def _adaptive_avg_pool(b: Builder, node: Node) -> None:
    n = 2 if node.op == "adaptive_avg_pool2d" else 1
    x = node.inputs[0]
    out_size = int_pair(node.attrs["output_size"], n)
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
def _upsample(b: Builder, node: Node) -> None:
    """``Resize`` on the spatial axes (2, or 2 and 3): nearest is ``asymmetric``/``floor`` (torch's ``nearest``)."""
    a = node.attrs
    out = node.outputs[0]
    n = 1 if node.op.endswith("1d") else 2
    if a.get("output_size"):
        inputs = [b.value(node.inputs[0]), "", "", b.ints(int_pair(a["output_size"], n), f"{out}/sizes")]
    elif a.get("scale_factors"):
        factors = float_pair(a["scale_factors"]) if n == 2 else [float(s) for s in a["scale_factors"]][:1]
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
def _max_pool1d(b: Builder, node: Node) -> None:
    b.add("MaxPool", [b.value(node.inputs[0])], node.outputs[0], dilations=int_pair(node.attrs.get("dilation", 1), 1),
          **_pool_attrs(b, node, 1))


@onnx_converter("avg_pool1d")
def _avg_pool1d(b: Builder, node: Node) -> None:
    include = int(bool(node.attrs.get("count_include_pad", True)))
    b.add("AveragePool", [b.value(node.inputs[0])], node.outputs[0], count_include_pad=include,
          **_pool_attrs(b, node, 1))
