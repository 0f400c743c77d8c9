"""The stage-pair verdict of ``quantlens analyze`` / the demo / ``quantlens report``: a pair is called exact only
when every compared op is bit-exact, and a pair that compared nothing is "no data", never exact, in the console
summary, ``index.html`` and ``summary.json``."""

import json

import pytest
import torch
from rich.console import Console

from quantlens.cli.pipeline import (
    PairResult,
    PairVerdict,
    print_losses,
    ranked_losses,
    summarize,
    worst_differing,
    write_index,
    write_summary,
)
from quantlens.profiler.compare import LayerComparison, LayerRow


def row(name, *, lsb="", atol=0.0, sqnr=None, same_sqnr=None, compared=True, index=0):
    """A compared row (``lsb``: its accumulated LSB verdict, "" for a row without a grid)."""
    metrics = dict(Cosine=1.0, Atol=atol, SQNR=sqnr) if compared else {}
    return LayerRow(index=index, op_name=name, base_op_type="conv2d", analy_op_type="conv2d", module_type="",
                    shape="[1, 4]", quant_dtype="qint8" if lsb else "float", scale=0.1 if lsb else None,
                    lsb_verdict=lsb, same_input_sqnr=same_sqnr, **metrics)


def pair(kind, *rows, **fields):
    result = PairResult(kind, "qat_ir", "onnx", kind, **fields)
    return summarize(result, LayerComparison(list(rows), "b", "a")) if not result.skipped else result


def console_text(pairs) -> str:
    console = Console(record=True, width=250)
    print_losses(console, pairs)
    return console.export_text()


def line_of(text: str, kind: str) -> str:
    return next(ln for ln in text.splitlines() if ln.strip("│ ").startswith(kind))


def index_row(path, kind: str) -> str:
    return next(ln for ln in path.read_text().splitlines() if f">{kind}</a>" in ln or f"<td>{kind}</td>" in ln)


def test_exact_only_when_every_compared_row_is_bit_exact():
    exact = pair("export", row("a", lsb="bit-exact", atol=0.04), row("b", atol=0.0), row("c", compared=False))
    assert exact.verdict is PairVerdict.EXACT and exact.worst_op is None
    assert (exact.compared, exact.differing) == (2, 0) and exact.worst_text == "none (exact)"
    # one float row off by float noise: not exact
    noisy = pair("export", row("a", lsb="bit-exact"), row("b", atol=1e-7, sqnr=150.0))
    assert noisy.verdict is PairVerdict.DIFFERS and noisy.worst_op == "b"
    assert noisy.worst_diff == "max |diff| 1e-07" and noisy.differing == 1


def test_no_same_input_data_worst_op_from_the_lsb_data():
    """The onnxruntime pair has no same-input SQNR: its worst op is the highest LSB verdict, the first among
    equals, ahead of float rows."""
    rows = [row("a", lsb="bit-exact"), row("f", atol=1e-3, sqnr=20.0), row("b", lsb="within 1 LSB"),
            row("c", lsb="within 4 LSB"), row("d", lsb="within 4 LSB"), row("e", lsb="within 1 LSB")]
    result = pair("onnxruntime", *rows)
    assert result.verdict is PairVerdict.DIFFERS and result.worst_op == "c" and result.worst_diff == "within 4 LSB"
    assert result.worst_sqnr is None and (result.compared, result.differing) == (6, 5)
    assert result.verdict_text == "differs (5/6 ops differ)" and result.worst_text == "c (within 4 LSB)"
    assert worst_differing(LayerComparison(rows + [row("g", lsb="diverged")], "b", "a")).op_name == "g"
    # float rows only: the lowest accumulated SQNR, a NaN first
    floats = [row("x", atol=1e-6, sqnr=90.0), row("y", atol=1e-5, sqnr=70.0), row("z", atol=2e-6, sqnr=80.0)]
    assert worst_differing(LayerComparison(floats, "b", "a")).op_name == "y"
    assert worst_differing(LayerComparison(floats + [row("n", atol=float("nan"), sqnr=float("nan"))], "b",
                                           "a")).op_name == "n"


def test_lossy_by_same_input_sqnr():
    result = pair("convert", row("a", lsb="within 1 LSB", same_sqnr=130.0), row("b", lsb="within 4 LSB",
                                                                                same_sqnr=40.0))
    assert result.verdict is PairVerdict.LOSSY and result.worst_op == "b" and result.worst_sqnr == 40.0
    # every same-input SQNR >= 120 dB (float noise): no op loses precision of its own, but the rows differ
    noise = pair("convert", row("a", lsb="within 1 LSB", same_sqnr=130.0))
    assert noise.verdict is PairVerdict.DIFFERS and noise.worst_op == "a"


def test_no_data_is_never_shown_as_exact(tmp_path):
    """A pair with no compared row says "no data" in the console, index.html and summary.json."""
    empty = pair("onnxruntime", row("a", compared=False))
    exact = pair("export", row("a", lsb="bit-exact"))
    assert empty.verdict is PairVerdict.NO_DATA and empty.worst_op is None and empty.compared == 0
    results = [exact, empty]

    text = console_text(results)
    line = line_of(text, "onnxruntime")
    assert "no data" in line and "exact" not in line, line
    assert "none (exact)" in line_of(text, "export")
    assert "no compared op differs in any stage pair; no data (nothing compared): onnxruntime" in text

    html_row = index_row(write_index(results, tmp_path), "onnxruntime")
    assert "no data" in html_row and "exact" not in html_row, html_row
    assert "none (exact)" in index_row(tmp_path / "index.html", "export")

    summary = json.loads(write_summary(results, tmp_path).read_text())
    assert [p["verdict"] for p in summary["pairs"]] == ["exact", "no data"]
    assert summary["pairs"][1]["worst_op"] is None and summary["pairs"][1]["compared"] == 0
    assert summary["culprit"] is None


def test_skipped_pair():
    skipped = pair("onnxruntime", skipped="onnx is not installed")
    assert skipped.verdict is PairVerdict.SKIPPED and skipped.worst_text == "skipped: onnx is not installed"
    line = line_of(console_text([skipped]), "onnxruntime")
    assert "skipped" in line and "exact" not in line


def test_ranking_and_culprit(tmp_path):
    """Lossy pairs by same-input SQNR first, then the pairs that differ (no SQNR to rank them by)."""
    differs = pair("onnxruntime", row("o", lsb="within 4 LSB"))
    lossy_a = pair("fake_quant", row("a", same_sqnr=50.0))
    lossy_b = pair("convert", row("b", lsb="within 1 LSB", same_sqnr=30.0))
    exact = pair("export", row("e", lsb="bit-exact"))
    results = [lossy_a, exact, lossy_b, differs]
    assert [r.analysis_type for r in ranked_losses(results)] == ["convert", "fake_quant", "onnxruntime"]
    text = console_text(results)
    assert "precision is lost most at b (convert: qat_ir vs onnx, same-input SQNR 30.0 dB" in text
    assert "o (within 4 LSB)" in line_of(text, "onnxruntime")
    only = console_text([exact, differs])
    assert "precision is lost most at o (onnxruntime: qat_ir vs onnx, within 4 LSB, no same-input data)" in only
    summary = json.loads(write_summary([exact, differs], tmp_path).read_text())
    assert summary["culprit"] == summary["most_loss"] == {"op": "o", "analysis_type": "onnxruntime",
                                                          "verdict": "differs", "same_input_sqnr": None,
                                                          "diff": "within 4 LSB"}


@pytest.mark.parametrize("verdict", list(PairVerdict))
def test_every_verdict_renders(verdict, tmp_path):
    rows = {PairVerdict.EXACT: [row("a", lsb="bit-exact")], PairVerdict.LOSSY: [row("a", same_sqnr=10.0)],
            PairVerdict.DIFFERS: [row("a", lsb="diverged")], PairVerdict.NO_DATA: [], PairVerdict.SKIPPED: []}
    result = pair("convert", *rows[verdict], **({"skipped": "not built"} if verdict is PairVerdict.SKIPPED else {}))
    assert result.verdict is verdict
    assert verdict.value in line_of(console_text([result]), "convert")
    assert verdict.value in index_row(write_index([result], tmp_path), "convert")
    assert json.loads(write_summary([result], tmp_path).read_text())["pairs"][0]["verdict"] == verdict.value


def test_a_pair_skipped_for_a_stage_that_failed_names_that_stage_not_an_install(tmp_path):
    """The onnxruntime pair after a failed export: its qat IR was never built, which is what it says (it said
    "onnx and onnxruntime are not installed" with both installed)."""
    from quantlens.cli.pipeline import analyze_pairs
    from quantlens.cli.stages import Stages

    stages = Stages(float=torch.nn.Identity(), qat_ir=None, onnx=None, failed="export", error="boom")
    (result,) = analyze_pairs(stages, ["onnxruntime"], tmp_path, None, None)
    assert result.skipped == "stage qat_ir not built"
