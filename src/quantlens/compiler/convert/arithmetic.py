"""add, sub, cat, mul, sums, clamp, abs/neg, batch_norm, prelu (``docs/march.md`` §10): the parameters from
``quantlens.march.rules``."""

from __future__ import annotations

import torch

from quantlens.compiler.convert.state import (
    Converter,
    converter,
    require_per_tensor,
    required_grid,
    scalar_constant,
)
from quantlens.compiler.ir import Node
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, rules


@converter("add", "sub", "cat")
def _rescaled(c, node):
    if node.op in ("add", "sub") and any(scalar_constant(c, v) is not None for v in node.inputs):
        return _add_constant(c, node)
    if node.op in ("add", "sub") and any(c.is_const(v) and v not in c.q for v in node.inputs):
        return _add_constant_tensor(c, node)
    # an empty constant (torch.zeros(1, 0) padding a cat to a multiple) adds nothing and has no grid
    values = [v for v in node.inputs if not (c.is_const(v) and c.src.constants[v].numel() == 0)]
    infos = [c.int_input(node, v) for v in values]
    qdtype, out_scale = required_grid(c, node, channels=node.op != "cat")
    scales = [i.scale for i in infos]
    axis = c.grid_axes.get(node.outputs[0])  # an output in channel-exponent form (§3.1)
    if node.op == "cat":  # each input is requantized alone (§10): no sum, no F
        attrs = rules.cat(scales, out_scale, qdtype, c.qpp, node.attrs["dim"])
    else:
        attrs = rules.add(scales, out_scale, qdtype, c.qpp, out_axis=axis)
    c.emit(node, node.op, [i.name for i in infos], attrs, qdtype, out_scale, axis)
    if axis is not None:
        c.q[node.outputs[0]].exponents = True


def _add_constant_tensor(c: Converter, node: Node) -> None:
    """``x ± K`` for a float constant tensor ``K``: ``K`` enters as int32 codes on the sum's fractional grid
    (``rules.constant_addend_codes``), then the add rule of two inputs."""
    a, b = node.inputs
    qdtype, out_scale = required_grid(c, node)
    k_first = c.is_const(a) and a not in c.q
    x = c.int_input(node, b if k_first else a)
    k = c.src.constants[a if k_first else b]
    codes, k_scale = rules.constant_addend_codes(k, out_scale, c.qpp)
    k_name = c.const(codes, f"{node.outputs[0]}_addend")
    c.out.values[k_name].qdtype = QuantDType.qint32.value
    inputs, scales = ([k_name, x.name], [k_scale, x.scale]) if k_first else ([x.name, k_name], [x.scale, k_scale])
    c.emit(node, node.op, inputs, rules.add(scales, out_scale, qdtype, c.qpp), qdtype, out_scale)


def _add_constant(c: Converter, node: Node) -> None:
    """``x ± k`` for a scalar constant ``k``: x is rescaled as in §10 and ``k`` enters as ``rhe(k · 2**F / s_out)``
    (in the F extra fractional bits), so the result is rounded once."""
    a, b = node.inputs
    qdtype, out_scale = required_grid(c, node)
    if scalar_constant(c, a) is not None:  # k - x  or  k + x
        k, x, sign_x = scalar_constant(c, a), c.int_input(node, b), -1 if node.op == "sub" else 1
    else:
        k, x, sign_x = scalar_constant(c, b) * (-1 if node.op == "sub" else 1), c.int_input(node, a), 1
    attrs = rules.add_constant(x.scale, k, out_scale, qdtype, c.qpp, negate=sign_x < 0)
    c.emit(node, "add_const", [x.name], attrs, qdtype, out_scale)


@converter("mul", "div")
def _mul(c, node):
    a, b = node.inputs
    if node.outputs[0] in c.folded:  # already part of the GEMM's multiplier
        c.q[node.outputs[0]] = c.q[a]
        return
    qdtype, out_scale = required_grid(c, node)
    k = scalar_constant(c, b)
    if k is not None:
        real = 1.0 / k if node.op == "div" else k
        if real == 0:
            raise QuantLensError(f"convert: multiplication by 0 at op site '{node.site}'.")
        x = c.int_input(node, a)
        attrs = rules.scale_by_constant(real, x.scale, out_scale, qdtype, c.qpp)
        c.emit(node, "scale", [x.name], attrs, qdtype, out_scale)
        return
    if node.op == "div":
        raise QuantLensError(
            f"convert: division by a tensor at op site '{node.site}' needs the reciprocal lookup table; run "
            "export on the QAT model (it applies pre_export) instead of exporting without tables."
        )
    x, y = c.int_input(node, a), c.int_input(node, b)
    c.emit(node, "mul", [x.name, y.name], rules.mul(x.scale, y.scale, out_scale, qdtype, c.qpp), qdtype, out_scale)


@converter("mean", "sum")
def _reduce(c, node):
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = required_grid(c, node)
    shape = c.src.values[node.inputs[0]].shape
    dims = node.attrs["dim"] if node.attrs.get("dim") is not None else list(range(len(shape)))
    count = 1
    for d in dims:
        count *= shape[d]
    divisor = count if node.op == "mean" else 1
    attrs = {"dim": dims, "keepdim": node.attrs.get("keepdim", False),
             **rules.average(x.scale, divisor, out_scale, qdtype, c.qpp)}
    c.emit(node, "sum_int", [x.name], attrs, qdtype, out_scale)


@converter("cumsum")
def _cumsum(c, node):
    """§10.2 running sums: the exact integer running sum of the codes along ``dim``, each requantized by
    ``s_x / s_out`` (the sum rule)."""
    x = c.int_input(node, node.inputs[0])
    require_per_tensor(c, node, x, "cumsum")
    qdtype, out_scale = required_grid(c, node)
    attrs = {"dim": int(node.attrs["dim"]), **rules.average(x.scale, 1, out_scale, qdtype, c.qpp)}
    c.emit(node, "cumsum_int", [x.name], attrs, qdtype, out_scale)


@converter("clamp", "hardtanh")
def _clamp(c, node):
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = required_grid(c, node)
    lo_val = node.attrs.get("min", node.attrs.get("min_val"))
    hi_val = node.attrs.get("max", node.attrs.get("max_val"))
    c.emit(node, "clamp", [x.name], rules.clamp(lo_val, hi_val, x.scale, out_scale, qdtype, c.qpp), qdtype,
           out_scale)


@converter("abs", "neg")
def _sign_op(c, node):
    """|q| and -q are exact on integers; the result is rescaled to the op's output grid."""
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = required_grid(c, node)
    c.emit(node, f"{node.op}_int", [x.name], rules.sign_op(x.scale, out_scale, qdtype, c.qpp), qdtype, out_scale)


@converter("batch_norm")
def _batch_norm(c, node):
    """BatchNorm on its own (after an activation): a per-channel affine ``a·x + b`` computed as a depthwise 1x1
    GEMM (§10.2): int8 weights ``±127`` at ``s_w = |a|/127``, an int32 bias at ``s_x·s_w``, exact accumulation,
    one per-channel requantize to the output grid."""
    x = c.int_input(node, node.inputs[0])
    require_per_tensor(c, node, x, "batch_norm")
    qdtype, out_scale = required_grid(c, node)
    consts = []
    for name in node.inputs[1:]:
        if name and not c.is_const(name):
            raise QuantLensError(f"convert: batch_norm at op site '{node.site}' has a computed weight or statistic.")
        consts.append(c.src.constants[name].to(torch.float64) if name else None)
    weight, bias, mean, var = consts
    channels = mean.numel()
    weight = torch.ones(channels, dtype=torch.float64) if weight is None else weight
    bias = torch.zeros(channels, dtype=torch.float64) if bias is None else bias
    a = weight / torch.sqrt(var + node.attrs["eps"])
    b = bias - mean * a
    w_q, bias_q, attrs = rules.channel_affine(a, b, x.scale, out_scale, qdtype, c.qpp)
    inputs = [x.name, c.const(w_q, f"{node.outputs[0]}_a"), c.const(bias_q, f"{node.outputs[0]}_b")]
    c.emit(node, "channel_affine", inputs, attrs, qdtype, out_scale)


@converter("prelu", "leaky_relu")
def _prelu(c, node):
    """``x >= 0 ? x : α·x`` (§10.3): the same integers, requantized by ``s_x/s_out`` where ``q >= 0`` and by
    ``|α|·s_x/s_out`` (sign folded into the integers) where ``q < 0``; ``α`` per channel for prelu."""
    x = c.int_input(node, node.inputs[0])
    require_per_tensor(c, node, x, node.op)
    qdtype, out_scale = required_grid(c, node)
    if node.op == "leaky_relu":
        alpha = torch.tensor([float(node.attrs["negative_slope"])], dtype=torch.float64)
    elif node.inputs[1] in c.q:  # a fake-quantized weight: the integer model uses exactly its grid value
        w = c.q[node.inputs[1]]
        alpha = (c.out.constants[w.name].to(torch.float64) * w.scale.to(torch.float64)).reshape(-1)
    else:
        alpha = c.src.constants[node.inputs[1]].to(torch.float64).reshape(-1)
    attrs = rules.prelu(alpha, x.scale, out_scale, qdtype, c.qpp)
    c.emit(node, "prelu_int", [x.name], attrs, qdtype, out_scale)
