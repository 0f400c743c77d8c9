"""The advisor's findings with the gain the remedy search measured where it ran (issue #24): a finding at an op
site that a kept remedy acted on says which remedy and how much it moved the metric."""

from __future__ import annotations

from dataclasses import dataclass

from quantlens.profiler.advisor import Finding
from quantlens.search.remedies.result import RemedyResult

__all__ = ["MeasuredFinding", "findings_with_gains"]


@dataclass(frozen=True)
class MeasuredFinding:
    """A finding and the kept remedies at its op site: ``(kind, name, before, after)`` each, measured."""

    finding: Finding
    measured: tuple[tuple[str, str, float, float], ...]

    @property
    def text(self) -> str:
        """The finding's advice, then what was measured there."""
        done = "; ".join(f"{kind} {name}: {before:.5g} -> {after:.5g}" for kind, name, before, after in self.measured)
        return self.finding.advice + (f" [measured: {done}]" if done else " [not measured]")


def findings_with_gains(findings: list[Finding], result: RemedyResult) -> list[MeasuredFinding]:
    """Each finding with the kept remedies of ``result`` at its op site (none: ``measured`` is empty)."""
    at: dict[str, list[tuple[str, str, float, float]]] = {}
    for trial in result.trials:
        if trial.kept and trial.site and trial.before is not None:
            at.setdefault(trial.site, []).append((trial.kind, trial.name, trial.before, trial.value))
    return [MeasuredFinding(f, tuple(at.get(f.op_name, ()))) for f in findings]
