"""The march's order rule for the ops that select by value (``docs/march.md`` §11.1): among equal values the lower
index comes first, in ``topk`` and in ``sort``, as ONNX's TopK defines it.

torch leaves the order of ties to its kernels (``torch.topk([1, 2, 2, 1, 2, 0, 3, 3], 4)`` returns the indices
``[7, 6, 4, 1]`` on the CPU, onnxruntime ``[6, 7, 1, 2]``), and on an integer grid ties are common: a
mixture-of-experts router whose int8 logits tie would pick other experts on the device. Every stage calls these
functions instead of torch's (the prepared model through its tracer, both IRs' kernels), so the choice is one rule.
"""

from __future__ import annotations

import torch

__all__ = ["topk", "sort", "ORDER_FUNCTIONS", "select_by_attrs"]


def topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """``torch.topk`` with the march's tie order: a stable sort (descending for the largest), then the first ``k``."""
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def sort(input: torch.Tensor, dim: int = -1, descending: bool = False, stable: bool | None = None):  # noqa: A002
    """``torch.sort`` with the march's tie order (a stable sort, whatever ``stable`` asks)."""
    return torch.sort(input, dim=dim, descending=descending, stable=True)


#: op type -> the march's function for it (``quantization.tracer`` calls it in place of torch's)
ORDER_FUNCTIONS = {"topk": topk, "sort": sort}


def select_by_attrs(op: str, x: torch.Tensor, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """An IR node's ``topk`` / ``sort`` (its attrs as the lowering records them): (values, indices)."""
    if op == "topk":
        return tuple(topk(x, attrs["k"], attrs.get("dim", -1), attrs.get("largest", True)))
    return tuple(sort(x, attrs.get("dim", -1), attrs.get("descending", False)))
