"""The lowering registry (aten overload -> rule), the context a rule writes into, and the helpers rules share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant)
from quantlens._registry import make_registry
from quantlens.compiler.graph import Graph, Node, ValueInfo
from quantlens.compiler.op_meanings import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.sites.source_location import MACHINERY_DIRS, TORCH_DIR, is_within

__all__ = ["LOWERINGS", "LoweringContext", "register_lowering", "emit", "value_of", "normalized"]

aten = torch.ops.aten


@dataclass
class LoweringContext:
    """What the rules of one lowering write into: the graph being built and the IR value of each fx node."""

    graph: Graph
    names: dict[fx.Node, Any] = field(default_factory=dict)  # fx node -> value name (or list, or python value)
    counter: int = 0
    #: value name -> its tensor, for values computed in the graph from constants only (see the driver)
    known: dict[str, torch.Tensor] = field(default_factory=dict)

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


#: aten overload -> its lowering rule (``LoweringContext, fx.Node -> None``)
LOWERINGS, _lowering = make_registry("lowering rule for aten op")


def op_site(node: fx.Node) -> str:
    """The op site name the tracer recorded on ``node`` ("" when none: a node torch added)."""
    return (node.meta.get("custom") or {}).get("op_site", "")


_MACHINERY = (TORCH_DIR, *MACHINERY_DIRS)


def user_source(node: fx.Node) -> str:
    """The user's frame of the node's stack trace: the innermost outside torch and quantlens' tracer."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    user = [f for f in frames if not is_within(f.split('"')[1] if '"' in f else f, _MACHINERY)]
    return (user or frames or ["<unknown source>"])[-1]


def dim_or_batch(d) -> int:
    """A static dim, or -1 for the dynamic batch dim (a SymInt). A SymInt that torch.export specialised (a guard
    such as a reshape to a literal batch fixed it) is static."""
    if isinstance(d, torch.SymInt):
        value = d.node.maybe_as_int()
        return -1 if value is None else int(value)
    return int(d)


def static_shape(val) -> tuple[int, ...]:
    """A fake tensor's shape with :func:`dim_or_batch` per dim."""
    return tuple(dim_or_batch(d) for d in val.shape)


def value_info(node: fx.Node) -> ValueInfo:
    """The IR type of ``node``'s value, from its fake tensor (``"unknown"`` dtype when it is no tensor)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ValueInfo(static_shape(val), str(val.dtype).replace("torch.", ""))
    return ValueInfo((), "unknown")


def emit(ctx: LoweringContext, node: fx.Node, op: str, inputs: list[str], attrs: dict, n_out: int = 1) -> list[str]:
    """Append the IR node ``op(inputs)`` for fx ``node``, type its outputs from the node's fake values and name
    them as ``node``'s value(s); returns the output names."""
    vals = node.meta.get("val")
    # a one-part split (one feature level) still returns a tuple, which getitem indexes: a list of one name
    many = n_out != 1 or isinstance(vals, (tuple, list))
    outs = [f"{node.name}_{i}" for i in range(n_out)] if many else [node.name]
    ctx.graph.nodes.append(Node(op, inputs, outs, attrs, op_site(node)))
    if not many:
        ctx.graph.values[outs[0]] = value_info(node)
        ctx.names[node] = outs[0]
    else:
        for i, out in enumerate(outs):
            v = vals[i] if isinstance(vals, (tuple, list)) else None
            ctx.graph.values[out] = (
                ValueInfo(static_shape(v), str(v.dtype).replace("torch.", ""))
                if isinstance(v, torch.Tensor) else ValueInfo((), "unknown")
            )
        ctx.names[node] = outs
    return outs


def value_of(ctx: LoweringContext, arg: Any) -> Any:
    """IR value name for an fx node argument (constants are materialised); python values pass through."""
    if isinstance(arg, fx.Node):
        return ctx.names[arg]
    if isinstance(arg, (list, tuple)):
        return type(arg)(value_of(ctx, a) for a in arg)
    return arg


def normalized(node: fx.Node) -> dict[str, Any]:
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


def tensor_operand(ctx: LoweringContext, value: Any, dtype: str = "float32") -> str:
    """A tensor operand: an IR value, or a python scalar made into a 0-d constant of ``dtype`` (the dtype torch
    computes in, so ``ids + 1`` stays integer)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)):
        return ctx.const(torch.tensor(value, dtype=getattr(torch, dtype)), "scalar")
    raise QuantLensError(f"Expected a tensor operand, got {value!r}.")


def _operand_dtype(ctx: LoweringContext, names: list, node: fx.Node) -> str:
    """dtype for python scalars of an op: the other operand's for comparisons, else the result's."""
    out = value_info(node).dtype
    if out != "bool":
        return out
    for v in names:
        if isinstance(v, str) and v in ctx.graph.values:
            return ctx.graph.values[v].dtype
    return "float32"


def generic_rule(op: str, tensor_args: tuple[str, ...], attr_args: tuple[str, ...] = (), n_out: int = 1):
    """Rule: tensor schema args -> inputs ("" for None), listed attr args -> attrs. ``op``'s float meaning must be
    declared in :mod:`quantlens.compiler.op_meanings` (the qat kernel calls that torch op): a rule reads it, it never
    adds one."""
    if op not in TORCH_OPS:
        raise QuantLensError(f"lowering rule for IR op {op!r}: the op has no float meaning in "
                             "quantlens.compiler.op_meanings.TORCH_OPS; declare its torch op there.")

    def rule(ctx: LoweringContext, node: fx.Node) -> None:
        bound = normalized(node)
        values = [value_of(ctx, bound[name]) for name in tensor_args]
        dtype = _operand_dtype(ctx, values, node)
        inputs = []
        for v in values:
            inputs.append("" if v is None else tensor_operand(ctx, v, dtype))
        attrs = {name: jsonable(bound[name]) for name in attr_args}
        emit(ctx, node, op, inputs, attrs, n_out)
        if isinstance(bound.get("dtype"), torch.dtype) and "dtype" not in attr_args and n_out == 1:
            _cast_result(ctx, node, bound["dtype"])  # cumsum(..., dtype=torch.int32): the IR op keeps its input's

    return rule


def _cast_result(ctx: LoweringContext, node: fx.Node, dtype: torch.dtype) -> None:
    """The last emitted node computes in its input's dtype; a ``cast`` to the aten op's ``dtype`` argument makes
    the node's value (its IR name and value info stay the aten node's)."""
    emitted = ctx.graph.nodes[-1]
    inner = ctx.fresh(f"{node.name}_uncast")
    emitted.outputs[0] = inner
    info = ctx.graph.values[node.name]
    ctx.graph.values[inner] = ValueInfo(info.shape, value_info(node.args[0]).dtype if isinstance(node.args[0], fx.Node)
                                        else info.dtype)
    ctx.graph.nodes.append(Node("cast", [inner], [node.name], {"dtype": str(dtype).replace("torch.", "")},
                                op_site(node)))


def jsonable(value: Any) -> Any:
    """An aten argument as an IR attr: dtypes by name, lists as lists, a SymInt as its static dim (or -1)."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.SymInt):
        return dim_or_batch(value)
    return value


def register_lowering(targets, rule) -> None:
    """Make ``rule`` the lowering of one aten overload or of each of a list of them."""
    _lowering(*(targets if isinstance(targets, (list, tuple)) else (targets,)))(rule)
