"""The passes after the target is reached: pruning (backward elimination) and exchange rounds."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from quantlens.search.graph import conflicts
from quantlens.search.promotion import MaxLatency, Promotion, within_budget
from quantlens.search.result import CurvePoint
from quantlens.search.state import SearchContext, SearchState

__all__ = ["prune_pass", "exchange_pass"]


def prune_pass(ctx: SearchContext, state: SearchState, show: Callable[[Promotion], None]) -> None:
    """Backward elimination: try each chosen promotion without it, smallest gain at the time it was added
    first; drop it when the rest still reaches the target. Changes ``state``."""
    gain = _gains(state.curve)
    selected = state.selected
    # ties (``method="descend"`` adds no single promotion: no gains) go last-added first, the least needed
    for candidate in sorted(selected, key=lambda c: (abs(gain.get(c, 0.0)), -selected.index(c))):
        if len(selected) <= 1:
            break
        show(candidate)
        trial = [c for c in selected if c != candidate]  # fewer int16 sites: no new int16 x int16 pair
        value = ctx.measurer.measure(trial)
        if not ctx.goal.reached(value):
            continue
        state.step += 1
        selected.remove(candidate)
        point = CurvePoint(state.step, len(selected), None, value, ctx.measurer.latency_of(selected), 1,
                           removed=candidate)
        state.add_point(point, {"step": state.step, "removed": asdict(candidate), "metric": value})


def _gains(curve: list[CurvePoint]) -> dict[Promotion, float]:
    """What each promotion added to the metric when the curve added it."""
    gain = {}
    for before, point in zip(curve, curve[1:]):
        if point.added is not None:
            gain[point.added] = point.metric - before.metric
    return gain


def exchange_pass(ctx: SearchContext, state: SearchState, rounds: int, show: Callable[[str], None]) -> None:
    """Exchange rounds (after :func:`prune_pass`): swap the chosen promotion whose removal costs least for the
    outside candidate that does most in its place, when that beats the current set, then prune again. A set
    just above the target can hold a better one of the same size after which a site can go (backward
    elimination alone never revisits a site it kept). A round that swaps nothing ends it. Changes ``state``."""
    for r in range(rounds):
        if len(state.selected) <= 1:
            break
        name = f"exchange {r + 1}"
        current = state.metric
        drop = _cheapest_drop(ctx, state, name, show)
        rest = [x for x in state.selected if x != drop]
        outside = [c for c in ctx.candidates if c not in state.selected and within_budget(rest + [c], ctx.budget)
                   and not conflicts(rest + [c], ctx.graph)]
        swap = _best_swap(ctx, rest, outside, drop, current, name, show)
        if swap is None:
            break
        value, add = swap
        state.selected[:] = rest + [add]
        state.step += 1
        point = CurvePoint(state.step, len(state.selected), add, value, ctx.measurer.latency_of(state.selected),
                           len(outside), removed=drop)
        state.add_point(point, {"step": state.step, "added": asdict(add), "removed": asdict(drop), "metric": value})
        prune_pass(ctx, state, lambda c, name=name: show(f"{name}: pruning without {c.label()}"))


def _cheapest_drop(ctx: SearchContext, state: SearchState, name: str, show: Callable[[str], None]) -> Promotion:
    """The chosen promotion whose removal leaves the best metric."""
    drop, drop_value = None, None
    for k, s in enumerate(state.selected):
        show(f"{name}: without {s.label()} ({k + 1}/{len(state.selected)})")
        value = ctx.measurer.measure([x for x in state.selected if x != s])
        if drop is None or ctx.goal.better(value, drop_value):
            drop, drop_value = s, value
    return drop


def _best_swap(ctx: SearchContext, rest: list[Promotion], outside: list[Promotion], drop: Promotion,
               current: float, name: str, show: Callable[[str], None]) -> tuple[float, Promotion] | None:
    """The outside candidate that does best in ``drop``'s place, with its metric, when that beats ``current``
    (and fits a latency budget); None when none does."""
    trials = []
    for k, c in enumerate(outside):
        show(f"{name}: {drop.label()} -> {c.label()} ({k + 1}/{len(outside)})")
        trials.append((ctx.measurer.measure(rest + [c]), k, c))
    trials.sort(key=lambda t: (ctx.goal.best_first(t[0]), t[1]))  # best first; ties keep the candidates' order
    for value, _, c in trials:
        if not ctx.goal.better(value, current):
            break
        if isinstance(ctx.budget, MaxLatency) and ctx.measurer.latency_of(rest + [c]) > ctx.budget.cycles:
            continue
        return value, c
    return None
