"""Measuring a configuration: prepare -> calibrate -> evaluate (and, on request, its latency estimate), each
configuration once, the values kept in the progress file."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import nn

from quantlens.quantization.calibration_stats import CalibrationStats
from quantlens.quantization.prepare import prepare
from quantlens.search.evaluation import call_evaluate
from quantlens.search.goal import Goal
from quantlens.search.progress import Progress, selection_key
from quantlens.search.promotion import Promotion
from quantlens.search.setter import MixedPrecisionQconfigSetter

__all__ = ["Builder", "Measurer", "describe_selection"]


def describe_selection(selection: Sequence[Promotion]) -> str:
    """A configuration of the mixed-precision search in words (errors name it)."""
    if not selection:
        return "'the base setter, no int16'"
    return "'int16 at " + ", ".join(p.label() for p in sorted(selection)) + "'"


@dataclass(frozen=True, eq=False)
class Builder:
    """Builds the calibrated model of a set of promotions on top of ``base_setter``. A promotion changes dtypes
    only, so the calibration statistics of the configurations built before serve it (``stats``: the batches run
    once per observer, the same scales bit for bit)."""

    model: nn.Module
    example_inputs: Any
    batches: list
    base_setter: Any
    stats: CalibrationStats = field(default_factory=CalibrationStats)

    def __call__(self, selection: Sequence[Promotion]) -> nn.Module:
        setter = MixedPrecisionQconfigSetter(selection, self.base_setter)
        # every configuration re-runs prepare and calibrate: their warnings would repeat once per measurement; a
        # model without QuantStub was the user's choice at their own prepare (allow_no_stubs), not refused again
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare(self.model, self.example_inputs, setter, check_result_dir=None, allow_no_stubs=True)
            self.stats.calibrate(prepared, self.batches)
        return prepared


class Measurer:
    """The metric (:meth:`measure`) and latency estimate (:meth:`latency_of`) of a set of promotions, each
    computed once and saved to the progress file as it finishes (a resumed search replays them)."""

    def __init__(self, build: Builder, evaluate: Callable[[nn.Module], float], goal: Goal, latency: bool,
                 progress: Progress):
        self.build = build
        self.evaluate = evaluate
        self.goal = goal
        self.latency = latency
        self.progress = progress
        self._metrics = progress.data["measurements"]
        self._cycles = progress.data["latency"]

    @property
    def count(self) -> int:
        """How many configurations have been measured (this run and the runs it resumed)."""
        return len(self._metrics)

    def measure(self, selection: Sequence[Promotion], prepared: nn.Module | None = None) -> float:
        """``evaluate`` of the calibrated model of ``selection`` (``prepared`` when already built); a value that
        is not one finite number, or an error of ``evaluate``, is an
        :class:`~quantlens.search.evaluation.EvaluateError` naming the configuration."""
        key = selection_key(selection)
        if key not in self._metrics:
            prepared = prepared if prepared is not None else self.build(selection)
            self._metrics[key] = call_evaluate(self.evaluate, prepared, describe_selection(selection))
            self.progress.save()
        return self._metrics[key]

    def latency_of(self, selection: Sequence[Promotion]) -> int | None:
        """The quantized IR's latency estimate of ``selection`` in cycles (None without ``latency``)."""
        if not self.latency:
            return None
        key = selection_key(selection)
        if key not in self._cycles:
            # imported here: only latency=True needs export and convert
            from quantlens.compiler import convert, export

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q_ir = convert(export(self.build(selection), self.build.example_inputs))
            self._cycles[key] = int(q_ir.latency_estimate().cycles)
            self.progress.save()
        return self._cycles[key]
