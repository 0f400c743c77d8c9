"""The greedy forward pass: each step measures a pool of ``tries`` candidates, each promoted on top of the
current set, keeps the best, and re-ranks the rest by what was measured."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Sequence

from quantlens.search.graph import SearchGraph, conflicts
from quantlens.search.promotion import MaxLatency, Promotion, within_budget
from quantlens.search.result import CurvePoint
from quantlens.search.state import SearchContext, SearchState

__all__ = ["greedy_pass"]


def greedy_pass(ctx: SearchContext, state: SearchState, show: Callable[..., None]) -> None:
    """Add one promotion per step until the target is reached, ``ctx.max_steps`` promotions are held or no
    candidate is left; short of the target, go back to the best set the pass measured. Changes ``state``."""
    start = len(state.curve) - 1
    _add_until_reached(ctx, state, show)
    if not ctx.goal.reached(state.metric):
        _back_to_the_best(ctx, state, start)


def _back_to_the_best(ctx: SearchContext, state: SearchState, start: int) -> None:
    """The pass's best point (the fewest sites among equals) where that is not its last: a promotion can lower
    the metric (transformers' GPT-2 at a target it cannot reach: all 36 sites 0.99178, the first 15 0.99186), and
    a search that misses its target gives the best it found."""
    points = state.curve[start:]  # the pass's start, then one point per promotion added (a prefix each)
    best = points[0]
    for point in points[1:]:
        if ctx.goal.better(point.metric, best.metric):
            best = point
    if best is points[-1]:
        return
    state.selected = state.selected[:best.num_int16]
    state.step += 1
    state.add_point(CurvePoint(state.step, best.num_int16, None, best.metric,
                               ctx.measurer.latency_of(state.selected), 0, back=True))


def _add_until_reached(ctx: SearchContext, state: SearchState, show: Callable[..., None]) -> None:
    while not ctx.goal.reached(state.metric) and len(state.selected) < ctx.max_steps:
        # counted before the checks below: a step that finds no candidate still takes its number
        state.step += 1
        show(f"step {state.step}: metric {state.metric:.4f} -> {ctx.goal.target}", state.step - 1)
        pool = _pool(_allowed(ctx, state), ctx.first_ranking, ctx.tries)
        if not pool:
            break
        results = _measure_pool(ctx, state, pool, show)
        best = _best(pool, results, ctx)
        ranking = _rerank(ctx, state, pool, results, best)
        state.selected.append(best)
        state.ranking = ranking
        point = CurvePoint(state.step, len(state.selected), best, results[best],
                           ctx.measurer.latency_of(state.selected), len(pool))
        state.add_point(point, {"step": state.step, "added": asdict(best), "metric": results[best],
                                "tried": [asdict(c) for c in pool]})


def _allowed(ctx: SearchContext, state: SearchState) -> list[Promotion]:
    """The candidates that may join the current set, in the current ranking's order: within the budget and
    without an int16 x int16 GEMM. Under a latency budget: the first ``tries`` of them whose set stays within
    it, and none when the current set (the base at step 1) is already over."""
    selected = state.selected
    allowed = [c for c in state.ranking if c not in selected and within_budget(selected + [c], ctx.budget)
               and not conflicts(selected + [c], ctx.graph)]
    if not isinstance(ctx.budget, MaxLatency):
        return allowed
    latency_of = ctx.measurer.latency_of
    if latency_of(selected) > ctx.budget.cycles:
        return []
    fitting: list[Promotion] = []
    for c in allowed:
        if len(fitting) >= ctx.tries:
            break
        if latency_of(selected + [c]) <= ctx.budget.cycles:
            fitting.append(c)
    return fitting


def _pool(allowed: list[Promotion], first_ranking: Sequence[Promotion], tries: int) -> list[Promotion]:
    """The ``tries`` candidates of one step."""
    # Half the pool (rounded down) follows the first ranking: the re-ranked candidates (those that helped,
    # the neighbours) would otherwise fill every slot and push back sites the ranking puts ahead (on
    # MiniLM the search then needed more promotions than the ranking's top-k).
    first = [c for c in first_ranking if c in allowed]
    pool = allowed[:tries - tries // 2]
    pool += [c for c in first if c not in pool][:tries - len(pool)]
    pool += [c for c in allowed if c not in pool][:tries - len(pool)]
    return pool


def _measure_pool(ctx: SearchContext, state: SearchState, pool: list[Promotion],
                  show: Callable[..., None]) -> dict[Promotion, float]:
    """The metric of the current set plus each candidate of ``pool``."""
    results = {}
    for c in pool:
        show(f"step {state.step}: trying {c.label()}")
        results[c] = ctx.measurer.measure(state.selected + [c])
    return results


def _best(pool: list[Promotion], results: dict[Promotion, float], ctx: SearchContext) -> Promotion:
    """The candidate with the best metric (ties: the first in the pool)."""
    best = pool[0]
    for c in pool[1:]:
        if ctx.goal.better(results[c], results[best]):
            best = c
    return best


def _rerank(ctx: SearchContext, state: SearchState, pool: list[Promotion], results: dict[Promotion, float],
            best: Promotion) -> list[Promotion]:
    """The ranking for the next step: the pool's candidates that improved the metric (by gain), then the graph
    neighbours of ``best``, then the unmeasured ones, then the pool's candidates that did not improve it."""
    gains = {c: ctx.goal.gain(results[c], state.metric) for c in pool if c != best}
    helped = sorted((c for c in gains if gains[c] > 0), key=lambda c: (-gains[c], ctx.graph.order.get(c.site, 0)))
    idle = [c for c in pool if c != best and c not in helped]
    rest = [c for c in state.ranking if c not in pool and c not in state.selected]
    # The promoted site's graph neighbours (its producers and consumers, and its own other kind) are
    # measured next: their gain depends on it (an int16 add gains little while the linear feeding it
    # stays int8, and the other way round), so a "no gain" measured before this step is stale.
    near = ctx.graph.neighbours.get(_rep(best.site, ctx.graph), set()) | {best.site}
    fresh = [c for c in rest + idle if _rep(c.site, ctx.graph) in near]
    return helped + fresh + [c for c in rest if c not in fresh] + [c for c in idle if c not in fresh]


def _rep(site: str, graph: SearchGraph) -> str:
    """The site that names ``site``'s fused group (its last op)."""
    return graph.group.get(site, (site,))[-1]
