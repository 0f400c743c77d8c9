"""Reductions and average pools (``docs/march.md`` §10.2): exact integer sums, then one requantize."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantlens.kernels.integer.core import acc64, exact, int_kernel, magnitude, requant

__all__ = ["sum_kernel", "cumsum_kernel", "avg_pool2d_kernel", "avg_pool1d_kernel"]


def _sum_dtype(q: torch.Tensor, terms: int) -> tuple[torch.dtype, float]:
    """float32 when every partial sum of ``terms`` values of ``q`` stays below 2**24 (exact), else float64; and
    the bound on the sum."""
    bound = terms * magnitude(q)
    return (torch.float32 if bound < 2**24 else torch.float64), float(bound)


@int_kernel("sum_int")
def sum_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    q = inputs[0]
    dtype, bound = _sum_dtype(q, max(1, q.numel()))  # at most numel terms per sum
    acc = torch.sum(q.to(dtype), dim=attrs["dim"], keepdim=attrs["keepdim"])
    return requant(attrs, acc, bound=bound, consume=acc.dtype == torch.float64)


@int_kernel("cumsum_int")
def cumsum_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """§10.2 ``cumsum``: the exact running sums of the codes along ``dim``, each requantized like a sum."""
    q = inputs[0]
    dim = int(attrs["dim"])
    dtype, bound = _sum_dtype(q, max(1, q.shape[dim] if q.dim() else 1))
    acc = torch.cumsum(q.to(dtype), dim=dim)
    return requant(attrs, acc, bound=bound, consume=acc.dtype == torch.float64)


@int_kernel("avg_pool2d_int")
def avg_pool2d_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    a = attrs
    k = a["kernel_size"]
    dtype, bound = _sum_dtype(inputs[0], k[0] * k[-1] if isinstance(k, (list, tuple)) else k * k)
    acc = F.avg_pool2d(inputs[0].to(dtype), a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"],
                       a["count_include_pad"], divisor_override=1)
    return requant(attrs, acc, bound=bound, consume=acc.dtype == torch.float64)


@int_kernel("avg_pool2d_div_int")
def avg_pool2d_div_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """The exact sum of each window, requantized by the multiplier of that window's divisor (``divisors``: the
    [H_out][W_out] map; ``divisor_values`` with one ``multiplier`` / ``shift`` each)."""
    a = attrs
    k = a["kernel_size"]
    dtype, bound = _sum_dtype(inputs[0], k[0] * k[-1] if isinstance(k, (list, tuple)) else k * k)
    acc = F.avg_pool2d(inputs[0].to(dtype), k, a["stride"], a["padding"], a["ceil_mode"], True, divisor_override=1)
    divisors = torch.tensor(a["divisors"], dtype=torch.int64, device=acc.device)
    out = None
    for value, mult, shift in zip(a["divisor_values"], a["multiplier"], a["shift"]):
        part = requant({"multiplier": [mult], "shift": [shift], "out_dtype": a["out_dtype"]}, acc, bound=bound)
        out = part if out is None else torch.where(divisors == value, part, out)
    return out


@int_kernel("avg_pool1d_int")
def avg_pool1d_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """The exact sum of each window (zero padding counts), then one requantize by ``s_in / (k · s_out)``."""
    a = attrs
    x = exact(inputs[0]).unsqueeze(-2)  # [..., 1, L]: the 2-d sum pool with a 1-row window
    acc = acc64(F.avg_pool2d(x, [1, a["kernel_size"][0]], [1, a["stride"][0]], [0, a["padding"][0]],
                             divisor_override=1)).squeeze(-2)
    return requant(attrs, acc)
