"""What a trace computes from tensors: each stored tensor's statistics (:func:`tensor_stat`, run by the writer
thread) and the fingerprint of the bad case a trace was made on (:func:`input_digest`)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from quantlens.profiler._sums import CHUNK, chunks, sum64
from quantlens.profiler.trace.format import TensorStat

__all__ = ["tensor_stat", "input_digest", "NUMPY_MOMENTS", "NUMPY_EXTREMES"]

#: at most this many elements: mean and variance in numpy, in float64 (a copy of a chunk's size). A torch call
#: costs 5-10 µs on these machines, numpy's about 1: a 16-element bias took 58 µs through the torch passes and
#: 13 µs here; from about 64 K elements torch's chunked float32 passes are the faster
NUMPY_MOMENTS = 1 << 15
#: at most this many elements: the extremes by numpy's min and max (two passes over a tensor that fits the
#: core's cache: 45 µs against torch's aminmax and finiteness checks' 125 at 256 K elements; at 1 M the single
#: aminmax pass is the faster)
NUMPY_EXTREMES = 1 << 18
#: the dtypes whose CPU tensors numpy reads in place
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _numpy_stat(x: torch.Tensor, moments: bool) -> tuple[float, float, float | None, float | None] | None:
    """The extremes (and, with ``moments``, mean and variance) of a flat CPU tensor of at most
    :data:`NUMPY_EXTREMES` elements (:data:`NUMPY_MOMENTS` with moments) through numpy; None where it holds a
    NaN or an Inf (the torch path counts those)."""
    a = x.numpy()
    lo, hi = a.min(), a.max()  # (NaN propagates; an Inf is an extreme)
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    if not moments:
        return lo, hi, None, None
    wide = a.astype(np.float64)  # (a copy: the deviations are computed in place)
    mean = float(wide.sum()) / wide.size
    wide -= mean
    np.multiply(wide, wide, out=wide)
    return lo, hi, mean, float(wide.sum()) / wide.size


def tensor_stat(t: torch.Tensor, scratch: Callable[[int], torch.Tensor] | None = None,
                moments: bool = True) -> TensorStat:
    """``scratch(nbytes)``, when given, lends a byte buffer for the variance pass's temporary (the writer
    thread reuses one instead of allocating an activation-sized tensor per call). ``moments=False``: the extremes
    and the NaN/Inf counts only (mean and var None), one pass instead of three."""
    x = t.detach()
    shape, dtype = tuple(x.shape), str(x.dtype).replace("torch.", "")
    if x.numel() == 0:
        return TensorStat(shape, dtype, None, None, None, None)
    nan = inf = 0
    x = x.reshape(-1)
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES and \
            x.numel() <= (NUMPY_MOMENTS if moments else NUMPY_EXTREMES):
        small = _numpy_stat(x.contiguous(), moments)
        if small is not None:
            return TensorStat(shape, dtype, *small)
    lo = hi = None
    if x.is_floating_point():
        # one pass decides finiteness: aminmax propagates NaN, and an Inf is one of the extremes
        lo, hi = torch.aminmax(x)
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            x = x[torch.isfinite(x)]
            lo = hi = None
            if x.numel() == 0:
                return TensorStat(shape, dtype, None, None, None, None, nan, inf)
    # A few cheap passes with float64 accumulation, and no copy of the tensor: an integer or half-precision one
    # (an IR's weight codes) goes to float64 a chunk at a time, and the variance pass's temporary is one chunk
    # (a few activations' temporaries would be a tenth of a traced run's memory; the forward's thread computes
    # a weight's statistics without a scratch buffer).
    wide = x.dtype not in (torch.float32, torch.float64)
    if lo is None:
        lo, hi = torch.aminmax(x)
    if not moments:
        return TensorStat(shape, dtype, float(lo), float(hi), None, None, nan, inf)
    x = x.contiguous()
    pieces = (lambda: (c.double() for c in chunks(x))) if wide else (lambda: chunks(x))
    mean = (sum(sum64(c) for c in pieces()) if wide else sum64(x)) / x.numel()
    buf = None
    if scratch is not None and not wide:
        buf = scratch(min(x.numel(), CHUNK) * x.element_size()).view(x.dtype)
    var = sum(sum64(torch.sub(c, mean, out=buf[:c.numel()] if buf is not None else None).square_())
              for c in pieces()) / x.numel()
    return TensorStat(shape, dtype, float(lo), float(hi), mean, var, nan, inf)


def input_digest(example: Any) -> str:
    """A fingerprint of the tensors of one call's inputs (values, shapes, dtypes), to tell whether two traces
    were made on the same bad case."""
    h = hashlib.sha256()
    for leaf in pytree.tree_leaves(example):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
