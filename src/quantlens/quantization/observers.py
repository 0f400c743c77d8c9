"""Observers: record the range of float tensors during calibration / QAT and turn it into a symmetric scale.

Every scale follows the march rule of ``MarchSpec.scale_from_range``, ``max(absmax / qmax, min_scale)`` rounded
to float32, through the one vectorized helper :func:`_scale_from_absmax`, so that observers, reports and the
compiler agree bit for bit. Non-finite inputs are never fatal while observing: they are left out of the
statistics and remembered in ``saw_nonfinite`` so that a report can flag them afterwards.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, get_march

__all__ = [
    "Observer", "ObserverFactory", "MinMaxObserver", "PercentileObserver", "MSEObserver", "KLObserver",
    "FixedScaleObserver", "FixedRangeObserver"
]


def _scale_from_absmax(absmax: torch.Tensor, dtype: QuantDType, owner: str = "Observer") -> torch.Tensor:
    """Vectorized ``MarchSpec.scale_from_range``: ``max(absmax / qmax, min_scale)``, rounded to float32."""
    # Divide in float64 and round once to float32, exactly like the Python-float rule in march/spec.py.
    a = absmax.detach().to(torch.float64)
    bad = ~torch.isfinite(a)
    if bool(bad.any()):
        where = "" if a.dim() == 0 else f" in {int(bad.sum())} of {a.numel()} channels"
        raise QuantLensError(
            f"{owner} cannot derive a {dtype.value} scale: its statistic is NaN/Inf{where}. Check the model "
            "input and the op that produced this tensor, or the state dict that was loaded into the observer."
        )
    return torch.clamp_min(a / dtype.qmax, get_march().spec.min_scale).to(torch.float32)


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """``numpy.interp`` for a non-decreasing ``xp`` (flat stretches allowed); clamps outside ``xp``."""
    # right=True picks the last knot <= x, so the segment used is never a flat one except at the very end.
    i = torch.searchsorted(xp, x, right=True).clamp(1, xp.numel() - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    width = x1 - x0
    t = torch.where(width > 0, (x - x0) / torch.where(width > 0, width, torch.ones_like(width)), 0.0)
    return f0 + t.clamp(0.0, 1.0) * (f1 - f0)


class Observer(nn.Module, ABC):
    """Base of all observers: watches a float tensor and derives a symmetric scale for ``dtype``.

    ``ch_axis=None`` observes per tensor (0-dim statistics and scale); an int observes per channel along that
    axis (``[C]`` statistics and scale, shaped lazily on the first batch). ``forward`` returns its input
    unchanged. The running ``min_val`` / ``max_val`` of the finite values and the ``saw_nonfinite`` flag are
    buffers, so they are saved in the state dict and follow ``.to()``. Before any finite value the range is
    ``(+inf, -inf)``.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None):
        super().__init__()
        self.dtype = QuantDType.parse(dtype)
        if ch_axis is not None and (isinstance(ch_axis, bool) or not isinstance(ch_axis, int)):
            raise QuantLensError(
                f"{type(self).__name__}: ch_axis must be an int or None, got {ch_axis!r}. Options other than "
                "dtype and ch_axis are keyword-only (e.g. FixedScaleObserver(dtype, scale=0.5))."
            )
        self.ch_axis = ch_axis
        shape = () if ch_axis is None else (0,)
        self.register_buffer("min_val", torch.full(shape, math.inf))
        self.register_buffer("max_val", torch.full(shape, -math.inf))
        self.register_buffer("saw_nonfinite", torch.tensor(False))

    @classmethod
    def with_args(cls, **kwargs) -> ObserverFactory:
        """A picklable factory ``factory(dtype, ch_axis) -> observer`` with ``kwargs`` bound (a ``partial``)."""
        try:  # fail now, where the options are written, rather than deep inside prepare
            inspect.signature(cls).bind_partial(QuantDType.qint8, None, **kwargs)
        except TypeError as exc:
            raise QuantLensError(f"{cls.__name__}.with_args: bad options {kwargs}: {exc}.") from None
        return functools.partial(cls, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        xd = x.detach().to(torch.float32)
        # one pass tells an all-finite batch (the usual one: no mask over it is needed): a NaN propagates to both
        # extremes, an infinity is one of them
        lo, hi = torch.aminmax(xd)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            finite = None
        else:
            finite = torch.isfinite(xd)
            self.saw_nonfinite.fill_(True)
        self._observe(xd, finite)
        return x

    @property
    def has_stats(self) -> bool:
        """Whether every channel has seen a finite value (so :meth:`calculate_scale` has something to use)."""
        # Compare with ">" so that the (+inf, -inf) sentinel means "no data" while a NaN loaded from a state
        # dict still counts as stats and reaches the NaN/Inf check of _scale_from_absmax.
        return self.min_val.numel() > 0 and not bool((self.min_val > self.max_val).any())

    def calculate_scale(self) -> torch.Tensor:
        """The float32 scale: 0-dim per tensor, ``[C]`` per channel. Raises if there is nothing to use."""
        if not self.has_stats:
            name = type(self).__name__
            if bool(self.saw_nonfinite):
                some = " for some channels" if self.ch_axis is not None else ""
                raise QuantLensError(
                    f"{name} saw only NaN/Inf values{some}, so there is no finite range to derive a "
                    f"{self.dtype.value} scale from. Check the model input and the op that produced this tensor "
                    "(overflow, log/division by zero, uninitialised weights)."
                )
            raise QuantLensError(
                f"{name} has not observed any data yet, so it cannot compute a scale. Run calibration batches "
                "through the prepared model before computing scales."
            )
        return self._calculate_scale()

    def observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min, max)`` of the finite values seen: 0-dim, or ``[C]`` per channel (empty before any batch)."""
        return self.min_val.clone(), self.max_val.clone()

    def reset(self) -> None:
        """Forget everything observed (per-channel buffers go back to empty)."""
        if self.ch_axis is None:
            self.min_val.fill_(math.inf)
            self.max_val.fill_(-math.inf)
        else:
            self.min_val = self.min_val.new_empty(0)
            self.max_val = self.max_val.new_empty(0)
        self.saw_nonfinite.fill_(False)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v}" for k, v in self._options().items())
        return f"dtype={self.dtype.value}, ch_axis={self.ch_axis}{options}"

    @abstractmethod
    def _calculate_scale(self) -> torch.Tensor:
        """The scale, once :attr:`has_stats` is known to hold."""

    def _options(self) -> dict:
        return {}

    def _observe(self, x: torch.Tensor, finite: torch.Tensor | None) -> None:
        """Update the statistics from a float32 batch; ``finite`` masks the values that may be used (None: all)."""
        lo, hi = self._batch_min_max(x, finite)
        if self.min_val.shape != lo.shape:
            if self.min_val.numel() == 0:  # first per-channel batch fixes the channel count
                self.min_val, self.max_val = lo.to(self.min_val), hi.to(self.max_val)
                return
            raise QuantLensError(
                f"{type(self).__name__} (ch_axis={self.ch_axis}) first saw {self.min_val.numel()} channels and "
                f"now a tensor of shape {tuple(x.shape)}. One observer watches one tensor; use one per tensor."
            )
        self.min_val.copy_(self._merge(self.min_val, lo, torch.minimum))
        self.max_val.copy_(self._merge(self.max_val, hi, torch.maximum))

    def _merge(self, current: torch.Tensor, batch: torch.Tensor, pick: Callable) -> torch.Tensor:
        """Combine a running statistic with the batch's (default: the running extreme)."""
        return pick(current, batch)

    def _batch_min_max(self, x: torch.Tensor, finite: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Non-finite values become the neutral element of the reduction, so they never move min/max (the usual
        # all-finite tensor, ``finite`` None, is reduced as it is: no two masked copies of it)
        if finite is None:
            lo = hi = x
        else:
            lo = torch.where(finite, x, math.inf)
            hi = torch.where(finite, x, -math.inf)
        if self.ch_axis is None:
            return torch.aminmax(x) if lo is x else (lo.amin(), hi.amax())
        if not -x.dim() <= self.ch_axis < x.dim():
            raise QuantLensError(
                f"{type(self).__name__} has ch_axis={self.ch_axis} but got a tensor of shape {tuple(x.shape)}; "
                "ch_axis must index one of its dimensions."
            )
        axis = self.ch_axis % x.dim()
        dims = tuple(d for d in range(x.dim()) if d != axis)
        return (lo.amin(dim=dims), hi.amax(dim=dims)) if dims else (lo, hi)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.ch_axis is not None:
            # Per-channel buffers take their shape from the first batch, so a fresh observer adopts the saved one.
            for name in ("min_val", "max_val"):
                saved = state_dict.get(prefix + name)
                mine = self._buffers[name]
                if saved is not None and saved.shape != mine.shape:
                    self._buffers[name] = torch.empty(saved.shape, dtype=mine.dtype, device=mine.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


ObserverFactory = Callable[[QuantDType, int | None], Observer]


class MinMaxObserver(Observer):
    """Scale ``max(|min|, |max|) / qmax`` (at least ``min_scale``) from the observed range.

    ``averaging_constant=None`` keeps the running min/max over all batches (calibration). A float ``c`` in
    ``(0, 1]`` keeps an exponential moving average instead (QAT): the first batch sets the range, then
    ``min += c * (batch_min - min)`` and likewise for max. Per channel, each batch reduces over every dim
    except ``ch_axis``.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, averaging_constant: float | None = None):
        super().__init__(dtype, ch_axis)
        if averaging_constant is not None and not (0.0 < float(averaging_constant) <= 1.0):
            raise QuantLensError(
                f"MinMaxObserver: averaging_constant must be None (running min/max) or in (0, 1], "
                f"got {averaging_constant!r}."
            )
        self.averaging_constant = None if averaging_constant is None else float(averaging_constant)

    def _options(self) -> dict:
        return {"averaging_constant": self.averaging_constant}

    def _merge(self, current, batch, pick):
        c = self.averaging_constant
        if c is None:
            return pick(current, batch)
        # A channel's first finite batch sets it directly (there is nothing to average with yet); a batch with
        # no finite value for a channel leaves it as it was.
        ema = current + c * (batch - current)
        return torch.where(torch.isfinite(current), torch.where(torch.isfinite(batch), ema, current), batch)

    def _calculate_scale(self) -> torch.Tensor:
        return _scale_from_absmax(torch.maximum(-self.min_val, self.max_val), self.dtype, type(self).__name__)


class _AbsHistogramObserver(Observer):
    """Shared by the percentile and MSE observers: a histogram of ``|x|`` over ``[0, running absmax]``.

    ``bins`` equal bins. When a batch widens the range, the existing counts are re-binned into the wider range
    in proportion to the overlap of old and new bins (each old bin's count taken as uniform over its width),
    which is deterministic and keeps the total count. Per tensor only.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, bins: int = 2048):
        super().__init__(dtype, ch_axis)
        if ch_axis is not None:
            raise QuantLensError(
                f"{type(self).__name__} is per-tensor only (got ch_axis={ch_axis}). Use MinMaxObserver for "
                "per-channel weights."
            )
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise QuantLensError(f"{type(self).__name__}: bins must be a positive int, got {bins!r}.")
        self.bins = bins
        # float64 counts: re-binning makes them fractional, and float32 stops counting exactly at 2**24.
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))

    def _options(self) -> dict:
        return {"bins": self.bins}

    def _range(self) -> float:
        """Upper edge of the histogram, the running absmax (``-inf`` before any finite value)."""
        return float(torch.maximum(-self.min_val, self.max_val))

    def _observe(self, x, finite):
        old = self._range()
        super()._observe(x, finite)
        new = self._range()
        a = (x.reshape(-1) if finite is None else x[finite]).abs().to(torch.float64)
        if a.numel() == 0:
            return
        if old >= 0 and new > old:
            self.histogram.copy_(self._rebinned(old, new))
        if new == 0:  # only zeros so far: a zero-width range, everything sits in the first bin
            self.histogram[0] += a.numel()
            return
        # bincount rather than histc: histc has no deterministic CUDA kernel.
        idx = torch.floor(a * (self.bins / new)).clamp_(max=self.bins - 1).to(torch.int64)
        self.histogram += torch.bincount(idx, minlength=self.bins).to(self.histogram.dtype)

    def _rebinned(self, old: float, new: float) -> torch.Tensor:
        hist = self.histogram.to(torch.float64)
        if old == 0:
            out = torch.zeros_like(hist)
            out[0] = hist.sum()
            return out
        # The cumulative count is piecewise linear between the old edges; sampling it at the new edges and
        # differencing moves each old bin's count into the new bins in proportion to their overlap.
        cdf = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
        old_edges = torch.linspace(0.0, old, self.bins + 1, dtype=torch.float64, device=hist.device)
        new_edges = torch.linspace(0.0, new, self.bins + 1, dtype=torch.float64, device=hist.device)
        return _interp(new_edges, old_edges, cdf).diff()

    def _edges(self) -> torch.Tensor:
        h = self.histogram
        return torch.linspace(0.0, self._range(), self.bins + 1, dtype=torch.float64, device=h.device)

    @abstractmethod
    def _threshold(self) -> torch.Tensor:
        """The clipping threshold (float32, 0-dim) the scale must cover."""

    def _calculate_scale(self) -> torch.Tensor:
        return _scale_from_absmax(self._threshold(), self.dtype, type(self).__name__)

    def reset(self) -> None:
        super().reset()
        self.histogram.zero_()


class PercentileObserver(_AbsHistogramObserver):
    """Scale ``t / qmax`` where ``t`` is the ``percentile``-th percentile of ``|x|``.

    ``t`` is read off the ``|x|`` histogram, interpolating linearly inside the bin where the cumulative count
    reaches ``percentile / 100`` of the total. Values above ``t`` saturate. Per tensor only.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, percentile: float = 99.99, bins: int = 2048):
        super().__init__(dtype, ch_axis, bins=bins)
        if not 0.0 < float(percentile) <= 100.0:
            raise QuantLensError(f"PercentileObserver: percentile must be in (0, 100], got {percentile!r}.")
        self.percentile = float(percentile)

    def _options(self) -> dict:
        return {"percentile": self.percentile, **super()._options()}

    def _threshold(self) -> torch.Tensor:
        hist = self.histogram.to(torch.float64)
        cdf = torch.cat([hist.new_zeros(1), hist.cumsum(0)])
        target = (cdf[-1] * (self.percentile / 100.0)).reshape(1)
        return _interp(target, cdf, self._edges())[0].to(torch.float32)


class MSEObserver(_AbsHistogramObserver):
    """Scale ``t / qmax`` for the clipping threshold ``t`` with the least expected squared quantization error.

    Candidates are ``t_k = absmax * k / num_candidates`` for ``k = 1..num_candidates``. For each, with
    ``s = t_k / qmax`` (march-rounded), the error is ``sum_bins n * (c - min(round(c / s), qmax) * s) ** 2``
    over the ``|x|`` histogram (``c`` the bin centre, ``n`` its count). Ties go to the largest threshold.
    Per tensor only.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, bins: int = 2048, num_candidates: int = 128):
        super().__init__(dtype, ch_axis, bins=bins)
        if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
            raise QuantLensError(f"MSEObserver: num_candidates must be a positive int, got {num_candidates!r}.")
        self.num_candidates = num_candidates

    def _options(self) -> dict:
        return {**super()._options(), "num_candidates": self.num_candidates}

    def _threshold(self) -> torch.Tensor:
        absmax = self._range()
        hist = self.histogram.to(torch.float64)
        if absmax == 0:
            return torch.zeros((), dtype=torch.float32, device=hist.device)
        k = torch.arange(1, self.num_candidates + 1, dtype=torch.float64, device=hist.device)
        thresholds = (absmax * k / self.num_candidates).to(torch.float32)
        # Score each candidate with the scale it would really get, so the winner's error is the one deployed.
        scales = _scale_from_absmax(thresholds, self.dtype, type(self).__name__).to(torch.float64)[:, None]
        edges = self._edges()
        centres = ((edges[:-1] + edges[1:]) / 2)[None, :]
        # |x| >= 0, so only the upper clamp matters; torch.round is half-to-even like the march.
        deq = torch.clamp(torch.round(centres / scales), max=self.dtype.qmax) * scales
        err = ((centres - deq) ** 2 * hist).sum(dim=1)
        best = self.num_candidates - 1 - int(torch.argmin(err.flip(0)))  # argmin takes the first: flip for last
        return thresholds[best]


class KLObserver(_AbsHistogramObserver):
    """Scale ``t / qmax`` for the clipping threshold ``t`` whose quantized distribution is closest to the
    observed one in KL divergence (entropy calibration).

    Over the ``|x|`` histogram (``bins`` bins up to the running absmax), each candidate threshold at the upper edge
    of bin ``i`` (``i = qmax + 1 .. bins``, every ``stride`` bins, and ``bins`` itself) is scored: ``P`` is the
    histogram's first ``i`` bins with every count above folded into bin ``i - 1`` (what clipping does); ``Q``
    merges those ``i`` bins into ``qmax + 1`` levels (``|q| = 0..qmax``) and spreads each level's count evenly over
    its non-empty bins (Q is built from the unclipped counts, so the folded mass is what it misses). The candidate
    with the least ``KL(P || Q)`` wins; ties go to the largest threshold. With
    ``qmax + 1 >= bins`` (int16 on the default 2048 bins) every level is finer than a bin, nothing is lost by
    keeping the full range, and the threshold is the absmax. Per tensor only.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, bins: int = 2048, stride: int = 16):
        super().__init__(dtype, ch_axis, bins=bins)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise QuantLensError(f"KLObserver: stride must be a positive int, got {stride!r}.")
        self.stride = stride

    def _options(self) -> dict:
        return {**super()._options(), "stride": self.stride}

    def _threshold(self) -> torch.Tensor:
        absmax = self._range()
        hist = self.histogram.to(torch.float64)
        levels = self.dtype.qmax + 1
        if absmax <= 0 or levels >= self.bins or float(hist.sum()) == 0:
            return torch.tensor(max(absmax, 0.0), dtype=torch.float32)
        candidates = list(range(levels, self.bins + 1, self.stride))
        if candidates[-1] != self.bins:
            candidates.append(self.bins)
        best, best_kl = self.bins, math.inf
        for i in candidates:
            kl = _kl_of_clipping(hist, i, levels)
            if kl <= best_kl:  # <=: ties go to the larger threshold
                best, best_kl = i, kl
        return torch.tensor(absmax * best / self.bins, dtype=torch.float32)


def _kl_of_clipping(hist: torch.Tensor, i: int, levels: int) -> float:
    """``KL(P || Q)`` of clipping the histogram at bin ``i`` and quantizing its ``i`` bins to ``levels`` levels."""
    p = hist[:i].clone()
    p[-1] += hist[i:].sum()
    # bin j of the first i bins belongs to level floor(j * levels / i)
    level = torch.div(torch.arange(i, dtype=torch.int64) * levels, i, rounding_mode="floor")
    nonzero = (hist[:i] > 0).to(torch.float64)
    total = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, hist[:i])
    count = torch.zeros(levels, dtype=torch.float64).index_add_(0, level, nonzero)
    # Q is built from the unclipped bins: the mass clipping folds into P's last bin is what Q cannot represent
    q = torch.where(nonzero > 0, total[level] / count[level].clamp(min=1), torch.zeros_like(p))
    p_sum, q_sum = p.sum(), q.sum()
    if p_sum <= 0 or q_sum <= 0:
        return math.inf
    p, q = _smooth(p / p_sum), _smooth(q / q_sum)
    mask = p > 0
    return float((p[mask] * torch.log(p[mask] / q[mask])).sum())


def _smooth(d: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Move ``eps`` of probability onto every empty bin (taken evenly from the others), so a sparse histogram
    (few samples, empty bins where P is not) gives a finite divergence; a no-op without empty bins."""
    zero = d == 0
    n_zero, n_other = int(zero.sum()), int((~zero).sum())
    if n_zero == 0 or n_other == 0:
        return d
    return torch.where(zero, torch.full_like(d, eps), d - eps * n_zero / n_other).clamp(min=eps * 1e-3)


class FixedScaleObserver(Observer):
    """Always returns ``scale`` (float32, 0-dim), e.g. for inputs with a known range. Per tensor only.

    ``forward`` still records min/max so that reports can show how much of the range the data used (or
    whether it saturates). :attr:`has_stats` is always true.
    """

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, scale: float):
        super().__init__(dtype, ch_axis)
        if ch_axis is not None:
            raise QuantLensError(f"FixedScaleObserver is per-tensor only (got ch_axis={ch_axis}).")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise QuantLensError(f"FixedScaleObserver: scale must be a positive finite number, got {scale!r}.")
        self.scale = float(scale)

    def _options(self) -> dict:
        return {"scale": self.scale}

    @property
    def has_stats(self) -> bool:
        return True

    def _calculate_scale(self) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32, device=self.min_val.device)


class FixedRangeObserver(FixedScaleObserver):
    """A fixed clipping range ``[-absmax, absmax]``: the scale is ``absmax / qmax`` of whatever dtype the op site
    gets (so an op site promoted to int16 keeps the range with finer steps, where a fixed scale would keep the int8
    step). Per tensor only; records min/max like :class:`FixedScaleObserver`."""

    def __init__(self, dtype: QuantDType, ch_axis: int | None = None, *, absmax: float):
        if isinstance(absmax, bool) or not isinstance(absmax, (int, float)) or not (math.isfinite(absmax)
                                                                                    and absmax > 0):
            raise QuantLensError(f"FixedRangeObserver: absmax must be a positive finite number, got {absmax!r}.")
        dtype = QuantDType.parse(dtype)
        scale = float(_scale_from_absmax(torch.tensor(float(absmax)), dtype, "FixedRangeObserver"))
        super().__init__(dtype, ch_axis, scale=scale)
        self.absmax = float(absmax)

    def _options(self) -> dict:
        return {"absmax": self.absmax}
