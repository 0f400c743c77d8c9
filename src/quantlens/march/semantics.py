"""Where the march defines what torch leaves open or what fake quantization makes singular, every stage computes the
march's answer: the prepared model (its tracer calls :data:`MARCH_FUNCTIONS` in place of torch's function) and
both IRs' kernels.

* **Order of ties** (``docs/march.md`` §11.1): among equal values the lower index comes first, in ``topk``,
  ``sort`` and ``argsort``, as ONNX's TopK defines it: one function, :func:`ordered`. ``argmax`` / ``argmin`` /
  ``max(dim)`` need none: torch documents the first extreme, as ONNX's ArgMax (``select_last_index=0``) computes.
* **0 / 0** (§13.5): a quotient of two quantized tensors whose codes are both 0 is 0 on the device; torch's float
  division gives NaN, and a fake-quantized divisor rounds to 0 where the float one was only small (an l2 norm's
  ``x / sqrt(sum(x²) + eps)``), so the fake-quant model would return NaN where the integer model does not.

torch leaves the order of ties to its kernels (``torch.topk([1, 2, 2, 1, 2, 0, 3, 3], 4)`` returns the indices
``[7, 6, 4, 1]`` on the CPU, onnxruntime ``[6, 7, 1, 2]``), and on an integer grid ties are common: a
mixture-of-experts router whose int8 logits tie would pick other experts on the device. Every stage calls these
functions instead of torch's (the prepared model through its tracer, both IRs' kernels), so the choice is one rule.
"""

from __future__ import annotations

import torch

__all__ = ["ordered", "topk", "sort", "argsort", "div", "MARCH_FUNCTIONS", "ORDER_OPS", "select_by_attrs"]


def ordered(input: torch.Tensor, dim: int = -1, descending: bool = False,  # noqa: A002
            k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The march's order of ties (§11.1), the one function every stage's ``topk`` / ``sort`` / ``argsort`` calls:
    ``(values, indices)`` in ascending (or ``descending``) order along ``dim``, equal values with the lower index
    first (a stable sort), and only the first ``k`` when ``k`` is given."""
    values, indices = torch.sort(input, dim=dim, descending=descending, stable=True)
    if k is not None:
        values, indices = values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
    return values, indices


def topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """``torch.topk`` with the march's tie order (:func:`ordered`: the first ``k``, descending for the largest)."""
    return torch.return_types.topk(ordered(input, dim, largest, k))


def sort(input: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool | None = None):  # noqa: A002
    """``torch.sort`` with the march's tie order (:func:`ordered`, whatever ``stable`` asks)."""
    return torch.return_types.sort(ordered(input, dim, descending))


def argsort(input: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool = False):  # noqa: A002
    """``torch.argsort`` with the march's tie order (:func:`ordered`'s indices, whatever ``stable`` asks)."""
    return ordered(input, dim, descending)[1]


def div(input, other, *, rounding_mode: str | None = None):  # noqa: A002
    """``torch.div`` with the march's ``0 / 0 = 0`` for a true division of two tensors (the divisor taken as 1 there,
    so the gradient stays finite too)."""
    if rounding_mode is not None or not isinstance(other, torch.Tensor) or not isinstance(input, torch.Tensor):
        return torch.div(input, other, rounding_mode=rounding_mode)
    return torch.div(input, torch.where((input == 0) & (other == 0), torch.ones_like(other), other))


#: the ops whose order of ties the march fixes
ORDER_OPS = frozenset({"topk", "sort", "argsort"})
#: op type -> the march's function for it (``sites.tracer`` calls it in place of torch's, out of place only)
MARCH_FUNCTIONS = {"topk": topk, "sort": sort, "argsort": argsort, "div": div}


def select_by_attrs(op: str, x: torch.Tensor, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """An IR node's ``topk`` / ``sort`` (its attrs as the lowering records them): (values, indices)."""
    if op == "topk":
        return tuple(topk(x, attrs["k"], attrs.get("dim", -1), attrs.get("largest", True)))
    return tuple(sort(x, attrs.get("dim", -1), attrs.get("descending", False)))
