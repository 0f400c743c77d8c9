"""Fake quants (the boundary quantize, weights, requantizes) and the GEMMs (``docs/march.md`` §5-§8)."""

from __future__ import annotations

import torch

from quantlens.compiler.convert.state import (
    Converter,
    QInfo,
    converter,
    fq_dtype,
)
from quantlens.compiler.ir import Node
from quantlens.compiler.kernels_int import storage_dtype
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, rules
from quantlens.march.numerics import quantize


@converter("fake_quant")
def fake_quant_converter(c: Converter, node: Node) -> None:
    """A fake quant: a constant becomes integer codes, a model input (or a host result) the boundary quantize, an
    integer value on another grid a requantize (§8)."""
    x, scale_name = node.inputs
    qdtype = fq_dtype(node.attrs)
    scale = c.src.constants[scale_name].to(torch.float32)
    axis = node.attrs["axis"] if node.attrs["axis"] >= 0 else None
    out = node.outputs[0]
    if c.is_const(x):  # weights and biases become integer constants
        q = quantize(c.src.constants[x], scale, qdtype, axis, storage_dtype(qdtype.value))
        name = c.const(q, out)
        c.out.values[name].qdtype = qdtype.value
        c.q[out] = QInfo(name, qdtype, scale, axis)
        return
    if x in c.q:
        info = c.q[x]
        if info.same_grid(qdtype, scale):
            c.q[out] = info
            return
        attrs = rules.move(info.scale, scale, qdtype, c.qpp)
        attrs["axis"] = info.axis
        c.emit(node, "requantize", [info.name], attrs, qdtype, scale)
        return
    if x in c.float_values:  # a model input: the boundary quantize
        scale_const = c.const(scale, f"{out}_in_scale")
        c.emit(node, "quantize", [c.float_values[x], scale_const], {"out_dtype": qdtype.value, "axis": axis},
               qdtype, scale, axis)
        return
    raise QuantLensError(
        f"convert: fake quant at op site '{node.site}' quantizes '{x}', a float value computed inside the model. "
        "Only model inputs may be quantized from float; the op producing it has no integer form."
    )


def _operands(c: Converter, node: Node) -> tuple[QInfo, QInfo, torch.Tensor, torch.Tensor]:
    """The GEMM's input and weight, and the scales its accumulator is at: a linear whose weight is folded with its
    input's channel exponents (an ``[O, C]`` weight scale, §3.1) reads the int8 codes as they are, at ``s`` (the
    widest channel's) times the weight's row scales; any other GEMM reads them on their common grid."""
    w = c.int_input(node, node.inputs[1])
    if w.scale.dim() <= 1:
        x = c.int_input(node, node.inputs[0])
        return x, w, x.scale, w.scale
    x = c.q.get(node.inputs[0])
    rank = len(c.src.values[node.inputs[0]].shape)
    if node.op != "linear" or x is None or not x.exponents or x.axis is None or x.axis % rank != rank - 1:
        raise QuantLensError(
            f"convert: {node.op} at op site '{node.site}' has a weight folded with channel exponents (an [out, in] "
            "scale, docs/march.md §3.1) but its input is not in channel-exponent form along its last dim. Run a "
            "forward of the prepared model after the last calibration or promotion (the weight refolds), then "
            "export again.")
    return x, w, x.scale.amax(), rules.folded_rows(w.scale, x.scale)


def _gemm(c: Converter, node: Node, channel_axis: int | None) -> None:
    x, w, x_scale, w_scale = _operands(c, node)
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    acc_scale = rules.accumulator_scale(x_scale, w_scale)
    inputs = [x.name, w.name]
    if bias:
        b = c.int_input(node, bias)
        if b.qdtype is not QuantDType.qint32:
            raise QuantLensError(f"convert: the bias of op site '{node.site}' is not int32-quantized.")
        inputs.append(b.name)
    elif node.op != "matmul":
        inputs.append("")
    # a GEMM's requantize is per output channel already (per-channel weights): it writes channel exponents there
    grid = c.output_grid(node, fold_scalars=True, channels=channel_axis is not None)
    if grid is None:
        if node.op == "matmul":
            raise QuantLensError(f"convert: matmul at op site '{node.site}' has no output fake quant.")
        scale = acc_scale.to(torch.float32)
        axis = None if scale.numel() == 1 else channel_axis
        c.emit(node, node.op, inputs, {**node.attrs, "out_dtype": "qint32"}, QuantDType.qint32, scale, axis)
        return
    qdtype, out_scale, factor = grid
    axis = c.grid_axes.get(node.outputs[0])
    if axis is not None:  # an output in channel-exponent form (§3.1), along the GEMM's own output channels only
        rank = len(c.src.values[node.outputs[0]].shape)
        if axis % rank != channel_axis % rank:
            raise QuantLensError(f"convert: {node.op} at op site '{node.site}' has a per-channel output scale along "
                                 f"dim {axis}, not its output channels (dim {channel_axis}).")
        rules.channel_exponents(out_scale)  # refused unless in channel-exponent form
    attrs = {**node.attrs, **rules.gemm(x_scale, w_scale, out_scale, qdtype, c.qpp, factor)}
    c.emit(node, node.op, inputs, attrs, qdtype, out_scale, axis)
    if axis is not None:
        c.q[node.outputs[0]].exponents = True


@converter("conv2d", "conv1d")
def _conv(c, node):
    _gemm(c, node, 1)


@converter("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(c, node):
    """A transposed conv accumulates like a conv (§6): its weight ``[in, out, k...]`` is per channel along axis 1
    (the output channels), so the bias and the requantize are per output channel (dim 1 of the output)."""
    w = c.int_input(node, node.inputs[1])
    if w.scale.numel() > 1 and (w.axis != 1 or node.attrs.get("groups", 1) != 1):
        raise QuantLensError(
            f"convert: {node.op} at op site '{node.site}' has a weight quantized per channel along axis "
            f"{w.axis} with groups={node.attrs.get('groups', 1)}; a transposed conv needs axis 1 (its output "
            "channels) and groups = 1, or a per-tensor weight."
        )
    _gemm(c, node, 1)


@converter("linear")
def _linear(c, node):
    _gemm(c, node, len(c.src.values[node.outputs[0]].shape) - 1)


@converter("matmul")
def _matmul(c, node):
    _gemm(c, node, None)
