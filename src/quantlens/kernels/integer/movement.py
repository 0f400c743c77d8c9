"""Kernels that move integers (their scale stays): relu, max pools, pads, fills, scatters, and the ops whose
later outputs are indices (topk, sort, max_dim)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantlens.kernels.integer.aten_call import MOVEMENT_OPS, call_op
from quantlens.kernels.integer.core import exact, int_kernel
from quantlens.march.opset import ops_in
from quantlens.march.semantics import ORDER_OPS, select_by_attrs

__all__ = ["relu_kernel", "max_pool2d_kernel", "max_pool1d_kernel", "values_and_indices_kernel", "pad_kernel",
           "fill_kernel", "scatter_kernel"]


@int_kernel("relu")
def relu_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    return torch.clamp(inputs[0], min=0)


@int_kernel("max_pool2d")
def max_pool2d_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    a = attrs
    q = inputs[0]  # int8/int16 values are exact in float32
    y = F.max_pool2d(q.to(torch.float32), a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    return y.to(q.dtype)


@int_kernel("max_pool1d")
def max_pool1d_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    a = attrs
    q = inputs[0]  # float64 holds every int8/int16/int32 value exactly
    y = F.max_pool1d(exact(q), a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    return y.to(q.dtype)


def values_and_indices_kernel(op: str):
    """The kernel of an op whose outputs are values then indices (``topk``, ``sort``, ``max_dim``): its aten op
    on the integers (as float64); the values keep the input's integer type."""
    torch_op = MOVEMENT_OPS[op]

    def kernel(inputs: list, attrs: dict, site: str = "") -> list:
        q = inputs[0]
        if op in ORDER_OPS:  # topk / sort: the march's tie order (docs/march.md §11.1)
            values, indices = select_by_attrs(op, exact(q), attrs)
        else:  # max_dim: torch's first maximum, as ONNX's ArgMax
            values, indices = call_op(torch_op, attrs, [exact(q)])
        return [values.to(q.dtype), indices]

    return kernel


for _op in sorted(ops_in(index_outputs=True)):
    int_kernel(_op)(values_and_indices_kernel(_op))


@int_kernel("pad_int")
def pad_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """Pads integers (exact in float64 for reflect/replicate, which torch implements for floats only)."""
    q = inputs[0]
    a = attrs
    if a["mode"] == "constant":
        return F.pad(q, a["pad"], mode="constant", value=int(a["value"]))
    return F.pad(q.to(torch.float64), a["pad"], mode=a["mode"]).to(q.dtype)


@int_kernel("fill_int")
def fill_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    return torch.full_like(inputs[0], int(attrs["value"]))


def scatter_kernel(op: str):
    """The kernel of ``select_scatter`` / ``slice_scatter``: its aten op on the integers as they are."""
    torch_op = MOVEMENT_OPS[op]

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        return call_op(torch_op, attrs, inputs)

    return kernel


for _op in ("select_scatter", "slice_scatter"):
    int_kernel(_op)(scatter_kernel(_op))
