"""Metrics that compare a baseline tensor ``x`` with an analysis tensor ``y`` (a registry).

Every metric is computed in float64 on the flattened tensors, so results do not depend on the models' dtypes.
Definitions (also in ``docs/profiler.md``):

=========  =====================================================================  ==============
metric     value                                                                  worse when
=========  =====================================================================  ==============
Cosine     ``<x, y> / (‖x‖ ‖y‖)``; 1 when both are all zero, 0 when only one is    lower
MSE        ``mean((x - y)^2)``                                                    higher
L1         ``mean(|x - y|)``                                                      higher
KL         ``mean over positions of sum_c p_c (log p_c - log q_c)`` with
           ``p = softmax(x)``, ``q = softmax(y)`` over dim 1 if ``x.dim() > 2``,
           else over the last dim                                                 higher
SQNR       ``20 log10(‖x‖ / ‖x - y‖)`` dB; +inf when identical                    lower
Atol       ``max |x - y|``                                                        higher
=========  =====================================================================  ==============

The error in units of an op's output scale (``Atol / scale``) is :func:`in_scale_units`; it is not a registry
entry because it needs the scale as well as the two tensors. Per-channel SQNR (:func:`channel_sqnr`) is not one
either: it needs the channel axis, and gives one value per channel.

A tensor containing NaN/Inf gives NaN for every metric (the advisor reports NaN/Inf separately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import torch

from quantlens._finite import all_finite
from quantlens.errors import QuantLensError
from quantlens.profiler.pair_sums import PairSums, blocks, pair_kl, pair_sums, scratch_rows
from quantlens.quantization.qconfig_template import METRIC_HIGHER_IS_WORSE, register_metric_direction

__all__ = ["Metric", "METRICS", "register_metric", "get_metric", "metric_names", "compute_all", "compute_pair",
           "MetricPair", "in_scale_units", "custom_metric", "channel_sqnr", "channel_signal", "sqnr_of_energies",
           "SAME_INPUT_SQNR_LIMIT"]

#: a same-input SQNR below this (dB) means the op itself loses precision (int8 on well-scaled data gives ~35-45);
#: also the limit of the per-channel share ``channels_below`` (a channel below it is a damaged channel). The
#: advisor's threshold of the same name is this one.
SAME_INPUT_SQNR_LIMIT = 20.0


@dataclass(frozen=True)
class Metric:
    """A comparison of two same-shaped tensors. ``higher_is_worse`` orders results (worst first)."""

    name: str
    func: Callable[[torch.Tensor, torch.Tensor], float]
    higher_is_worse: bool
    description: str = ""
    #: a built-in's formula on a :class:`MetricPair` (``func`` wraps it): :func:`compute_all` hands every built-in
    #: one pair, so ``x - y`` and ``|x - y|`` are computed once per row, not once per metric
    pair_func: Callable[["MetricPair"], float] | None = None

    def __call__(self, baseline: torch.Tensor, analysis: torch.Tensor) -> float:
        x, y = _detached(baseline), _detached(analysis)
        if x.shape != y.shape:
            raise QuantLensError(
                f"Metric {self.name}: shapes differ, baseline {tuple(baseline.shape)} vs analysis "
                f"{tuple(analysis.shape)}. Both models must produce the same output structure for one input."
            )
        if not (all_finite(x) and all_finite(y)):
            return math.nan
        if self.pair_func is not None:
            return float(self.pair_func(MetricPair(x, y)))
        return float(self.func(_prepare(x), _prepare(y)))

    def worse(self, a: float, b: float) -> bool:
        """Whether value ``a`` is strictly worse than ``b`` (NaN counts as the worst possible value)."""
        if math.isnan(a):
            return not math.isnan(b)
        if math.isnan(b):
            return False
        return a > b if self.higher_is_worse else a < b

    def sort_key(self, value: float) -> float:
        """Key that sorts worst first with ``sorted(..., key=...)`` (NaN first)."""
        if math.isnan(value):
            return -math.inf
        return -value if self.higher_is_worse else value


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def _prepare(t: torch.Tensor) -> torch.Tensor:
    """The float64 copy a metric that is not built in receives."""
    return t.detach().to(torch.float64).cpu()


class MetricPair:
    """The baseline ``x`` and analysis ``y`` of one row (any float dtype, one shape), and the float64 sums the
    built-in metrics are formulas of (:func:`~quantlens.profiler.pair_sums.pair_sums`), computed once per pair:
    no float64 copy of either tensor is made."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sums: PairSums | None = None):
        self.x, self.y = x, y
        if sums is not None:  # computed already, with the row's other sums (pair_sums.row_sums)
            self.__dict__["sums"] = sums

    @cached_property
    def sums(self) -> PairSums:
        return pair_sums(self.x, self.y)

    @property
    def x_norm(self) -> float:
        return math.sqrt(self.sums.xx)

    @property
    def diff_norm(self) -> float:
        return math.sqrt(self.sums.dd)


def _cosine(p: MetricPair) -> float:
    nx, ny = p.x_norm, math.sqrt(p.sums.yy)
    if nx == 0 and ny == 0:
        return 1.0
    if nx == 0 or ny == 0:
        return 0.0
    return p.sums.xy / (nx * ny)


def _mse(p: MetricPair) -> float:
    return p.sums.dd / p.sums.count if p.sums.count else 0.0


def _l1(p: MetricPair) -> float:
    return p.sums.ad / p.sums.count if p.sums.count else 0.0


def _kl(p: MetricPair) -> float:
    return pair_kl(p.x, p.y)


def _sqnr(p: MetricPair) -> float:
    noise = p.diff_norm
    if noise == 0:
        return math.inf
    signal = p.x_norm
    if signal == 0:
        return -math.inf
    return 20.0 * math.log10(signal / noise)


def _atol(p: MetricPair) -> float:
    return p.sums.amax


METRICS: dict[str, Metric] = {}


def register_metric(metric: Metric) -> Metric:
    """Add a metric to the registry (the name is what users pass, e.g. ``metric="L1"``). Its function may run on
    any thread, and on two at once (the trace writer's during ``run()``, two rows at a time in
    ``compare_per_layer()``): a pure function of its two tensors."""
    METRICS[metric.name] = metric
    # the sensitive-op qconfig setters (below the profiler) read a sensitivity row's direction from there
    register_metric_direction(metric.name, metric.higher_is_worse)
    return metric


def _builtin(name: str, pair_func: Callable[[MetricPair], float], description: str) -> Metric:
    # the direction of a built-in is declared once, in the quantization layer's table of sensitivity metrics
    return register_metric(Metric(name, lambda x, y: pair_func(MetricPair(x, y)),
                                  higher_is_worse=METRIC_HIGHER_IS_WORSE[name], description=description,
                                  pair_func=pair_func))


_builtin("Cosine", _cosine, "cosine similarity")
_builtin("MSE", _mse, "mean squared error")
_builtin("L1", _l1, "mean absolute error")
_builtin("KL", _kl, "KL(softmax(baseline) || softmax(analysis))")
_builtin("SQNR", _sqnr, "signal-to-quantization-noise ratio, dB")
_builtin("Atol", _atol, "max absolute difference")


def compute_all(baseline: torch.Tensor, analysis: torch.Tensor,
                names: Sequence[str] | None = None) -> dict[str, float]:
    """Every registered metric of one pair (or those in ``names``), the float64 copies and the NaN/Inf check made
    once (the same values as calling each :class:`Metric`)."""
    return compute_pair(baseline, analysis, names)[0]


def compute_pair(baseline: torch.Tensor, analysis: torch.Tensor, names: Sequence[str] | None = None,
                 finite: bool = False, sums: PairSums | None = None) -> tuple[dict[str, float], MetricPair | None]:
    """:func:`compute_all`, and the float64 pair with the intermediates it computed (None when the shapes
    differ), for more figures of the same pair without computing them again. ``finite``: both tensors are known
    to be finite (a trace's statistics say so), so they are not checked again. ``sums``: the pair's
    :class:`PairSums`, computed already."""
    chosen = {n: METRICS[n] for n in names} if names is not None else METRICS
    x, y = _detached(baseline), _detached(analysis)
    if x.shape != y.shape:
        return {name: metric(baseline, analysis) for name, metric in chosen.items()}, None  # raises, naming it
    pair = MetricPair(x, y, sums)
    if not finite and not (all_finite(x) and all_finite(y)):
        return {name: math.nan for name in chosen}, pair
    copies: list[torch.Tensor] = []  # float64 copies, made only for a metric that is not built in

    def value(metric: Metric) -> float:
        if metric.pair_func is not None:
            return float(metric.pair_func(pair))
        if not copies:
            copies.extend((_prepare(x), _prepare(y)))
        return float(metric.func(*copies))

    return {name: value(metric) for name, metric in chosen.items()}, pair


def metric_names() -> list[str]:
    return list(METRICS)


def get_metric(name: str) -> Metric:
    """The registered metric ``name`` (case-insensitive)."""
    if isinstance(name, Metric):
        return name
    for key, metric in METRICS.items():
        if isinstance(name, str) and key.lower() == name.lower():
            return metric
    raise QuantLensError(
        f"Unknown metric {name!r}. Expected one of {metric_names()} (case-insensitive), or pass "
        "custom_metric_func= with custom_metric_order_seq= where a custom metric is accepted."
    )


_ORDERS = {"descending": True, "ascending": False}


def custom_metric(func: Callable, order: str | None, name: str = "Custom") -> Metric:
    """Wrap a user metric ``func(baseline, analysis) -> float``.

    ``order`` says how to sort it so that the worst comes first: ``"descending"`` (larger is worse, like L1)
    or ``"ascending"`` (smaller is worse, like Cosine).
    """
    if not callable(func):
        raise QuantLensError(f"custom_metric_func must be callable(baseline, analysis) -> float, got {func!r}.")
    if order not in _ORDERS:
        raise QuantLensError(
            f"custom_metric_order_seq must be 'descending' (larger values are worse, like L1) or 'ascending' "
            f"(smaller values are worse, like Cosine), got {order!r}."
        )

    def call(x: torch.Tensor, y: torch.Tensor) -> float:
        value = func(x, y)
        if isinstance(value, torch.Tensor):
            value = value.item()
        return float(value)

    return Metric(name, call, higher_is_worse=_ORDERS[order], description="user metric")


def in_scale_units(atol: float | None, scale: float | None) -> float | None:
    """``atol / scale``: an error in output quantization steps (None without a per-tensor scale)."""
    if atol is None or scale is None or scale <= 0:
        return None
    return atol / scale


def _energy(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a float64 ``(before, channel, after)`` tensor per channel."""
    if t.shape[2] == 1:  # channels last (a linear's output): a column sum
        return t.reshape(t.shape[0], t.shape[1]).square().sum(0)
    return torch.linalg.vector_norm(t, dim=2).square().sum(0)  # contiguous rows: no temporary


def _by_channel(t: torch.Tensor, axis: int) -> torch.Tensor:
    return t.detach().cpu().reshape(math.prod(t.shape[:axis]), t.shape[axis], -1)


def channel_signal(baseline: torch.Tensor, axis: int) -> torch.Tensor:
    """The energy (sum of squares, float64) of each channel of ``baseline`` along ``axis``: the signal of
    :func:`channel_sqnr`."""
    x3 = _by_channel(baseline, axis % baseline.dim())
    signal = torch.zeros(x3.shape[1], dtype=torch.float64)
    for rows, cols in blocks(x3.shape):
        (a,) = scratch_rows(x3[rows, :, cols])
        signal += _energy(a)
    return signal


def channel_sqnr(baseline: torch.Tensor, analysis: torch.Tensor, axis: int,
                 signal: torch.Tensor | None = None, finite: bool = False) -> torch.Tensor | None:
    """The SQNR (dB) of each channel along ``axis``: ``20 log10(‖x_c‖ / ‖x_c - y_c‖)``, +inf for a channel the
    analysis reproduces exactly, in channel order.

    A channel whose baseline is all zero has no SQNR (there is no signal to compare its error with; e.g. a ReLU
    channel dead on the bad case) and is left out of the result; its error still counts in the whole-tensor
    SQNR. None when the shapes differ, the tensor is a scalar, a tensor holds NaN/Inf (the whole-tensor metrics
    are NaN then) or no channel has signal.

    One pass over each tensor: the values are viewed as ``(before, channel, after)`` and the norms taken over
    ``after`` (contiguous), then summed over ``before``; the values go to float64 a block at a time (every
    channel whole: :func:`~quantlens.profiler.pair_sums.blocks`), into reused scratch buffers (:func:`~quantlens.profiler.pair_sums.scratch_rows`), not as copies of the
    activation. ``signal``: :func:`channel_signal` of ``baseline`` when
    already computed (several analysis tensors against one baseline); ``finite``: both are known to be finite."""
    x, y = _detached(baseline), _detached(analysis)
    if x.shape != y.shape or x.dim() == 0 or x.numel() == 0 or not (finite or (all_finite(x) and all_finite(y))):
        return None
    axis %= x.dim()
    x3, y3 = _by_channel(x, axis), _by_channel(y, axis)
    signal = channel_signal(x, axis) if signal is None else signal
    noise = torch.zeros_like(signal)
    for rows, cols in blocks(x3.shape):
        a, b = scratch_rows(x3[rows, :, cols], y3[rows, :, cols])
        noise += _energy(a.sub_(b))
    return sqnr_of_energies(signal, noise)


def sqnr_of_energies(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor | None:
    """:func:`channel_sqnr` from the channels' energies ``Σx_c²`` and ``Σ(x_c - y_c)²`` (float64)."""
    has_signal = signal > 0
    if not bool(has_signal.any()):
        return None
    # noise 0 -> signal / 0 = +inf -> +inf dB: an exact channel (energies: 10 log10 of their ratio)
    return 10.0 * torch.log10(signal[has_signal] / noise[has_signal])
