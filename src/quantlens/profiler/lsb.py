"""The deployed stages' figures in whole output steps (LSB): how far an integer model's values lie from the
baseline's on its own grid, and the saturation it adds.

Both are counts and a maximum, so they are computed a slice at a time in float64 scratch buffers
(:func:`~quantlens.profiler.pair_sums.scratch_rows`) with exactly the values a whole-tensor pass gives, and a row
of a large activation holds no float64 copy of it.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from quantlens._finite import all_finite
from quantlens.march import QuantDType
from quantlens.profiler.pair_sums import blocks, joined, scratch_rows

__all__ = ["LSB_VERDICTS", "LSB_BUCKETS", "lsb_report", "extra_saturation"]

#: the verdicts of the deployed stages, best first
LSB_VERDICTS = ("bit-exact", "within 1 LSB", "within 4 LSB", "diverged")
#: histogram buckets of |diff| in LSB: (label, low, high), inclusive
LSB_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-8", 5, 8), (">8", 9, math.inf))
#: steps counted one by one up to this one; every larger step falls in the last bucket
_LAST_STEP = 9


def _slices(x3: torch.Tensor, y3: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Float64 copies of consecutive blocks (channels whole) of two same-shaped ``(before, channel, after)``
    views."""
    for rows, cols in blocks(x3.shape):
        a, b = scratch_rows(x3[rows, :, cols], y3[rows, :, cols])
        yield a, b


def _same_shapes(base: list[torch.Tensor], analy: list[torch.Tensor]) -> bool:
    return len(base) == len(analy) and all(x.shape == y.shape for x, y in zip(base, analy))


def lsb_report(base: list[torch.Tensor], analy: list[torch.Tensor], scale: float | list[float] | None,
               axis: int | None = None, finite: bool = False) -> dict[str, str]:
    """``{verdict, hist}`` of ``|base - analy| / scale`` rounded to whole LSB (values on one grid differ by whole
    steps; rounding absorbs float32 noise). A per-channel ``scale`` (a list) divides along ``axis`` of a single
    output."""
    if scale is None or not _same_shapes(base, analy):
        return {}
    if isinstance(scale, list):
        if axis is None or len(base) != 1 or base[0].dim() == 0 or min(scale) <= 0 or \
                base[0].shape[axis % base[0].dim()] != len(scale):
            return {}
        x, y = base[0].detach(), analy[0].detach()
        axis %= x.dim()
        channels = x.shape[axis]
        x3, y3 = x.reshape(math.prod(x.shape[:axis]), channels, -1), y.reshape(math.prod(x.shape[:axis]), channels, -1)
        step = torch.tensor(scale, dtype=torch.float64).reshape(1, -1, 1)
    elif scale <= 0:
        return {}
    else:
        x, y = joined(base).reshape(-1), joined(analy).reshape(-1)
        x3, y3 = x.reshape(-1, 1, 1), y.reshape(-1, 1, 1)
        step = scale
    if x.numel() == 0 or not (finite or (all_finite(x) and all_finite(y))):
        return {}
    counts = torch.zeros(_LAST_STEP + 1, dtype=torch.int64)
    for a, b in _slices(x3, y3):
        lsb = a.sub_(b).abs_().div_(step).round_().clamp_(max=_LAST_STEP)
        counts += torch.bincount(lsb.reshape(-1).to(torch.int64), minlength=_LAST_STEP + 1)
    worst = max(i for i in range(_LAST_STEP + 1) if counts[i])
    verdict = ("bit-exact" if worst == 0 else "within 1 LSB" if worst <= 1 else "within 4 LSB" if worst <= 4
               else "diverged")
    per_step = counts.tolist()
    buckets = [sum(per_step[lo:min(hi, _LAST_STEP) + 1]) for _, lo, hi in LSB_BUCKETS]
    return {"verdict": verdict, "hist": "|".join(f"{label}:{n}" for (label, _, _), n in zip(LSB_BUCKETS, buckets))}


def extra_saturation(base: list[torch.Tensor], analy: list[torch.Tensor], dtype: str, scale: float | None) -> float | None:
    """Fraction of ``analy`` at the limit (qmin/qmax) of the integer type whose ``base`` value lies at least two
    steps inside the range: saturation that the baseline's fake quant did not do (one step is rounding)."""
    if scale is None or scale <= 0 or dtype not in ("qint8", "qint16") or not _same_shapes(base, analy):
        return None
    x, y = joined(base).reshape(-1), joined(analy).reshape(-1)
    if x.numel() == 0:
        return None
    dt = QuantDType.parse(dtype)
    count = 0
    for a, b in _slices(x.reshape(-1, 1, 1), y.reshape(-1, 1, 1)):
        qx, qy = a.div_(scale).round_(), b.div_(scale).round_()
        inside = (qx >= dt.qmin + 2) & (qx <= dt.qmax - 2)
        count += int((((qy <= dt.qmin) | (qy >= dt.qmax)) & inside).sum())
    return count / x.numel()
