"""What a planted fault is (:class:`Fault`, :class:`FaultCase`) and the registry the fault modules add theirs to
(:data:`FAULTS`, :func:`register_fault`); the package imports every fault module, so importing it fills the
registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Fault", "FaultCase", "FAULTS", "register_fault"]


@dataclass(frozen=True)
class FaultCase:
    """What a fault builds: the two models of its stage pair, the bad case (positional inputs) and an optional
    post-process."""

    baseline: Any
    analysis: Any
    bad_case: tuple
    post_process: Callable | None = None


@dataclass(frozen=True)
class Fault:
    """One planted fault: its stage pair (the analysis type), the culprit op site(s) and how to build it."""

    name: str
    stage: str
    model: str  # what it is planted in ("tiny conv", "all-MiniLM-L6-v2", ...)
    #: the names of the culprit op site: any of them counts (a fused group's members: the conv holds the weight,
    #: its relu the output fake quant)
    culprit: tuple[str, ...]
    description: str
    build: Callable[[], FaultCase]
    #: whether the fault changes the model's output (a fault that does must be first by sensitivity)
    changes_output: bool = True
    #: an interaction fault: the culprit is two op sites together (each harmless alone); the pair method ranks
    #: the pair holding both, the other methods either of them
    interaction: tuple[str, ...] = ()
    #: whether the fault is visible op by op (an advisor finding must name it); an interaction is not: no op of
    #: it is wrong alone (the joint sensitivity's small-share warning and its pair row say it)
    per_op_finding: bool = True


FAULTS: dict[str, Fault] = {}


def register_fault(fault: Fault) -> Fault:
    """Add ``fault`` to :data:`FAULTS` (a repeated name is an error)."""
    if fault.name in FAULTS:
        raise ValueError(f"planted fault {fault.name!r} is registered twice.")
    FAULTS[fault.name] = fault
    return fault
