"""Lowering rules of the compute ops: GEMMs, elementwise, normalisation, softmax, reductions and pools."""

from __future__ import annotations

import operator

import torch

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant)
from quantlens.compiler.graph import Node, ValueInfo
from quantlens.compiler.lowering.rules import (
    aten,
    emit,
    generic_rule,
    normalized,
    op_site,
    register_lowering,
    static_shape,
    tensor_operand,
    user_source,
    value_info,
    value_of,
)
from quantlens.errors import QuantLensError

# -- GEMM and friends --------------------------------------------------------------------------------------
register_lowering(aten.conv2d.default, generic_rule("conv2d", ("input", "weight", "bias"),
                                         ("stride", "padding", "dilation", "groups")))
register_lowering(aten.conv1d.default, generic_rule("conv1d", ("input", "weight", "bias"),
                                         ("stride", "padding", "dilation", "groups")))
register_lowering(aten.conv_transpose1d.default,
          generic_rule("conv_transpose1d", ("input", "weight", "bias"),
                   ("stride", "padding", "output_padding", "groups", "dilation")))
register_lowering(aten.conv_transpose2d.input,
          generic_rule("conv_transpose2d", ("input", "weight", "bias"),
                   ("stride", "padding", "output_padding", "groups", "dilation")))
register_lowering(aten.linear.default, generic_rule("linear", ("input", "weight", "bias")))
register_lowering(aten.matmul.default, generic_rule("matmul", ("self", "other")))
register_lowering([aten.bmm.default, aten.mm.default], generic_rule("matmul", ("self", "mat2")))
register_lowering(aten.scaled_dot_product_attention.default,
          generic_rule("sdpa", ("query", "key", "value", "attn_mask"),
                   ("dropout_p", "is_causal", "scale")))
register_lowering(aten.embedding.default, generic_rule("embedding", ("weight", "indices")))

# -- elementwise -------------------------------------------------------------------------------------------
for _name in ("add", "sub", "mul", "div"):
    _tensor_overload = getattr(aten, _name).Tensor

    def _binary(ctx, node, _op=_name, _t=_tensor_overload):
        bound = normalized(node)
        dtype = value_info(node).dtype
        a = tensor_operand(ctx, value_of(ctx, bound["self"]), dtype)
        b = tensor_operand(ctx, value_of(ctx, bound["other"]), dtype)
        alpha = bound.get("alpha", 1)
        if alpha not in (None, 1):
            b_scaled = ctx.fresh("alpha")
            factor = ctx.const(float(alpha))
            ctx.graph.nodes.append(Node("mul", [b, factor], [b_scaled], {}, op_site(node)))
            ctx.graph.values[b_scaled] = _scaled_info(ctx, b, factor, node)
            b = b_scaled
        if bound.get("rounding_mode") is not None:
            raise QuantLensError(f"div with rounding_mode={bound['rounding_mode']!r} is not supported "
                                 f"(op site '{op_site(node)}', {user_source(node)}).")
        emit(ctx, node, _op, [a, b], {})

    register_lowering([getattr(aten, _name).Tensor, getattr(aten, _name).Scalar], _binary)


def _scaled_info(ctx, b: str, factor: str, node) -> ValueInfo:
    """The type of ``b · alpha``: ``b``'s shape (the add broadcasts it after), the dtype the mul computes."""
    info = ctx.graph.values.get(b)
    if info is None or info.dtype == "unknown":
        return value_info(node)
    like = torch.empty([1] * len(info.shape), dtype=getattr(torch, info.dtype), device="meta")
    dtype = torch.result_type(like, ctx.graph.constants[factor])
    return ValueInfo(info.shape, str(dtype).replace("torch.", ""))


def _rsub(ctx, node):
    bound = normalized(node)
    dtype = value_info(node).dtype
    a = tensor_operand(ctx, value_of(ctx, bound["self"]), dtype)
    b = tensor_operand(ctx, value_of(ctx, bound["other"]), dtype)
    emit(ctx, node, "sub", [b, a], {})


register_lowering([aten.rsub.Scalar, aten.rsub.Tensor], _rsub)

for _name, _overload in (
    ("relu", aten.relu.default), ("sigmoid", aten.sigmoid.default), ("tanh", aten.tanh.default),
    ("silu", aten.silu.default), ("exp", aten.exp.default), ("reciprocal", aten.reciprocal.default),
    ("rsqrt", aten.rsqrt.default), ("sqrt", aten.sqrt.default), ("neg", aten.neg.default),
    ("abs", aten.abs.default), ("erf", aten.erf.default), ("log", aten.log.default),
):
    register_lowering(_overload, generic_rule(_name, ("self",)))
register_lowering(aten.relu_.default, generic_rule("relu", ("self",)))
register_lowering(aten.gelu.default, generic_rule("gelu", ("self",), ("approximate",)))
register_lowering(aten.softplus.default, generic_rule("softplus", ("self",), ("beta", "threshold")))
register_lowering([aten.clamp.default], generic_rule("clamp", ("self",), ("min", "max")))
register_lowering(aten.hardtanh.default, generic_rule("hardtanh", ("self",), ("min_val", "max_val")))
register_lowering(aten.pow.Tensor_Scalar, generic_rule("pow", ("self",), ("exponent",)))
# float table ops (docs/march.md §13.4): in the qat IR only where pre_export left them float
register_lowering(aten.hardswish.default, generic_rule("hardswish", ("self",)))
register_lowering(aten.hardsigmoid.default, generic_rule("hardsigmoid", ("self",)))
register_lowering(aten.elu.default, generic_rule("elu", ("self",), ("alpha", "scale", "input_scale")))
register_lowering(aten.where.self, generic_rule("where", ("condition", "self", "other")))
register_lowering([aten.masked_fill.Scalar], generic_rule("masked_fill", ("self", "mask"), ("value",)))


def _masked_fill_tensor(ctx, node):
    """``masked_fill`` with a 0-d tensor value: the value must be a constant (it becomes an attribute)."""
    bound = normalized(node)
    value = value_of(ctx, bound["value"])
    if not ctx.is_const(value):
        raise QuantLensError(f"masked_fill at op site '{op_site(node)}' ({user_source(node)}) fills with a computed "
                             "value; the IR needs a constant fill value.")
    emit(ctx, node, "masked_fill", [value_of(ctx, bound["self"]), value_of(ctx, bound["mask"])],
          {"value": float(ctx.graph.constants[value])})


register_lowering([aten.masked_fill.Tensor], _masked_fill_tensor)

# -- normalisation, softmax ----------------------------------------------------------------------------------
register_lowering(aten.layer_norm.default, generic_rule("layer_norm", ("input", "weight", "bias"),
                                             ("normalized_shape", "eps")))
register_lowering(aten.softmax.int, generic_rule("softmax", ("self",), ("dim",)))
register_lowering(aten._softmax.default, generic_rule("softmax", ("self",), ("dim",)))
register_lowering(aten.log_softmax.int, generic_rule("log_softmax", ("self",), ("dim",)))

# -- reductions and pooling ------------------------------------------------------------------------------------
register_lowering(aten.mean.dim, generic_rule("mean", ("self",), ("dim", "keepdim")))
register_lowering(aten.sum.dim_IntList, generic_rule("sum", ("self",), ("dim", "keepdim")))
for _name in ("mean", "sum"):
    register_lowering(getattr(aten, _name).default,
              lambda ctx, node, _op=_name: emit(ctx, node, _op, [value_of(ctx, node.args[0])],
                                                 {"dim": None, "keepdim": False}))
register_lowering(aten.cumsum.default, generic_rule("cumsum", ("self",), ("dim",)))
register_lowering(aten.amax.default, generic_rule("amax", ("self",), ("dim", "keepdim")))
register_lowering(aten.max.dim, generic_rule("max_dim", ("self",), ("dim", "keepdim"), n_out=2))
register_lowering(aten.argmax.default, generic_rule("argmax", ("self",), ("dim", "keepdim")))
register_lowering(aten.topk.default, generic_rule("topk", ("self",), ("k", "dim", "largest", "sorted"), 2))
register_lowering(aten.sort.default, generic_rule("sort", ("self",), ("dim", "descending"), 2))
# (the prepared model's topk is a stable sort and a narrow: the march's tie order, docs/march.md §11.1)
register_lowering(aten.sort.stable, generic_rule("sort", ("self",), ("dim", "descending"), 2))
register_lowering(aten.max_pool2d.default, generic_rule("max_pool2d", ("self",),
                                             ("kernel_size", "stride", "padding", "dilation", "ceil_mode")))
register_lowering(aten.avg_pool2d.default, generic_rule("avg_pool2d", ("self",),
                                             ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                                              "divisor_override")))
register_lowering(aten.adaptive_avg_pool2d.default, generic_rule("adaptive_avg_pool2d",
                                                      ("self",), ("output_size",)))
register_lowering(aten.adaptive_avg_pool1d.default, generic_rule("adaptive_avg_pool1d",
                                                      ("self",), ("output_size",)))
register_lowering(aten.upsample_nearest2d.vec, generic_rule("upsample_nearest2d", ("input",),
                                                 ("output_size", "scale_factors")))
register_lowering(aten.upsample_bilinear2d.vec, generic_rule("upsample_bilinear2d", ("input",),
                                                  ("output_size", "align_corners", "scale_factors")))
register_lowering(aten.max_pool1d.default, generic_rule("max_pool1d", ("self",),
                                             ("kernel_size", "stride", "padding", "dilation", "ceil_mode")))
register_lowering(aten.avg_pool1d.default, generic_rule("avg_pool1d", ("self",),
                                             ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")))
register_lowering(aten.upsample_nearest1d.vec, generic_rule("upsample_nearest1d", ("input",),
                                                 ("output_size", "scale_factors")))


def _adaptive_max_pool(ctx, node):
    """``adaptive_max_pool1d/2d`` with even windows (the output size divides the input size) is the max pool with
    kernel = stride = input / output; its indices output is refused (a max pool has none in the IR)."""
    n = 1 if node.target is aten.adaptive_max_pool1d.default else 2
    spatial = list(value_info(node.args[0]).shape[-n:])
    out_size = [int(s) for s in node.args[1]]
    if any(s <= 0 or o <= 0 or s % o for s, o in zip(spatial, out_size)):
        raise QuantLensError(
            f"export: adaptive_max_pool{n}d at op site '{op_site(node)}' ({user_source(node)}) from {spatial} to "
            f"{out_size} has uneven windows; make the input size a multiple of the output size (or use max_pool)."
        )
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        raise QuantLensError(
            f"export: adaptive_max_pool{n}d at op site '{op_site(node)}' ({user_source(node)}) uses its indices; the IR "
            "has its values only (return_indices=False)."
        )
    kernel = [s // o for s, o in zip(spatial, out_size)]
    attrs = {"kernel_size": kernel, "stride": kernel, "padding": [0] * n, "dilation": [1] * n, "ceil_mode": False}
    out = node.name
    ctx.graph.nodes.append(Node(f"max_pool{n}d", [value_of(ctx, node.args[0])], [out], attrs, op_site(node)))
    val = node.meta["val"][0]
    ctx.graph.values[out] = ValueInfo(static_shape(val), str(val.dtype).replace("torch.", ""))
    ctx.names[node] = [out, None]


register_lowering([aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default], _adaptive_max_pool)
