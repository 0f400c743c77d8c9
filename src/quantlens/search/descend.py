"""``method="descend"``: from every activation int16 down to the fewest most-needed sites that reach the target.

(1) every activation int16 (conflict-free, in ranking order) and the cost of sending each one back to int8
alone; (2) the fewest most-needed sites that reach the target (bisection on that order); (3) backward
elimination with re-measurement from a few sites above (2)'s answer: each round measures every site's removal
and drops the one that costs least while the target holds (the costs of (1) were measured with every other
activation int16; near the answer the sites interact differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from quantlens.search.goal import Goal
from quantlens.search.graph import SearchGraph, conflicts
from quantlens.search.promotion import Promotion
from quantlens.search.result import CurvePoint
from quantlens.search.state import SearchContext, SearchState

__all__ = ["Descent", "descend", "descend_pass"]

Measure = Callable[[Sequence[Promotion]], float]
#: configurations measured on the way: (promotions, metric)
Point = tuple[tuple[Promotion, ...], float]


@dataclass(frozen=True)
class Descent:
    """What the descent chose, and every configuration it measured on the way (by size, the chosen left out)."""

    chosen: tuple[Promotion, ...]
    points: tuple[Point, ...]


def descend_pass(ctx: SearchContext, state: SearchState, show: Callable[..., None]) -> None:
    """Start the search from the descent's answer: its configurations, by size, then the chosen one, on the
    curve (the curve ends there). Leaves ``state`` alone when even every activation int16 misses the target
    (the greedy search then starts from the base)."""
    found = descend(ctx, show)
    if found is None:
        return
    measurer = ctx.measurer
    for selection, value in found.points:
        state.step += 1
        state.add_point(CurvePoint(state.step, len(selection), None, value, measurer.latency_of(selection), 1,
                                   kept=len(selection)))
    state.selected = list(found.chosen)
    metric = measurer.measure(state.selected)
    state.step += 1
    state.add_point(CurvePoint(state.step, len(state.selected), None, metric, measurer.latency_of(state.selected), 1,
                               kept=len(state.selected)))
    state.ranking = [c for c in state.ranking if c not in state.selected]


def descend(ctx: SearchContext, show: Callable[..., None]) -> Descent | None:
    """Steps (1)-(3) of the module docstring; ``None`` when even every activation int16 misses the target."""
    goal, measure = ctx.goal, ctx.measurer.measure
    top = _every_activation(ctx.first_ranking, ctx.graph)
    show(f"descend: every activation int16 ({len(top)} sites)")
    if not top or not goal.reached(measure(top)):
        return None
    full = measure(top)
    order = _most_needed_first(top, full, goal, measure, show)
    points: dict[int, Point] = {len(order): (tuple(order), full)}
    bisected = _fewest_reaching(order, min(len(order), ctx.max_steps), goal, measure, show)
    if bisected is None:
        return None
    hi, measured = bisected
    points.update(measured)
    chosen = list(order[:hi])
    path = _eliminate_from_above(order, hi, goal, measure, show)
    if path and len(path[-1][0]) < len(chosen):
        chosen = list(path[-1][0])
        for selection, value in path:
            points[len(selection)] = (selection, value)
    ordered = [points[k] for k in sorted(points) if points[k][0] != tuple(chosen)]
    return Descent(tuple(chosen), tuple(ordered))


def _every_activation(ranked: Sequence[Promotion], graph: SearchGraph) -> list[Promotion]:
    """Every activation candidate, in ranking order, that adds no int16 x int16 GEMM to those before it."""
    top: list[Promotion] = []
    for c in ranked:
        if c.kind == "activation" and not conflicts(top + [c], graph):
            top.append(c)
    return top


def _most_needed_first(top: list[Promotion], full: float, goal: Goal, measure: Measure,
                       show: Callable[..., None]) -> list[Promotion]:
    """``top`` ordered by what sending each site alone back to int8 costs, most first (ties: ranking order)."""
    cost = {}
    for i, c in enumerate(top):
        show(f"descend: {c.label()} back to int8 ({i + 1}/{len(top)})")
        without = measure([x for x in top if x != c])
        cost[c] = goal.gain(full, without)
    return sorted(top, key=lambda c: (-cost[c], top.index(c)))


def _fewest_reaching(order: list[Promotion], hi: int, goal: Goal, measure: Measure,
                     show: Callable[..., None]) -> tuple[int, dict[int, Point]] | None:
    """The smallest ``k <= hi`` whose prefix ``order[:k]`` reaches the target (bisection), with the prefixes
    measured on the way by size; ``None`` when ``order[:hi]`` misses it."""
    if not goal.reached(measure(order[:hi])):
        return None
    measured: dict[int, Point] = {hi: (tuple(order[:hi]), measure(order[:hi]))}
    lo = 0  # the smallest k with a reaching prefix lies in (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        show(f"descend: the {mid} most needed sites")
        value = measure(order[:mid])
        measured[mid] = (tuple(order[:mid]), value)
        if goal.reached(value):
            hi = mid
        else:
            lo = mid
    return hi, measured


def _eliminate_from_above(order: list[Promotion], hi: int, goal: Goal, measure: Measure,
                          show: Callable[..., None]) -> list[Point]:
    """Backward elimination with re-measurement from a few sites above ``hi``: each round drops the site whose
    removal costs least while the target holds. The configurations it kept, largest first (empty when it
    could not start: nothing above ``hi``, or that set misses the target)."""
    start = min(len(order), hi + max(2, hi // 8))
    current = list(order[:start])
    if start <= hi or not goal.reached(measure(current)):
        return []
    path = [(tuple(current), measure(current))]
    while len(current) > 1:
        best = None
        for k, c in enumerate(current):
            show(f"descend: {len(current)} sites, without {c.label()} ({k + 1}/{len(current)})")
            value = measure([x for x in current if x != c])
            if best is None or goal.better(value, best[0]):
                best = (value, c)
        if not goal.reached(best[0]):
            break
        current.remove(best[1])
        path.append((tuple(current), best[0]))
    return path
