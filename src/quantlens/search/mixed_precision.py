"""``search_mixed_precision``: check the arguments, set the search up, run its passes, return the result."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from quantlens.errors import QuantLensError
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.bar import SearchBar
from quantlens.search.clock import StepClock
from quantlens.search.curve_files import CSV_FILE, HTML_FILE, write_curve
from quantlens.search.descend import descend_pass
from quantlens.search.goal import Goal
from quantlens.search.graph import SearchGraph, graph_candidates, int16x16_resolutions, search_graph
from quantlens.search.greedy import greedy_pass
from quantlens.search.measure import Builder, Measurer
from quantlens.search.progress import PROGRESS_FILE, Progress, fingerprint
from quantlens.search.progress_file import check_out_dir
from quantlens.search.promotion import MaxLatency, Promotion, as_promotion
from quantlens.search.provenance import evaluate_identity, setter_identity
from quantlens.search.ranking import first_ranking, initial_ranking
from quantlens.search.refine import exchange_pass, prune_pass
from quantlens.search.result import CurvePoint, MixedPrecisionResult
from quantlens.search.state import SearchContext, SearchState

__all__ = ["search_mixed_precision"]


def search_mixed_precision(
    model: nn.Module,
    example_inputs: Any,
    calibration_batches: Sequence[Any],
    evaluate: Callable[[nn.Module], float],
    target: float,
    *,
    base_setter: Any = default_calibration_qconfig_setter,
    budget: int | MaxLatency | None = None,
    candidates: Iterable[Any] | None = None,
    out_dir: str | os.PathLike = "mixed_precision",
    resume: bool = True,
    ranking: Any = None,
    tries: int = 4,
    method: str = "greedy",
    higher_is_better: bool = True,
    latency: bool = False,
    prune: bool = True,
    exchange: int = 0,
    progress: bool = True,
    evaluation_key: str = "",
) -> MixedPrecisionResult:
    """Greedy int16 promotion with re-measurement until ``evaluate`` reaches ``target``.

    Args:
        model: the float model (not modified).
        example_inputs: one call's inputs, as for ``prepare`` (also the profiler's bad case for the ranking).
        calibration_batches: the batches ``calibrate`` runs for every measured configuration.
        evaluate: ``evaluate(prepared_model) -> float`` on a calibrated model in VALIDATION state (e.g. the output
            cosine against the float model on held-out data); called without gradients.
        target: the metric to reach (``>=``, or ``<=`` with ``higher_is_better=False``).
        base_setter: the qconfig setter (or tuple) every configuration starts from.
        budget: the most promotions (``int``), or ``MaxLatency(cycles)``: configurations whose quantized IR's
            latency estimate exceeds it are not taken (implies ``latency``).
        candidates: promotions to consider (``Promotion``, site names = activations, ``(site, kind)`` pairs,
            sensitivity rows); default :func:`mixed_precision_candidates` of the base model.
        out_dir: progress file, curve CSV/HTML (and the profiler's sensitivity files when it ranks).
        resume: continue from ``out_dir``'s progress file when it was written by a search with the same inputs.
        ranking: first ranking (a sensitivity table/result, or promotions most promising first); default the
            profiler's sensitivity of the base model.
        tries: candidates measured per step.
        method: ``"greedy"`` (from the base up, one promotion per step) or ``"descend"``: first measure what
            each op site's output costs when it alone goes back to int8 from "every activation int16" (one
            measurement per site), keep the fewest most-needed sites that reach the target (bisection on that
            order), then continue greedily if needed; it sees interactions the one-at-a-time ranking misses (two
            sites that help only together are each needed once the other is int16). Both end with ``prune``.
        latency: also export -> convert every accepted configuration and record its latency estimate.
        prune: once the target is reached, take back each promotion the target no longer needs (smallest gain
            first, one measurement each): a promotion that helped early may be redundant once later ones are in.
        exchange: rounds of exchange after the pruning pass (0, the default, or ``prune=False``: none): the chosen
            promotion whose removal costs least is swapped for the outside candidate that does most in its place
            (one measurement per chosen site and one per candidate outside the set) when that beats the current
            set, and the pass prunes again; a round that improves nothing ends it. It can find a set one site
            smaller that backward elimination misses (two sites that do best together); each round costs about
            as many measurements as there are candidates.
        progress: show a rich progress bar.
        evaluation_key: what else decides ``evaluate``'s value that the search cannot see (a digest of data it
            reads from disk): part of the resume key, with ``evaluate``'s own identity (its code, the file it is
            written in, the tensors and modules it reads: :func:`~quantlens.search.provenance.evaluate_identity`).

    ``evaluate`` must return one finite number: anything else, or an error it raises, is an
    :class:`~quantlens.search.evaluation.EvaluateError` naming the configuration it was measured on.
    """
    out = Path(out_dir)
    _check_arguments(tries, exchange, method, budget)
    check_out_dir(out, "search_mixed_precision")
    latency = latency or isinstance(budget, MaxLatency)
    batches = list(calibration_batches)
    goal = Goal(target, higher_is_better)
    build = Builder(model, example_inputs, batches, base_setter)
    clock = StepClock()
    with clock.step("base: prepare and calibrate"):
        base_prepared = build(())
        graph = search_graph(base_prepared)
        cands = _candidates(graph, candidates)
    with clock.step("ranking: the profiler's sensitivity"):
        given = None if ranking is None else initial_ranking(model, base_prepared, example_inputs, cands, ranking,
                                                             out)
        fp = fingerprint(model, example_inputs, batches, cands, given or [], target, budget, tries,
                         setter_identity(base_setter, base_prepared), higher_is_better, method, prune, exchange,
                         evaluation=evaluate_identity(evaluate) + "|" + evaluation_key)
        prog = Progress(out / PROGRESS_FILE, fp, resume)  # constructed here: its warning names our caller's line
        ranked0 = first_ranking(given, prog, lambda: initial_ranking(model, base_prepared, example_inputs, cands,
                                                                     None, out))
    measurer = Measurer(build, evaluate, goal, latency, prog)
    ctx = SearchContext(goal, measurer, graph, budget, tuple(cands), tuple(ranked0), tries,
                        _max_steps(budget, len(cands)), clock)
    with clock.step("base: evaluate", lambda: measurer.count):
        base_metric = measurer.measure((), base_prepared)
    state = SearchState([], list(ranked0), [CurvePoint(0, 0, None, base_metric, measurer.latency_of(()), 1)],
                        prog.data["steps"], prog)
    with SearchBar(ctx.max_steps, progress) as bar:
        _run_passes(ctx, state, method, prune, exchange, bar)
    final = build(state.selected) if state.selected else base_prepared
    resolutions = tuple(int16x16_resolutions(final))
    prog.data["done"] = True
    prog.save()
    result = MixedPrecisionResult(
        chosen=tuple(state.selected), curve=tuple(state.curve), target=float(target),
        reached=bool(goal.reached(state.metric)), base_metric=base_metric, metric=state.metric,
        candidates=tuple(cands), measurements=measurer.count, int16x16_resolutions=resolutions,
        csv_path=str(out / CSV_FILE), html_path=str(out / HTML_FILE), progress_path=str(out / PROGRESS_FILE),
        base_setter=base_setter, step_times=tuple(clock.steps))
    write_curve(result, out)
    return result


def _check_arguments(tries: int, exchange: Any, method: str, budget: Any) -> None:
    """Refuse what the search cannot run, before anything is prepared."""
    if tries < 1:
        raise QuantLensError(f"search_mixed_precision: tries must be >= 1, got {tries}.")
    if isinstance(exchange, bool) or not isinstance(exchange, int) or exchange < 0:
        raise QuantLensError(f"search_mixed_precision: exchange must be an int >= 0 (rounds), got {exchange!r}.")
    if method not in ("greedy", "descend"):
        raise QuantLensError(f"search_mixed_precision: method must be 'greedy' or 'descend', got {method!r}.")
    if isinstance(budget, MaxLatency):
        return
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise QuantLensError(f"search_mixed_precision: budget must be an int >= 0, MaxLatency(cycles) or None, "
                             f"got {budget!r}.")


def _candidates(graph: SearchGraph, candidates: Iterable[Any] | None) -> list[Promotion]:
    """The promotions to consider: every one of the base model, or the caller's (each checked, no repeats)."""
    every = graph_candidates(graph)
    if candidates is None:
        return every
    cands: list[Promotion] = []
    for item in candidates:
        p = as_promotion(item)
        if p not in every:
            raise QuantLensError(f"search_mixed_precision: candidate {p.label()} cannot be promoted on this "
                                 f"model (not a quantized op site with that {p.kind}).")
        if p not in cands:
            cands.append(p)
    return cands


def _max_steps(budget: Any, num_candidates: int) -> int:
    """The most promotions a pass may hold: every candidate, or an ``int`` budget below that."""
    if not isinstance(budget, int) or isinstance(budget, bool):
        return num_candidates
    return min(budget, num_candidates)


def _run_passes(ctx: SearchContext, state: SearchState, method: str, prune: bool, exchange: int,
                bar: SearchBar) -> None:
    """Descend (``method="descend"``), the greedy forward pass, then pruning and exchange once the target is
    reached."""
    step = ctx.clock.step
    count = lambda: ctx.measurer.count  # noqa: E731
    if method == "descend" and not ctx.goal.reached(state.metric):
        with step("descend", count):
            descend_pass(ctx, state, bar.show)
    with step("greedy", count):
        greedy_pass(ctx, state, bar.show)
    if prune and ctx.goal.reached(state.metric) and len(state.selected) > 1:
        with step("prune", count):
            prune_pass(ctx, state, lambda c: bar.show(f"pruning: without {c.label()}"))
    if prune and exchange and ctx.goal.reached(state.metric) and len(state.selected) > 1:
        with step("exchange", count):
            exchange_pass(ctx, state, exchange, bar.show)
    bar.show(f"done: {len(state.selected)} int16, metric {state.metric:.4f}", len(state.selected))
