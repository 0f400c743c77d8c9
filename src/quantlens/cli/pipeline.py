"""The stage pipeline behind ``quantlens analyze`` and the demo.

float -> calibration -> (QAT) -> pre_export -> qat IR (``export``) -> quantized IR (``convert``) [-> ONNX], then
one :class:`~quantlens.profiler.QuantAnalysis` per neighbouring stage pair, each in its own folder of ``out_dir``,
an ``index.html`` linking every pair's ``profiler.html``, and ``summary.json`` with the verdict and the worst op
per pair (:class:`PairVerdict`: a pair is ``exact`` only when every compared op is bit-exact; a pair that compared
nothing is ``no data``, never exact), where precision is first lost along the chain and where the most
(:mod:`.pair_result` computes them, :mod:`.loss_report` writes and prints them).

The ``onnxruntime`` pair runs the ONNX file at onnxruntime's default level (``ORT_ENABLE_ALL``, what a user's
default session runs) and compares every op site; ``OnnxModelAccess(..., optimization="disable_all")`` in your
own QuantAnalysis gives the graph as written.

Each pair folder also gets ``quantlens_pair.json`` (the analysis type and the models' descriptions), which is
what ``quantlens report`` needs to re-render the reports from the saved traces.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from quantlens._io import atomic_write_text
from quantlens.cli.loss_report import SUMMARY_FILE, headline, headline_lines, print_losses, write_index, write_summary
from quantlens.cli.pair_result import (
    PAIRS,
    PairResult,
    PairVerdict,
    first_loss,
    first_lossy_row,
    is_exact,
    pair_stages,
    ranked_losses,
    summarize,
    worst_differing,
    worst_row,
)
from quantlens.cli.stages import Stages, build_stages, onnxruntime_available
from quantlens.profiler.report_files import PAIR_FILE

__all__ = ["PAIRS", "STAGE_CHOICES", "PairResult", "PairVerdict", "Stages", "build_stages", "onnxruntime_available",
           "analyze_pair",
           "analyze_pairs", "write_index", "write_summary", "worst_row", "worst_differing", "is_exact", "summarize",
           "print_losses", "ranked_losses", "first_loss", "first_lossy_row", "headline", "headline_lines", "ort_note",
           "PAIR_FILE", "SUMMARY_FILE", "ORT_PAIR_LEVEL"]


STAGE_CHOICES = [*PAIRS, "all"]
#: the onnxruntime level the ``onnxruntime`` pair runs the ONNX file at: onnxruntime's default (ORT_ENABLE_ALL)
ORT_PAIR_LEVEL = "all"


def _has_tables(model: Any) -> bool:
    from quantlens.quantization import lut_sites

    return isinstance(model, torch.nn.Module) and bool(lut_sites(model))


def analyze_pair(kind: str, baseline: Any, analysis: Any, out_dir: Path, data: Iterable[Any] | None,
                 example: Any, *, post_process: Any = None, num_steps: int | None = None,
                 sensitivity: bool = True, progress: bool = False) -> PairResult:
    """Run one QuantAnalysis (bad case, trace, per-layer comparison, advisor, sensitivity) into ``out_dir``."""
    from quantlens.profiler import QuantAnalysis

    base_name, analy_name = PAIRS[kind]
    if kind == "onnxruntime" and getattr(baseline, "kind", None) == "quantized":  # March.ORT_CPU (pair_stages)
        base_name = "quantized_ir"
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


def _onnx_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))


def analyze_pairs(stages: Stages, kinds: list[str], out_dir: Path, data: Callable[[], Iterable[Any]] | None,
                  example: Any, *, post_process: Any = None, num_steps: int | None = None,
                  sensitivity: bool = True, progress: bool = False,
                  step: Callable[[str], None] | None = None) -> list[PairResult]:
    results = []
    for kind in kinds:
        base_name, analy_name = pair_stages(kind, stages)
        base, analy = getattr(stages, base_name), getattr(stages, analy_name)
        folder = out_dir / kind
        if base is None or analy is None:
            # the stage that is missing, the first one first: an onnx file is never built from a qat IR that failed,
            # and only a missing runtime is a missing install
            missing = base_name if base is None else analy_name
            why = ("onnx and onnxruntime are not installed (pip install 'quantlens[onnx]')"
                   if base is not None and kind == "onnxruntime" and not _onnx_installed()
                   else f"stage {missing} not built")
            results.append(PairResult(kind, base_name, analy_name, folder.name, skipped=why))
            continue
        if step:
            step(f"{kind}: {base_name} vs {analy_name}")
        results.append(analyze_pair(kind, base, analy, folder, data() if data else None, example,
                                    post_process=post_process, num_steps=num_steps, sensitivity=sensitivity,
                                    progress=progress))
    return results
