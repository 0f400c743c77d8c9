"""The IR interpreter: run nodes in order with a kernel registry chosen by the module kind.

* qat IR kernels (``QAT_KERNELS`` + the generic rule) call the torch op that defines the IR op's float
  semantics, so the qat IR computes exactly what the exported model computed;
* quantized IR kernels live in ``kernels_int.py`` (integer arithmetic of ``docs/march.md``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from quantlens.compiler.ir import Graph, Module, Node
from quantlens.compiler.lowering import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.kernels import TABLE_OP_IO, table_torch_op
from quantlens.opset import IR_OPS

__all__ = ["run_graph", "QAT_KERNELS", "qat_kernel", "call_torch_op"]

QAT_KERNELS: dict[str, Callable[[Node, list], Any]] = {}


def qat_kernel(*ops: str):
    def register(fn):
        for op in ops:
            QAT_KERNELS[op] = fn
        return fn

    return register


_ATTR_ALIASES = {"size": "shape"}


def call_torch_op(torch_op, node: Node, inputs: list) -> Any:
    """Call an aten/custom op with the node's inputs (tensor schema args, in order) and attrs (the rest)."""
    schema = torch_op._schema
    pending = list(inputs)
    kwargs = {}
    for arg in schema.arguments:
        type_text = str(arg.type)
        if type_text.startswith("List[Tensor]") or type_text == "Tensor[]":
            kwargs[arg.name], pending = pending, []
        elif type_text.startswith("Tensor") or type_text.startswith("Optional[Tensor]"):
            kwargs[arg.name] = pending.pop(0) if pending else None
        elif arg.name in node.attrs or _ATTR_ALIASES.get(arg.name) in node.attrs:
            kwargs[arg.name] = node.attrs.get(arg.name, node.attrs.get(_ATTR_ALIASES.get(arg.name)))
    return torch_op(**kwargs)


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


def run_graph(module: Module, feeds: dict[str, torch.Tensor], observer: Callable | None = None) -> list:
    graph: Graph = module.graph
    env: dict[str, Any] = dict(graph.constants)
    for name in graph.inputs:
        if name not in feeds:
            raise QuantLensError(f"IR input '{name}' was not given; inputs are {graph.inputs}.")
        env[name] = feeds[name]
    allowed = ("qat", "both") if module.kind == "qat" else ("quantized", "both")
    for node in graph.nodes:  # the op set says which ops each IR kind may hold (docs/ops.md)
        op = IR_OPS.get(node.op)
        if op is None or (op.level not in allowed and not node.attrs.get("host")):
            raise QuantLensError(
                f"{module.kind} IR: op '{node.op}' (op site '{node.site}') is not an op of a {module.kind} IR in "
                "quantlens.opset (docs/ops.md lists them); the file or graph was made by another quantlens "
                "version or edited by hand. Export it again."
            )
    if module.kind == "qat":
        dispatch = qat_dispatch
    else:
        from quantlens.compiler.kernels_int import int_dispatch

        dispatch = int_dispatch
    # Free each value after its last use: memory stays bounded by the live set, not the whole network.
    last_use: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_use[name] = i
    keep = set(graph.outputs) | set(graph.constants)
    with torch.no_grad():
        for i, node in enumerate(graph.nodes):
            inputs = [env[name] if name else None for name in node.inputs]
            result = dispatch(node, inputs)
            outs = list(result) if isinstance(result, (list, tuple)) else [result]
            if len(outs) != len(node.outputs):
                raise QuantLensError(
                    f"IR kernel for '{node.op}' returned {len(outs)} outputs, expected {len(node.outputs)} "
                    f"(op site '{node.site}')."
                )
            for name, value in zip(node.outputs, outs):
                env[name] = value
            if observer is not None:
                observer(node, inputs, outs)
            for name in node.inputs:
                if name and last_use.get(name) == i and name not in keep:
                    env.pop(name, None)
    return [env[name] for name in graph.outputs]


@qat_kernel("pad")
def _pad(node: Node, inputs: list):
    a = node.attrs
    return torch.nn.functional.pad(inputs[0], a["pad"], mode=a["mode"],
                                   value=a["value"] if a["mode"] == "constant" else None)


@qat_kernel("batch_norm")
def _batch_norm(node: Node, inputs: list):
    x, weight, bias, mean, var = inputs
    return torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, node.attrs["eps"])
