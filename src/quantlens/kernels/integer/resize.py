"""Resize kernels: bilinear (an exact integer interpolation by two weight matrices, one requantize; §10.2) and
nearest (integers move: the qat op's own kernel on them)."""

from __future__ import annotations

import torch

from quantlens.kernels.integer.aten_call import MOVEMENT_OPS, call_op
from quantlens.kernels.integer.core import acc64, exact, int_kernel, requant

__all__ = ["bilinear_kernel", "nearest_kernel"]


@int_kernel("bilinear_int")
def bilinear_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    q, a_h, a_w = inputs
    acc = acc64(torch.matmul(torch.matmul(exact(a_h), exact(q)), exact(a_w).t()))
    return requant(attrs, acc)


def nearest_kernel(op: str):
    """The kernel of ``upsample_nearest1d`` / ``upsample_nearest2d``: its aten op on the integers (as float64)."""
    torch_op = MOVEMENT_OPS[op]

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        q = inputs[0]
        return call_op(torch_op, attrs, [exact(q)]).to(q.dtype)

    return kernel


for _op in ("upsample_nearest1d", "upsample_nearest2d"):
    int_kernel(_op)(nearest_kernel(_op))
