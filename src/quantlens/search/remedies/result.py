"""What the remedies search returns and its report reads: every measured candidate (:class:`Trial`), the remedies
that failed (:class:`SkippedRemedy`) and the choice (:class:`RemedyResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quantlens.search.clock import StepTime

__all__ = ["Trial", "SkippedRemedy", "RemedyResult", "level_now"]


def level_now() -> int | str:
    """The consistency level set now, as a result names it (``"off"``: none set)."""
    from quantlens.quantization import ConsistencyStrategy

    level = ConsistencyStrategy.get_consistency_level()
    return "off" if level is None else int(level)


@dataclass(frozen=True)
class Trial:
    """One measured candidate: the remedy (``kind``: "equalization", "weights", "range" or "int16"), where it
    applies, its value of the metric, and whether it was kept."""

    kind: str
    name: str
    site: str
    value: float
    kept: bool
    #: a kept remedy: the metric before it (its measured gain is ``value - before``)
    before: float | None = None
    #: a kept remedy with ``latency=True``: the latency estimate (cycles) before and after it
    cycles: tuple[int, int] | None = None
    #: the noise of the configuration it was measured against (:mod:`.noise`): it is kept only when it gains more
    noise: float | None = None


@dataclass(frozen=True)
class SkippedRemedy:
    """A whole-model remedy that failed and was skipped: its name and the error, on one line."""

    name: str
    error: str


@dataclass(frozen=True)
class RemedyResult:
    """What the search chose: ``model`` (the float model after the kept transforms) and ``setter`` (ranges and
    int16 promotions on top of the base setter) go to ``prepare`` unchanged; ``value`` is their metric."""

    model: nn.Module
    setter: Any
    value: float
    base_value: float
    observers: dict[str, str]
    int16: tuple = ()
    trials: tuple[Trial, ...] = field(default_factory=tuple)
    #: the kept whole-model remedies, in the order applied (their names in ``REMEDIES``)
    transforms: tuple[str, ...] = ()
    target: float | None = None
    higher_is_better: bool = True
    #: the int16 phase's curve (metric vs int16 sites), empty when it did not run
    int16_curve: tuple = ()
    #: ``latency=True``: the quantized IR's latency estimate (cycles) of the base setter and of the result
    latency_cycles: tuple[int, int] | None = None
    #: what ``value`` measures, in words (the report and the console name it)
    metric: str = "evaluate(prepared)"
    #: the metric's noise around the base configuration (:mod:`.noise`; each trial carries the one it was
    #: judged against)
    noise: float = 0.0
    #: the whole-model remedies that failed, in the order tried
    skipped: tuple[SkippedRemedy, ...] = ()
    #: the fingerprint of the float model the search started from (``load_remedies`` refuses another model)
    model_digest: str = ""
    #: the wall time of each step of the search (base, each whole-model remedy, the ranges, the int16 phase's
    #: passes), in the order they ran
    step_times: tuple[StepTime, ...] = ()
    #: ``search_remedies(deployed=...)``: the metric of the result's deployed model (the quantized IR), measured
    #: after the int16 phase (None: not measured)
    deployed_value: float | None = None
    #: the consistency level every configuration was prepared at (``"off"``: none set): deploy at the same level,
    #: or the integer model is not the one measured
    consistency_level: int | str = "off"

    def reached(self, target: float | None = None, higher_is_better: bool | None = None) -> bool:
        """Whether ``value`` reaches ``target`` (default: the search's own), and the deployed model's value too
        where it was measured."""
        target = self.target if target is None else target
        higher = self.higher_is_better if higher_is_better is None else higher_is_better
        values = [self.value] + ([self.deployed_value] if self.deployed_value is not None else [])
        return all(v >= target if higher else v <= target for v in values)
