"""Ops that move integers (their grid stays), constant writes, resize and the integer/bool index values."""

from __future__ import annotations

import torch

from quantlens.compiler.convert.state import (
    DIM_PRESERVING,
    INDEX_OUTPUTS,
    Converter,
    QInfo,
    converter,
    float_movement,
    index_input,
    on_grid,
    require_per_tensor,
    required_grid,
)
from quantlens.compiler.ir import Node, ValueInfo
from quantlens.compiler.kernels_int import storage_dtype
from quantlens.errors import QuantLensError
from quantlens.march import rules
from quantlens.march.fake_quant import fake_quant_range
from quantlens.march.numerics import interpolation_weights, quantize
from quantlens.march.opset import Category, ops_in


@converter("upsample_bilinear2d")
def _bilinear(c, node):
    """Bilinear resize as two integer interpolation matrices (weights in 2**-8 fixed point, ``docs/march.md``
    §11): ``acc = A_h · q · A_wᵀ`` exactly, then one requantize by ``s_in · 2**-16 / s_out``."""
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = required_grid(c, node)
    in_h, in_w = c.src.values[node.inputs[0]].shape[-2:]
    out_h, out_w = c.src.values[node.outputs[0]].shape[-2:]
    align = bool(node.attrs.get("align_corners"))
    a_h = c.const(interpolation_weights(in_h, out_h, align), f"{node.outputs[0]}_rows")
    a_w = c.const(interpolation_weights(in_w, out_w, align), f"{node.outputs[0]}_cols")
    c.emit(node, "bilinear_int", [x.name, a_h, a_w], rules.bilinear(x.scale, out_scale, qdtype, c.qpp), qdtype,
           out_scale)


def passthrough(c, node):
    """A movement op: the integers move, the grid stays (registered, at the end of this module, for every movement
    op without a converter of its own)."""
    x = c.q.get(node.inputs[0])
    if x is None:
        if node.inputs[0] in c.float_values or c.is_const(node.inputs[0]):
            return float_movement(c, node)
        x = c.int_input(node, node.inputs[0])
    axis = x.axis if x.axis is None or node.op in DIM_PRESERVING else _moved_axis(c, node, x.axis)
    extra = [c.q[v].name if v in c.q else index_input(c, node, v) for v in node.inputs[1:]]
    outs = [c.fresh(o) for o in node.outputs]
    c.out.nodes.append(Node(node.op, [x.name] + extra, outs, dict(node.attrs), node.site))
    value_outputs = node.outputs if node.op not in INDEX_OUTPUTS else node.outputs[:1]
    for src_out, name in zip(node.outputs, outs):
        info = c.src.values.get(src_out, ValueInfo((), "unknown"))
        if src_out in value_outputs:
            c.out.values[name] = ValueInfo(info.shape, str(storage_dtype(x.qdtype.value)).replace("torch.", ""),
                                           x.qdtype.value, None, axis)
            c.q[src_out] = QInfo(name, x.qdtype, x.scale, axis, x.exponents)  # (a channel moves with its exponent)
        else:  # indices
            c.out.values[name] = info
            c.float_values[src_out] = name


def _moved_axis(c: Converter, node: Node, axis: int) -> int:
    """Where the channel axis of a per-channel (int32 high-precision) value lands after a movement op."""
    in_shape = list(c.src.values[node.inputs[0]].shape)
    axis %= len(in_shape)
    if node.op == "permute":
        return node.attrs["dims"].index(axis)
    if node.op == "select" and node.attrs["dim"] % len(in_shape) != axis:  # (a pooler's x[:, 0]) one dim goes
        return axis - (1 if node.attrs["dim"] % len(in_shape) < axis else 0)
    if node.op == "reshape":
        # The channel dim must survive whole: same size, same number of elements before it.
        out_shape = list(c.src.values[node.outputs[0]].shape)
        dyn = 7919  # stands for the dynamic batch (-1) on both sides
        prefix = 1
        for d in in_shape[:axis]:
            prefix *= dyn if d == -1 else d
        running = 1
        for j, d in enumerate(out_shape):
            if running == prefix and d == in_shape[axis]:
                return j
            running *= dyn if d == -1 else d
    raise QuantLensError(
        f"convert: op '{node.op}' at op site '{node.site}' splits, merges or selects from the channel dim of a "
        "per-channel value (an int32 high-precision output, or channel-exponent codes, docs/march.md §3.1); "
        "dequantize it first (put the DeQuantStub right after the final conv/linear), or give it one scale."
    )


@converter("masked_fill")
def _masked_fill(c, node):
    x = c.int_input(node, node.inputs[0])
    mask = index_input(c, node, node.inputs[1])
    value = node.attrs.get("value")
    if value is None:
        value = float(c.src.constants[node.inputs[2]])
    grid = c.output_grid(node) if x.scale.numel() == 1 else None
    if grid is not None:
        # a fill off the input grid's range (attention logits' -1e9, whose output fake quant was calibrated on it):
        # the codes moved to the output grid first and the fill written there, as the output fake quant makes it
        # of the filled tensor (§11: a select of the operands on the output grid); on the input grid the fill
        # saturated to qmin and the requantize turned it into 0
        qdtype, scale = grid
        moved = _operand_on_grid(c, node, node.inputs[0], qdtype, scale)
        c.emit(node, "masked_fill_int", [moved, mask], {"value": rules.fill_code(value, scale, qdtype)}, qdtype, scale)
        return
    fill = rules.fill_code(value, x.scale, x.qdtype)
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node("masked_fill_int", [x.name, mask], [name], {"value": fill}, node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, x.name and c.out.values[x.name].dtype,
                                   x.qdtype.value)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis)


@converter("embedding")
def _embedding(c, node):
    table = c.int_input(node, node.inputs[0])
    ids = index_input(c, node, node.inputs[1])
    c.emit(node, "embedding", [table.name, ids], {}, table.qdtype, table.scale)


_ORDER_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


def _compare_with_constant(c, node) -> bool:
    """``x <= 0.5`` on a per-tensor quantized ``x``: the codes are compared with the constant divided by the scale
    (``q·s <= k  <=>  q <= k/s`` for a positive scale). False when the node is not such a comparison."""
    if len(node.inputs) != 2:
        return False
    (x, k), swapped = node.inputs, False
    if k in c.q and x not in c.q:
        (k, x), swapped = node.inputs, True
    if x not in c.q or not c.is_const(k) or c.q[x].scale.numel() != 1 or c.src.constants[k].numel() != 1:
        return False
    info = c.q[x]
    bound = c.const((c.src.constants[k].double() / info.scale.double()).float().reshape(()),
                    f"{node.outputs[0]}_in_codes")
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(node.op, [bound, info.name] if swapped else [info.name, bound], [name],
                            dict(node.attrs), node.site))
    c.out.values[name] = c.src.values.get(node.outputs[0], ValueInfo((), "unknown"))
    c.float_values[node.outputs[0]] = name
    return True


@converter(*sorted(ops_in(Category.INDEX, level="qat")))
def _non_numeric(c, node):
    """Ops whose result is an index or a mask: computed on the integer values (order is preserved)."""
    if node.op in _ORDER_COMPARISONS and _compare_with_constant(c, node):
        return
    if node.op == "cast" and node.inputs[0] in c.q and str(node.attrs.get("dtype", "")).startswith("float"):
        # a cast between float dtypes moves a quantized value unchanged (prepare plans it as a passthrough):
        # its integers stay what they are
        c.q[node.outputs[0]] = c.q[node.inputs[0]]
        return
    if any(v in c.q for v in node.inputs) and node.op not in ("argmax",):
        # quantized values met by float ones (a cast to float64, a comparison with a float tensor): the host
        # computes it on the dequantized values, which is what the qat IR computes on its fake-quantized ones
        c.host_op(node)
        return
    ins = [c.q[v].name if v in c.q else index_input(c, node, v) for v in node.inputs]
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(node.op, ins, [name], dict(node.attrs), node.site))
    c.out.values[name] = c.src.values.get(node.outputs[0], ValueInfo((), "unknown"))
    c.float_values[node.outputs[0]] = name


@converter("pad", "fill")
def _pad(c, node):
    """Padding and filling keep the grid; the constant is written as its integer on that grid. Channel-exponent
    codes (§3.1) padded along other dims than their channels keep their form (a zero, or a copied edge, is on every
    channel's own grid: Swin's window padding before its projections)."""
    attrs = dict(node.attrs)
    raw = c.q.get(node.inputs[0])
    keeps = (node.op == "pad" and raw is not None and raw.exponents and not _pads_dim(attrs, node, c, raw.axis)
             and (attrs.get("mode") != "constant" or float(attrs.get("value", 0.0)) == 0.0))
    x = raw if keeps else c.int_input(node, node.inputs[0])
    if node.op == "fill" or attrs.get("mode") == "constant":
        if not keeps:
            require_per_tensor(c, node, x, node.op)
        attrs["value"] = 0 if keeps else on_grid(attrs["value"], x)
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(f"{node.op}_int", [x.name], [name], attrs, node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, c.out.values[x.name].dtype, x.qdtype.value,
                                   None, x.axis)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis, x.exponents)


def _pads_dim(attrs: dict, node: Node, c: Converter, axis: int) -> bool:
    """Whether a pad (``F.pad``'s order: the last dim's pair first) pads dim ``axis``."""
    rank = len(c.src.values[node.inputs[0]].shape)
    j = rank - 1 - axis % rank
    return any(attrs.get("pad", [])[2 * j:2 * j + 2])


@converter("select_scatter", "slice_scatter")
def _scatter(c, node):
    """``x[...] = src`` (functionalized): the integers of src are written into x's. src on another grid than x
    (a state written into a cache of its own scale) is moved onto x's grid first (§8: one requantize, at most half
    a step of x's grid from the qat IR, which writes src's values as they are)."""
    if node.inputs[0] not in c.q:  # written into a float host tensor (a state buffer made by full_like): the host
        c.host_op(node)  # writes the dequantized values, and the reading op quantizes the result
        return
    x, src = c.int_input(node, node.inputs[0]), c.int_input(node, node.inputs[1])
    source = src.name
    if not src.same_grid(x.qdtype, x.scale):
        require_per_tensor(c, node, x, node.op)
        source = _operand_on_grid(c, node, node.inputs[1], x.qdtype, x.scale)
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(node.op, [x.name, source], [name], dict(node.attrs), node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, c.out.values[x.name].dtype, x.qdtype.value)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis)


def _operand_on_grid(c, node, value: str, qdtype, scale) -> str:
    """One value operand of a select, as codes on the output grid: a quantized value moved there (§8, one
    requantize when its grid differs), a constant quantized onto it (§11's constant code, saturated). A constant
    fake-quantized on its own grid (a ``finfo.min`` mask value made inside forward: a grid of 1e36) is that
    constant: its fake-quantized value goes onto the output grid the same way, which is what the qat IR's output
    fake quant makes of it."""
    constant = _fake_quantized_constant(c, value)
    if constant is not None:
        codes = quantize(constant, scale.to(torch.float32), qdtype, None, storage_dtype(qdtype.value))
        return c.const(codes, f"{node.outputs[0]}_codes")
    if value in c.q:
        info = c.q[value]
        require_per_tensor(c, node, info, f"'{node.op}'")
        if info.same_grid(qdtype, scale):
            return info.name
        name = c.fresh(f"{value}_to_{node.outputs[0]}")
        attrs = {**rules.move(info.scale, scale, qdtype, c.qpp), "axis": None}
        c.out.nodes.append(Node("requantize", [info.name], [name], attrs, node.site))
        c.out.values[name] = ValueInfo(c.src.values[value].shape, str(storage_dtype(qdtype.value)).replace(
            "torch.", ""), qdtype.value)
        return name
    if c.is_const(value):
        codes = quantize(c.src.constants[value].float(), scale.to(torch.float32), qdtype, None,
                         storage_dtype(qdtype.value))
        return c.const(codes, f"{node.outputs[0]}_codes")
    raise QuantLensError(
        f"convert: '{node.op}' at op site '{node.site}' selects '{value}', a float value computed in the model that "
        "has no grid; quantize it (give its producer an int8/int16 output) or select between constants.")


def _fake_quantized_constant(c, value: str) -> torch.Tensor | None:
    """The values of ``fake_quant(constant)`` when that is what made ``value`` in the qat IR, else None."""
    node = c.producers.get(value)
    if node is None or node.op != "fake_quant" or not c.is_const(node.inputs[0]) or not c.is_const(node.inputs[1]):
        return None
    a = node.attrs
    return fake_quant_range(c.src.constants[node.inputs[0]].float(), c.src.constants[node.inputs[1]].float(),
                            a["qmin"], a["qmax"], a.get("axis", -1))


@converter("where")
def _where(c, node):
    """§11 select: ``where(cond, a, b)`` picks codes of ``a`` and ``b`` moved to the output grid; exact, since a
    fake quant after the select equals the select of the fake-quantized operands."""
    qdtype, scale = required_grid(c, node)
    cond = index_input(c, node, node.inputs[0])
    operands = [_operand_on_grid(c, node, v, qdtype, scale) for v in node.inputs[1:]]
    c.emit(node, "where", [cond, *operands], {}, qdtype, scale)
