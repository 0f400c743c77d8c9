"""A bad case of the wrong shape, said in words before any model runs on it (and when one fails on it).

What the models take is known without running them: an IR has its input contract (``Module.check_inputs``: rank,
static dims, dtype), and a prepared model its record of the example inputs ``prepare`` ran (``QuantState.record``):
the shape of every model input an op site read, and the op site's module, whose ``in_features`` / ``in_channels``
fix the width of that input. Only the width is checked for a torch model: the other dims (batch, sequence
length, image size) may differ from the example inputs in a model that takes them. A forward that fails on a
shape anyway gets the record's shapes next to the bad case's (:func:`explain_shape_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError

__all__ = ["check_bad_case_shapes", "explain_shape_error"]

_FIX = ("Pass inputs shaped like the example inputs the model was prepared with (set_bad_case(...), or the items "
        "of auto_find_bad_case's data).")


@dataclass(frozen=True)
class _Width:
    """A model input read by op site ``site`` directly: recorded as ``shape`` by prepare; its dim ``dim`` must
    be ``width`` (the site's module's ``in_features`` / ``in_channels``)."""

    shape: tuple[int, ...]
    dim: int
    width: int
    site: str


def _float_leaves(data: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every floating-point tensor of one call's inputs: ``input[0]``, ``input['x']`` ..."""
    leaves, _ = pytree.tree_flatten_with_path(data)
    return [(f"input{pytree.keystr(path)}", t) for path, t in leaves
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _module_width(model: torch.nn.Module, name: str) -> tuple[int, int] | None:
    """(dim, width) a module's data input must have: a linear's last dim, a conv's channels."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    if isinstance(getattr(module, "in_features", None), int):
        return -1, module.in_features
    if isinstance(getattr(module, "in_channels", None), int) and isinstance(module, torch.nn.modules.conv._ConvNd):
        return 1, module.in_channels
    return None


def _widths(access) -> list[_Width]:
    """The widths a prepared model's record fixes (see the module docstring); [] for other models."""
    state = getattr(access, "state", None)
    record = getattr(state, "record", None)
    if not getattr(access, "prepared", False) or record is None:
        return []
    out = []
    for site in record.sites.values():
        for inp in site.inputs:
            if not (inp.from_input and inp.producer is None and not inp.is_parameter):
                continue
            # the site itself, or the ones right after a QuantStub that passes the input on unchanged
            readers = [site] + ([record.sites[c] for c in record.consumers(site.name)] if site.boundary == "input"
                                else [])
            for reader in readers:
                width = _module_width(access.model, reader.module_name) if reader.is_module else None
                if width is not None and len(inp.shape) > 1:
                    out.append(_Width(tuple(inp.shape), width[0], width[1], reader.name))
    return out


def _width_problem(widths: Iterable[_Width], data: Any, what: str) -> str | None:
    leaves = _float_leaves(data)
    for w in widths:
        same_rank = [(n, t) for n, t in leaves if t.dim() == len(w.shape)]
        if not same_rank or any(t.shape[w.dim] == w.width for _, t in same_rank):
            continue  # (an input of that width is there, or none of that rank: nothing is known of it)
        name, t = same_rank[0]
        dim = w.dim % t.dim()
        return (f"{what}'s {name} has shape {tuple(t.shape)}, but op site {w.site} takes {w.width} in its dim {dim} "
                f"(expected shape {w.shape} as prepared, or the same with another batch size). {_FIX}")
    return None


def _ir_problem(access, data: Any, what: str) -> str | None:
    module = getattr(access, "module", None)
    if module is None or not hasattr(module, "check_inputs"):
        return None
    from quantlens.profiler.ir_module import call_ir

    try:
        module.check_inputs(call_ir(module, data), check_finite=False)
    except QuantLensError as exc:
        return f"{what} does not fit the {access.label} IR: {exc}"
    return None


def check_bad_case_shapes(accesses: Iterable[Any], data: Any, where: str, what: str = "the bad case") -> None:
    """Refuse ``data`` when a model of ``accesses`` cannot take it (an IR's contract, a prepared model's widths):
    one line naming the input, its shape and the expected one, before any model runs on it."""
    for access in accesses:
        problem = _ir_problem(access, data, what) or _width_problem(_widths(access), data, what)
        if problem is not None:
            raise QuantLensError(f"{where}: {problem}")


def explain_shape_error(accesses: Iterable[Any], data: Any, exc: RuntimeError, where: str,
                        what: str = "the bad case") -> QuantLensError | None:
    """The error in words for a forward on ``data`` that failed with ``exc`` on a shape ("mat1 and mat2 shapes
    cannot be multiplied", "size of tensor a must match"): the input whose shape differs from what the models
    were prepared with; None when nothing known explains it (the model's own error then propagates)."""
    accesses = list(accesses)
    text = str(exc)
    if "shape" not in text and "size" not in text:
        return None
    for access in accesses:
        problem = _ir_problem(access, data, what) or _width_problem(_widths(access), data, what)
        if problem is not None:
            return QuantLensError(f"{where}: {problem}")
    recorded = sorted({w.shape for a in accesses for w in _widths(a)})
    unknown = [(n, t) for n, t in _float_leaves(data) if tuple(t.shape) not in recorded]
    if not recorded or not unknown:
        return None
    name, t = unknown[0]
    return QuantLensError(
        f"{where}: the model failed on {what} ({text.splitlines()[0]}); its {name} has shape {tuple(t.shape)}, "
        f"and the model was prepared with inputs of shape {', '.join(map(str, recorded))}. {_FIX}")
