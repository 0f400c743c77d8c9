"""The target a search aims at and which way its metric improves (:class:`Goal`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Goal"]


@dataclass(frozen=True)
class Goal:
    """``target`` reached at ``>=`` (``higher_is_better``) or ``<=``; every comparison of metric values goes
    through here so that the passes never test the direction themselves."""

    target: float
    higher_is_better: bool = True

    def reached(self, value: float) -> bool:
        """Whether ``value`` meets the target."""
        return value >= self.target if self.higher_is_better else value <= self.target

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a > b if self.higher_is_better else a < b

    def gain(self, new: float, old: float) -> float:
        """How much better ``new`` is than ``old`` (negative: worse)."""
        return new - old if self.higher_is_better else old - new

    def best_first(self, value: float) -> float:
        """A sort key that puts the best value first."""
        return -value if self.higher_is_better else value
