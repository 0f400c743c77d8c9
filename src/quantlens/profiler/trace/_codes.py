"""A site's values on its output grid, stored as integer codes (exactly, or not at all)."""

from __future__ import annotations

from typing import Callable

import torch

from quantlens.profiler._sums import CHUNK, chunks

__all__ = ["CODE_DTYPES", "encode"]

#: the integer grids whose values may be stored as codes: quant dtype -> (qmin, qmax, code dtype)
CODE_DTYPES = {"qint8": (-128, 127, torch.int8), "qint16": (-32768, 32767, torch.int16)}


def encode(x: torch.Tensor, scale: float, qmin: int, qmax: int, dtype: torch.dtype,
            scratch: Callable[[int], torch.Tensor], codes_buf: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
    """Integer codes ``c`` with ``c.float() * scale == x`` elementwise (value equality: -0.0 comes back as 0.0),
    or None where ``x`` is not exactly on that grid (NaN, Inf, off-grid values, out of range)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() == 0:
        return None
    s = torch.tensor(scale, dtype=torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    codes = codes_buf(x.numel() * size).view(dtype)[:x.numel()]
    buf = scratch(min(x.numel(), CHUNK) * 4).view(torch.float32)
    done = 0
    for c in chunks(x):  # (a chunk's temporary, not an activation's)
        q = torch.div(c, s, out=buf[:c.numel()]).round_()
        lo, hi = torch.aminmax(q)
        if not (bool(lo >= qmin) and bool(hi <= qmax)):  # NaN fails both
            return None
        codes[done:done + c.numel()].copy_(q)
        if not torch.equal(q.mul_(s), c):
            return None
        done += c.numel()
    return codes.view(x.shape)
