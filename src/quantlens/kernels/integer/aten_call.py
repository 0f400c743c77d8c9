"""Calling a torch op (aten or custom) with a call's tensors and attrs, by the names of the op's schema.

The IR's generic rule: a node's inputs are the op's tensor arguments in schema order, its attrs the other
arguments by name. The qat IR's interpreter calls its torch ops this way (``compiler.interpreter.call_torch_op``),
and so do the integer kernels that move integers with the op a qat node runs (:data:`MOVEMENT_OPS`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["call_op", "MOVEMENT_OPS"]

aten = torch.ops.aten

#: integer kernels that run the qat node's torch op on their integers (as float64, exact): the op of each
MOVEMENT_OPS = {
    "upsample_nearest1d": aten.upsample_nearest1d.vec,
    "upsample_nearest2d": aten.upsample_nearest2d.vec,
    "max_dim": aten.max.dim,
    "sort": aten.sort.default,
    "topk": aten.topk.default,
    "select_scatter": aten.select_scatter.default,
    "slice_scatter": aten.slice_scatter.default,
}

#: schema argument name -> the attr name IR nodes use for it (``expand``'s ``size`` is its ``shape`` attr)
ATTR_ALIASES = {"size": "shape"}

#: torch op -> its schema's arguments as (name, "list" | "tensor" | "attr"), read once (str(arg.type) costs more
#: than many small kernels)
_ARG_PLANS: dict[Any, list[tuple[str, str]]] = {}


def arg_plan(torch_op) -> list[tuple[str, str]]:
    """``torch_op``'s schema arguments as ``(name, "list" | "tensor" | "attr")``: how a call's inputs and attrs fill
    them (cached per op)."""
    plan = _ARG_PLANS.get(torch_op)
    if plan is None:
        plan = []
        for arg in torch_op._schema.arguments:
            type_text = str(arg.type)
            if type_text.startswith("List[Tensor]") or type_text == "Tensor[]":
                plan.append((arg.name, "list"))
            elif type_text.startswith("Tensor") or type_text.startswith("Optional[Tensor]"):
                plan.append((arg.name, "tensor"))
            else:
                plan.append((arg.name, "attr"))
        _ARG_PLANS[torch_op] = plan
    return plan


def call_op(torch_op, attrs: dict, inputs: list) -> Any:
    """Call an aten/custom op with ``inputs`` (its tensor schema args, in order) and ``attrs`` (the rest)."""
    pending = list(inputs)
    kwargs = {}
    for name, kind in arg_plan(torch_op):
        if kind == "list":
            kwargs[name], pending = pending, []
        elif kind == "tensor":
            kwargs[name] = pending.pop(0) if pending else None
        elif name in attrs or ATTR_ALIASES.get(name) in attrs:
            kwargs[name] = attrs.get(name, attrs.get(ATTR_ALIASES.get(name)))
    return torch_op(**kwargs)
