"""The boundary and requantize kernels (``docs/march.md`` §7, §8): float to integers at an input scale, integers
to float, and an integer tensor rescaled to another scale."""

from __future__ import annotations

import torch

from quantlens.kernels.integer.core import bound_of, int_kernel, qdtype, requant, storage_dtype
from quantlens.march.numerics import dequantize, quantize

__all__ = ["quantize_kernel", "dequantize_kernel", "requantize_kernel"]


@int_kernel("quantize")
def quantize_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    x, scale = inputs
    return quantize(x, scale, qdtype(attrs), attrs.get("axis"), storage_dtype(attrs["out_dtype"]))


@int_kernel("dequantize")
def dequantize_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    q, scale = inputs
    return dequantize(q, scale, attrs.get("axis"))


@int_kernel("requantize")
def requantize_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    q = inputs[0]
    return requant(attrs, q.to(torch.int64), attrs.get("axis"), bound=bound_of(q))
