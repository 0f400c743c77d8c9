"""The IR interpreter: run nodes in order with the kernel table of the module's kind.

* qat IR kernels (``kernels_qat``: ``QAT_KERNELS`` + the op meanings of ``op_meanings``) compute the float
  semantics of each op, so the qat IR computes exactly what the exported model computed;
* quantized IR kernels are the integer kernels of ``quantlens.kernels.integer`` (integer arithmetic of
  ``docs/march.md``), adapted to IR nodes by ``kernels_int``.

The interpreter reads the graph data only (:class:`~quantlens.compiler.graph.RunnableIR`); ``Module.run`` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from quantlens.compiler.graph import Graph, Node, RunnableIR
from quantlens.compiler.kernels_int import int_dispatch
from quantlens.compiler.kernels_qat import QAT_KERNELS, call_torch_op, qat_dispatch, qat_kernel
from quantlens.errors import QuantLensError
from quantlens.march.opset import IR_OPS

# (the qat kernel table is re-exported: the interpreter is where users have looked it up)
__all__ = ["run_graph", "run_nodes", "RunHooks", "QAT_KERNELS", "qat_kernel", "qat_dispatch", "call_torch_op",
           "check_ops", "dispatch_for"]


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


def dispatch_for(module: RunnableIR) -> Callable[[Node, list], Any]:
    """The kernel registry of the module's IR kind."""
    return qat_dispatch if module.kind == "qat" else int_dispatch


def check_ops(module: RunnableIR) -> None:
    """Every node's op must be an op of the module's IR kind in the op set (docs/ops.md); a host node, or a node
    a runtime march lowered to its runtime's kernel (attr ``runtime``), may hold any op of the set."""
    allowed = ("qat", "both") if module.kind == "qat" else ("quantized", "both")
    for node in module.graph.nodes:
        op = IR_OPS.get(node.op)
        if op is None or (op.level not in allowed and not node.attrs.get("host") and not node.attrs.get("runtime")):
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


def run_nodes(module: RunnableIR, nodes: list[Node], env: dict[str, Any]) -> dict[str, Any]:
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


def run_graph(module: RunnableIR, feeds: dict[str, torch.Tensor], observer: Callable | None = None,
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


def _graph_signature(module: RunnableIR) -> tuple:
    """What a run plan depends on: the kind, the graph object, each node (identity, op, host flag, inputs and
    outputs), the graph outputs and the constants' names. Any edit of those makes a new plan."""
    graph = module.graph
    return (module.kind, id(graph), id(graph.nodes),
            [(id(n), n.op, n.attrs.get("host"), tuple(n.inputs), tuple(n.outputs)) for n in graph.nodes],
            tuple(graph.outputs), tuple(graph.constants))


def _run_plan(module: RunnableIR) -> tuple[Callable, list[list[str]]]:
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
