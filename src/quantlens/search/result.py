"""What a search returns: the curve (:class:`CurvePoint`) and :class:`MixedPrecisionResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.clock import StepTime
from quantlens.search.promotion import Promotion
from quantlens.search.setter import MixedPrecisionQconfigSetter

__all__ = ["CurvePoint", "MixedPrecisionResult"]


@dataclass(frozen=True)
class CurvePoint:
    """The search after ``step`` steps (step 0: the base setter alone). A step adds one promotion (``added``) or,
    in the pruning pass after the target is reached, takes one back that the target no longer needs
    (``removed``); an exchange step does both (``removed`` swapped for ``added``)."""

    step: int
    num_int16: int
    added: Promotion | None
    metric: float
    latency_cycles: int | None
    tried: int
    removed: Promotion | None = None
    #: ``method="descend"``: the point keeps the ``kept`` most-needed op sites (no single promotion added)
    kept: int | None = None
    #: the greedy pass ended short of the target: the point goes back to its best set (its first ``num_int16``)
    back: bool = False


@dataclass(frozen=True)
class MixedPrecisionResult:
    """The chosen promotions (in the order the search added them), the curve, and where the files are."""

    chosen: tuple[Promotion, ...]
    curve: tuple[CurvePoint, ...]
    target: float
    reached: bool
    base_metric: float
    metric: float
    candidates: tuple[Promotion, ...]
    measurements: int
    int16x16_resolutions: tuple[str, ...]
    csv_path: str = field(compare=False)
    html_path: str = field(compare=False)
    progress_path: str = field(compare=False)
    base_setter: Any = field(default=default_calibration_qconfig_setter, compare=False, repr=False)
    #: the wall time of each step (base, ranking, greedy, prune, ...), in the order they ran
    step_times: tuple[StepTime, ...] = field(default=(), compare=False)

    @property
    def num_int16(self) -> int:
        """How many promotions were chosen."""
        return len(self.chosen)

    def setter(self) -> MixedPrecisionQconfigSetter:
        """A qconfig setter that ``prepare`` takes unchanged: the chosen promotions, then the base setter."""
        return MixedPrecisionQconfigSetter(self.chosen, self.base_setter)
