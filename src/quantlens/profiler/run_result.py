"""What :meth:`~quantlens.profiler.QuantAnalysis.run` returns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantlens.profiler.model_access import ConsistencyInfo

__all__ = ["RunResult"]


@dataclass(frozen=True)
class RunResult:
    """What :meth:`QuantAnalysis.run` traced: the folders and the number of op sites per model."""

    baseline_dir: Path | None
    analysis_dir: Path | None
    baseline_sites: int | None
    analysis_sites: int | None
    outputs: list[str]
    #: the consistency level the models were built with (the analysis model's, else the baseline's; None for
    #: two float/torch models without one): ``consistency.describe()`` is the line the reports show
    consistency: ConsistencyInfo | None = None
