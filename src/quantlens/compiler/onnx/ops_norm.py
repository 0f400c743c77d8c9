"""ONNX converters: normalisation (layer norm, standalone batch norm) and softmax / log-softmax."""

from __future__ import annotations

import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import _Builder
from quantlens.compiler.onnx.registry import onnx_converter


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
