"""What the search promotes and how much it may promote: :class:`Promotion`, :class:`MaxLatency`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from quantlens.errors import QuantLensError

__all__ = ["Promotion", "MaxLatency", "as_promotion", "within_budget"]


@dataclass(frozen=True, order=True)
class Promotion:
    """One int16 promotion: ``kind`` is ``"activation"`` (the op site's output) or ``"weight"``."""

    site: str
    kind: str = "activation"

    def __post_init__(self):
        if self.kind not in ("activation", "weight"):
            raise QuantLensError(f"Promotion kind must be 'activation' or 'weight', got {self.kind!r}.")

    def label(self) -> str:
        """``"site (kind)"``, as the progress bar and the curve page name it."""
        return f"{self.site} ({self.kind})"


@dataclass(frozen=True)
class MaxLatency:
    """A budget on the march's latency estimate (``Module.latency_estimate().cycles`` of the quantized IR)."""

    cycles: int


def as_promotion(item: Any) -> Promotion:
    """``item`` as a :class:`Promotion`: a promotion, a site name (its activation), a ``(site, kind)`` pair, or a
    sensitivity row (a mapping or object with ``op_name`` and ``sensitive_type``)."""
    if isinstance(item, Promotion):
        return item
    if isinstance(item, str):
        return Promotion(item, "activation")
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return Promotion(str(item[0]), str(item[1]))
    op_name = item.get("op_name") if isinstance(item, dict) else getattr(item, "op_name", None)
    kind = item.get("sensitive_type") if isinstance(item, dict) else getattr(item, "sensitive_type", None)
    if op_name is None:
        raise QuantLensError(f"Cannot read a candidate from {item!r}: pass Promotion(site, kind), a site name, "
                             "a (site, kind) pair or a sensitivity row.")
    return Promotion(op_name, kind or "activation")


def within_budget(selection: Sequence[Promotion], budget: Any) -> bool:
    """Whether ``selection`` fits an ``int`` budget (most promotions); other budgets are checked by latency."""
    return not (isinstance(budget, int) and not isinstance(budget, bool) and len(selection) > budget)
