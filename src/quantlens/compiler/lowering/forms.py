"""Other aten forms of the IR's GEMMs: what torch's decompositions leave (``convolution`` from ``conv2d(padding=
"same")``) and what third-party layers call (``addmm``: transformers' GPT-2 ``Conv1D``)."""

from __future__ import annotations

from torch import fx

from quantlens._advice import setting
from quantlens.compiler.graph import Node, ValueInfo
from quantlens.compiler.lowering.movement import batch_rows
from quantlens.compiler.lowering.rules import (
    aten,
    emit,
    normalized,
    op_site,
    register_lowering,
    user_source,
    value_info,
    value_of,
)
from quantlens.errors import QuantLensError

_CONV_BY_RANK = {3: "conv1d", 4: "conv2d"}


def _convolution(ctx, node):
    """``aten.convolution`` (not transposed) -> ``conv1d`` / ``conv2d`` by the weight's rank, same attributes."""
    bound = normalized(node)
    rank = len(value_info(bound["weight"]).shape)
    if bound["transposed"] or rank not in _CONV_BY_RANK:
        raise QuantLensError(
            f"export: convolution at op site '{op_site(node)}' ({user_source(node)}) is "
            f"{'transposed' if bound['transposed'] else f'{rank - 2}-d'}; the IR lowers 1-d and 2-d convolutions "
            "(and conv_transpose1d/2d called as such).")
    inputs = [value_of(ctx, bound["input"]), value_of(ctx, bound["weight"]),
              "" if bound["bias"] is None else value_of(ctx, bound["bias"])]
    attrs = {k: [int(v) for v in bound[k]] for k in ("stride", "padding", "dilation")}
    attrs["groups"] = int(bound["groups"])
    emit(ctx, node, _CONV_BY_RANK[rank], inputs, attrs)


register_lowering(aten.convolution.default, _convolution)


def _addmm(ctx, node):
    """``addmm(bias, x, w)`` with beta = alpha = 1 is ``linear(x, wᵀ, bias)``: the weight's transpose is a data move
    of the (fake-quantized) weight, which convert carries out on the integer weight."""
    bound = normalized(node)
    if bound["beta"] != 1 or bound["alpha"] != 1:
        raise QuantLensError(f"export: addmm at op site '{op_site(node)}' ({user_source(node)}) scales its terms "
                             f"(beta={bound['beta']}, alpha={bound['alpha']}); the IR lowers addmm as a linear layer.")
    weight = value_of(ctx, bound["mat2"])
    shape = value_info(bound["mat2"]).shape
    transposed = ctx.fresh("addmm_weight_t")
    ctx.graph.nodes.append(Node("permute", [weight], [transposed], {"dims": [1, 0]}, op_site(node)))
    ctx.graph.values[transposed] = ValueInfo((shape[1], shape[0]), value_info(bound["mat2"]).dtype)
    emit(ctx, node, "linear", [value_of(ctx, bound["mat1"]), transposed, value_of(ctx, bound["self"])], {})


register_lowering(aten.addmm.default, _addmm)


def _repeat(ctx, node):
    """``x.repeat(r_0, ..., r_k)``: a reshape that puts a 1 before each dim, an ``expand`` of those to ``r_i``, and a
    reshape that merges each pair (data movement: the values keep their grid). torch's own decomposition of repeat
    leaves strides that a later ``view`` (wavlm's position bias) cannot take. A count computed from the dynamic
    batch (DeBERTa's ``pos.repeat(q.size(0) // heads, 1, 1)``) is an ``index_select`` of index 0 as many times as
    the count has rows (``batch_rows``): the IR's expand takes static sizes only."""
    bound = normalized(node)
    symbolic = [i for i, r in enumerate(bound["repeats"]) if isinstance(r, fx.Node)]
    shape = list(value_info(bound["self"]).shape)
    shape = [1] * (len(bound["repeats"]) - len(shape)) + shape
    rows = batch_rows(ctx, node, bound["repeats"][symbolic[0]]) if len(symbolic) == 1 else None
    if symbolic and (rows is None or any(d < 0 for d in shape)):
        raise QuantLensError(f"export: repeat at op site '{op_site(node) or '<none>'}' ({user_source(node)}) repeats "
                             f"{'a dynamic dim' if any(d < 0 for d in shape) else 'by counts'} computed at run time "
                             "in a form the IR cannot follow (it follows one count that is the dynamic batch, or a "
                             "multiple or quotient of it by a constant, of a tensor of static shape); export with "
                             f"{setting('dynamic_batch', False)} (one IR per batch size), or at the deployment batch "
                             "size.")
    if any(d < 0 for d in shape):
        raise QuantLensError(f"export: repeat at op site '{op_site(node)}' ({user_source(node)}) of a dynamic dim; export "
                             f"with static shapes ({setting('dynamic_batch', False)}).")
    reps = [-1 if i in symbolic else int(r) for i, r in enumerate(bound["repeats"])]
    value, dtype = value_of(ctx, bound["self"]), value_info(node).dtype
    value = _step(ctx, node, "reshape", [value], {"shape": [d for s in shape for d in (1, s)]}, dtype)
    if rows is not None:  # index 0 of the inserted dim, once per row of the count
        index = _step(ctx, node, "cast", [rows], {"dtype": "int64"}, "int64", (-1,))
        index = _step(ctx, node, "fill", [index], {"value": 0}, "int64", (-1,))
        value = _step(ctx, node, "index_select", [value, index], {"dim": 2 * symbolic[0]}, dtype,
                      [d for r, s in zip(reps, shape) for d in (-1 if r < 0 else 1, s)])
    value = _step(ctx, node, "expand", [value], {"shape": [d for r, s in zip(reps, shape) for d in (r, s)]}, dtype)
    emit(ctx, node, "reshape", [value], {"shape": [-1 if r < 0 else r * s for r, s in zip(reps, shape)]})


def _step(ctx, node, op: str, inputs: list[str], attrs: dict, dtype: str, shape=None) -> str:
    name = ctx.fresh(f"{node.name}_{op}")
    ctx.graph.nodes.append(Node(op, inputs, [name], attrs, op_site(node)))
    ctx.graph.values[name] = ValueInfo(tuple(attrs["shape"] if shape is None else shape), dtype)
    return name


register_lowering(aten.repeat.default, _repeat)
