"""Model outputs as named tensors, and the optional ``post_process`` applied to them.

Names come from the output's structure: a lone tensor is ``"0"``, tuple/list items are ``"0"``, ``"1"``,
dict entries their key, nested ones join with ``"."`` (``"heads.cls"``); a name met twice (``{"a": {"b": x},
"a.b": y}``) gets ``#1``, ``#2`` ... on its later leaves, so every leaf keeps its own name. Post-processed
outputs are named ``"post_process"`` (a lone tensor) or ``"post_process.<name>"``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError

__all__ = ["named_outputs", "float_outputs", "PostProcess", "unique_name"]


def _key_text(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def named_outputs(output: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf of ``output`` by name (see the module docstring)."""
    if isinstance(output, torch.Tensor):
        return {prefix or "0": output}
    leaves, _ = pytree.tree_flatten_with_path(output)
    named: dict[str, torch.Tensor] = {}
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = ".".join(_key_text(p) for p in path) or "0"
            named[unique_name(f"{prefix}.{name}" if prefix else name, named)] = leaf
    return named


def unique_name(name: str, taken) -> str:
    """``name``, or ``name#1``, ``name#2`` ... when ``taken`` has it already: two leaves whose paths print the
    same (``{"a": {"b": x}}`` and ``{"a.b": y}``) keep two names, the later one in flattening order suffixed."""
    if name not in taken:
        return name
    k = 1
    while f"{name}#{k}" in taken:
        k += 1
    return f"{name}#{k}"


def float_outputs(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point outputs (integer outputs such as labels or indices are not compared)."""
    return {k: v for k, v in named.items() if v.is_floating_point()}


class PostProcess:
    """``post_process`` of :class:`~.quant_analysis.QuantAnalysis`: a callable or module run on each model's
    output (outside the op-site tracer: host-side float code), whose results are compared too."""

    def __init__(self, func: Callable | None):
        if func is not None and not callable(func):
            raise QuantLensError(
                f"post_process must be a callable or an nn.Module taking the model output, got {type(func).__name__}."
            )
        self.func = func

    def outputs(self, output: Any) -> dict[str, torch.Tensor]:
        """The model's named outputs plus the post-processed ones."""
        named = named_outputs(output)
        if self.func is not None:
            with torch.no_grad():
                for name, value in self.extra(output).items():
                    named[unique_name(name, named)] = value
        return named

    def extra(self, output: Any) -> dict[str, torch.Tensor]:
        if self.func is None:
            return {}
        with torch.no_grad():
            return named_outputs(self.func(output), prefix="post_process")
