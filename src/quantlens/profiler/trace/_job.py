"""One op site's copies on their way to disk, and the small facts the writer reads off tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from quantlens.profiler.trace.format import TensorStat, TracedSite

__all__ = ["Job", "scale_value", "version"]


def scale_value(scale: torch.Tensor | None) -> float | list[float] | None:
    if scale is None:
        return None
    values = [float(v) for v in scale.detach().cpu().reshape(-1).tolist()]  # (one call, not a tensor per value)
    return values[0] if len(values) == 1 and scale.dim() == 0 else values


def version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None where torch keeps none: inference tensors)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


@dataclass(eq=False)  # (a job is itself: the queue's lists find it by identity, never by comparing tensors)
class Job:
    """One op site's copies on their way to disk (see :class:`TraceWriter`)."""

    site: TracedSite
    tensors: dict[str, torch.Tensor]  # the copies to store, by key
    order: list[str]  # every key of the site, stored or referenced, in the trace's order
    nbytes: int
    quant_error: Callable[[], Any] | None = None  # computed by the writer thread (see torch_probe)
    stats: dict[str, TensorStat] = field(default_factory=dict)
    encode: dict[str, tuple[float, int, int, torch.dtype]] = field(default_factory=dict)  # key -> grid
    buffer: torch.Tensor | None = None  # the pool buffer holding the copies
    stats_only: frozenset[str] = frozenset()  # keys whose statistics are computed but which are not written
    # Storing a site has two parts: computing (statistics, codes, the file, the deferred split: on the writer
    # thread, or on the forward's thread where it would wait) and recording (in queue order, on the writer thread).
    claimed: bool = False  # some thread computes it (under TraceWriter._lock)
    computed: threading.Event = field(default_factory=threading.Event)  # set once the computing part is done
    error: BaseException | None = None  # what the computing part raised, on a helping thread
    payload: dict[str, torch.Tensor] | None = None  # what the file holds, for holding it (no codes)
    weight: tuple[torch.Tensor, int | None] | None = None  # the weight the op read and its version then (the
    # model's own tensor: kept until finish() checks it)
