"""Lowering a ``torch.export`` graph (aten ops) to the qat IR op set (``docs/ir.md``).

One registry maps each supported aten overload to a lowering rule. Most rules are generic: tensor arguments
become node inputs and the other arguments become attributes, named as in the aten schema. Shape ops are
normalised (``view``/``flatten``/``squeeze``/``unsqueeze`` -> ``reshape``, ``transpose``/``t`` -> ``permute``),
scalars become constants, and every subgraph that depends only on constants (BatchNorm folding, position ids)
is folded at export. An aten op with no rule is an error naming the op, its op site and the user's source line.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant)
from quantlens.compiler.ir import Graph, Node, ValueInfo
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS
from quantlens.quantization.tracer import TORCH_DIR, is_within

__all__ = ["lower_exported_program", "LOWERINGS", "TORCH_OPS"]

aten = torch.ops.aten


@dataclass
class _Ctx:
    graph: Graph
    names: dict[fx.Node, Any] = field(default_factory=dict)  # fx node -> value name (or list, or python value)
    counter: int = 0

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}_{self.counter}"

    def const(self, value: Any, base: str = "c") -> str:
        name = self.fresh(base)
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)
        self.graph.constants[name] = tensor.detach().clone()
        self.graph.values[name] = ValueInfo(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
        return name

    def is_const(self, name: Any) -> bool:
        return isinstance(name, str) and name in self.graph.constants


# IR op name -> the torch op whose float semantics it has (the qat kernels call it).
TORCH_OPS: dict[str, Callable] = {}
LOWERINGS: dict[Any, Callable[[_Ctx, fx.Node], None]] = {}


def _site(node: fx.Node) -> str:
    return (node.meta.get("custom") or {}).get("op_site", "")


_MACHINERY = (TORCH_DIR, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quantization"))


def _source(node: fx.Node) -> str:
    """The user's frame of the node's stack trace: the innermost outside torch and quantlens' tracer."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    user = [f for f in frames if not is_within(f.split('"')[1] if '"' in f else f, _MACHINERY)]
    return (user or frames or ["<unknown source>"])[-1]


def _dim(d) -> int:
    """A static dim, or -1 for the dynamic batch dim (a SymInt). A SymInt that torch.export specialised (a guard
    such as a reshape to a literal batch fixed it) is static."""
    if isinstance(d, torch.SymInt):
        value = d.node.maybe_as_int()
        return -1 if value is None else int(value)
    return int(d)


def _shape(val) -> tuple[int, ...]:
    return tuple(_dim(d) for d in val.shape)


def _info(node: fx.Node) -> ValueInfo:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ValueInfo(_shape(val), str(val.dtype).replace("torch.", ""))
    return ValueInfo((), "unknown")


def _emit(ctx: _Ctx, node: fx.Node, op: str, inputs: list[str], attrs: dict, n_out: int = 1) -> list[str]:
    outs = [node.name] if n_out == 1 else [f"{node.name}_{i}" for i in range(n_out)]
    ctx.graph.nodes.append(Node(op, inputs, outs, attrs, _site(node)))
    vals = node.meta.get("val")
    if n_out == 1:
        ctx.graph.values[outs[0]] = _info(node)
        ctx.names[node] = outs[0]
    else:
        for i, out in enumerate(outs):
            v = vals[i] if isinstance(vals, (tuple, list)) else None
            ctx.graph.values[out] = (
                ValueInfo(_shape(v), str(v.dtype).replace("torch.", ""))
                if isinstance(v, torch.Tensor) else ValueInfo((), "unknown")
            )
        ctx.names[node] = outs
    return outs


def _value(ctx: _Ctx, arg: Any) -> Any:
    """IR value name for an fx node argument (constants are materialised); python values pass through."""
    if isinstance(arg, fx.Node):
        return ctx.names[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_value(ctx, a) for a in arg)
    return arg


def _normalized(node: fx.Node) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def _tensor_arg(ctx: _Ctx, value: Any, dtype: str = "float32") -> str:
    """A tensor operand: an IR value, or a python scalar made into a 0-d constant of ``dtype`` (the dtype torch
    computes in, so ``ids + 1`` stays integer)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)):
        return ctx.const(torch.tensor(value, dtype=getattr(torch, dtype)), "scalar")
    raise QuantLensError(f"Expected a tensor operand, got {value!r}.")


def _operand_dtype(ctx: _Ctx, names: list, node: fx.Node) -> str:
    """dtype for python scalars of an op: the other operand's for comparisons, else the result's."""
    out = _info(node).dtype
    if out != "bool":
        return out
    for v in names:
        if isinstance(v, str) and v in ctx.graph.values:
            return ctx.graph.values[v].dtype
    return "float32"


def _generic(op: str, torch_op, tensor_args: tuple[str, ...], attr_args: tuple[str, ...] = (), n_out: int = 1):
    """Rule: tensor schema args -> inputs ("" for None), listed attr args -> attrs."""

    def rule(ctx: _Ctx, node: fx.Node) -> None:
        bound = _normalized(node)
        values = [_value(ctx, bound[name]) for name in tensor_args]
        dtype = _operand_dtype(ctx, values, node)
        inputs = []
        for v in values:
            inputs.append("" if v is None else _tensor_arg(ctx, v, dtype))
        attrs = {name: _jsonable(bound[name]) for name in attr_args}
        _emit(ctx, node, op, inputs, attrs, n_out)

    TORCH_OPS.setdefault(op, torch_op)
    return rule


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.SymInt):
        return _dim(value)
    return value


def _register(targets, rule) -> None:
    for target in targets if isinstance(targets, (list, tuple)) else (targets,):
        LOWERINGS[target] = rule


# -- GEMM and friends --------------------------------------------------------------------------------------
_register(aten.conv2d.default, _generic("conv2d", aten.conv2d.default, ("input", "weight", "bias"),
                                         ("stride", "padding", "dilation", "groups")))
_register(aten.conv1d.default, _generic("conv1d", aten.conv1d.default, ("input", "weight", "bias"),
                                         ("stride", "padding", "dilation", "groups")))
_register(aten.conv_transpose1d.default,
          _generic("conv_transpose1d", aten.conv_transpose1d.default, ("input", "weight", "bias"),
                   ("stride", "padding", "output_padding", "groups", "dilation")))
_register(aten.conv_transpose2d.input,
          _generic("conv_transpose2d", aten.conv_transpose2d.input, ("input", "weight", "bias"),
                   ("stride", "padding", "output_padding", "groups", "dilation")))
_register(aten.linear.default, _generic("linear", aten.linear.default, ("input", "weight", "bias")))
_register(aten.matmul.default, _generic("matmul", aten.matmul.default, ("self", "other")))
_register([aten.bmm.default, aten.mm.default], _generic("matmul", aten.matmul.default, ("self", "mat2")))
_register(aten.scaled_dot_product_attention.default,
          _generic("sdpa", aten.scaled_dot_product_attention.default, ("query", "key", "value", "attn_mask"),
                   ("dropout_p", "is_causal", "scale")))
_register(aten.embedding.default, _generic("embedding", aten.embedding.default, ("weight", "indices")))

# -- elementwise -------------------------------------------------------------------------------------------
for _name in ("add", "sub", "mul", "div"):
    _tensor_overload = getattr(aten, _name).Tensor

    def _binary(ctx, node, _op=_name, _t=_tensor_overload):
        bound = _normalized(node)
        dtype = _info(node).dtype
        a = _tensor_arg(ctx, _value(ctx, bound["self"]), dtype)
        b = _tensor_arg(ctx, _value(ctx, bound["other"]), dtype)
        alpha = bound.get("alpha", 1)
        if alpha not in (None, 1):
            b_scaled = ctx.fresh("alpha")
            ctx.graph.nodes.append(Node("mul", [b, ctx.const(float(alpha))], [b_scaled], {}, _site(node)))
            ctx.graph.values[b_scaled] = _info(node)
            b = b_scaled
        if bound.get("rounding_mode") is not None:
            raise QuantLensError(f"div with rounding_mode={bound['rounding_mode']!r} is not supported "
                                 f"(op site '{_site(node)}', {_source(node)}).")
        _emit(ctx, node, _op, [a, b], {})

    TORCH_OPS[_name] = _tensor_overload
    _register([getattr(aten, _name).Tensor, getattr(aten, _name).Scalar], _binary)


def _rsub(ctx, node):
    bound = _normalized(node)
    dtype = _info(node).dtype
    a = _tensor_arg(ctx, _value(ctx, bound["self"]), dtype)
    b = _tensor_arg(ctx, _value(ctx, bound["other"]), dtype)
    _emit(ctx, node, "sub", [b, a], {})


_register([aten.rsub.Scalar, aten.rsub.Tensor], _rsub)

for _name, _overload in (
    ("relu", aten.relu.default), ("sigmoid", aten.sigmoid.default), ("tanh", aten.tanh.default),
    ("silu", aten.silu.default), ("exp", aten.exp.default), ("reciprocal", aten.reciprocal.default),
    ("rsqrt", aten.rsqrt.default), ("sqrt", aten.sqrt.default), ("neg", aten.neg.default),
    ("abs", aten.abs.default), ("erf", aten.erf.default), ("log", aten.log.default),
):
    _register(_overload, _generic(_name, _overload, ("self",)))
_register(aten.relu_.default, _generic("relu", aten.relu.default, ("self",)))
_register(aten.gelu.default, _generic("gelu", aten.gelu.default, ("self",), ("approximate",)))
_register(aten.softplus.default, _generic("softplus", aten.softplus.default, ("self",), ("beta", "threshold")))
_register([aten.clamp.default], _generic("clamp", aten.clamp.default, ("self",), ("min", "max")))
_register(aten.hardtanh.default, _generic("hardtanh", aten.hardtanh.default, ("self",), ("min_val", "max_val")))
_register(aten.pow.Tensor_Scalar, _generic("pow", aten.pow.Tensor_Scalar, ("self",), ("exponent",)))
# float table ops (docs/march.md §13.4): in the qat IR only where pre_export left them float
_register(aten.hardswish.default, _generic("hardswish", aten.hardswish.default, ("self",)))
_register(aten.hardsigmoid.default, _generic("hardsigmoid", aten.hardsigmoid.default, ("self",)))
_register(aten.elu.default, _generic("elu", aten.elu.default, ("self",), ("alpha", "scale", "input_scale")))
_register(aten.where.self, _generic("where", aten.where.self, ("condition", "self", "other")))
_register([aten.masked_fill.Scalar], _generic("masked_fill", aten.masked_fill.Scalar, ("self", "mask"), ("value",)))


def _masked_fill_tensor(ctx, node):
    """``masked_fill`` with a 0-d tensor value: the value must be a constant (it becomes an attribute)."""
    bound = _normalized(node)
    value = _value(ctx, bound["value"])
    if not ctx.is_const(value):
        raise QuantLensError(f"masked_fill at op site '{_site(node)}' ({_source(node)}) fills with a computed "
                             "value; the IR needs a constant fill value.")
    _emit(ctx, node, "masked_fill", [_value(ctx, bound["self"]), _value(ctx, bound["mask"])],
          {"value": float(ctx.graph.constants[value])})


_register([aten.masked_fill.Tensor], _masked_fill_tensor)

# -- normalisation, softmax ----------------------------------------------------------------------------------
_register(aten.layer_norm.default, _generic("layer_norm", aten.layer_norm.default, ("input", "weight", "bias"),
                                             ("normalized_shape", "eps")))
_register(aten.softmax.int, _generic("softmax", aten.softmax.int, ("self",), ("dim",)))
_register(aten._softmax.default, _generic("softmax", aten.softmax.int, ("self",), ("dim",)))
_register(aten.log_softmax.int, _generic("log_softmax", aten.log_softmax.int, ("self",), ("dim",)))

# -- reductions and pooling ------------------------------------------------------------------------------------
_register(aten.mean.dim, _generic("mean", aten.mean.dim, ("self",), ("dim", "keepdim")))
_register(aten.sum.dim_IntList, _generic("sum", aten.sum.dim_IntList, ("self",), ("dim", "keepdim")))
for _name in ("mean", "sum"):
    _register(getattr(aten, _name).default,
              lambda ctx, node, _op=_name: _emit(ctx, node, _op, [_value(ctx, node.args[0])],
                                                 {"dim": None, "keepdim": False}))
_register(aten.amax.default, _generic("amax", aten.amax.default, ("self",), ("dim", "keepdim")))
_register(aten.max.dim, _generic("max_dim", aten.max.dim, ("self",), ("dim", "keepdim"), n_out=2))
_register(aten.argmax.default, _generic("argmax", aten.argmax.default, ("self",), ("dim", "keepdim")))
_register(aten.topk.default, _generic("topk", aten.topk.default, ("self",), ("k", "dim", "largest", "sorted"), 2))
_register(aten.sort.default, _generic("sort", aten.sort.default, ("self",), ("dim", "descending"), 2))
_register(aten.max_pool2d.default, _generic("max_pool2d", aten.max_pool2d.default, ("self",),
                                             ("kernel_size", "stride", "padding", "dilation", "ceil_mode")))
_register(aten.avg_pool2d.default, _generic("avg_pool2d", aten.avg_pool2d.default, ("self",),
                                             ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                                              "divisor_override")))
_register(aten.adaptive_avg_pool2d.default, _generic("adaptive_avg_pool2d", aten.adaptive_avg_pool2d.default,
                                                      ("self",), ("output_size",)))
_register(aten.adaptive_avg_pool1d.default, _generic("adaptive_avg_pool1d", aten.adaptive_avg_pool1d.default,
                                                      ("self",), ("output_size",)))
_register(aten.upsample_nearest2d.vec, _generic("upsample_nearest2d", aten.upsample_nearest2d.vec, ("input",),
                                                 ("output_size", "scale_factors")))
_register(aten.upsample_bilinear2d.vec, _generic("upsample_bilinear2d", aten.upsample_bilinear2d.vec, ("input",),
                                                  ("output_size", "align_corners", "scale_factors")))
_register(aten.max_pool1d.default, _generic("max_pool1d", aten.max_pool1d.default, ("self",),
                                             ("kernel_size", "stride", "padding", "dilation", "ceil_mode")))
_register(aten.avg_pool1d.default, _generic("avg_pool1d", aten.avg_pool1d.default, ("self",),
                                             ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")))
_register(aten.upsample_nearest1d.vec, _generic("upsample_nearest1d", aten.upsample_nearest1d.vec, ("input",),
                                                 ("output_size", "scale_factors")))


def _adaptive_max_pool(ctx, node):
    """``adaptive_max_pool1d/2d`` with even windows (the output size divides the input size) is the max pool with
    kernel = stride = input / output; its indices output is refused (a max pool has none in the IR)."""
    n = 1 if node.target is aten.adaptive_max_pool1d.default else 2
    spatial = list(_info(node.args[0]).shape[-n:])
    out_size = [int(s) for s in node.args[1]]
    if any(s <= 0 or o <= 0 or s % o for s, o in zip(spatial, out_size)):
        raise QuantLensError(
            f"export: adaptive_max_pool{n}d at op site '{_site(node)}' ({_source(node)}) from {spatial} to "
            f"{out_size} has uneven windows; make the input size a multiple of the output size (or use max_pool)."
        )
    if any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users):
        raise QuantLensError(
            f"export: adaptive_max_pool{n}d at op site '{_site(node)}' ({_source(node)}) uses its indices; the IR "
            "has its values only (return_indices=False)."
        )
    kernel = [s // o for s, o in zip(spatial, out_size)]
    attrs = {"kernel_size": kernel, "stride": kernel, "padding": [0] * n, "dilation": [1] * n, "ceil_mode": False}
    out = node.name
    ctx.graph.nodes.append(Node(f"max_pool{n}d", [_value(ctx, node.args[0])], [out], attrs, _site(node)))
    val = node.meta["val"][0]
    ctx.graph.values[out] = ValueInfo(_shape(val), str(val.dtype).replace("torch.", ""))
    ctx.names[node] = [out, None]


_register([aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default], _adaptive_max_pool)

# -- data movement ---------------------------------------------------------------------------------------------


def _reshape(ctx, node):
    x = _value(ctx, node.args[0])
    _emit(ctx, node, "reshape", [x], {"shape": list(_info(node).shape)})


def _permute(ctx, node):
    x = _value(ctx, node.args[0])
    ndim = len(_info(node.args[0]).shape)
    if node.target in (aten.transpose.int,):
        d0, d1 = (d % ndim for d in node.args[1:3])
        dims = list(range(ndim))
        dims[d0], dims[d1] = dims[d1], dims[d0]
    elif node.target is aten.t.default:
        dims = list(range(ndim))[::-1]
    else:
        dims = [d % ndim for d in node.args[1]]
    _emit(ctx, node, "permute", [x], {"dims": dims})


def _identity(ctx, node):
    ctx.names[node] = _value(ctx, node.args[0])


def _to(ctx, node):
    src = _info(node.args[0])
    dst = _info(node)
    if src.dtype == dst.dtype:
        return _identity(ctx, node)
    _emit(ctx, node, "cast", [_value(ctx, node.args[0])], {"dtype": dst.dtype})


def _cat(ctx, node):
    bound = _normalized(node)
    tensors = [_tensor_arg(ctx, v) for v in _value(ctx, bound["tensors"])]
    _emit(ctx, node, "cat", tensors, {"dim": bound["dim"] % len(_info(node).shape)})


def _stack(ctx, node):
    bound = _normalized(node)
    ndim = len(_info(node).shape)
    dim = bound["dim"] % ndim
    parts = []
    for v, src in zip(_value(ctx, bound["tensors"]), bound["tensors"]):
        shape = list(_info(src).shape)
        shape.insert(dim, 1)
        name = ctx.fresh("stack_part")
        ctx.graph.nodes.append(Node("reshape", [v], [name], {"shape": shape}, _site(node)))
        ctx.graph.values[name] = ValueInfo(tuple(shape), _info(src).dtype)
        parts.append(name)
    _emit(ctx, node, "cat", parts, {"dim": dim})


def _split(ctx, node):
    bound = _normalized(node)
    x = _value(ctx, bound["self"])
    vals = node.meta["val"]
    dim = bound["dim"] % len(_info(node.args[0]).shape)
    sizes = [_dim(v.shape[dim]) for v in vals]
    _emit(ctx, node, "split", [x], {"sizes": sizes, "dim": dim}, n_out=len(sizes))


def _static_dim(node: fx.Node, shape: tuple, dim: int) -> None:
    if shape[dim] == -1:
        raise QuantLensError(
            f"export: op site '{_site(node)}' ({_source(node)}) indexes the dynamic batch dimension; export with "
            "dynamic_batch=False (the default) for this model."
        )


def _slice(ctx, node):
    bound = _normalized(node)
    shape = _info(node.args[0]).shape
    dim = bound["dim"] % len(shape)
    if shape[dim] == -1 and bound["start"] in (None, 0) and bound["step"] in (None, 1) and (
            bound["end"] is None or (isinstance(bound["end"], int) and bound["end"] >= 2**31 - 1)):
        return _identity(ctx, node)  # x[:, ...]: the whole dynamic batch
    _static_dim(node, shape, dim)
    start = bound["start"] if bound["start"] is not None else 0
    end = bound["end"] if bound["end"] is not None else shape[dim]
    start, end, _ = slice(start, end, bound["step"]).indices(shape[dim])
    _emit(ctx, node, "slice", [_value(ctx, bound["self"])],
          {"dim": dim, "start": start, "end": end, "step": bound["step"]})


def _select(ctx, node):
    bound = _normalized(node)
    shape = _info(node.args[0]).shape
    dim = bound["dim"] % len(shape)
    _static_dim(node, shape, dim)
    _emit(ctx, node, "select", [_value(ctx, bound["self"])], {"dim": dim, "index": bound["index"] % shape[dim]})


def _getitem(ctx, node):
    source, index = node.args
    ctx.names[node] = ctx.names[source][index]


_register([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
           aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default],
          _reshape)
_register([aten.permute.default, aten.transpose.int, aten.t.default], _permute)
_register([aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
           aten.dropout.default, aten.lift_fresh_copy.default, aten.detach_.default], _identity)
_register([aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default], _to)
_register(aten.cat.default, _cat)
_register(aten.stack.default, _stack)
_register([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], _split)


def _unbind(ctx, node):
    """``unbind(x, dim)``: a split into size-1 parts, each reshaped without ``dim``."""
    bound = _normalized(node)
    x = _value(ctx, bound["self"])
    in_shape = _info(node.args[0]).shape
    dim = bound["dim"] % len(in_shape)
    _static_dim(node, in_shape, dim)
    parts = []
    for i, v in enumerate(node.meta["val"]):
        part = ctx.fresh("unbind_part")
        parts.append(part)
        ctx.graph.values[part] = ValueInfo(in_shape[:dim] + (1,) + in_shape[dim + 1:], _info(node.args[0]).dtype)
    ctx.graph.nodes.append(Node("split", [x], parts, {"sizes": [1] * len(parts), "dim": dim}, _site(node)))
    outs = []
    for i, (part, v) in enumerate(zip(parts, node.meta["val"])):
        out = f"{node.name}_{i}"
        ctx.graph.nodes.append(Node("reshape", [part], [out], {"shape": list(_shape(v))}, _site(node)))
        ctx.graph.values[out] = ValueInfo(_shape(v), str(v.dtype).replace("torch.", ""))
        outs.append(out)
    ctx.names[node] = outs


_register(aten.unbind.int, _unbind)
_register(aten.slice.Tensor, _slice)
_register(aten.select.int, _select)
_register(aten.expand.default, lambda ctx, node: _emit(ctx, node, "expand", [_value(ctx, node.args[0])],
                                                        {"shape": list(_info(node).shape)}))
_register(aten.gather.default, _generic("gather", aten.gather.default, ("self", "index"), ("dim",)))
_register(aten.index_select.default, _generic("index_select", aten.index_select.default, ("self", "index"),
                                               ("dim",)))
_register(operator.getitem, _getitem)
_register(aten.pixel_shuffle.default, _generic("pixel_shuffle", aten.pixel_shuffle.default, ("self",),
                                               ("upscale_factor",)))
_register(aten.pixel_unshuffle.default, _generic("pixel_unshuffle", aten.pixel_unshuffle.default, ("self",),
                                                 ("downscale_factor",)))


def _flip(ctx, node):
    ndim = len(_info(node.args[0]).shape)
    _emit(ctx, node, "flip", [_value(ctx, node.args[0])], {"dims": sorted(d % ndim for d in node.args[1])})


_register(aten.flip.default, _flip)
TORCH_OPS["flip"] = aten.flip.default


def _index(ctx, node):
    """Advanced indexing ``x[i, j]`` (masks, gathers): ``index(x, i0, i1, ...)``, "" for an unindexed dim."""
    x, indices = node.args[0], node.args[1]
    names = [_value(ctx, x)] + ["" if i is None else _value(ctx, i) for i in indices]
    _emit(ctx, node, "index", names, {})


_register(aten.index.Tensor, _index)
TORCH_OPS.update({"reshape": aten.reshape.default, "permute": aten.permute.default, "cat": aten.cat.default,
                  "expand": aten.expand.default})
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _register([getattr(aten, _name).Tensor, getattr(aten, _name).Scalar],
              _generic(_name, getattr(aten, _name).Tensor, ("self", "other")))
def _bool_only(op: str, torch_op, args: tuple[str, ...]):
    """Bitwise ops are logical ops on bool tensors (masks); on integers they have no IR op."""
    generic = _generic(op, torch_op, args)

    def rule(ctx, node):
        if _info(node).dtype != "bool":
            raise QuantLensError(
                f"export: {node.target} on {_info(node).dtype} tensors (op site '{_site(node)}', {_source(node)}) "
                "is not supported; the IR has logical ops on bool masks only."
            )
        generic(ctx, node)

    return rule


_register([aten.logical_not.default, aten.bitwise_not.default],
          _bool_only("logical_not", aten.logical_not.default, ("self",)))
_register([aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default],
          _bool_only("logical_and", aten.logical_and.default, ("self", "other")))
_register([aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default],
          _bool_only("logical_or", aten.logical_or.default, ("self", "other")))


def _fake_quant(ctx, node):
    x, scale, qmin, qmax, axis = node.args
    _emit(ctx, node, "fake_quant", [_value(ctx, x), _value(ctx, scale)], {"qmin": qmin, "qmax": qmax, "axis": axis})


_register(torch.ops.quantlens.fake_quant.default, _fake_quant)
TORCH_OPS["fake_quant"] = torch.ops.quantlens.fake_quant.default


def _quantlens_custom(ctx, node):
    """pre_export's table ops (``torch.ops.quantlens.*``) map one to one to IR ops of the same name."""
    bound = _normalized(node)
    schema = node.target._schema
    inputs, attrs = [], {}
    for arg in schema.arguments:
        value = _value(ctx, bound[arg.name])
        if str(arg.type).startswith("Tensor"):
            inputs.append("" if value is None else value)
        else:
            attrs[arg.name] = _jsonable(value)
    op = schema.name.split("::", 1)[1]
    TORCH_OPS.setdefault(op, node.target)
    _emit(ctx, node, op, inputs, attrs)


# Nodes that only depend on constants are evaluated at export (BatchNorm folding, position ids, masks).
_NEVER_FOLD = {"fake_quant"}


def _try_fold(ctx: _Ctx, node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if getattr(node.target, "namespace", None) == "quantlens":
        return False

    def all_const(a):
        if isinstance(a, fx.Node):
            v = ctx.names.get(a)
            if isinstance(v, list):
                return all(ctx.is_const(x) for x in v)
            return ctx.is_const(v)
        if isinstance(a, (list, tuple)):
            return all(all_const(x) for x in a)
        return True

    if not all_const(list(node.args) + list(node.kwargs.values())):
        return False

    def materialise(a):
        if isinstance(a, fx.Node):
            v = ctx.names[a]
            return [ctx.graph.constants[x] for x in v] if isinstance(v, list) else ctx.graph.constants[v]
        if isinstance(a, (list, tuple)):
            return type(a)(materialise(x) for x in a)
        return a

    result = node.target(*materialise(node.args), **{k: materialise(v) for k, v in node.kwargs.items()})
    if isinstance(result, torch.Tensor):
        ctx.names[node] = ctx.const(result, "folded")
    elif isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        ctx.names[node] = [ctx.const(r, "folded") for r in result]
    else:
        return False
    return True


def lower_exported_program(ep: torch.export.ExportedProgram, input_names: list[str]) -> Graph:
    """Lower an exported program whose user inputs are flat tensors named ``input_names``."""
    graph = Graph(nodes=[], inputs=list(input_names), outputs=[], constants={}, values={})
    ctx = _Ctx(graph)
    sig = ep.graph_signature
    state = dict(ep.state_dict)
    state.update(ep.constants)
    user_inputs = list(sig.user_inputs)
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in lifted:
                tensor = state[lifted[node.name]]
                name = lifted[node.name].replace(".", "_")
                graph.constants[name] = tensor.detach().clone()
                graph.values[name] = ValueInfo(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
                ctx.names[node] = name
            else:
                idx = user_inputs.index(node.name)
                ctx.names[node] = input_names[idx]
                graph.values[input_names[idx]] = _info(node)
            continue
        if node.op == "output":
            outs = node.args[0]
            graph.outputs = [_output_name(ctx, o) for o in outs[: len(sig.user_outputs)]]
            continue
        if _is_symbolic(node):
            # Size arithmetic on the dynamic batch: the shape ops read static shapes (-1 = batch) from meta.
            ctx.names[node] = -1
            continue
        if _try_fold(ctx, node):
            continue
        rule = LOWERINGS.get(node.target)
        if rule is None and getattr(node.target, "namespace", None) == "quantlens":
            rule = _quantlens_custom
        if rule is None:
            raise QuantLensError(
                f"export: the op {node.target} is not supported by the quantlens IR (op site "
                f"'{_site(node) or '<unknown>'}', {_source(node)}). Supported ops are listed in docs/ir.md; "
                "rewrite that line with supported ops, or keep it outside the exported model (e.g. in "
                "post-processing)."
            )
        rule(ctx, node)
    _drop_dead(graph)
    undeclared = sorted({n.op for n in graph.nodes if n.op not in IR_OPS or IR_OPS[n.op].level == "quantized"})
    if undeclared:  # a lowering rule emitted an op the op set does not declare: a quantlens bug, not the user's
        raise QuantLensError(f"export: lowering produced IR ops {undeclared} that quantlens.march.opset does not declare "
                             "as qat IR ops; please report this.")
    return graph


_SHAPE_ASSERTS = {"_assert_scalar", "sym_constrain_range_for_size", "_assert_tensor_metadata"}


def _is_symbolic(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return True
    return getattr(node.target, "__name__", "").split(".")[0] in _SHAPE_ASSERTS or (
        node.op == "call_function" and val is None and str(node.target).split(".")[-2:-1] == ["_assert_scalar"]
    )


def _output_name(ctx: _Ctx, out: fx.Node) -> str:
    name = ctx.names[out]
    if name in ctx.graph.constants:
        return name
    return name


def _drop_dead(graph: Graph) -> None:
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(o in live for o in node.outputs):
            kept.append(node)
            live.update(i for i in node.inputs if i)
    graph.nodes = kept[::-1]
    graph.constants = {k: v for k, v in graph.constants.items() if k in live}
    graph.values = {k: v for k, v in graph.values.items() if k in live or k in graph.inputs}


# -- padding, standalone batch norm, prelu / leaky_relu, relu6, functionalized in-place writes -----------------
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "replicate"}


def _pad(ctx, node):
    """``F.pad`` and the aten pads it becomes: one ``pad`` op ``{pad, mode, value}`` (``docs/march.md`` §11)."""
    bound = _normalized(node)
    target = node.target
    if target is aten.pad.default:
        mode, pad, value = bound["mode"], bound["pad"], bound["value"]
    elif target is aten.constant_pad_nd.default:
        mode, pad, value = "constant", bound["pad"], bound["value"]
    else:
        mode = "reflect" if "reflection" in str(target) else "replicate"
        pad, value = bound["padding"], None
    if mode not in _PAD_MODES:
        raise QuantLensError(
            f"export: pad mode {mode!r} at op site '{_site(node)}' ({_source(node)}) is not supported; the march "
            f"pads with a constant, by reflection or by replication ({sorted(_PAD_MODES)})."
        )
    _emit(ctx, node, "pad", [_value(ctx, bound.get("self", bound.get("input")))],
          {"pad": [int(p) for p in pad], "mode": mode, "value": float(value or 0.0)})


_register([aten.pad.default, aten.constant_pad_nd.default, aten.reflection_pad1d.default,
           aten.reflection_pad2d.default, aten.replication_pad1d.default, aten.replication_pad2d.default], _pad)


def _batch_norm(ctx, node):
    """A BatchNorm that export sees (one not folded into a conv/linear at prepare): ``batch_norm`` with its
    statistics as constant inputs. ``_native_batch_norm_legit_no_training`` has three outputs; only the first
    is a value."""
    bound = _normalized(node)
    names = [_value(ctx, bound[k]) if bound[k] is not None else ""
             for k in ("input", "weight", "bias", "running_mean", "running_var")]
    if bound.get("training"):
        raise QuantLensError(f"export: BatchNorm at op site '{_site(node)}' ({_source(node)}) runs in training "
                             "mode; call model.eval() before export.")
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    out = node.name
    ctx.graph.nodes.append(Node("batch_norm", names, [out], {"eps": float(bound["eps"])}, _site(node)))
    ctx.graph.values[out] = ValueInfo(_shape(first), str(first.dtype).replace("torch.", ""))
    ctx.names[node] = [out, out, out] if isinstance(val, (tuple, list)) else out


_register([aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default], _batch_norm)
_register(aten.prelu.default, _generic("prelu", aten.prelu.default, ("self", "weight")))
_register(aten._prelu_kernel.default, _generic("prelu", aten.prelu.default, ("self", "weight")))
_register(aten.leaky_relu.default, _generic("leaky_relu", aten.leaky_relu.default, ("self",), ("negative_slope",)))


def _relu6(ctx, node):
    _emit(ctx, node, "hardtanh", [_value(ctx, node.args[0])], {"min_val": 0.0, "max_val": 6.0})


_register(aten.relu6.default, _relu6)
_register([aten.fill.Scalar], _generic("fill", aten.fill.Scalar, ("self",), ("value",)))


def _fill_tensor(ctx, node):
    value = _value(ctx, node.args[1])
    if not ctx.is_const(value):
        raise QuantLensError(f"export: op site '{_site(node)}' ({_source(node)}) writes a computed value into a "
                             "tensor; the IR writes constants only (x[...] = 0.5).")
    _emit(ctx, node, "fill", [_value(ctx, node.args[0])], {"value": float(ctx.graph.constants[value])})


_register(aten.fill.Tensor, _fill_tensor)


def _scatter(op: str, torch_op, attrs: tuple[str, ...]):
    generic = _generic(op, torch_op, ("self", "src"), attrs)

    def rule(ctx, node):
        shape = _info(node.args[0]).shape
        bound = _normalized(node)
        dim = bound["dim"] % len(shape)
        _static_dim(node, shape, dim)
        generic(ctx, node)
        ctx.graph.nodes[-1].attrs["dim"] = dim
        if op == "slice_scatter":  # normalise start/end like slice
            a = ctx.graph.nodes[-1].attrs
            a["start"], a["end"], a["step"] = slice(a["start"], a["end"], a["step"]).indices(shape[dim])
        elif op == "select_scatter":
            ctx.graph.nodes[-1].attrs["index"] = bound["index"] % shape[dim]

    return rule


_register(aten.select_scatter.default, _scatter("select_scatter", aten.select_scatter.default, ("dim", "index")))
_register(aten.slice_scatter.default,
          _scatter("slice_scatter", aten.slice_scatter.default, ("dim", "start", "end", "step")))


def _copy(ctx, node):
    """Functional ``copy(dst, src)`` (an in-place write after functionalization): the value is ``src``, broadcast
    to ``dst``'s shape and cast to its dtype."""
    dst, src = node.args[0], node.args[1]
    value = _value(ctx, src)
    if _info(src).shape != _info(dst).shape:
        name = ctx.fresh("copy_expand")
        ctx.graph.nodes.append(Node("expand", [value], [name], {"shape": list(_info(dst).shape)}, _site(node)))
        ctx.graph.values[name] = ValueInfo(_info(dst).shape, _info(src).dtype)
        value = name
    if _info(src).dtype != _info(dst).dtype:
        _emit(ctx, node, "cast", [value], {"dtype": _info(dst).dtype})
        return
    ctx.names[node] = value


_register(aten.copy.default, _copy)
