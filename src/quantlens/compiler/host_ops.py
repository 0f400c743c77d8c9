"""Host ops: any operator the march has no integer rule for, in the IR, as ``host_aten`` nodes (the partition,
``docs/march.md`` §12.1).

What the NPU cannot compute runs on the host in float, so no integer rule is asked of it and any op torch.export
captures is fine: an aten or prims op, or a custom operator a library registered with ``torch.library`` (transformers'
``grouped_mm_fallback`` of its mixture-of-experts layers). An op with an IR lowering keeps it (``attrs["host"]``); an
op with none becomes one ``host_aten`` node that names the overload and the call's other arguments:
``{"target": "aten::topk.default", "args": [{"input": 0}, 3], "kwargs": {}}``. Running it looks the overload up among
the operators registered with torch in this process (a data file names an op; it never carries code, and never
makes quantlens import a package): a library's op needs that library imported first, which the error says.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx

from quantlens.errors import QuantLensError

__all__ = ["encode_call", "call_host_aten", "draws_random", "node_draws_random"]

#: an operator's qualified name: ``namespace::name.overload``, identifiers only
_TARGET = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_DTYPE = "dtype"
_INPUT = "input"


def encode_call(node: fx.Node, value_of) -> tuple[list[str], dict[str, Any]]:
    """``(inputs, attrs)`` of a ``host_aten`` node for an fx call of an aten overload; ``value_of(fx_node)`` gives
    the IR value name of a tensor argument."""
    inputs: list[str] = []

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            inputs.append(value_of(a))
            return {_INPUT: len(inputs) - 1}
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if isinstance(a, torch.dtype):
            return {_DTYPE: str(a).replace("torch.", "")}
        if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
            return None  # host ops run on the CPU with default layouts
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise QuantLensError(f"export: host op {node.target} takes an argument of type {type(a).__name__} that the "
                             "IR cannot record.")

    target = node.target
    name = f"{target.namespace}::{target._schema.name.split('::')[-1]}.{target._overloadname}"
    args = [enc(a) for a in node.args]
    kwargs = {k: enc(v) for k, v in node.kwargs.items() if k not in ("device", "layout", "pin_memory",
                                                                       "memory_format")}
    return inputs, {"target": name, "args": args, "kwargs": kwargs}


def aten_overload(target: str, site: str):
    """The operator overload a host node's ``target`` (``"aten::add.Tensor"``) names, registered in this process;
    refused, naming the op site, when it is none."""
    namespace, _, rest = target.partition("::")
    name, _, overload = rest.partition(".")
    op = None
    if isinstance(target, str) and _TARGET.match(target) and namespace != "quantlens":
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        except (AttributeError, RuntimeError):  # not registered in this process
            op = None
    if not isinstance(op, torch._ops.OpOverload):
        hint = ("" if namespace in ("aten", "prims") else f" If a library defines the '{namespace}' operators, import "
                f"it before running this IR (quantlens never imports a package a file names).")
        raise QuantLensError(f"host op at op site '{site}': {target!r} is not an operator registered with this torch "
                             f"({torch.__version__}).{hint} Otherwise export the model again.")
    return op


def call_host_aten(attrs: dict, inputs: list, site: str) -> Any:
    """Run a ``host_aten`` node: its aten overload on ``inputs`` and the recorded arguments."""

    def dec(a: Any) -> Any:
        if isinstance(a, dict) and set(a) == {_INPUT}:
            return inputs[a[_INPUT]]
        if isinstance(a, dict) and set(a) == {_DTYPE}:
            return getattr(torch, a[_DTYPE])
        if isinstance(a, list):
            return [dec(x) for x in a]
        return a

    op = aten_overload(attrs["target"], site)
    return op(*[dec(a) for a in attrs["args"]], **{k: dec(v) for k, v in attrs["kwargs"].items()})


def draws_random(graph) -> bool:
    """Whether an IR graph draws random numbers (a host op tagged ``nondeterministic_seeded``: ViT-MAE's masking
    noise): torch's generator draws them, so runs agree only when seeded alike, and another runtime draws its own."""
    return any(node_draws_random(node) for node in graph.nodes)


def node_draws_random(node) -> bool:
    """Whether an IR node is a random draw (a ``host_aten`` node of an op tagged ``nondeterministic_seeded``)."""
    if node.op != "host_aten":
        return False
    try:
        op = aten_overload(node.attrs.get("target", ""), node.site)
    except QuantLensError:
        return False
    return torch.Tag.nondeterministic_seeded in op.tags
