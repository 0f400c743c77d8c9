"""The CONFIG's task metric (``evaluate(model) -> float``) on every stage model ``analyze`` built: where the
task accuracy is lost, next to where the per-layer precision is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["StageMetric", "stage_metrics", "metrics_table"]

#: the stage models ``Stages`` holds, in pipeline order, with the names the reports use
_STAGES = (("float", "float"), ("calibration", "calibration"), ("qat", "qat"), ("pre_export", "pre_export"),
           ("qat_ir", "qat IR"), ("quantized_ir", "quantized IR"))


@dataclass(frozen=True)
class StageMetric:
    """One stage's metric, or why it could not be measured (``error``)."""

    stage: str
    value: float | None
    error: str = ""


def stage_metrics(stages: Any, evaluate: Callable[[Any], float]) -> list[StageMetric]:
    """``evaluate`` on each stage model that was built (the QAT model only when it was trained: otherwise it is
    the calibration model). A stage on which ``evaluate`` fails gets the error's first line: the analysis goes on,
    and the table says which stage the CONFIG's function does not accept."""
    out = []
    for attr, name in _STAGES:
        model = getattr(stages, attr, None)
        if model is None or (attr == "qat" and model is stages.calibration):
            continue
        try:
            value = float(evaluate(model))
        except Exception as exc:  # noqa: BLE001 - the CONFIG's own code: report it per stage, keep the analysis
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            out.append(StageMetric(name, None, f"{type(exc).__name__}: {first}"))
            continue
        out.append(StageMetric(name, value))
    return out


def metrics_table(metrics: list[StageMetric], higher_is_better: bool = True):
    """A rich table: the metric per stage and its change from the float model (worse changes in red)."""
    from rich.table import Table

    from quantlens.cli._common import esc

    table = Table(title="the CONFIG's evaluate(model) per stage")
    for col in ("stage", "metric", "vs float"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    base = next((m.value for m in metrics if m.stage == "float"), None)
    for m in metrics:
        if m.value is None:
            table.add_row(m.stage, "-", f"[red]failed: {esc(m.error)}[/]")
            continue
        delta = None if base is None else m.value - base
        worse = delta is not None and (delta < 0 if higher_is_better else delta > 0)
        shown = "-" if delta is None else f"{delta:+.6g}"
        table.add_row(m.stage, f"{m.value:.6g}", f"[red]{shown}[/]" if worse else shown)
    return table
