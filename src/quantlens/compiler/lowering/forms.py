"""Other aten forms of the IR's GEMMs: what torch's decompositions leave (``convolution`` from ``conv2d(padding=
"same")``) and what third-party layers call (``addmm``: transformers' GPT-2 ``Conv1D``)."""

from __future__ import annotations

from torch import fx

from quantlens.compiler.ir import Node, ValueInfo
from quantlens.compiler.lowering.rules import (
    TORCH_OPS,
    _emit,
    _info,
    _normalized,
    _register,
    _site,
    _source,
    _value,
    aten,
)
from quantlens.errors import QuantLensError

_CONV_BY_RANK = {3: "conv1d", 4: "conv2d"}


def _convolution(ctx, node):
    """``aten.convolution`` (not transposed) -> ``conv1d`` / ``conv2d`` by the weight's rank, same attributes."""
    bound = _normalized(node)
    rank = len(_info(bound["weight"]).shape)
    if bound["transposed"] or rank not in _CONV_BY_RANK:
        raise QuantLensError(
            f"export: convolution at op site '{_site(node)}' ({_source(node)}) is "
            f"{'transposed' if bound['transposed'] else f'{rank - 2}-d'}; the IR lowers 1-d and 2-d convolutions "
            "(and conv_transpose1d/2d called as such).")
    inputs = [_value(ctx, bound["input"]), _value(ctx, bound["weight"]),
              "" if bound["bias"] is None else _value(ctx, bound["bias"])]
    attrs = {k: [int(v) for v in bound[k]] for k in ("stride", "padding", "dilation")}
    attrs["groups"] = int(bound["groups"])
    _emit(ctx, node, _CONV_BY_RANK[rank], inputs, attrs)


_register(aten.convolution.default, _convolution)


def _addmm(ctx, node):
    """``addmm(bias, x, w)`` with beta = alpha = 1 is ``linear(x, wᵀ, bias)``: the weight's transpose is a data move
    of the (fake-quantized) weight, which convert carries out on the integer weight."""
    bound = _normalized(node)
    if bound["beta"] != 1 or bound["alpha"] != 1:
        raise QuantLensError(f"export: addmm at op site '{_site(node)}' ({_source(node)}) scales its terms "
                             f"(beta={bound['beta']}, alpha={bound['alpha']}); the IR lowers addmm as a linear layer.")
    weight = _value(ctx, bound["mat2"])
    shape = _info(bound["mat2"]).shape
    transposed = ctx.fresh("addmm_weight_t")
    ctx.graph.nodes.append(Node("permute", [weight], [transposed], {"dims": [1, 0]}, _site(node)))
    ctx.graph.values[transposed] = ValueInfo((shape[1], shape[0]), _info(bound["mat2"]).dtype)
    _emit(ctx, node, "linear", [_value(ctx, bound["mat1"]), transposed, _value(ctx, bound["self"])], {})


_register(aten.addmm.default, _addmm)
TORCH_OPS.setdefault("linear", aten.linear.default)


def _repeat(ctx, node):
    """``x.repeat(r_0, ..., r_k)``: a reshape that puts a 1 before each dim, an ``expand`` of those to ``r_i``, and a
    reshape that merges each pair (data movement: the values keep their grid). torch's own decomposition of repeat
    leaves strides that a later ``view`` (wavlm's position bias) cannot take."""
    bound = _normalized(node)
    if any(isinstance(r, fx.Node) for r in bound["repeats"]):
        raise QuantLensError(f"export: repeat at op site '{_site(node) or '<none>'}' ({_source(node)}) repeats by a "
                             "count computed from the dynamic batch (e.g. x.repeat(batch // heads, 1, 1)), which the "
                             "IR's static repeat cannot express; export with dynamic_batch=False (one IR per batch "
                             "size), or at the deployment batch size.")
    reps = [int(r) for r in bound["repeats"]]
    shape = list(_info(bound["self"]).shape)
    shape = [1] * (len(reps) - len(shape)) + shape
    if any(d < 0 for d in shape):
        raise QuantLensError(f"export: repeat at op site '{_site(node)}' ({_source(node)}) of a dynamic dim; export "
                             "with static shapes (dynamic_batch=False).")
    value, dtype = _value(ctx, bound["self"]), _info(node).dtype
    steps = (("reshape", [d for s in shape for d in (1, s)]), ("expand", [d for r, s in zip(reps, shape)
                                                                        for d in (r, s)]))
    for op, new_shape in steps:
        name = ctx.fresh(f"{node.name}_{op}")
        ctx.graph.nodes.append(Node(op, [value], [name], {"shape": new_shape}, _site(node)))
        ctx.graph.values[name] = ValueInfo(tuple(new_shape), dtype)
        value = name
    _emit(ctx, node, "reshape", [value], {"shape": [r * s for r, s in zip(reps, shape)]})


_register(aten.repeat.default, _repeat)
