"""``auto_find_bad_case``: the sample on which the analysis model departs most from the baseline.

Both models run over the data; for every (float) model output and every metric the worst sample is kept.
"Worst" follows each metric's order (largest L1/MSE/KL/Atol, smallest Cosine/SQNR); ties keep the earlier
sample, so the result is deterministic. Only the inputs of samples that are currently worst somewhere are
kept in memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from quantlens.errors import QuantLensError
from quantlens.profiler.metrics import METRICS, Metric, custom_metric, get_metric
from quantlens.profiler.model_access import ModelAccess
from quantlens.profiler.outputs import PostProcess, float_outputs
from quantlens.profiler.progress import progress_iter

__all__ = ["BadCaseResult", "find_bad_case"]


@dataclass
class BadCaseResult:
    """What :meth:`QuantAnalysis.auto_find_bad_case` found (and ``badcase.txt`` shows)."""

    metric: str  # the metric that chose the bad case
    metrics: list[str]
    outputs: list[str]
    num_samples: int
    worst_index: dict[str, dict[str, int]]  # output -> metric -> sample index
    worst_value: dict[str, dict[str, float]]  # output -> metric -> value at that index
    overall: dict[str, tuple[int, str, float]]  # metric -> (sample index, output, value), over all outputs
    inputs: dict[int, Any] = field(default_factory=dict, repr=False)  # sample index -> its inputs
    #: output -> metric -> the value of every searched sample, in sample order (badcase_report.html)
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict, repr=False)

    @property
    def bad_case_index(self) -> int:
        """The sample used by ``run()``: the worst one under :attr:`metric` over all outputs."""
        return self.overall[self.metric][0]

    @property
    def bad_case(self) -> Any:
        return self.inputs[self.bad_case_index]


def _metric_set(metric: str, func, order) -> tuple[list[Metric], Metric]:
    metrics = list(METRICS.values())
    if func is not None:
        custom = custom_metric(func, order)
        return metrics + [custom], custom
    if order is not None:
        raise QuantLensError("custom_metric_order_seq was given without custom_metric_func; pass both or neither.")
    return metrics, get_metric(metric)


def find_bad_case(
    baseline: ModelAccess,
    analysis: ModelAccess,
    data: Iterable[Any],
    post_process: PostProcess,
    num_steps: int | None = None,
    metric: str = "L1",
    custom_metric_func=None,
    custom_metric_order_seq: str | None = None,
    progress: bool = True,
) -> BadCaseResult:
    """Run both models over ``data`` (each item is one call's inputs) and keep the worst samples."""
    metrics, primary = _metric_set(metric, custom_metric_func, custom_metric_order_seq)
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
        raise QuantLensError(f"num_steps must be a positive int or None (all data), got {num_steps!r}.")
    items = itertools.islice(data, num_steps) if num_steps is not None else data
    total = num_steps if num_steps is not None else (len(data) if hasattr(data, "__len__") else None)
    worst: dict[tuple[str, str], tuple[int, float]] = {}
    outputs: list[str] = []
    inputs: dict[int, Any] = {}
    values: dict[str, dict[str, list[float]]] = {}
    count = 0
    for index, example in enumerate(progress_iter(items, "searching bad case", total, progress)):
        count += 1
        base = float_outputs(post_process.outputs(baseline.run(example)))
        analy = float_outputs(post_process.outputs(analysis.run(example)))
        if set(base) != set(analy):
            raise QuantLensError(
                f"Sample {index}: the models returned different outputs (baseline {sorted(base)}, analysis "
                f"{sorted(analy)}). Both must return the same structure for the same input."
            )
        if not base:
            raise QuantLensError("The models returned no floating-point tensor output; there is nothing to compare.")
        for name in base:
            if name not in outputs:
                outputs.append(name)
            for m in metrics:
                value = m(base[name], analy[name])
                values.setdefault(name, {}).setdefault(m.name, []).append(value)
                key = (name, m.name)
                if key not in worst or m.worse(value, worst[key][1]):
                    worst[key] = (index, value)
        inputs[index] = example
        keep = {i for i, _ in worst.values()}
        for i in [i for i in inputs if i not in keep]:
            del inputs[i]
    if count == 0:
        raise QuantLensError("auto_find_bad_case: data_generator yielded no samples.")
    names = [m.name for m in metrics]
    overall: dict[str, tuple[int, str, float]] = {}
    for m in metrics:
        for out in outputs:
            index, value = worst[(out, m.name)]
            if m.name not in overall or m.worse(value, overall[m.name][2]):
                overall[m.name] = (index, out, value)
    return BadCaseResult(
        metric=primary.name, metrics=names, outputs=outputs, num_samples=count,
        worst_index={o: {m: worst[(o, m)][0] for m in names} for o in outputs},
        worst_value={o: {m: worst[(o, m)][1] for m in names} for o in outputs},
        overall=overall, inputs=inputs, values=values,
    )
