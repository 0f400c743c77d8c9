"""`./dev demo` (python -m quantlens.demo): every stage, every stage-pair analysis, and the planted fault found."""

import json
import os
import subprocess
import sys

import pytest

from quantlens.cli.pipeline import PAIRS, onnxruntime_available
from quantlens.demo import FAULT_SITE


def demo(out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "quantlens.demo", "--out", str(out), "--qat-epochs", "1",
                           "--batches", "1", "--no-sensitivity", *extra], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "fault"])
def test_demo_writes_every_pair_and_an_index(fault, tmp_path):
    res = demo(tmp_path, *(["--fault"] if fault else []))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr
    index = (tmp_path / "index.html").read_text()
    pairs = [k for k in PAIRS if k != "onnxruntime" or onnxruntime_available()]
    for kind in pairs:
        assert (tmp_path / kind / "profiler.html").is_file(), kind
        assert f'href="{kind}/profiler.html"' in index
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["analysis_type"] for p in summary["pairs"]] == list(PAIRS)
    assert {s["stage"] for s in summary["stages"]} >= {"float", "int8 calibration", "int8 QAT", "quantized IR (integer)"}
    assert "where precision is lost" in res.stdout
    for kind in pairs:  # the worst op of every analysed pair is printed
        assert kind in res.stdout
    by_kind = {p["analysis_type"]: p for p in summary["pairs"]}
    for kind in pairs:  # a verdict from compared rows: "none (exact)" only where every compared op is bit-exact
        p = by_kind[kind]
        assert p["verdict"] in ("exact", "lossy", "differs") and p["compared"] > 0, p
        assert (p["verdict"] == "exact") == (p["differing"] == 0) == (p["worst_op"] is None), p
        row = next(line for line in res.stdout.splitlines() if [c.strip() for c in line.split("│")][1:2] == [kind])
        assert ("none (exact)" in row) == (p["verdict"] == "exact"), row
    if onnxruntime_available():  # onnxruntime's default level, every op site traced
        assert by_kind["onnxruntime"]["note"].startswith("ORT_ENABLE_ALL (onnxruntime's default level)")
        assert "onnxruntime: ORT_ENABLE_ALL" in res.stdout
    culprit = summary["culprit"]["op"]
    first = next(line for line in res.stdout.splitlines() if "precision is lost most at" in line)
    assert culprit in first
    if fault:
        assert summary["fault"] == FAULT_SITE
        assert culprit == FAULT_SITE, summary["pairs"]
        assert summary["culprit"]["analysis_type"] == "fake_quant"
        assert f"planted fault: {FAULT_SITE} (found it)" in res.stdout
    else:
        assert summary["fault"] is None
