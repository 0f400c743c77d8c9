"""The two models a newcomer brought (issue #42; tests/newcomers/), through the whole command line as they ran it:
``quantlens analyze --stage all``, ``quantlens report`` on the folder it wrote (every report byte-identical:
the same findings whoever renders them), and ``quantlens fix`` (a search that runs to its end, naming its
metric)."""

import filecmp
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_cli import ql  # noqa: E402

NEWCOMERS = Path(__file__).parent / "newcomers"
PAIRS = ("fake_quant", "pre_export", "export", "convert", "onnxruntime")
_REPORTS = ("abnormal_layer_advisor.txt", "compare_per_layer_out.txt", "compare_per_layer_out.csv", "profiler.html")


def _reports(folder: Path) -> list[Path]:
    return [folder / name for name in ("index.html", "summary.json")] + [
        folder / pair / name for pair in PAIRS for name in _REPORTS if (folder / pair / name).is_file()]


@pytest.mark.parametrize("name", ["cnn_gru", "deberta"])
def test_a_newcomers_model_through_analyze_report_and_fix(name, tmp_path, few_learning_epochs):
    config = NEWCOMERS / f"{name}.py"
    out = tmp_path / "out"
    run = ql("analyze", config, "--stage", "all", "--out", out, "--no-sensitivity")
    assert run.returncode in (0, 1), run.stdout[-2000:] + run.stderr
    assert "Traceback" not in run.stderr and "warning: The tensor attributes" not in run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [p["analysis_type"] for p in summary["pairs"]] == list(PAIRS)
    assert summary["headline"][0].startswith("precision is first lost in")

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    again = ql("report", copy)
    assert again.returncode == run.returncode, again.stderr
    differ = [str(p.relative_to(out)) for p in _reports(out)
              if not filecmp.cmp(p, copy / p.relative_to(out), shallow=False)]
    assert differ == [], differ

    fixed = ql("fix", config, "--target", "1.5", "--range-sites", "0", "--no-int16", "--out", tmp_path / "fix")
    assert fixed.returncode == 1, fixed.stdout[-2000:] + fixed.stderr  # 1.5: a cosine never reaches it
    assert "Traceback" not in fixed.stderr and "failed and was skipped" not in fixed.stderr, fixed.stderr
    # the result's deployed model was measured (export -> convert -> the metric on the quantized IR)
    assert "deployed quantized IR" in fixed.stdout and "was not checked" not in fixed.stdout, fixed.stdout[-2000:]
    page = (tmp_path / "fix" / "remedies.html").read_text()
    assert "cosine" in page
