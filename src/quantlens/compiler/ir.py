"""The quantlens IR: a flat list of nodes over named values, plus constants.

One data model serves both IR kinds:

* the **qat IR** (``kind="qat"``): float ops and ``fake_quant`` nodes, the semantics of the prepared model;
* the **quantized IR** (``kind="quantized"``): integer ops only, ``quantize``/``dequantize`` at the boundary.

A node is ``(op, inputs, outputs, attrs, site)``: ``inputs``/``outputs`` name values, ``attrs`` hold
JSON-serialisable parameters, and ``site`` is the op site name of the torch op it came from (see
``docs/architecture.md``), so the profiler can match IR nodes with torch op sites. Op semantics are listed in
``docs/ir.md``; kernels live in registries (``kernels_qat``, ``kernels_int``), never in if-chains.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError

__all__ = ["IR_VERSION", "Node", "ValueInfo", "Graph", "Module", "InputLeaf"]

IR_VERSION = 1


@dataclass
class Node:
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
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    constants: dict[str, torch.Tensor]
    values: dict[str, ValueInfo]

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        result: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    result.setdefault(name, []).append(node)
        return result


KernelFn = Callable[[Node, list, "Graph"], Any]


class Module:
    """A runnable IR model. Call it like the torch model it came from (same input pytree, non-tensor leaves
    equal to the exported ones), or with the tensors alone, by input name: ``module(image=..., meta=...)``."""

    def __init__(
        self,
        kind: str,
        graph: Graph,
        input_leaves: list[InputLeaf],
        input_spec: str,
        output_spec: str,
        meta: dict[str, Any] | None = None,
    ):
        if kind not in ("qat", "quantized"):
            raise QuantLensError(f"IR kind must be 'qat' or 'quantized', got {kind!r}.")
        self.kind = kind
        self.graph = graph
        self.input_leaves = input_leaves
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.meta = dict(meta or {})

    # -- calling -----------------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return list(self.graph.inputs)

    def _feeds_from_call(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        if kwargs and not args and set(kwargs) <= set(self.graph.inputs):
            missing = [n for n in self.graph.inputs if n not in kwargs]
            if missing:
                raise QuantLensError(
                    f"IR model called by input name is missing {missing}; its inputs are {self.graph.inputs}."
                )
            return dict(kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        expected = pytree.treespec_loads(self.input_spec)
        if spec != expected:
            deployed = self._deployment_spec()
            if spec == deployed:  # the deployment format: the same structure without the non-tensor leaves
                tensors = iter(leaves)
                leaves = [next(tensors) if info.kind == "tensor" else info.value for info in self.input_leaves]
                spec = expected
        if spec != expected or len(leaves) != len(self.input_leaves):
            raise QuantLensError(
                "The IR model was exported for inputs of structure "
                f"{expected} but was called with {spec}. Call it with the same structure as at export, or "
                f"with the tensors alone by input name: {self.graph.inputs}."
            )
        feeds = {}
        for i, (leaf, info) in enumerate(zip(leaves, self.input_leaves)):
            if info.kind == "tensor":
                if not isinstance(leaf, torch.Tensor):
                    raise QuantLensError(f"IR input '{info.name}' must be a tensor, got {type(leaf).__name__}.")
                feeds[info.name] = leaf
            elif not _same_const(leaf, info.value):
                raise QuantLensError(
                    f"Non-tensor input leaf #{i} was {info.value!r} at export and is {leaf!r} now. The IR is "
                    "specialised for the exported value (e.g. the task list picks a branch); export again "
                    "with this value, or pass the tensors alone by input name."
                )
        return feeds

    def _deployment_spec(self):
        """The input structure without its non-tensor leaves (seed 2.3.2's deployment format): a task list is
        dropped, a dict loses its non-tensor entries, containers left empty disappear."""
        marker = object()
        tree = pytree.tree_unflatten([None if leaf.kind == "tensor" else marker for leaf in self.input_leaves],
                                     pytree.treespec_loads(self.input_spec))
        return pytree.tree_flatten(_prune(tree, marker))[1]

    def run(self, feeds: dict[str, torch.Tensor], observer: Callable | None = None, hooks: Any = None
            ) -> list[torch.Tensor]:
        """Run the graph on named inputs; returns the flat outputs. ``observer(node, inputs, outputs)`` is called
        after every node; ``hooks`` (:class:`~quantlens.compiler.interpreter.RunHooks`) adds per-node kernel
        override and output substitution (the profiler's hooks)."""
        from quantlens.compiler.interpreter import run_graph

        return run_graph(self, feeds, observer, hooks)

    def __call__(self, *args, **kwargs):
        feeds = self._feeds_from_call(args, kwargs)
        flat = self.run(feeds)
        return pytree.tree_unflatten(flat, pytree.treespec_loads(self.output_spec))

    # -- inspection ----------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, int]:
        """Op counts by ``op`` and, for integer ops, ``op[dtype]`` (requantize ops included)."""
        counts: Counter = Counter()
        for node in self.graph.nodes:
            counts[node.op] += 1
            out = self.graph.values.get(node.outputs[0]) if node.outputs else None
            if out is not None and out.qdtype:
                counts[f"{node.op}[{out.qdtype}]"] += 1
        return dict(sorted(counts.items()))

    def __repr__(self) -> str:
        lines = [f"quantlens IR ({self.kind}), inputs {self.graph.inputs} -> outputs {self.graph.outputs}"]
        lines += [f"  {node!r}" for node in self.graph.nodes]
        return "\n".join(lines)


_EMPTY = object()


def _prune(tree: Any, marker: object) -> Any:
    """``tree`` without the leaves that are ``marker`` (and without containers that end up empty, except the
    top-level (args, kwargs) pair and its args tuple)."""
    def walk(node, top=False):
        if node is marker:
            return _EMPTY
        if isinstance(node, dict):
            kept = {k: walk(v) for k, v in node.items()}
            kept = {k: v for k, v in kept.items() if v is not _EMPTY}
            return kept if kept or top else _EMPTY
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            kept = [v for v in (walk(x) for x in node) if v is not _EMPTY]
            return type(node)(kept) if kept or top else _EMPTY
        return node

    args, kwargs = tree
    return walk(args, top=True), walk(kwargs, top=True)


def _same_const(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b
