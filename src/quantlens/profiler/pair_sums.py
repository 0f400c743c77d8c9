"""The float64 sums a row's figures are formulas of, computed a chunk at a time.

A row compares a baseline tensor ``x`` with an analysis tensor ``y`` of the same shape (float32 as a trace stores
them). Its figures (:mod:`.metrics`, the same-input error split of :mod:`.compare`) are float64 formulas of a few
sums: ``Σx²``, ``Σy²``, ``Σxy``, ``Σ(x-y)²``, ``Σ|x-y|``, ``max |x-y|``. Computing them on whole float64 copies
took 6-12 activation-sized temporaries per row; their fresh pages cost more than the arithmetic (page faults:
8 MB of new float64 memory takes 1.5-2 ms to touch, the subtraction itself 0.3 ms), and they held about 48 bytes
per element of the activation while the forward was running.

Here the values go to float64 :data:`ROW_CHUNK` elements at a time, into scratch buffers each thread reuses
(:func:`_scratch`), and every sum adds up per-chunk float64 sums. The formulas are the same; only the order of
the float64 additions differs from a whole-tensor sum (relative differences around 1e-16, far below any figure
printed). The reductions are torch's own (no BLAS dot, whose summation order can depend on memory alignment):
the same inputs give the same sums, bit for bit.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["ROW_CHUNK", "PairSums", "pair_sums", "pair_kl", "SplitSums", "split_sums", "RowSums", "row_sums", "kl_dim",
           "scratch_rows", "blocks",
           "joined"]

#: elements per chunk (1 MiB per float64 buffer). One thread computes a row as fast with 32 Ki-element chunks as
#: with 128 Ki ones; two threads computing rows side by side (compare_traces) gained nothing with 32 Ki chunks, whose
#: many small torch calls take turns for the GIL, and 25-35 % of the wall time with 128 Ki (docs/performance.md)
ROW_CHUNK = 1 << 17

_local = threading.local()


def _scratch(count: int) -> list[torch.Tensor]:
    """``count`` float64 buffers of :data:`ROW_CHUNK` elements, this thread's own and reused by every call (the
    rows of a trace are computed one after another on one thread; a buffer is never handed out twice at once)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None or len(buffers) < count:
        buffers = _local.buffers = [torch.empty(ROW_CHUNK, dtype=torch.float64) for _ in range(max(count, 4))]
    return buffers[:count]


def scratch_rows(*slices: torch.Tensor) -> list[torch.Tensor]:
    """Float64 copies of ``slices`` (same-shaped, at most :data:`ROW_CHUNK` elements each: this thread's scratch
    buffers; larger ones: fresh tensors), for in-place arithmetic on them."""
    if slices[0].numel() > ROW_CHUNK:
        return [t.to(torch.float64, copy=True) for t in slices]
    return [buf[:t.numel()].view(t.shape).copy_(t) for buf, t in zip(_scratch(len(slices)), slices)]


def blocks(shape: torch.Size | tuple[int, int, int]) -> Iterator[tuple[slice, slice]]:
    """Blocks ``[rows, :, cols]`` of a ``(before, channel, after)`` tensor of ``shape``, in order, each of at most
    :data:`ROW_CHUNK` elements with every channel whole: whole rows of ``before`` where a row fits a chunk, else
    slices of one row's ``after`` (a single position's channels larger than a chunk make a block of their own)."""
    outer, channels, inner = shape
    if outer * channels * inner == 0:
        return  # (nothing to sum)
    per_row = channels * inner
    rows = max(1, ROW_CHUNK // per_row)
    cols = inner if per_row <= ROW_CHUNK else max(1, ROW_CHUNK // channels)
    for r0 in range(0, outer, rows):
        for c0 in range(0, inner, cols):
            yield slice(r0, r0 + rows), slice(c0, c0 + cols)


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A row's values as one tensor: a single output as it is (its shape is the KL's and the channels'), several
    flattened and concatenated in float64."""
    if len(tensors) == 1:
        return tensors[0].detach()
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


@dataclass(frozen=True)
class PairSums:
    """Float64 sums over the elements of a pair ``x``, ``y``: ``count`` elements, ``Σx²`` (``xx``), ``Σy²``,
    ``Σxy``, ``Σ(x-y)²`` (``dd``), ``Σ|x-y|`` (``ad``) and ``max |x-y|`` (``amax``, 0 for an empty pair)."""

    count: int
    xx: float
    yy: float
    xy: float
    dd: float
    ad: float
    amax: float


def pair_sums(x: torch.Tensor, y: torch.Tensor) -> PairSums:
    """The :class:`PairSums` of two same-sized tensors of any float dtype, in one pass."""
    xf, yf = _flat(x), _flat(y)
    n = xf.numel()
    xx = yy = xy = dd = ad = amax = 0.0
    a_buf, b_buf, c_buf = _scratch(3)
    for start in range(0, n, ROW_CHUNK):
        m = min(ROW_CHUNK, n - start)
        a, b, c = a_buf[:m], b_buf[:m], c_buf[:m]
        a.copy_(xf[start:start + m])
        b.copy_(yf[start:start + m])
        xy += float(torch.mul(a, b, out=c).sum())
        xx += float(torch.mul(a, a, out=c).sum())
        yy += float(torch.mul(b, b, out=c).sum())
        d = torch.sub(a, b, out=c)
        dd += float(torch.mul(d, d, out=a).sum())
        d.abs_()
        ad += float(d.sum())
        amax = max(amax, float(d.max()))
    return PairSums(n, xx, yy, xy, dd, ad, amax)


def kl_dim(shape: torch.Size) -> int:
    """The dimension the KL's softmax runs over: the channels (dim 1) of a batched activation (more than two
    dims), else the last."""
    return 1 if len(shape) > 2 else len(shape) - 1


def pair_kl(x: torch.Tensor, y: torch.Tensor) -> float:
    """``mean over positions of Σ_c p_c (log p_c - log q_c)``, ``p = softmax(x)``, ``q = softmax(y)`` over
    :func:`kl_dim`; each position's softmax is whole in one chunk (:func:`blocks`)."""
    if x.numel() == 0 or x.dim() == 0:
        return 0.0
    dim = kl_dim(x.shape)
    outer, channels = math.prod(x.shape[:dim]), x.shape[dim]
    inner = x.numel() // (outer * channels)
    x3, y3 = x.detach().reshape(outer, channels, inner), y.detach().reshape(outer, channels, inner)
    total = 0.0
    for rows, cols in blocks(x3.shape):
        p, q = scratch_rows(x3[rows, :, cols], y3[rows, :, cols])
        if inner == 1:  # (a 2-D view: torch's softmax over a last dim of size 1 took 7x as long, 515 against 71 µs)
            p, q = p.view(p.shape[0], channels), q.view(q.shape[0], channels)
        torch.log_softmax(p, 1, out=p)
        torch.log_softmax(q, 1, out=q)
        # p * (log p - log q), in place: -(log q - log p) is exactly log p - log q
        q.sub_(p).neg_()
        total += float(p.exp_().mul_(q).sum())
    return total / (outer * inner)


@dataclass(frozen=True)
class SplitSums:
    """Float64 sums of the same-input error split (:func:`~quantlens.profiler.compare._split`): ``Σ(x-p)²``
    (``inner``), and ``Σ(p-y)²`` over the elements where ``p`` saturates (``clipped``) and over the others
    (``rounded``)."""

    inner: float
    clipped: float
    rounded: float


def split_sums(x: torch.Tensor, p: torch.Tensor, y: torch.Tensor, low: float | None = None,
               high: float | None = None) -> SplitSums:
    """:class:`SplitSums` of the baseline ``x``, the pre-rounding value ``p`` and the result ``y``; ``p``
    saturates where it lies above ``high`` or below ``low`` (None: nowhere)."""
    xf, pf, yf = _flat(x), _flat(p), _flat(y)
    n = xf.numel()
    inner = clipped = rounded = 0.0
    a_buf, b_buf, c_buf = _scratch(3)
    for start in range(0, n, ROW_CHUNK):
        m = min(ROW_CHUNK, n - start)
        a, b, c = a_buf[:m], b_buf[:m], c_buf[:m]
        b.copy_(pf[start:start + m])
        a.copy_(xf[start:start + m]).sub_(b)
        inner += float(a.mul_(a).sum())
        c.copy_(yf[start:start + m])
        quant = torch.sub(b, c, out=a).mul_(a)
        saturates = False
        if high is not None:
            lo, hi = torch.aminmax(b)  # (one pass; the mask only in a chunk where some element saturates)
            saturates = float(hi) > high or float(lo) < low
        if saturates:
            clip = (b > high) | (b < low)
            # each part summed on its own: as total - clipping, a small rounding part next to a large clipping one
            # would be lost to cancellation
            clipped += float(torch.where(clip, quant, 0.0).sum())
            rounded += float(torch.where(clip, 0.0, quant).sum())
        else:
            rounded += float(quant.sum())
    return SplitSums(inner, clipped, rounded)


@dataclass(frozen=True)
class RowSums:
    """Every sum of one row, from one pass over its tensors (:func:`row_sums`).

    ``pairs[i]``: the :class:`PairSums` of ``x`` and ``others[i]`` (for a pair in ``dd_only``: only ``count``,
    ``xx`` and ``dd``, the others NaN). ``signal`` and ``noise[i]``: the float64 energies ``Σx²`` and
    ``Σ(x - others[i])²`` of each channel along the channel axis (None without one). ``split``: the
    :class:`SplitSums` of ``x``, ``others[pre]`` and ``others[result]`` (None when not asked for)."""

    pairs: tuple[PairSums, ...]
    signal: torch.Tensor | None
    noise: tuple[torch.Tensor, ...] | None
    split: SplitSums | None


def _sq_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) ** 2


def row_sums(x: torch.Tensor, others: list[torch.Tensor], axis: int | None = None, dd_only: frozenset[int] = frozenset(),
             split: tuple[int, int, float | None, float | None] | None = None) -> RowSums:
    """The sums of :func:`pair_sums` for ``x`` against each of ``others`` (same shape, any float dtype), the
    per-channel energies of :func:`~quantlens.profiler.metrics.channel_sqnr` along ``axis`` and the split of
    :func:`split_sums` (``split = (pre, result, low, high)``: indices into ``others`` and the saturation bounds),
    all in one pass: each tensor goes to float64 once per block (:func:`blocks`, every channel whole), not once per
    figure.

    Fewer passes over each block than the separate functions, the same formulas: ``Σxy = (Σx² + Σy² - Σ(x-y)²) / 2``
    (exact in real arithmetic; in float64 its rounding is relative to ``Σx² + Σy²``, like the direct sum's), the
    squares summed by ``torch.linalg.vector_norm`` (torch's own reduction, squared back: a relative difference of
    about 1e-16), ``Σx²`` and ``Σ(x-y)²`` as the sums of the channels' energies where there is an axis. Measured
    against the separate functions in ``tests/test_pair_sums.py``."""
    n = x.numel()
    if axis is None:
        x3 = x.detach().reshape(1, 1, n)
    else:
        axis %= x.dim()
        x3 = x.detach().reshape(math.prod(x.shape[:axis]), x.shape[axis], -1)
    o3 = [t.detach().reshape(x3.shape) for t in others]
    k = len(o3)
    channels = x3.shape[1]
    signal = torch.zeros(channels, dtype=torch.float64) if axis is not None else None
    noise = [torch.zeros(channels, dtype=torch.float64) for _ in range(k)] if axis is not None else None
    xx = 0.0
    tt, dd, ad, amax = [0.0] * k, [0.0] * k, [0.0] * k, [0.0] * k
    clipped = rounded = 0.0
    for rows, cols in blocks(x3.shape):
        views = [x3[rows, :, cols]] + [t[rows, :, cols] for t in o3]
        a, *bs = scratch_rows(*views)
        tmp = _scratch(len(views) + 1)[-1][:a.numel()].view(a.shape) if a.numel() <= ROW_CHUNK else torch.empty_like(a)
        if signal is not None:
            signal += _energy3(a, tmp)
        else:
            xx += _sq_norm(a)
        if split is not None:  # first: the loop below overwrites the blocks
            c, r = _split_block(bs[split[0]], bs[split[1]], split[2], split[3], tmp)
            clipped, rounded = clipped + c, rounded + r
        for i, b in enumerate(bs):
            # (in place, the fastest form at 1 thread: an op with out= took 2.5x as long)
            if i not in dd_only:
                tt[i] += _sq_norm(b)
            d = b.sub_(a)  # y - x: the same squares and absolute values as x - y
            if i not in dd_only:
                ad[i] += float(d.abs_().sum())
                amax[i] = max(amax[i], float(d.amax()))  # (amax: 2.5x as fast as max() on float64)
            if noise is not None:
                noise[i] += _energy3(d, d)
            else:
                dd[i] += _sq_norm(d)
    if signal is not None:
        xx = float(signal.sum())
        dd = [float(e.sum()) for e in noise]
    pairs = tuple(PairSums(n, xx, math.nan, math.nan, dd[i], math.nan, math.nan) if i in dd_only else
                  PairSums(n, xx, tt[i], (xx + tt[i] - dd[i]) / 2, dd[i], ad[i], amax[i]) for i in range(k))
    split_result = None
    if split is not None:
        split_result = SplitSums(pairs[split[0]].dd, clipped, rounded)
    return RowSums(pairs, signal, tuple(noise) if noise is not None else None, split_result)


def _split_block(p: torch.Tensor, y: torch.Tensor, low: float | None, high: float | None,
                 tmp: torch.Tensor) -> tuple[float, float]:
    """``Σ(p-y)²`` of one block over the elements where ``p`` saturates and over the others (:func:`split_sums`)."""
    q = tmp.copy_(p).sub_(y)
    if high is not None:
        # (the mask only in a block where some element saturates; amax and amin: faster than aminmax on float64)
        over, under = float(p.amax()) > high, float(p.amin()) < low
        if over or under:
            clip = ((p > high) | (p < low)) if over and under else (p > high) if over else (p < low)
            q.square_()
            clipped, total = float(q[clip].sum()), float(q.sum())
            if clipped <= total / 2:  # the rest as the difference: no cancellation beyond a factor 2
                return clipped, total - clipped
            # else each part on its own: a small rounding part next to a large clipping one would be lost
            return clipped, float(torch.where(clip, 0.0, q).sum())
    return 0.0, _sq_norm(q)


def _energy3(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sum of squares per channel of a float64 ``(before, channel, after)`` block; ``out``: a same-sized scratch
    block (may be ``t`` itself, which is then overwritten)."""
    if t.shape[2] == 1:  # channels last (a linear's output): squares, then a column sum
        return torch.mul(t, t, out=out).reshape(t.shape[0], t.shape[1]).sum(0)
    return torch.linalg.vector_norm(t, dim=2).square().sum(0)  # contiguous rows: no temporary
