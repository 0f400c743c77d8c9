"""The quantlens IR's data: a flat list of nodes over named values, plus constants.

One data model serves both IR kinds:

* the **qat IR** (``kind="qat"``): float ops and ``fake_quant`` nodes, the semantics of the prepared model;
* the **quantized IR** (``kind="quantized"``): integer ops only, ``quantize``/``dequantize`` at the boundary.

A node is ``(op, inputs, outputs, attrs, site)``: ``inputs``/``outputs`` name values, ``attrs`` hold
JSON-serialisable parameters, and ``site`` is the op site name of the torch op it came from (see
``docs/architecture.md``), so the profiler can match IR nodes with torch op sites. Op semantics are listed in
``docs/ir.md``; what an op means in float is declared in ``op_meanings``, its kernels live in registries
(``kernels_qat``, ``kernels_int``), never in if-chains.

This module holds data only, so the interpreter, the lowering and the runnable :class:`~quantlens.compiler.ir.Module`
(which calls the interpreter) all build on it without importing one another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

__all__ = ["IR_VERSION", "Node", "ValueInfo", "Graph", "InputLeaf", "KernelFn", "RunnableIR"]

#: the version of the IR data model that ``save`` writes and ``load`` reads (a newer file is refused)
IR_VERSION = 1


@dataclass
class Node:
    """One IR operation: ``outputs = op(inputs)`` with ``attrs``, from the torch op at op site ``site``."""

    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    site: str = ""

    def __repr__(self) -> str:
        ins = ", ".join(self.inputs)
        outs = ", ".join(self.outputs)
        return f"{outs} = {self.op}({ins}) {self.attrs if self.attrs else ''} @{self.site}"


@dataclass
class ValueInfo:
    """Static type of a value: shape, storage dtype (torch dtype name) and, in the quantized IR, its scale."""

    shape: tuple[int, ...]
    dtype: str
    qdtype: str | None = None  # "qint8" / "qint16" / "qint32" for integer values of the quantized IR
    scale: str | None = None  # name of the scale constant (per-tensor or per-channel)
    axis: int | None = None


@dataclass
class InputLeaf:
    """One leaf of the model's input pytree: a tensor graph input, or a non-tensor value fixed at export."""

    kind: str  # "tensor" or "const"
    name: str | None = None  # graph input name for tensors
    value: Any = None  # the specialised value for consts


@dataclass
class Graph:
    """The nodes in run order, the graph's input and output value names, its constants and every value's type."""

    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    constants: dict[str, torch.Tensor]
    values: dict[str, ValueInfo]

    def producers(self) -> dict[str, Node]:
        """Value name -> the node that computes it."""
        return {out: node for node in self.nodes for out in node.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        """Value name -> the nodes that read it, in run order."""
        result: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    result.setdefault(name, []).append(node)
        return result


KernelFn = Callable[[Node, list, "Graph"], Any]


class RunnableIR(Protocol):
    """What the interpreter reads of an IR module (:class:`quantlens.compiler.ir.Module` is one): its kind, which
    picks the kernel table, and its graph. A protocol, so the interpreter needs no import of the module class that
    calls it."""

    kind: str
    graph: Graph
