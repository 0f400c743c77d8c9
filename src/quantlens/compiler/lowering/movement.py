"""Lowering rules of data movement, comparisons, boolean ops, fake quants and pre_export's table ops."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant)
from quantlens._advice import setting
from quantlens.compiler.graph import Node, ValueInfo
from quantlens.compiler.lowering.rules import (
    aten,
    dim_or_batch,
    emit,
    generic_rule,
    jsonable,
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

# -- data movement ---------------------------------------------------------------------------------------------


def _reshape(ctx, node):
    x = value_of(ctx, node.args[0])
    emit(ctx, node, "reshape", [x], {"shape": list(value_info(node).shape)})


def _permute(ctx, node):
    x = value_of(ctx, node.args[0])
    ndim = len(value_info(node.args[0]).shape)
    if node.target in (aten.transpose.int,):
        d0, d1 = (d % ndim for d in node.args[1:3])
        dims = list(range(ndim))
        dims[d0], dims[d1] = dims[d1], dims[d0]
    elif node.target is aten.t.default:
        dims = list(range(ndim))[::-1]
    else:
        dims = [d % ndim for d in node.args[1]]
    emit(ctx, node, "permute", [x], {"dims": dims})


def _identity(ctx, node):
    ctx.names[node] = value_of(ctx, node.args[0])


def _to(ctx, node):
    src = value_info(node.args[0])
    dst = value_info(node)
    if src.dtype == dst.dtype:
        return _identity(ctx, node)
    emit(ctx, node, "cast", [value_of(ctx, node.args[0])], {"dtype": dst.dtype})


def _cat(ctx, node):
    bound = normalized(node)
    tensors = [tensor_operand(ctx, v) for v in value_of(ctx, bound["tensors"])]
    emit(ctx, node, "cat", tensors, {"dim": bound["dim"] % len(value_info(node).shape)})


def _stack(ctx, node):
    bound = normalized(node)
    ndim = len(value_info(node).shape)
    dim = bound["dim"] % ndim
    parts = []
    for v, src in zip(value_of(ctx, bound["tensors"]), bound["tensors"]):
        shape = list(value_info(src).shape)
        shape.insert(dim, 1)
        name = ctx.fresh("stack_part")
        ctx.graph.nodes.append(Node("reshape", [v], [name], {"shape": shape}, op_site(node)))
        ctx.graph.values[name] = ValueInfo(tuple(shape), value_info(src).dtype)
        parts.append(name)
    emit(ctx, node, "cat", parts, {"dim": dim})


def _split(ctx, node):
    bound = normalized(node)
    x = value_of(ctx, bound["self"])
    vals = node.meta["val"]
    dim = bound["dim"] % len(value_info(node.args[0]).shape)
    if len(vals) > 1 and any(free_unbacked_symbols(v.shape[dim]) for v in vals):
        raise QuantLensError(
            f"export: op site '{op_site(node)}' ({user_source(node)}) splits by sizes computed from tensor data (a .tolist() "
            "or .item() of a tensor, such as the expert sizes of a mixture-of-experts split); the IR's split sizes "
            "are static. Compute such sizes outside the model, or give every part a fixed size."
        )
    sizes = [dim_or_batch(v.shape[dim]) for v in vals]
    emit(ctx, node, "split", [x], {"sizes": sizes, "dim": dim}, n_out=len(sizes))


def require_static_dim(node: fx.Node, shape: tuple, dim: int) -> None:
    """Refuse an op that indexes along the dynamic batch dim (``-1`` in ``shape``): the IR's index attrs are static."""
    if shape[dim] == -1:
        raise QuantLensError(
            f"export: op site '{op_site(node)}' ({user_source(node)}) indexes the dynamic batch dimension; export with "
            f"{setting('dynamic_batch', False)} (the default) for this model."
        )


def _slice(ctx, node):
    bound = normalized(node)
    shape = value_info(node.args[0]).shape
    dim = bound["dim"] % len(shape)
    if shape[dim] == -1 and bound["start"] in (None, 0) and bound["step"] in (None, 1) and (
            bound["end"] is None or (isinstance(bound["end"], int) and bound["end"] >= 2**31 - 1)):
        return _identity(ctx, node)  # x[:, ...]: the whole dynamic batch
    require_static_dim(node, shape, dim)
    start = bound["start"] if bound["start"] is not None else 0
    end = bound["end"] if bound["end"] is not None else shape[dim]
    start, end, _ = slice(start, end, bound["step"]).indices(shape[dim])
    emit(ctx, node, "slice", [value_of(ctx, bound["self"])],
          {"dim": dim, "start": start, "end": end, "step": bound["step"]})


def _select(ctx, node):
    bound = normalized(node)
    shape = value_info(node.args[0]).shape
    dim = bound["dim"] % len(shape)
    require_static_dim(node, shape, dim)
    emit(ctx, node, "select", [value_of(ctx, bound["self"])], {"dim": dim, "index": bound["index"] % shape[dim]})


def _getitem(ctx, node):
    source, index = node.args
    ctx.names[node] = ctx.names[source][index]


register_lowering([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
           aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default],
          _reshape)
register_lowering([aten.permute.default, aten.transpose.int, aten.t.default], _permute)
register_lowering([aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
           aten.dropout.default, aten.lift_fresh_copy.default, aten.detach_.default], _identity)
register_lowering([aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default], _to)
register_lowering(aten.cat.default, _cat)
register_lowering(aten.stack.default, _stack)
register_lowering([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], _split)


def _unbind(ctx, node):
    """``unbind(x, dim)``: a split into size-1 parts, each reshaped without ``dim``."""
    bound = normalized(node)
    x = value_of(ctx, bound["self"])
    in_shape = value_info(node.args[0]).shape
    dim = bound["dim"] % len(in_shape)
    require_static_dim(node, in_shape, dim)
    parts = []
    for i, v in enumerate(node.meta["val"]):
        part = ctx.fresh("unbind_part")
        parts.append(part)
        ctx.graph.values[part] = ValueInfo(in_shape[:dim] + (1,) + in_shape[dim + 1:], value_info(node.args[0]).dtype)
    ctx.graph.nodes.append(Node("split", [x], parts, {"sizes": [1] * len(parts), "dim": dim}, op_site(node)))
    outs = []
    for i, (part, v) in enumerate(zip(parts, node.meta["val"])):
        out = f"{node.name}_{i}"
        ctx.graph.nodes.append(Node("reshape", [part], [out], {"shape": list(static_shape(v))}, op_site(node)))
        ctx.graph.values[out] = ValueInfo(static_shape(v), str(v.dtype).replace("torch.", ""))
        outs.append(out)
    ctx.names[node] = outs


register_lowering(aten.unbind.int, _unbind)
register_lowering(aten.slice.Tensor, _slice)
register_lowering(aten.select.int, _select)
register_lowering(aten.expand.default, lambda ctx, node: emit(ctx, node, "expand", [value_of(ctx, node.args[0])],
                                                        {"shape": list(value_info(node).shape)}))
register_lowering(aten.gather.default, generic_rule("gather", ("self", "index"), ("dim",)))
register_lowering(aten.index_select.default, generic_rule("index_select", ("self", "index"),
                                               ("dim",)))
register_lowering(operator.getitem, _getitem)
register_lowering(aten.pixel_shuffle.default, generic_rule("pixel_shuffle", ("self",),
                                               ("upscale_factor",)))
register_lowering(aten.pixel_unshuffle.default, generic_rule("pixel_unshuffle", ("self",),
                                                 ("downscale_factor",)))


def _flip(ctx, node):
    ndim = len(value_info(node.args[0]).shape)
    emit(ctx, node, "flip", [value_of(ctx, node.args[0])], {"dims": sorted(d % ndim for d in node.args[1])})


register_lowering(aten.flip.default, _flip)


def _index(ctx, node):
    """Advanced indexing ``x[i, j]`` (masks, gathers): ``index(x, i0, i1, ...)``, "" for an unindexed dim."""
    x, indices = node.args[0], node.args[1]
    names = [value_of(ctx, x)] + ["" if i is None else value_of(ctx, i) for i in indices]
    emit(ctx, node, "index", names, {})


register_lowering(aten.index.Tensor, _index)
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register_lowering([getattr(aten, _name).Tensor, getattr(aten, _name).Scalar],
              generic_rule(_name, ("self", "other")))
def _bool_only(op: str, args: tuple[str, ...]):
    """Bitwise ops are logical ops on bool tensors (masks); on integers they have no IR op."""
    generic = generic_rule(op, args)

    def rule(ctx, node):
        if value_info(node).dtype != "bool":
            raise QuantLensError(
                f"export: {node.target} on {value_info(node).dtype} tensors (op site '{op_site(node)}', {user_source(node)}) "
                "is not supported; the IR has logical ops on bool masks only."
            )
        generic(ctx, node)

    return rule


register_lowering([aten.logical_not.default, aten.bitwise_not.default],
          _bool_only("logical_not", ("self",)))
register_lowering([aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default],
          _bool_only("logical_and", ("self", "other")))
register_lowering([aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default],
          _bool_only("logical_or", ("self", "other")))


def _fake_quant(ctx, node):
    x, scale, qmin, qmax, axis = node.args
    emit(ctx, node, "fake_quant", [value_of(ctx, x), value_of(ctx, scale)], {"qmin": qmin, "qmax": qmax, "axis": axis})


register_lowering(torch.ops.quantlens.fake_quant.default, _fake_quant)


def lower_quantlens_op(ctx, node):
    """pre_export's table ops (``torch.ops.quantlens.*``) map one to one to IR ops of the same name."""
    bound = normalized(node)
    schema = node.target._schema
    inputs, attrs = [], {}
    for arg in schema.arguments:
        value = value_of(ctx, bound[arg.name])
        if str(arg.type).startswith("Tensor"):
            inputs.append("" if value is None else value)
        else:
            attrs[arg.name] = jsonable(value)
    op = schema.name.split("::", 1)[1]  # (its meaning is that custom op: op_meanings.torch_op_of finds it)
    emit(ctx, node, op, inputs, attrs)


# -- tensors sized by the dynamic batch --------------------------------------------------------------------------
def _append(ctx, node: fx.Node, op: str, value: str, attrs: dict, shape: list[int], dtype: str) -> str:
    out = ctx.fresh(f"{node.name}_{op}")
    ctx.graph.nodes.append(Node(op, [value], [out], attrs, op_site(node)))
    ctx.graph.values[out] = ValueInfo(tuple(shape), dtype)
    return out


def batch_rows(ctx, node: fx.Node, size) -> str | None:
    """A 1-d value with one element per unit of the run-time size ``size`` (a SymInt node of shape math on the
    dynamic batch), made by data movement from the tensor the size was read from: ``x.size(d)`` on a dynamic dim
    (``select`` index 0 on every other dim), ``n // c`` (every c-th element from the c-th: floor(n / c) of them) and
    ``n * c`` (each element c times). The IR has no integer scalars; a size it can follow is a tensor's length.
    None for any other form."""
    if not isinstance(size, fx.Node):
        return None
    if size.target is aten.sym_size.int:
        tensor, dim = size.args
        shape = list(value_info(tensor).shape)
        dim %= len(shape)
        if shape[dim] != -1:
            return None
        name, dtype = value_of(ctx, tensor), value_info(tensor).dtype
        for k in reversed(range(len(shape))):  # down to the dynamic dim alone: shape [-1]
            if k != dim:
                shape.pop(k)
                name = _append(ctx, node, "select", name, {"dim": k, "index": 0}, shape, dtype)
        return name
    if size.target not in (operator.floordiv, operator.mul) or len(size.args) != 2:
        return None
    a, b = size.args
    inner_node, factor = (b, a) if size.target is operator.mul and isinstance(a, int) else (a, b)
    if not isinstance(factor, int) or factor < 1:
        return None
    inner = batch_rows(ctx, node, inner_node)
    if inner is None:
        return None
    dtype = ctx.graph.values[inner].dtype
    if size.target is operator.floordiv:
        return _append(ctx, node, "slice", inner, {"dim": 0, "start": factor - 1, "end": 2**63 - 1, "step": factor},
                       [-1], dtype)
    wide = _append(ctx, node, "reshape", inner, {"shape": [-1, 1]}, [-1, 1], dtype)
    wide = _append(ctx, node, "expand", wide, {"shape": [-1, factor]}, [-1, factor], dtype)
    return _append(ctx, node, "reshape", wide, {"shape": [-1]}, [-1], dtype)


def _batch_sized_full(ctx, node):
    """``zeros`` / ``full`` whose size holds the dynamic batch (an ``nn.LSTM``'s zero initial state under a
    symbolic batch): not a constant, so it is built from the tensor the batch size was read from. One element per
    unit of that size (``batch_rows``), shaped and expanded to the size, then filled. A static size is a constant
    (folded before lowering)."""
    size = list(node.args[0])
    value = 0.0 if node.target is aten.zeros.default else float(node.args[1])
    dynamic = [(i, a) for i, a in enumerate(size) if isinstance(a, fx.Node)]
    name = batch_rows(ctx, node, dynamic[0][1]) if len(dynamic) == 1 else None
    if name is None:
        raise QuantLensError(
            f"export: op site '{op_site(node)}' ({user_source(node)}) makes a tensor whose size is computed at run time "
            f"({node.target}); the IR supports sizes that are constants or the dynamic batch read from an input "
            "(x.size(0), or a multiple or quotient of it by a constant). Pass the state explicitly, or export with "
            f"{setting('dynamic_batch', False)}.")
    position, dtype = dynamic[0][0], ctx.graph.values[name].dtype
    target = [-1 if i == position else int(a) for i, a in enumerate(size)]
    name = _append(ctx, node, "reshape", name, {"shape": [-1 if i == position else 1 for i in range(len(size))]},
                   [-1 if i == position else 1 for i in range(len(size))], dtype)
    name = _append(ctx, node, "expand", name, {"shape": target}, target, dtype)
    if value_info(node).dtype != dtype:
        name = _append(ctx, node, "cast", name, {"dtype": value_info(node).dtype}, target, value_info(node).dtype)
    emit(ctx, node, "fill", [name], {"value": value})


register_lowering([aten.zeros.default, aten.full.default], _batch_sized_full)
