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
from quantlens.profiler.bad_case_shapes import explain_shape_error
from quantlens.profiler.metrics import METRICS, Metric, custom_metric, get_metric
from quantlens.profiler.model_access import ModelAccess
from quantlens.profiler.outputs import PostProcess, float_outputs
from quantlens.profiler.progress import progress_iter

__all__ = ["BadCaseResult", "find_bad_case"]


@dataclass(frozen=True)
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
    #: how many worst samples are kept per output x metric (``auto_find_bad_case(..., topk=k)``)
    k: int = 1
    #: output -> metric -> the k worst samples ``(sample index, value)``, worst first (ties: earlier sample first);
    #: ``topk[o][m][0]`` is ``(worst_index[o][m], worst_value[o][m])``
    topk: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    #: metric -> the k worst distinct samples over all outputs ``(sample index, output, value)``, worst first (a
    #: sample is ranked by its worst output); ``overall_topk[m][0] == overall[m]``
    overall_topk: dict[str, list[tuple[int, str, float]]] = field(default_factory=dict)

    def ranked(self, rank: int = 1, metric: str | None = None, output: str | None = None) -> int:
        """The sample index of the ``rank``-th worst sample (1 = the worst) under ``metric`` (default: the metric
        that chose the bad case), over all outputs or for one ``output``."""
        metric = self.metric if metric is None else metric
        if metric not in self.metrics:
            raise QuantLensError(f"Bad case rank: unknown metric {metric!r}; the search used {self.metrics}.")
        if output is not None and output not in self.outputs:
            raise QuantLensError(f"Bad case rank: unknown output {output!r}; the models returned {self.outputs}.")
        ranking = ([i for i, _ in self.topk[output][metric]] if output is not None
                   else [i for i, _, _ in self.overall_topk[metric]])
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= len(ranking):
            where = f"output {output!r}" if output is not None else "all outputs"
            raise QuantLensError(
                f"Bad case rank {rank!r} is out of range: the search kept {len(ranking)} samples under {metric} for "
                f"{where} (ranks 1..{len(ranking)}, 1 = the worst). Pass a rank in that range, or search again with "
                "auto_find_bad_case(data, topk=k) for more.")
        return ranking[rank - 1]

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
    topk: int = 1,
) -> BadCaseResult:
    """Run both models over ``data`` (each item is one call's inputs) and keep the worst samples."""
    metrics, primary = _metric_set(metric, custom_metric_func, custom_metric_order_seq)
    _check_search_args(num_steps, topk)
    items = itertools.islice(data, num_steps) if num_steps is not None else data
    total = num_steps if num_steps is not None else (len(data) if hasattr(data, "__len__") else None)
    worst: dict[tuple[str, str], list[tuple[int, float]]] = {}  # the k worst, worst first
    outputs: list[str] = []
    inputs: dict[int, Any] = {}
    values: dict[str, dict[str, list[float]]] = {}
    count = 0
    for index, example in enumerate(progress_iter(items, "searching bad case", total, progress)):
        count += 1
        base, analy = _sample_outputs(index, example, baseline, analysis, post_process)
        for name in base:
            if name not in outputs:
                outputs.append(name)
            for m in metrics:
                value = m(base[name], analy[name])
                values.setdefault(name, {}).setdefault(m.name, []).append(value)
                _rank(worst.setdefault((name, m.name), []), index, value, m, topk)
        inputs[index] = example
        _drop_unranked(inputs, worst)
    if count == 0:
        raise QuantLensError("auto_find_bad_case: data_generator yielded no samples.")
    names = [m.name for m in metrics]
    overall_topk = _overall_topk(metrics, outputs, worst, topk)
    overall = _overall(metrics, outputs, worst)
    return BadCaseResult(
        metric=primary.name, metrics=names, outputs=outputs, num_samples=count,
        worst_index={o: {m: worst[(o, m)][0][0] for m in names} for o in outputs},
        worst_value={o: {m: worst[(o, m)][0][1] for m in names} for o in outputs},
        overall=overall, inputs=inputs, values=values, k=topk,
        topk={o: {m: list(worst[(o, m)]) for m in names} for o in outputs}, overall_topk=overall_topk,
    )


def _check_search_args(num_steps: int | None, topk: int) -> None:
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
        raise QuantLensError(f"num_steps must be a positive int or None (all data), got {num_steps!r}.")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise QuantLensError(f"topk must be a positive int (the worst samples kept per output and metric), got "
                             f"{topk!r}.")


def _sample_outputs(index: int, example: Any, baseline: ModelAccess, analysis: ModelAccess,
                    post_process: PostProcess) -> tuple[dict, dict]:
    """The float outputs of both models on one sample; both must return the same, non-empty set of outputs."""
    try:
        base = float_outputs(post_process.outputs(baseline.run(example)))
        analy = float_outputs(post_process.outputs(analysis.run(example)))
    except RuntimeError as exc:  # a sample of the wrong shape: named, with the shape the models were prepared with
        worded = explain_shape_error((analysis, baseline), example, exc, "auto_find_bad_case",
                                     f"sample {index} of data_generator")
        if worded is None:
            raise
        raise worded from None
    if set(base) != set(analy):
        raise QuantLensError(
            f"Sample {index}: the models returned different outputs (baseline {sorted(base)}, analysis "
            f"{sorted(analy)}). Both must return the same structure for the same input."
        )
    if not base:
        raise QuantLensError("The models returned no floating-point tensor output; there is nothing to compare.")
    return base, analy


def _rank(ranking: list[tuple[int, float]], index: int, value: float, m: Metric, topk: int) -> None:
    """Insert sample ``index`` into ``ranking`` (the k worst, worst first) if it is among the ``topk`` worst."""
    # insert after every entry that is not better (ties keep the earlier sample first)
    pos = len(ranking)
    while pos > 0 and m.worse(value, ranking[pos - 1][1]):
        pos -= 1
    if pos < topk:
        ranking.insert(pos, (index, value))
        del ranking[topk:]


def _drop_unranked(inputs: dict[int, Any], worst: dict[tuple[str, str], list[tuple[int, float]]]) -> None:
    """Forget the inputs of samples that are no longer among the worst of any output and metric."""
    keep = {i for ranking in worst.values() for i, _ in ranking}
    for i in [i for i in inputs if i not in keep]:
        del inputs[i]


def _overall_topk(metrics: list[Metric], outputs: list[str], worst: dict[tuple[str, str], list[tuple[int, float]]],
                  topk: int) -> dict[str, list[tuple[int, str, float]]]:
    """Per metric, the k worst distinct samples over all outputs, each ranked by its worst output."""
    overall_topk: dict[str, list[tuple[int, str, float]]] = {}
    for m in metrics:
        best: dict[int, tuple[int, str, float]] = {}  # sample -> its worst (output, value) among the kept ones
        for out in outputs:
            for index, value in worst[(out, m.name)]:
                if index not in best or m.worse(value, best[index][2]):
                    best[index] = (index, out, value)
        # stable: ties keep output order, then the earlier sample
        entries = sorted(best.values(), key=lambda e: (m.sort_key(e[2]), outputs.index(e[1]), e[0]))
        # each kept sample is among the k worst of some output, so the k worst over all outputs are among them
        overall_topk[m.name] = entries[:topk]
    return overall_topk


def _overall(metrics: list[Metric], outputs: list[str],
             worst: dict[tuple[str, str], list[tuple[int, float]]]) -> dict[str, tuple[int, str, float]]:
    """Per metric, the worst sample over all outputs (ties: the earlier output)."""
    overall: dict[str, tuple[int, str, float]] = {}
    for m in metrics:
        for out in outputs:
            index, value = worst[(out, m.name)][0]
            if m.name not in overall or m.worse(value, overall[m.name][2]):
                overall[m.name] = (index, out, value)
    return overall
