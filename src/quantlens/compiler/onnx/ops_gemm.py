"""ONNX converters: the GEMM ops (conv, transposed conv, linear, matmul, scaled dot-product attention) and
embedding."""

from __future__ import annotations

import math

import torch

from quantlens._advice import setting
from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.attrs import int_pair
from quantlens.compiler.onnx.builder import Builder
from quantlens.compiler.onnx.registry import onnx_converter


@onnx_converter("conv2d", "conv1d")
def _conv(b: Builder, node: Node) -> None:
    n = 2 if node.op == "conv2d" else 1
    a = node.attrs
    if isinstance(a.get("padding"), str):
        raise b.error(node, f"string padding {a['padding']!r}", "Use explicit integer padding in the model.")
    pads = int_pair(a.get("padding", 0), n)
    inputs = [b.value(i) for i in node.inputs if i]
    b.add("Conv", inputs, node.outputs[0], strides=int_pair(a.get("stride", 1), n), pads=pads + pads,
          dilations=int_pair(a.get("dilation", 1), n), group=int(a.get("groups", 1)))


@onnx_converter("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(b: Builder, node: Node) -> None:
    """``ConvTranspose``: the weight layout ``[in, out / groups, k...]`` is ONNX's; torch's padding crops both
    ends (``pads``), ``output_padding`` adds at the end."""
    n = 2 if node.op == "conv_transpose2d" else 1
    a = node.attrs
    pads = int_pair(a.get("padding", 0), n)
    inputs = [b.value(i) for i in node.inputs if i]
    b.add("ConvTranspose", inputs, node.outputs[0], strides=int_pair(a.get("stride", 1), n), pads=pads + pads,
          output_padding=int_pair(a.get("output_padding", 0), n), dilations=int_pair(a.get("dilation", 1), n),
          group=int(a.get("groups", 1)))


@onnx_converter("linear")
def _linear(b: Builder, node: Node) -> None:
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
                      f"Export with static shapes ({setting('dynamic_batch', False)}).")
    dtype = b.dtype(node.inputs[0])
    if len(x_shape) == 1:
        flat_shape, back_shape = [1, x_shape[0]], list(out_shape)
    else:
        flat_shape, back_shape = [-1, x_shape[-1]], list(out_shape)
    inputs[0] = b.add("Reshape", [x, b.ints(flat_shape, f"{out}/flat_shape")], f"{out}/flat", dtype=dtype, rank=2)
    y = b.add("Gemm", inputs, f"{out}/gemm", transB=1, dtype=b.out_dtype(node), rank=2)
    b.add("Reshape", [y, b.ints(back_shape, f"{out}/shape")], out)


@onnx_converter("matmul")
def _matmul(b: Builder, node: Node) -> None:
    b.add("MatMul", [b.value(i) for i in node.inputs], node.outputs[0])


@onnx_converter("sdpa")
def _sdpa(b: Builder, node: Node) -> None:
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
def _embedding(b: Builder, node: Node) -> None:
    weight, indices = node.inputs[:2]
    b.add("Gather", [b.value(weight), b.cast(b.value(indices), "int64")], node.outputs[0], axis=0)
