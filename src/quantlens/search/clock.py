"""Where a search's time goes: the wall time of each of its steps, in the order they ran (``docs/remedies.md``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["StepTime", "StepClock"]


@dataclass(frozen=True)
class StepTime:
    """One step of a search: what it did, its wall time and how many configurations it measured (a measurement
    replayed from a progress file counts, and costs nothing)."""

    step: str
    seconds: float
    measurements: int = 0


class StepClock:
    """Times the steps of a search: ``with clock.step("name", count): ...``; ``count()`` reads the search's
    measurement counter before and after, so each step says how many configurations it measured."""

    def __init__(self) -> None:
        self.steps: list[StepTime] = []

    @contextmanager
    def step(self, name: str, count=lambda: 0) -> Iterator[None]:
        began, before = time.perf_counter(), count()
        try:
            yield
        finally:
            self.steps.append(StepTime(name, time.perf_counter() - began, count() - before))

    def add(self, steps, prefix: str = "") -> None:
        """Another search's steps (the int16 phase's), named ``prefix + step``."""
        self.steps += [StepTime(prefix + s.step, s.seconds, s.measurements) for s in steps]

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.steps)
