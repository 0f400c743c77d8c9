"""The data the passes of a search share: what stays fixed (:class:`SearchContext`) and what they change
(:class:`SearchState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantlens.search.clock import StepClock
from quantlens.search.goal import Goal
from quantlens.search.graph import SearchGraph
from quantlens.search.measure import Measurer
from quantlens.search.progress import Progress
from quantlens.search.promotion import Promotion
from quantlens.search.result import CurvePoint

__all__ = ["SearchContext", "SearchState"]


@dataclass(frozen=True, eq=False)
class SearchContext:
    """What every pass reads and none changes."""

    goal: Goal
    measurer: Measurer
    graph: SearchGraph
    #: ``int`` (most promotions), :class:`~quantlens.search.promotion.MaxLatency` or None
    budget: Any
    candidates: tuple[Promotion, ...]
    #: the first ranking (the profiler's sensitivity or the caller's), most promising first
    first_ranking: tuple[Promotion, ...]
    tries: int
    #: the most promotions a pass may hold (the number of candidates, or an ``int`` budget below it)
    max_steps: int
    #: the wall time of each pass (``MixedPrecisionResult.step_times``)
    clock: StepClock = field(default_factory=StepClock)


@dataclass(eq=False)
class SearchState:
    """The search so far: the chosen promotions, the current ranking, the curve and the step count. ``steps``
    is the progress file's step log (the list inside ``progress.data``)."""

    selected: list[Promotion]
    ranking: list[Promotion]
    curve: list[CurvePoint]
    steps: list[dict]
    progress: Progress
    step: int = 0

    @property
    def metric(self) -> float:
        """The metric of the current set (the curve's last point)."""
        return self.curve[-1].metric

    def add_point(self, point: CurvePoint, entry: dict | None = None) -> None:
        """Append ``point`` to the curve and ``entry`` (if any) to the step log, unless a resumed run's log
        already holds this step."""
        self.curve.append(point)
        if entry is not None and len(self.steps) < self.step:
            self.steps.append(entry)
            self.progress.save()
