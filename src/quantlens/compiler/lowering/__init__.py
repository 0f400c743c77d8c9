"""Lowering a ``torch.export`` graph (aten ops) to the qat IR op set (``docs/ir.md``).

One registry maps each supported aten overload to a lowering rule. Most rules are generic: tensor arguments
become node inputs and the other arguments become attributes, named as in the aten schema. Shape ops are
normalised (``view``/``flatten``/``squeeze``/``unsqueeze`` -> ``reshape``, ``transpose``/``t`` -> ``permute``),
scalars become constants, and every subgraph that depends only on constants (BatchNorm folding, position ids)
is folded at export. An aten op with no rule is an error naming the op, its op site and the user's source line.

The rules live in one registry (:mod:`.rules`: ``LOWERINGS``), filled by :mod:`.compute`, :mod:`.movement`,
:mod:`.forms`, :mod:`.recurrence` and this module, the driver. What each IR op means in float is not theirs to say:
they read the static table of :mod:`quantlens.compiler.op_meanings` (``TORCH_OPS``, re-exported here).
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx
from torch.utils import _pytree as pytree

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant)
from quantlens.compiler.graph import Graph, Node, ValueInfo
from quantlens.compiler.host_ops import encode_call
from quantlens.compiler.lowering import compute, forms, recurrence  # noqa: F401 (fill LOWERINGS)
from quantlens.compiler.lowering.movement import lower_quantlens_op, require_static_dim
from quantlens.compiler.lowering.rules import (
    LOWERINGS,
    LoweringContext,
    aten,
    emit,
    generic_rule,
    normalized,
    op_site,
    register_lowering,
    static_shape,
    user_source,
    value_info,
    value_of,
)
from quantlens.compiler.op_meanings import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS, Category

__all__ = ["lower_exported_program", "decompose_unlowered", "LOWERINGS", "TORCH_OPS"]


def _unlowered(ep: torch.export.ExportedProgram, functional: bool = False) -> set:
    """The aten ops of ``ep`` with no lowering rule; ``functional``: each in-place op (``add_``) as the functional op
    (``add``) that functionalization makes of it."""
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
           and n.target.namespace == "aten" and _reads_a_node(n) and not _is_symbolic(n)}  # (shape math: not lowered)
    if functional:
        ops = {_functional_form(op) for op in ops}
    return {op for op in ops if op not in LOWERINGS}


def _functional_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    name = op._overloadpacket.__name__
    if not (op._schema.is_mutable and name.endswith("_")):
        return op
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, op._overloadname, op) if packet is not None else op


def _reads_a_node(node: fx.Node) -> bool:
    """Whether an op reads another node; one that does not (``zeros``, ``full``: an LSTM's initial state) is folded
    to a constant by lowering, so decomposing it would only cost a full retrace (each ``run_decompositions`` traces
    the whole graph again)."""
    return any(isinstance(a, fx.Node) for a in pytree.tree_leaves((node.args, node.kwargs)))


def decompose_unlowered(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Functionalize ``ep`` (in-place ops such as ``x += y``, ``x[:, 0] = 0``, ``clamp_`` become their functional
    forms) and decompose every aten op that has no lowering rule with torch's own decomposition tables (core ATen
    first, then torch's full table), until each op lowers or has no decomposition (then lowering refuses it, naming
    it). The decomposed nodes keep the op site of the op they replace (torch.export carries node metadata through).

    Each ``run_decompositions`` retraces the whole program (6 s for the sentence transformer here), so the first
    one both functionalizes and decomposes the ops the exported program already shows; a later one runs only when
    a decomposition produced another op without a rule."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    tables = (core_aten_decompositions(), decomposition_table)
    tried: set = set()
    unlowered = _unlowered(ep, functional=True)
    if _already_functional(ep) and not any(op in t or _composite(op) for op in unlowered for t in tables):
        return ep  # nothing to functionalize or decompose: the retrace would rebuild the same graph (2/3 of export)
    for round_ in range(8):  # a decomposition may produce ops that decompose further
        todo = {}
        for op in unlowered - tried:
            fn = next((t[op] for t in tables if op in t), None)
            # an op whose decomposition leaves prims ops (cumprod's reference: a window of prims.prod) stays whole:
            # no lowering knows prims, so it would reach the host in pieces that torch's ONNX exporter cannot write
            if fn is not None and not _leaves_prims(ep, op, fn):
                todo[op] = fn
        if round_ and not todo:
            break
        tried |= set(todo)
        ep = ep.run_decompositions(todo)  # (the first call, even with an empty table, functionalizes)
        unlowered = _unlowered(ep)
    return ep


def _leaves_prims(ep: torch.export.ExportedProgram, op, fn) -> bool:
    """Whether ``fn``, the decomposition of ``op``, traced on the shapes of one of its nodes, leaves a prims op or
    an in-place op (False when it cannot be traced there: the decomposition is then tried as before)."""
    if fn is None:
        return False
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    node = next((n for n in ep.graph.nodes if n.op == "call_function" and n.target is op), None)
    if node is None:
        return False
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    try:
        with detect_fake_mode((args, kwargs)) or contextlib.nullcontext():
            graph = make_fx(lambda *a: fn(*a, **kwargs))(*args).graph
    except Exception:  # noqa: BLE001 - a decomposition that does not trace alone is tried in the program
        return False
    # (a decomposition that writes in place, polar's ``result.real = ...``, is no functional graph after
    # functionalization: the op is then kept whole, a host op)
    return any(getattr(n.target, "namespace", None) == "prims"
               or (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)
               for n in graph.nodes if n.op == "call_function")


def _composite(op) -> bool:
    """An op torch decomposes whenever a program is traced again (``movedim`` into ``permute``)."""
    return op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def _already_functional(ep: torch.export.ExportedProgram) -> bool:
    """No in-place or out= op, no higher-order op and no buffer mutation: what functionalization would change."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
            return False
    signature = ep.graph_signature
    return not signature.buffers_to_mutate and not getattr(signature, "user_inputs_to_mutate", None)


# Nodes that only depend on constants are evaluated at export (BatchNorm folding, position ids, masks).
_NEVER_FOLD = {"fake_quant"}


def _try_fold(ctx: LoweringContext, node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    if getattr(node.target, "namespace", None) == "quantlens":
        return False
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return False  # a random draw (ViT-MAE's masking noise, a VAE's sample) is drawn at every run, not once
    if _known_args(ctx, (node.args, node.kwargs)) is not False:  # constants only (no known value)
        return False
    result = node.target(*_known_value(ctx, node.args), **{k: _known_value(ctx, v) for k, v in node.kwargs.items()})
    return _store_folded(ctx, node, result)


def _store_folded(ctx: LoweringContext, node: fx.Node, result) -> bool:
    """``node``'s folded result as constant(s); False when it is not a tensor or a sequence of them."""
    if isinstance(result, torch.Tensor):
        ctx.names[node] = ctx.const(result, "folded")
    elif isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        ctx.names[node] = [ctx.const(r, "folded") for r in result]
    else:
        return False
    return True


# Values computable at export that pass through fake quants (rotary tables: cos(fq(positions @ inv_freq)), ALiBi
# slopes, a parametrized weight): a fake quant of a constant, and a data move of such a value, stay in the graph
# (their consumers need to know the value is on a grid) and their value is also known; an op computing from known
# values only is folded to a constant (its own output fake quant follows it, as in the QAT model).
_KEEP_WHEN_KNOWN = {Category.MOVEMENT, Category.LOOKUP, Category.INDEX, Category.QUANTIZER, Category.BOUNDARY}


def _known_args(ctx: LoweringContext, args) -> bool | None:
    """None: an argument is computed at run time; else whether one of them (all constant or known) is known."""
    found = False
    for a in pytree.tree_leaves(args):
        if not isinstance(a, fx.Node):
            continue
        names = ctx.names.get(a)
        for name in names if isinstance(names, list) else [names]:
            if name in ctx.known:
                found = True
            elif not ctx.is_const(name):
                return None
    return found


def _known_value(ctx: LoweringContext, arg):
    if isinstance(arg, fx.Node):
        names = ctx.names[arg]
        pick = lambda n: ctx.known[n] if n in ctx.known else ctx.graph.constants[n]  # noqa: E731
        return [pick(n) for n in names] if isinstance(names, list) else pick(names)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_known_value(ctx, a) for a in arg)
    return arg


def _rule_on_constants(ctx: LoweringContext, node: fx.Node, rule) -> None:
    """A fake quant (or table op) of known values reads them as constants: a weight split into q/k/v, sliced or
    transposed before its fake quant is then quantized by convert as the constant it is, whatever moved it."""
    swapped = {}
    for arg in pytree.tree_leaves((node.args, node.kwargs)):
        name = ctx.names.get(arg) if isinstance(arg, fx.Node) else None
        if isinstance(name, str) and name in ctx.known and arg not in swapped:
            swapped[arg] = name
            ctx.names[arg] = ctx.const(ctx.known[name], "folded")
    try:
        rule(ctx, node)
    finally:
        ctx.names.update(swapped)


def _lower_known(ctx: LoweringContext, node: fx.Node, rule) -> bool:
    """Lower or fold ``node`` when its inputs are constants and known values (see above); False: not such a node."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    known = _known_args(ctx, (node.args, node.kwargs))
    if known is None or not (known or getattr(node.target, "namespace", None) == "quantlens"):
        return False  # computed at run time, or constants only (plain folding's job, or a table op's)
    result = node.target(*_known_value(ctx, node.args), **{k: _known_value(ctx, v) for k, v in node.kwargs.items()})
    first = len(ctx.graph.nodes)
    if rule is not None:
        if getattr(node.target, "namespace", None) == "quantlens":
            _rule_on_constants(ctx, node, rule)
        else:
            rule(ctx, node)
        emitted = ctx.graph.nodes[first:]
        if all(n.op in IR_OPS and IR_OPS[n.op].category in _KEEP_WHEN_KNOWN for n in emitted):
            names = ctx.names[node]
            for name, value in zip(names if isinstance(names, list) else [names],
                                   result if isinstance(result, (tuple, list)) else [result]):
                if isinstance(value, torch.Tensor):
                    ctx.known[name] = value
            return True
        del ctx.graph.nodes[first:]
    if not _store_folded(ctx, node, result):
        raise QuantLensError(f"export: op {node.target} at op site '{op_site(node) or '<unknown>'}' ({user_source(node)}) "
                             "computes from constants only but returned no tensor; please report this.")
    return True


def lower_exported_program(ep: torch.export.ExportedProgram, input_names: list[str],
                           host_sites: frozenset[str] = frozenset()) -> Graph:
    """Lower an exported program whose user inputs are flat tensors named ``input_names``. An op with no lowering
    rule at one of ``host_sites`` (after the DeQuantStub) becomes a float ``host_aten`` node."""
    graph = Graph(nodes=[], inputs=list(input_names), outputs=[], constants={}, values={})
    ctx = LoweringContext(graph)
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
                graph.values[input_names[idx]] = value_info(node)
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
            rule = lower_quantlens_op
        if _lower_known(ctx, node, rule):
            continue
        if rule is None and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace != "quantlens":
            # the march has no integer rule: the op runs on the host in float (the partition), whether torch's
            # (aten, prims) or a library's custom operator (transformers' grouped_mm_fallback)
            rule = _host_aten
        if rule is None:
            raise QuantLensError(
                f"export: the op {node.target} is not supported by the quantlens IR (op site "
                f"'{op_site(node) or '<unknown>'}', {user_source(node)}). Supported ops are listed in docs/ir.md; "
                "rewrite that line with supported ops, or keep it outside the exported model (e.g. in "
                "post-processing)."
            )
        _lower_or_host(ctx, node, rule)
    _drop_dead(graph)
    undeclared = sorted({n.op for n in graph.nodes if n.op not in IR_OPS or IR_OPS[n.op].level == "quantized"})
    if undeclared:  # a lowering rule emitted an op the op set does not declare: a quantlens bug, not the user's
        raise QuantLensError(f"export: lowering produced IR ops {undeclared} that quantlens.march.opset does not declare "
                             "as qat IR ops; please report this.")
    return graph


def _lower_or_host(ctx: LoweringContext, node: fx.Node, rule) -> None:
    """Lower ``node`` by its rule; a form the rule cannot express in the IR (a bitwise and of int32 tensors, where
    the IR has logical ops on bool masks) runs on the host instead, as an op with no rule does. Only an aten op
    whose arguments the host node can record falls back; any other refusal stands (its words say why)."""
    first, names = len(ctx.graph.nodes), dict(ctx.names)
    try:
        rule(ctx, node)
    except QuantLensError:
        if rule is _host_aten or not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace in (
                "quantlens",) or _reads_symbolic(node):
            raise
        del ctx.graph.nodes[first:]
        ctx.names.clear()
        ctx.names.update(names)
        _host_aten(ctx, node)


def _reads_symbolic(node: fx.Node) -> bool:
    """Whether an argument is shape math on the dynamic batch (the host node records plain values only)."""
    return any(isinstance(a, fx.Node) and _is_symbolic(a) for a in pytree.tree_leaves((node.args, node.kwargs)))


def _host_aten(ctx: LoweringContext, node: fx.Node) -> None:
    inputs, attrs = encode_call(node, lambda a: value_of(ctx, a))
    attrs["host"] = True
    emit(ctx, node, "host_aten", inputs, attrs, n_out=len(node.meta["val"]) if isinstance(
        node.meta.get("val"), (tuple, list)) else 1)


_SHAPE_ASSERTS = {"_assert_scalar", "sym_constrain_range_for_size", "_assert_tensor_metadata"}


def _is_symbolic(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return True
    return getattr(node.target, "__name__", "").split(".")[0] in _SHAPE_ASSERTS or (
        node.op == "call_function" and val is None and str(node.target).split(".")[-2:-1] == ["_assert_scalar"]
    )


def _output_name(ctx: LoweringContext, out: fx.Node) -> str:
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
    # every output of a kept node keeps its type, read or not (topk's indices after `.values`): the quantized IR
    # and the saved file then describe it, rather than a value of unknown type that load refuses
    produced = {o for node in graph.nodes for o in node.outputs}
    graph.values = {k: v for k, v in graph.values.items() if k in live or k in produced or k in graph.inputs}


# -- padding, standalone batch norm, prelu / leaky_relu, relu6, functionalized in-place writes -----------------
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "replicate"}


def _pad(ctx, node):
    """``F.pad`` and the aten pads it becomes: one ``pad`` op ``{pad, mode, value}`` (``docs/march.md`` §11)."""
    bound = normalized(node)
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
            f"export: pad mode {mode!r} at op site '{op_site(node)}' ({user_source(node)}) is not supported; the march "
            f"pads with a constant, by reflection or by replication ({sorted(_PAD_MODES)})."
        )
    emit(ctx, node, "pad", [value_of(ctx, bound.get("self", bound.get("input")))],
          {"pad": [int(p) for p in pad], "mode": mode, "value": float(value or 0.0)})


register_lowering([aten.pad.default, aten.constant_pad_nd.default, aten.reflection_pad1d.default,
           aten.reflection_pad2d.default, aten.replication_pad1d.default, aten.replication_pad2d.default], _pad)


def _batch_norm(ctx, node):
    """A BatchNorm that export sees (one not folded into a conv/linear at prepare): ``batch_norm`` with its
    statistics as constant inputs. ``_native_batch_norm_legit_no_training`` has three outputs; only the first
    is a value."""
    bound = normalized(node)
    names = [value_of(ctx, bound[k]) if bound[k] is not None else ""
             for k in ("input", "weight", "bias", "running_mean", "running_var")]
    if bound.get("training"):
        raise QuantLensError(f"export: BatchNorm at op site '{op_site(node)}' ({user_source(node)}) runs in training "
                             "mode; call model.eval() before export.")
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    out = node.name
    ctx.graph.nodes.append(Node("batch_norm", names, [out], {"eps": float(bound["eps"])}, op_site(node)))
    ctx.graph.values[out] = ValueInfo(static_shape(first), str(first.dtype).replace("torch.", ""))
    ctx.names[node] = [out, out, out] if isinstance(val, (tuple, list)) else out


register_lowering([aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default], _batch_norm)
register_lowering(aten.prelu.default, generic_rule("prelu", ("self", "weight")))
register_lowering(aten._prelu_kernel.default, generic_rule("prelu", ("self", "weight")))
register_lowering(aten.leaky_relu.default, generic_rule("leaky_relu", ("self",), ("negative_slope",)))


def _relu6(ctx, node):
    emit(ctx, node, "hardtanh", [value_of(ctx, node.args[0])], {"min_val": 0.0, "max_val": 6.0})


register_lowering(aten.relu6.default, _relu6)
register_lowering([aten.fill.Scalar], generic_rule("fill", ("self",), ("value",)))


def _fill_tensor(ctx, node):
    value = value_of(ctx, node.args[1])
    if not ctx.is_const(value):
        raise QuantLensError(f"export: op site '{op_site(node)}' ({user_source(node)}) writes a computed value into a "
                             "tensor; the IR writes constants only (x[...] = 0.5).")
    emit(ctx, node, "fill", [value_of(ctx, node.args[0])], {"value": float(ctx.graph.constants[value])})


register_lowering(aten.fill.Tensor, _fill_tensor)


def _scatter(op: str, attrs: tuple[str, ...]):
    generic = generic_rule(op, ("self", "src"), attrs)

    def rule(ctx, node):
        shape = value_info(node.args[0]).shape
        bound = normalized(node)
        dim = bound["dim"] % len(shape)
        require_static_dim(node, shape, dim)
        generic(ctx, node)
        ctx.graph.nodes[-1].attrs["dim"] = dim
        if op == "slice_scatter":  # normalise start/end like slice
            a = ctx.graph.nodes[-1].attrs
            a["start"], a["end"], a["step"] = slice(a["start"], a["end"], a["step"]).indices(shape[dim])
        elif op == "select_scatter":
            ctx.graph.nodes[-1].attrs["index"] = bound["index"] % shape[dim]

    return rule


register_lowering(aten.select_scatter.default, _scatter("select_scatter", ("dim", "index")))
register_lowering(aten.slice_scatter.default,
          _scatter("slice_scatter", ("dim", "start", "end", "step")))


def _copy(ctx, node):
    """Functional ``copy(dst, src)`` (an in-place write after functionalization): the value is ``src``, broadcast
    to ``dst``'s shape and cast to its dtype."""
    dst, src = node.args[0], node.args[1]
    value = value_of(ctx, src)
    if value_info(src).shape != value_info(dst).shape:
        name = ctx.fresh("copy_expand")
        ctx.graph.nodes.append(Node("expand", [value], [name], {"shape": list(value_info(dst).shape)}, op_site(node)))
        ctx.graph.values[name] = ValueInfo(value_info(dst).shape, value_info(src).dtype)
        value = name
    if value_info(src).dtype != value_info(dst).dtype:
        emit(ctx, node, "cast", [value], {"dtype": value_info(dst).dtype})
        return
    ctx.names[node] = value


register_lowering(aten.copy.default, _copy)
