"""The reports of a folder are the same bytes whoever renders them: ``quantlens analyze``, ``quantlens report`` on a
copy, or a new ``QuantAnalysis`` over the saved traces (issue #42: the report lost the GRU's bias_saturation finding,
the sensitivity ranking, the index title and the 'reaches output' marks)."""

import json
import shutil
from pathlib import Path

import pytest
from test_cli import ql

ROOT = Path(__file__).resolve().parents[1]
CNN_GRU = ROOT / "tests" / "newcomers" / "cnn_gru.py"
REPORTS = (".txt", ".csv", ".html", ".json")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory) -> Path:
    """``quantlens analyze cnn_gru.py --stage convert`` (with sensitivity): the convert pair holds the GRU's int32
    bias that saturates, a consistency level and a sensitivity ranking, none of which is in the traces."""
    out = tmp_path_factory.mktemp("analysed") / "cnn_gru"
    res = ql("analyze", CNN_GRU, "--stage", "convert", "--out", out)
    assert res.returncode == 1, res.stdout + res.stderr  # (advisor findings)
    return out


def _reports(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in REPORTS and "_model" not in p.parent.name}


def _assert_same(before: dict[str, bytes], after: dict[str, bytes]) -> None:
    assert sorted(before) == sorted(after)
    assert [name for name in before if before[name] != after[name]] == []


def test_report_rewrites_every_report_byte_for_byte(analysed, tmp_path):
    before = _reports(analysed)
    assert "bias_saturation" in before["convert/abnormal_layer_advisor.txt"].decode()
    assert "Ops the outputs are most sensitive to" in before["convert/compare_per_layer_out.txt"].decode()
    copy = tmp_path / "cnn_gru"
    shutil.copytree(analysed, copy)
    res = ql("report", copy)
    assert res.returncode == 1, res.stdout + res.stderr
    after = _reports(copy)
    _assert_same(before, after)
    summary = json.loads(after["summary.json"])
    assert summary["pairs"][0]["sensitivity_top"]
    assert "<title>quantlens analyze cnn_gru.py</title>" in after["index.html"].decode()


def test_new_quant_analysis_over_the_traces_keeps_reach_and_every_report(analysed, tmp_path):
    from quantlens.profiler import QuantAnalysis

    copy = tmp_path / "cnn_gru"
    shutil.copytree(analysed, copy)
    before = _reports(copy)
    qa = QuantAnalysis(copy / "qat_ir.qlir", copy / "quantized_ir.qlir", "convert", out_dir=copy / "convert",
                       progress=False)
    table = qa.compare_per_layer()  # no bad case: the traces are compared from the folder
    assert [r.op_name for r in table if r.reaches_output is None] == []
    _assert_same(before, _reports(copy))


def test_facts_of_other_traces_are_ignored(analysed, tmp_path):
    from quantlens.cli.report import render_pair

    copy = tmp_path / "convert"
    shutil.copytree(analysed / "convert", copy)
    path = copy / "pair_facts.json"
    facts = json.loads(path.read_text())
    # a forged entry: conv1's bias saturates. Saved for these traces it is reported; for other traces not trusted
    facts["bias"] = [dict(e, saturated=2, worst_ratio=3.0) if e["op_name"] == "conv1" else e for e in facts["bias"]]
    path.write_text(json.dumps(facts))

    def saturated() -> list[str]:
        return [f["op_name"] for f in render_pair(copy).findings if f["rule"] == "bias_saturation"]

    assert saturated() == ["conv1", "gru.l0.linear_1"]
    facts["traces"][0] = "0" * 64
    path.write_text(json.dumps(facts))
    assert saturated() == []
