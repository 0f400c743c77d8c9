"""The stage pipeline behind ``quantlens analyze`` and the demo.

float -> calibration -> (QAT) -> pre_export -> qat IR (``export``) -> quantized IR (``convert``) [-> ONNX], then
one :class:`~quantlens.profiler.QuantAnalysis` per neighbouring stage pair, each in its own folder of ``out_dir``,
an ``index.html`` linking every pair's ``profiler.html``, and ``summary.json`` with the verdict and the worst op
per pair (:class:`PairVerdict`: a pair is ``exact`` only when every compared op is bit-exact; a pair that compared
nothing is ``no data``, never exact).

The ``onnxruntime`` pair runs the ONNX file at onnxruntime's default level (``ORT_ENABLE_ALL``, what a user's
default session runs) and compares every op site; ``OnnxModelAccess(..., optimization="disable_all")`` in your
own QuantAnalysis gives the graph as written.

Each pair folder also gets ``quantlens_pair.json`` (the analysis type and the models' descriptions), which is
what ``quantlens report`` needs to re-render the reports from the saved traces.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from quantlens._io import atomic_write_text
from quantlens.cli.stages import Stages, build_stages, onnxruntime_available

__all__ = ["PAIRS", "STAGE_CHOICES", "PairResult", "PairVerdict", "Stages", "build_stages", "onnxruntime_available",
           "analyze_pair",
           "analyze_pairs", "write_index", "write_summary", "worst_row", "worst_differing", "is_exact", "summarize",
           "print_losses", "ranked_losses", "headline", "ort_note", "PAIR_FILE", "SUMMARY_FILE", "ORT_PAIR_LEVEL"]

PAIR_FILE = "quantlens_pair.json"
SUMMARY_FILE = "summary.json"

#: analysis type -> (baseline stage, analysis stage), in pipeline order
PAIRS: dict[str, tuple[str, str]] = {
    "fake_quant": ("float", "calibration"),
    "pre_export": ("qat", "pre_export"),
    "export": ("pre_export", "qat_ir"),
    "convert": ("qat_ir", "quantized_ir"),
    "onnxruntime": ("qat_ir", "onnx"),
}
STAGE_CHOICES = [*PAIRS, "all"]
#: the onnxruntime level the ``onnxruntime`` pair runs the ONNX file at: onnxruntime's default (ORT_ENABLE_ALL)
ORT_PAIR_LEVEL = "all"


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


def worst_row(table) -> Any:
    """The op that loses the most precision itself: the lowest finite same-input SQNR below 120 dB (float
    noise and bit-exact ops do not count), else None."""
    for row in table.ranked("same_input_sqnr"):
        if row.same_input_sqnr is not None and row.same_input_sqnr < 120:
            return row
    return None


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
    return result


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _has_tables(model: Any) -> bool:
    from quantlens.quantization import lut_sites

    return isinstance(model, torch.nn.Module) and bool(lut_sites(model))


def analyze_pair(kind: str, baseline: Any, analysis: Any, out_dir: Path, data: Iterable[Any] | None,
                 example: Any, *, post_process: Any = None, num_steps: int | None = None,
                 sensitivity: bool = True, progress: bool = False) -> PairResult:
    """Run one QuantAnalysis (bad case, trace, per-layer comparison, advisor, sensitivity) into ``out_dir``."""
    from quantlens.profiler import QuantAnalysis

    base_name, analy_name = PAIRS[kind]
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "onnxruntime":  # what a user's default onnxruntime session runs
        from quantlens.profiler import OnnxModelAccess

        analysis = OnnxModelAccess(analysis, "analysis", optimization=ORT_PAIR_LEVEL)
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, post_process=post_process, progress=progress)
    if data is not None:
        qa.auto_find_bad_case(data, num_steps=num_steps)
    else:
        qa.set_bad_case(example)
    qa.run()
    table = qa.compare_per_layer()
    findings = qa.advise(table)
    ort = _ort_meta(qa.analysis) if kind == "onnxruntime" else None
    result = summarize(PairResult(kind, base_name, analy_name, out_dir.name, findings=[asdict(f) for f in findings],
                                  lsb=table.lsb_summary(), note=ort_note(ort)), table)
    if sensitivity and kind != "onnxruntime" and not (kind == "pre_export" and not _has_tables(analysis)):
        sens = qa.sensitivity()
        if len(sens):
            result.sensitivity_top = [(r.op_name, r.sensitive_type, float(r.value)) for r in sens[0][:3]]
    meta = {"analysis_type": kind, "baseline": base_name, "analysis": analy_name,
            "fake_quant_state": qa.analysis.fake_quant_state,
            "consistency": asdict(qa.consistency) if qa.consistency is not None else None, "onnxruntime": ort}
    atomic_write_text(out_dir / PAIR_FILE, json.dumps(meta, indent=2) + "\n")
    return result


def _ort_meta(access) -> dict:
    """How the onnxruntime pair ran (kept in ``quantlens_pair.json`` for ``quantlens report``)."""
    check = access.output_check
    return {"optimization": access.optimization, "form": access.form, "outputs_only": access.outputs_only,
            "output_check": asdict(check) if check is not None else None}


def ort_note(meta: dict | None) -> str:
    """The onnxruntime pair's note: the level, what was traced, and the outputs check."""
    if not meta:
        return ""
    from quantlens.profiler.onnx_access import ORT_LEVELS

    level = ORT_LEVELS.get(meta["optimization"], meta["optimization"])
    if meta["optimization"] == ORT_PAIR_LEVEL:
        level += " (onnxruntime's default level)"
    if meta["outputs_only"]:
        return f"{level}, standard QDQ form: model outputs only (per-op outputs would block the integer Q/DQ fusions)"
    check = meta.get("output_check")
    if check is None:
        return f"{level}: every op site traced"
    if check["equal"]:
        return f"{level}: every op site traced; the model outputs equal a plain session's bit for bit"
    return (f"{level}: every op site traced, but the traced model outputs differ from a plain session's (max |diff| "
            f"{check['max_abs_diff']:.3g}): a per-op graph output blocked a fusion; the rows are the traced session's")


def analyze_pairs(stages: Stages, kinds: list[str], out_dir: Path, data: Callable[[], Iterable[Any]] | None,
                  example: Any, *, post_process: Any = None, num_steps: int | None = None,
                  sensitivity: bool = True, progress: bool = False,
                  step: Callable[[str], None] | None = None) -> list[PairResult]:
    results = []
    for kind in kinds:
        base_name, analy_name = PAIRS[kind]
        base, analy = getattr(stages, base_name), getattr(stages, analy_name)
        folder = out_dir / kind
        if base is None or analy is None:
            why = ("onnx and onnxruntime are not installed (pip install 'quantlens[onnx]')"
                   if kind == "onnxruntime" else f"stage {analy_name if analy is None else base_name} not built")
            results.append(PairResult(kind, base_name, analy_name, folder.name, skipped=why))
            continue
        if step:
            step(f"{kind}: {base_name} vs {analy_name}")
        results.append(analyze_pair(kind, base, analy, folder, data() if data else None, example,
                                    post_process=post_process, num_steps=num_steps, sensitivity=sensitivity,
                                    progress=progress))
    return results


def ranked_losses(results: list[PairResult]) -> list[PairResult]:
    """Pairs that lose precision: ``lossy`` ones by same-input SQNR (lowest first), then ``differs`` ones in
    pipeline order (no same-input SQNR to rank them). The first names the culprit."""
    lossy = sorted((r for r in results if r.verdict is PairVerdict.LOSSY),
                   key=lambda r: r.worst_sqnr if r.worst_sqnr is not None else math.inf)
    return lossy + [r for r in results if r.verdict is PairVerdict.DIFFERS]


def _culprit(ranked: list[PairResult]) -> dict | None:
    if not ranked:
        return None
    top = ranked[0]
    return {"op": top.worst_op, "analysis_type": top.analysis_type, "verdict": top.verdict.value,
            "same_input_sqnr": top.worst_sqnr, "diff": top.worst_diff}


def write_summary(results: list[PairResult], out_dir: Path, extra: dict | None = None) -> Path:
    """``summary.json``: the culprit (see :func:`ranked_losses`) and every pair's :class:`PairResult`."""
    data = dict(extra or {})
    data["culprit"] = _culprit(ranked_losses(results))
    data["pairs"] = [{**asdict(r), "verdict": r.verdict.value} for r in results]
    path = out_dir / SUMMARY_FILE
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    return path


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def headline(results: list[PairResult]) -> str:
    """The one-line answer (plain text): where precision is lost first, or that nothing compared differs."""
    ranked = ranked_losses(results)
    no_data = [r.analysis_type for r in results if r.verdict is PairVerdict.NO_DATA]
    tail = f"; no data (nothing compared): {', '.join(no_data)}" if no_data else ""
    if not ranked:
        return "no compared op differs in any stage pair" + tail
    top = ranked[0]
    if top.verdict is PairVerdict.LOSSY and top.worst_sqnr is not None:
        how = f"same-input SQNR {top.worst_sqnr:.1f} dB, {top.worst_error_kind or 'error'}"
    elif top.verdict is PairVerdict.LOSSY:
        how = "same-input SQNR below 120 dB"
    else:
        how = f"{top.worst_diff}, no same-input data"
    return (f"precision is lost first at {top.worst_op} ({top.analysis_type}: {top.baseline} vs {top.analysis}, "
            f"{how}){tail}")


def write_index(results: list[PairResult], out_dir: Path, title: str = "quantlens analysis",
                intro: str = "") -> Path:
    """One self-contained ``index.html`` linking each pair's ``profiler.html`` (relative links)."""
    rows = []
    for r in results:
        link = (f'<a href="{html.escape(r.folder)}/profiler.html">{html.escape(r.analysis_type)}</a>'
                if not r.skipped else html.escape(r.analysis_type))
        lsb = html.escape(str((r.lsb or {}).get("first_diverged") or "-")) if r.lsb else "-"
        rows.append(f"<tr><td>{link}</td><td>{html.escape(r.baseline)} vs {html.escape(r.analysis)}</td>"
                    f"<td>{html.escape(r.verdict_text)}</td><td>{html.escape(r.worst_text)}</td>"
                    f"<td>{_fmt(r.worst_sqnr, ' dB')}</td><td>{html.escape(r.worst_error_kind)}</td>"
                    f"<td>{len(r.findings)}</td><td>{lsb}</td></tr>")
    notes = "".join(f"<li>{html.escape(r.analysis_type)}: {html.escape(r.note)}</li>" for r in results if r.note)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}th{{background:#eee}}.culprit{{font-size:1.1em}}</style>
</head><body><h1>{html.escape(title)}</h1>
{f"<p>{html.escape(intro)}</p>" if intro else ""}
<p class=culprit>{html.escape(headline(results))}.</p>
<table><thead><tr><th>stage pair</th><th>models</th><th>verdict</th><th>worst op</th><th>same-input SQNR</th>
<th>error kind</th><th>advisor findings</th><th>first diverged (&gt;4 LSB)</th></tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
{f"<ul>{notes}</ul>" if notes else ""}
<p>Verdict: <i>exact</i> only when every compared op is bit-exact; <i>lossy</i>: an op loses precision of its own
(worst op: lowest same-input SQNR); <i>differs</i>: ops differ but none is measured losing precision on the same
input (worst op: highest LSB verdict, else lowest SQNR); <i>no data</i>: nothing was compared.
Each link opens that pair's <code>profiler.html</code>; the text and CSV reports are in the same folder.</p>
</body></html>
"""
    path = out_dir / "index.html"
    atomic_write_text(path, page)
    return path


def print_losses(console, pairs: list[PairResult]) -> None:
    """The 'where precision is lost' summary: the verdict and worst op per stage pair, the worst overall first."""
    from rich.markup import escape as esc
    from rich.table import Table

    ranked = ranked_losses(pairs)
    line = esc(headline(pairs))
    console.print(f"[bold red]{line}[/]" if ranked else line)
    table = Table(title="where precision is lost: the verdict and worst op per stage pair, worst first")
    for col, just in (("stage pair", "left"), ("verdict", "left"), ("worst op", "left"), ("SQNR dB", "right"),
                      ("kind", "left"), ("findings", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    rest = [p for p in pairs if p not in ranked]
    for p in [*ranked, *rest]:
        table.add_row(p.analysis_type, esc(p.verdict_text), esc(p.worst_text),
                      "-" if p.worst_sqnr is None else f"{p.worst_sqnr:.1f}", p.worst_error_kind, str(len(p.findings)))
    console.print(table)
    for p in pairs:
        if p.note:
            console.print(f"{p.analysis_type}: {esc(p.note)}")
    console.print("verdict: exact only when every compared op is bit-exact; no data: nothing compared. SQNR: the "
                  "same-input SQNR of the worst op (what the op loses by itself). Stage pairs: "
                  + ", ".join(f"{p.analysis_type} = {p.baseline} vs {p.analysis}" for p in pairs))
