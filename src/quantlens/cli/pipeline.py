"""The stage pipeline behind ``quantlens analyze`` and the demo.

float -> calibration -> (QAT) -> pre_export -> qat IR (``export``) -> quantized IR (``convert``) [-> ONNX], then
one :class:`~quantlens.profiler.QuantAnalysis` per neighbouring stage pair, each in its own folder of ``out_dir``,
an ``index.html`` linking every pair's ``profiler.html``, and ``summary.json`` with the worst op per pair.

Each pair folder also gets ``quantlens_pair.json`` (the analysis type and the models' descriptions), which is
what ``quantlens report`` needs to re-render the reports from the saved traces.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from quantlens._io import atomic_write_text

__all__ = ["PAIRS", "STAGE_CHOICES", "PairResult", "Stages", "build_stages", "analyze_pair", "analyze_pairs",
           "write_index", "write_summary", "worst_row", "print_losses", "ranked_losses", "PAIR_FILE", "SUMMARY_FILE"]

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


def onnxruntime_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))


@dataclass
class Stages:
    """Every model of the flow; ``qat`` is the calibration model when the flow has no QAT step."""

    float: Any = None
    calibration: Any = None
    qat: Any = None
    pre_export: Any = None
    qat_ir: Any = None
    quantized_ir: Any = None
    onnx: Any = None  # path of the ONNX file
    files: list[str] = field(default_factory=list)


def _calibrate(model, batches: Iterable[Any]) -> None:
    from quantlens.quantization import calibrate

    calibrate(model, batches)


def build_stages(float_model: torch.nn.Module, example_inputs: Any, calibration_data: Callable[[], Iterable[Any]],
                 calibration_qconfig_setter: Any, *, qat_qconfig_setter: Any = None,
                 train_qat: Callable[[torch.nn.Module], None] | None = None, upto: str = "onnx",
                 out_dir: Path | None = None, dynamic_batch: bool = True, step: Callable[[str], None] | None = None,
                 ) -> Stages:
    """Build the stages up to ``upto`` (a stage name). With ``out_dir`` the IRs (and the ONNX file) are saved
    there. ``train_qat(model)`` trains the QAT model (prepared with ``qat_qconfig_setter``, loaded from the
    calibrated state) and leaves it in eval mode / VALIDATION state; without it QAT is skipped."""
    from quantlens.compiler import convert, export, save
    from quantlens.quantization import pre_export, prepare

    order = ["float", "calibration", "qat", "pre_export", "qat_ir", "quantized_ir", "onnx"]
    last = order.index(upto)
    step = step or (lambda name: None)
    s = Stages(float=float_model.eval())
    step("calibration")
    s.calibration = prepare(float_model, example_inputs, calibration_qconfig_setter, check_result_dir=None)
    _calibrate(s.calibration, calibration_data())
    s.qat = s.calibration
    if last >= order.index("qat") and train_qat is not None:
        step("qat")
        s.qat = prepare(float_model, example_inputs, qat_qconfig_setter or calibration_qconfig_setter,
                        check_result_dir=None)
        s.qat.load_state_dict(s.calibration.state_dict())
        train_qat(s.qat)
    if last >= order.index("pre_export"):
        step("pre_export")
        s.pre_export = pre_export(s.qat)
    if last >= order.index("qat_ir"):
        step("export")
        s.qat_ir = export(s.pre_export, example_inputs, dynamic_batch=dynamic_batch)
        if out_dir is not None:
            s.files.append(str(save(s.qat_ir, out_dir / "qat_ir.qlir")))
    if last >= order.index("quantized_ir"):
        step("convert")
        s.quantized_ir = convert(s.qat_ir)
        if out_dir is not None:
            s.files.append(str(save(s.quantized_ir, out_dir / "quantized_ir.qlir")))
    if last >= order.index("onnx") and onnxruntime_available():
        from quantlens.compiler import to_onnx

        step("onnx")
        target = (out_dir or Path(".")) / "qat_ir.onnx"
        s.onnx = str(to_onnx(s.qat_ir, target))
        s.files.append(s.onnx)
    return s


@dataclass
class PairResult:
    """One stage pair's analysis, as ``summary.json`` and the console summary show it."""

    analysis_type: str
    baseline: str
    analysis: str
    folder: str
    worst_op: str | None = None  # the op that loses the most precision itself (lowest same-input SQNR)
    worst_op_type: str | None = None
    worst_sqnr: float | None = None  # its same-input SQNR, dB (None: no same-input result)
    worst_error_kind: str = ""
    output_cosine: float | None = None  # of the last compared row
    findings: list[dict] = field(default_factory=list)
    lsb: dict | None = None
    sensitivity_top: list[tuple[str, str, float]] = field(default_factory=list)
    skipped: str = ""  # why the pair was not analysed

    @property
    def problems(self) -> bool:
        return bool(self.findings) or bool(self.lsb and self.lsb.get("first_diverged"))


def worst_row(table) -> Any:
    """The op that loses the most precision itself: the lowest finite same-input SQNR below 120 dB (float
    noise and bit-exact ops do not count), else None."""
    for row in table.ranked("same_input_sqnr"):
        if row.same_input_sqnr is not None and row.same_input_sqnr < 120:
            return row
    return None


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
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, post_process=post_process, progress=progress)
    if data is not None:
        qa.auto_find_bad_case(data, num_steps=num_steps)
    else:
        qa.set_bad_case(example)
    qa.run()
    table = qa.compare_per_layer()
    findings = qa.advise(table)
    result = PairResult(kind, base_name, analy_name, out_dir.name,
                        findings=[asdict(f) for f in findings], lsb=table.lsb_summary())
    row = worst_row(table)
    if row is not None:
        result.worst_op, result.worst_op_type = row.op_name, row.analy_op_type or row.base_op_type
        result.worst_sqnr, result.worst_error_kind = _finite(row.same_input_sqnr), row.error_kind or ""
    compared = [r for r in table if r.Cosine is not None]
    if compared:
        result.output_cosine = _finite(compared[-1].Cosine)
    if sensitivity and kind != "onnxruntime" and not (kind == "pre_export" and not _has_tables(analysis)):
        sens = qa.sensitivity()
        if len(sens):
            result.sensitivity_top = [(r.op_name, r.sensitive_type, float(r.value)) for r in sens[0][:3]]
    meta = {"analysis_type": kind, "baseline": base_name, "analysis": analy_name,
            "fake_quant_state": qa.analysis.fake_quant_state,
            "consistency": asdict(qa.consistency) if qa.consistency is not None else None}
    atomic_write_text(out_dir / PAIR_FILE, json.dumps(meta, indent=2) + "\n")
    return result


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
    """Analysed pairs with a lossy op, the lowest same-input SQNR first: the first names the culprit."""
    lossy = [r for r in results if r.worst_op is not None]
    return sorted(lossy, key=lambda r: r.worst_sqnr if r.worst_sqnr is not None else math.inf)


def write_summary(results: list[PairResult], out_dir: Path, extra: dict | None = None) -> Path:
    ranked = ranked_losses(results)
    data = dict(extra or {})
    data["culprit"] = ({"op": ranked[0].worst_op, "analysis_type": ranked[0].analysis_type,
                        "same_input_sqnr": ranked[0].worst_sqnr} if ranked else None)
    data["pairs"] = [asdict(r) for r in results]
    path = out_dir / SUMMARY_FILE
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    return path


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def write_index(results: list[PairResult], out_dir: Path, title: str = "quantlens analysis",
                intro: str = "") -> Path:
    """One self-contained ``index.html`` linking each pair's ``profiler.html`` (relative links)."""
    ranked = ranked_losses(results)
    rows = []
    for r in results:
        link = (f'<a href="{html.escape(r.folder)}/profiler.html">{html.escape(r.analysis_type)}</a>'
                if not r.skipped else html.escape(r.analysis_type))
        worst = "skipped: " + html.escape(r.skipped) if r.skipped else html.escape(r.worst_op or "none (bit-exact)")
        lsb = html.escape(str((r.lsb or {}).get("first_diverged") or "-")) if r.lsb else "-"
        rows.append(f"<tr><td>{link}</td><td>{html.escape(r.baseline)} vs {html.escape(r.analysis)}</td>"
                    f"<td>{worst}</td><td>{_fmt(r.worst_sqnr, ' dB')}</td><td>{html.escape(r.worst_error_kind)}</td>"
                    f"<td>{len(r.findings)}</td><td>{lsb}</td></tr>")
    culprit = (f"<p class=culprit>Most precision is lost at <b>{html.escape(ranked[0].worst_op)}</b> "
               f"({html.escape(ranked[0].analysis_type)}, same-input SQNR {_fmt(ranked[0].worst_sqnr, ' dB')}).</p>"
               if ranked else "<p>No op loses precision of its own.</p>")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}th{{background:#eee}}.culprit{{font-size:1.1em}}</style>
</head><body><h1>{html.escape(title)}</h1>
{f"<p>{html.escape(intro)}</p>" if intro else ""}
{culprit}
<table><thead><tr><th>stage pair</th><th>models</th><th>worst op (same input)</th><th>same-input SQNR</th>
<th>error kind</th><th>advisor findings</th><th>first diverged (&gt;4 LSB)</th></tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
<p>Each link opens that pair's <code>profiler.html</code>; the text and CSV reports are in the same folder.</p>
</body></html>
"""
    path = out_dir / "index.html"
    atomic_write_text(path, page)
    return path


def print_losses(console, pairs) -> None:
    """The 'where precision is lost' summary: the worst op per stage pair, the worst overall first."""
    from rich.markup import escape as esc
    from rich.table import Table

    ranked = ranked_losses(pairs)
    if ranked:
        top = ranked[0]
        console.print(f"[bold red]precision is lost first at {esc(top.worst_op)}[/] ({top.analysis_type}: "
                      f"{top.baseline} vs {top.analysis}, same-input SQNR {top.worst_sqnr:.1f} dB, "
                      f"{top.worst_error_kind or 'error'})" if top.worst_sqnr is not None else
                      f"[bold red]precision is lost first at {esc(top.worst_op)}[/] ({top.analysis_type})")
    else:
        console.print("no op loses precision of its own in any stage pair")
    table = Table(title="where precision is lost: the worst op per stage pair, worst first")
    for col, just in (("stage pair", "left"), ("worst op", "left"), ("SQNR dB", "right"), ("kind", "left"),
                      ("findings", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    rest = [p for p in pairs if p not in ranked]
    for p in [*ranked, *rest]:
        table.add_row(f"{p.analysis_type}", esc(p.worst_op or (f"skipped: {p.skipped}" if p.skipped else "none (exact)")),
                      "-" if p.worst_sqnr is None else f"{p.worst_sqnr:.1f}", p.worst_error_kind,
                      str(len(p.findings)))
    console.print(table)
    console.print("SQNR: the same-input SQNR of the worst op (what the op loses by itself). Stage pairs: "
                  + ", ".join(f"{p.analysis_type} = {p.baseline} vs {p.analysis}" for p in pairs))
