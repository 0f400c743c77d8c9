"""The IR interpreter: run nodes in order with a kernel registry chosen by the module kind.

* qat IR kernels (``QAT_KERNELS`` + the generic rule) call the torch op that defines the IR op's float
  semantics, so the qat IR computes exactly what the exported model computed;
* quantized IR kernels are the integer kernels of ``quantlens.kernels.integer`` (integer arithmetic of
  ``docs/march.md``), adapted to IR nodes by ``kernels_int.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from quantlens._registry import make_registry
from quantlens.compiler.host_ops import call_host_aten
from quantlens.compiler.ir import Graph, Module, Node
from quantlens.compiler.lowering import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.kernels import TABLE_OP_IO, table_torch_op
from quantlens.kernels.integer import call_op
from quantlens.march.numerics import fake_quant_range
from quantlens.march.opset import IR_OPS
from quantlens.march.semantics import select_by_attrs

__all__ = ["run_graph", "run_nodes", "RunHooks", "QAT_KERNELS", "qat_kernel", "call_torch_op", "check_ops"]

#: qat IR op -> its kernel (``Node, inputs -> outputs``)
QAT_KERNELS, qat_kernel = make_registry("qat IR kernel for op")


def call_torch_op(torch_op, node: Node, inputs: list) -> Any:
    """Call an aten/custom op with the node's inputs (tensor schema args, in order) and attrs (the rest)."""
    return call_op(torch_op, node.attrs, inputs)


@qat_kernel("topk", "sort")
def _ordered(node: Node, inputs: list):
    return list(select_by_attrs(node.op, inputs[0], node.attrs))  # the march's tie order (docs/march.md §11.1)


@qat_kernel("host_aten")
def _host_aten(node: Node, inputs: list):
    return call_host_aten(node.attrs, inputs, node.site)


@qat_kernel("fake_quant")
def _fake_quant(node: Node, inputs: list):
    # numerics' function rather than the custom op: the same bits, without the op's dispatch in eager runs
    a = node.attrs
    return fake_quant_range(inputs[0], inputs[1], a["qmin"], a["qmax"], a.get("axis", -1))


@qat_kernel("split")
def _split(node: Node, inputs: list):
    return list(torch.split(inputs[0], node.attrs["sizes"], dim=node.attrs["dim"]))


@qat_kernel("slice")
def _slice(node: Node, inputs: list):
    a = node.attrs
    index = [slice(None)] * inputs[0].dim()
    index[a["dim"]] = slice(a["start"], a["end"], a["step"])
    return inputs[0][tuple(index)]


@qat_kernel("select")
def _select(node: Node, inputs: list):
    return inputs[0].select(node.attrs["dim"], node.attrs["index"])


@qat_kernel("index")
def _index(node: Node, inputs: list):
    return torch.ops.aten.index.Tensor(inputs[0], list(inputs[1:]))


@qat_kernel("embedding")
def _embedding(node: Node, inputs: list):
    """A table lookup; ids outside the table are refused by name (torch's own error is an IndexError that names
    neither the op site nor the input)."""
    table, ids = inputs[0], inputs[1]
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= table.shape[0]:
            bad = high if high >= table.shape[0] else low
            raise QuantLensError(
                f"op site '{node.site}' (embedding): id {bad} is outside the table of {table.shape[0]} rows; its "
                f"ids must lie in [0, {table.shape[0]}). Check the model input that feeds it (token ids from "
                "another tokenizer or vocabulary, or a mask passed in its place).")
    return torch.nn.functional.embedding(ids, table)


@qat_kernel("cast")
def _cast(node: Node, inputs: list):
    return inputs[0].to(getattr(torch, node.attrs["dtype"]))


def qat_dispatch(node: Node, inputs: list) -> Any:
    kernel = QAT_KERNELS.get(node.op)
    if kernel is not None:
        return kernel(node, inputs)
    torch_op = TORCH_OPS.get(node.op)
    if torch_op is None and node.op in TABLE_OP_IO:  # pre_export's table ops: their custom op, always registered
        torch_op = table_torch_op(node.op)
    if torch_op is None:
        raise QuantLensError(f"qat IR: no kernel for op '{node.op}' (op site '{node.site}').")
    return call_torch_op(torch_op, node, inputs)


@dataclass
class RunHooks:
    """The interpreter's public hooks (what the profiler builds on):

    * ``observer(node, inputs, outputs)``: called after every node;
    * ``override(node, inputs) -> outputs | None``: a per-node kernel override; a non-``None`` result is used
      instead of the node's kernel (which then does not run);
    * ``substitute(node, inputs, outputs) -> outputs | None``: per-node output substitution after the kernel ran;
      a non-``None`` result replaces the node's outputs for the rest of the run.
    """

    observer: Callable | None = None
    override: Callable | None = None
    substitute: Callable | None = None


def dispatch_for(module: Module) -> Callable[[Node, list], Any]:
    """The kernel registry of the module's IR kind."""
    if module.kind == "qat":
        return qat_dispatch
    from quantlens.compiler.kernels_int import int_dispatch

    return int_dispatch


def check_ops(module: Module) -> None:
    """Every node's op must be an op of the module's IR kind in the op set (docs/ops.md)."""
    allowed = ("qat", "both") if module.kind == "qat" else ("quantized", "both")
    for node in module.graph.nodes:
        op = IR_OPS.get(node.op)
        if op is None or (op.level not in allowed and not node.attrs.get("host")):
            raise QuantLensError(
                f"{module.kind} IR: op '{node.op}' (op site '{node.site}') is not an op of a {module.kind} IR in "
                "quantlens.march.opset (docs/ops.md lists them); the file or graph was made by another quantlens "
                "version or edited by hand. Export it again."
            )


def _outputs(node: Node, result: Any) -> list:
    outs = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(outs) != len(node.outputs):
        raise QuantLensError(
            f"IR kernel for '{node.op}' returned {len(outs)} outputs, expected {len(node.outputs)} "
            f"(op site '{node.site}')."
        )
    return outs


def run_nodes(module: Module, nodes: list[Node], env: dict[str, Any]) -> dict[str, Any]:
    """Evaluate ``nodes`` (a part of the module's graph, in order) on the values in ``env``, which is updated
    with their outputs and returned. Every input must be in ``env`` or a constant."""
    dispatch = dispatch_for(module)
    with torch.no_grad():
        for node in nodes:
            inputs = [(env[name] if name in env else module.graph.constants[name]) if name else None
                      for name in node.inputs]
            for name, value in zip(node.outputs, _outputs(node, dispatch(node, inputs))):
                env[name] = value
    return env


def run_graph(module: Module, feeds: dict[str, torch.Tensor], observer: Callable | None = None,
              hooks: RunHooks | None = None) -> list:
    graph: Graph = module.graph
    hooks = hooks or RunHooks(observer=observer)
    if observer is not None and hooks.observer is None:
        hooks.observer = observer
    env: dict[str, Any] = dict(graph.constants)
    for name in graph.inputs:
        if name not in feeds:
            raise QuantLensError(f"IR input '{name}' was not given; inputs are {graph.inputs}.")
        env[name] = feeds[name]
    dispatch, free_after = _run_plan(module)
    with torch.no_grad():
        for node, free in zip(graph.nodes, free_after):
            inputs = [env[name] if name else None for name in node.inputs]
            result = hooks.override(node, inputs) if hooks.override is not None else None
            outs = _outputs(node, dispatch(node, inputs) if result is None else result)
            if hooks.substitute is not None:
                replaced = hooks.substitute(node, inputs, outs)
                if replaced is not None:
                    outs = _outputs(node, replaced)
            for name, value in zip(node.outputs, outs):
                env[name] = value
            if hooks.observer is not None:
                hooks.observer(node, inputs, outs)
            for name in free:
                env.pop(name, None)
    return [env[name] for name in graph.outputs]


def _graph_signature(module: Module) -> tuple:
    """What a run plan depends on: the kind, the graph object, each node (identity, op, host flag, inputs and
    outputs), the graph outputs and the constants' names. Any edit of those makes a new plan."""
    graph = module.graph
    return (module.kind, id(graph), id(graph.nodes),
            [(id(n), n.op, n.attrs.get("host"), tuple(n.inputs), tuple(n.outputs)) for n in graph.nodes],
            tuple(graph.outputs), tuple(graph.constants))


def _run_plan(module: Module) -> tuple[Callable, list[list[str]]]:
    """The module's run plan, cached on it: the op check done, its dispatch, and per node the values to free after
    it (their last use: memory stays bounded by the live set, not the whole network)."""
    signature = _graph_signature(module)
    cached = module.__dict__.get("_run_plan_cache")
    if cached is not None and cached[0] == signature:
        return cached[1], cached[2]
    check_ops(module)
    graph = module.graph
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_use[name] = i
    keep = set(graph.outputs) | set(graph.constants)
    free_after = [[name for name in dict.fromkeys(node.inputs) if name and last_use.get(name) == i and name not in keep]
                  for i, node in enumerate(graph.nodes)]
    dispatch = dispatch_for(module)
    module.__dict__["_run_plan_cache"] = (signature, dispatch, free_after)
    return dispatch, free_after


@qat_kernel("pad")
def _pad(node: Node, inputs: list):
    a = node.attrs
    return torch.nn.functional.pad(inputs[0], a["pad"], mode=a["mode"],
                                   value=a["value"] if a["mode"] == "constant" else None)


@qat_kernel("batch_norm")
def _batch_norm(node: Node, inputs: list):
    x, weight, bias, mean, var = inputs
    return torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, node.attrs["eps"])
