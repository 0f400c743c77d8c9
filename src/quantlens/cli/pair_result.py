"""A stage pair's verdict and its worst op, from its per-layer comparison: what ``summary.json``, ``index.html``
and the console summary of ``quantlens analyze`` / ``report`` / the demo say about each pair (:class:`PairResult`),
and the two answers over the pairs: where precision is first lost along the chain (:func:`first_loss`) and where
the most is lost (:func:`ranked_losses`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["PAIRS", "pair_stages", "PairVerdict", "PairResult", "worst_row", "first_lossy_row", "is_exact", "worst_differing",
           "summarize", "ranked_losses", "first_loss", "LOSS_SQNR"]

#: analysis type -> (baseline stage, analysis stage), in pipeline order
PAIRS: dict[str, tuple[str, str]] = {
    "fake_quant": ("float", "calibration"),
    "pre_export": ("qat", "pre_export"),
    "export": ("pre_export", "qat_ir"),
    "convert": ("qat_ir", "quantized_ir"),
    "onnxruntime": ("qat_ir", "onnx"),
}


def pair_stages(kind: str, stages: Any = None) -> tuple[str, str]:
    """``(baseline stage, analysis stage)`` of the pair ``kind`` for these ``stages``: under ``March.ORT_CPU`` (the
    qat IR's march) the ``onnxruntime`` pair compares the quantized IR with the session, op by op, since that march
    is the runtime (``docs/march_ort.md``)."""
    qat_ir = getattr(stages, "qat_ir", None)
    if kind == "onnxruntime" and qat_ir is not None and qat_ir.meta.get("march") == "ort_cpu":
        return "quantized_ir", "onnx"
    return PAIRS[kind]


#: an op whose same-input SQNR is below this loses precision of its own (above: float noise)
LOSS_SQNR = 120.0


class PairVerdict(str, Enum):
    """A stage pair's verdict over its compared rows (rows with values on both sides).

    ``exact``: every compared row is bit-exact (rows with an LSB verdict "bit-exact", the others Atol == 0).
    ``lossy``: an op loses precision of its own (a same-input SQNR below 120 dB; the worst op is the lowest).
    ``differs``: rows differ but no op is measured losing precision on the same input (no same-input data, as for
    ``onnxruntime``, or every same-input SQNR >= 120 dB); the worst op comes from the LSB / error data
    (:func:`worst_differing`). ``no data``: nothing was compared (never shown as exact). ``skipped``: not analysed.
    """

    EXACT = "exact"
    LOSSY = "lossy"
    DIFFERS = "differs"
    NO_DATA = "no data"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


@dataclass
class PairResult:
    """One stage pair's analysis, as ``summary.json`` and the console summary show it."""

    analysis_type: str
    baseline: str
    analysis: str
    folder: str
    #: ``lossy``: the op that loses the most precision itself (lowest same-input SQNR); ``differs``: the worst
    #: differing row by accumulated LSB verdict (else lowest SQNR); None for ``exact`` / ``no data`` / ``skipped``
    worst_op: str | None = None
    worst_op_type: str | None = None
    worst_sqnr: float | None = None  # its same-input SQNR, dB (None: no same-input result)
    worst_error_kind: str = ""
    output_cosine: float | None = None  # of the last compared row
    findings: list[dict] = field(default_factory=list)
    lsb: dict | None = None
    sensitivity_top: list[tuple[str, str, float]] = field(default_factory=list)
    skipped: str = ""  # why the pair was not analysed
    verdict: PairVerdict = PairVerdict.NO_DATA
    compared: int = 0  # rows compared (values on both sides)
    differing: int = 0  # compared rows that are not bit-exact
    worst_diff: str = ""  # ``differs``: how the worst op differs ("within 4 LSB", "max |diff| 2.4e-07")
    #: where the pair starts losing: ``lossy``: the first op in execution order whose same-input SQNR is below
    #: :data:`LOSS_SQNR`; ``differs``: the first compared op that is not bit-exact; None otherwise
    first_op: str | None = None
    first_sqnr: float | None = None  # its same-input SQNR, dB (``lossy`` only)
    first_diff: str = ""  # ``differs``: how it differs
    note: str = ""  # how the pair was run, when it matters (the onnxruntime level, outputs only, outputs check)

    def __post_init__(self):
        if self.skipped:
            self.verdict = PairVerdict.SKIPPED

    @property
    def problems(self) -> bool:
        """An advisor finding to fix (advice does not count) or a deployed op that diverged."""
        return bool(self.problem_findings) or bool(self.lsb and self.lsb.get("first_diverged"))

    @property
    def problem_findings(self) -> list[dict]:
        return [f for f in self.findings if f.get("severity", "problem") == "problem"]

    @property
    def worst_text(self) -> str:
        """The worst-op cell of the summaries: "none (exact)" only for an exact pair."""
        if self.verdict is PairVerdict.SKIPPED:
            return f"skipped: {self.skipped}"
        if self.verdict is PairVerdict.EXACT:
            return "none (exact)"
        if self.verdict is PairVerdict.NO_DATA:
            return "no data (nothing compared)"
        return f"{self.worst_op} ({self.worst_diff})" if self.worst_diff else str(self.worst_op)

    @property
    def verdict_text(self) -> str:
        """The verdict cell: with the count of differing rows for ``lossy`` / ``differs``."""
        if self.verdict in (PairVerdict.LOSSY, PairVerdict.DIFFERS):
            return f"{self.verdict.value} ({self.differing}/{self.compared} ops differ)"
        return self.verdict.value


def _loses(row) -> bool:
    return row.same_input_sqnr is not None and row.same_input_sqnr < LOSS_SQNR


def worst_row(table) -> Any:
    """The op that loses the most precision itself: the lowest finite same-input SQNR below 120 dB (float
    noise and bit-exact ops do not count), else None."""
    return next((row for row in table.ranked("same_input_sqnr") if _loses(row)), None)


def first_lossy_row(table) -> Any:
    """The first op in execution order that loses precision itself (same-input SQNR below 120 dB), else None."""
    return next((row for row in table if _loses(row)), None)


def is_exact(row) -> bool:
    """A compared row equal to the baseline: bit-exact to its grid's LSB, or (no LSB verdict) Atol == 0."""
    return row.lsb_verdict == "bit-exact" if row.lsb_verdict else row.Atol == 0


#: accumulated LSB verdicts of a differing grid row, least to most
_LSB_RANK = {"within 1 LSB": 1, "within 4 LSB": 2, "diverged": 3}


def worst_differing(table) -> Any:
    """The worst compared row that is not bit-exact, from the per-layer LSB / error data (no same-input data
    needed): the highest LSB verdict, the first in execution order among equals; without a graded row, the
    lowest accumulated SQNR (NaN first). None when every compared row is exact."""
    rows = [r for r in table if r.compared and not is_exact(r)]
    graded = [r for r in rows if r.lsb_verdict in _LSB_RANK]
    if graded:
        return max(graded, key=lambda r: _LSB_RANK[r.lsb_verdict])
    return min(rows, key=lambda r: -math.inf if r.SQNR is None or math.isnan(r.SQNR) else r.SQNR, default=None)


def _diff_text(row) -> str:
    if row.lsb_verdict == "diverged":
        return "diverged: > 4 LSB"
    if row.lsb_verdict:
        return row.lsb_verdict
    return f"max |diff| {row.Atol:.3g}"


def summarize(result: PairResult, table) -> PairResult:
    """Fill ``result``'s verdict, counts and worst op from a per-layer comparison (``LayerComparison``)."""
    compared = [r for r in table if r.compared]
    result.compared, result.differing = len(compared), sum(not is_exact(r) for r in compared)
    result.output_cosine = _finite(compared[-1].Cosine) if compared else None
    lossy = worst_row(table)
    if lossy is not None:
        result.verdict = PairVerdict.LOSSY
        result.worst_op, result.worst_op_type = lossy.op_name, lossy.op_type or lossy.base_op_type
        result.worst_sqnr, result.worst_error_kind = _finite(lossy.same_input_sqnr), lossy.error_kind or ""
        first = first_lossy_row(table)
        result.first_op, result.first_sqnr = first.op_name, _finite(first.same_input_sqnr)
        return result
    if not compared:
        result.verdict = PairVerdict.NO_DATA
        return result
    row = worst_differing(table)
    if row is None:
        result.verdict = PairVerdict.EXACT
        return result
    result.verdict = PairVerdict.DIFFERS
    result.worst_op, result.worst_op_type = row.op_name, row.op_type or row.base_op_type
    result.worst_diff = _diff_text(row)
    first = next(r for r in compared if not is_exact(r))
    result.first_op, result.first_diff = first.op_name, _diff_text(first)
    return result


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def ranked_losses(results: list[PairResult]) -> list[PairResult]:
    """Pairs that lose precision: ``lossy`` ones by same-input SQNR (lowest first), then ``differs`` ones in
    pipeline order (no same-input SQNR to rank them). The first is where the most precision is lost."""
    lossy = sorted((r for r in results if r.verdict is PairVerdict.LOSSY),
                   key=lambda r: r.worst_sqnr if r.worst_sqnr is not None else math.inf)
    return lossy + [r for r in _in_pipeline_order(results) if r.verdict is PairVerdict.DIFFERS]


def _in_pipeline_order(results: list[PairResult]) -> list[PairResult]:
    order = list(PAIRS)
    return sorted(results, key=lambda r: order.index(r.analysis_type) if r.analysis_type in order else len(order))


def first_loss(results: list[PairResult]) -> PairResult | None:
    """The earliest pair along the chain (fake_quant -> pre_export -> export -> convert -> onnxruntime) whose
    compared values differ from its baseline (``lossy`` or ``differs``): where precision is first lost. Its
    ``first_op`` names the op there; None when no pair differs."""
    return next((r for r in _in_pipeline_order(results) if r.verdict in (PairVerdict.LOSSY, PairVerdict.DIFFERS)),
                None)
