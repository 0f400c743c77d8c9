"""The float model the profiler traces is the one the user runs (issue #42, point 4): a library branch on
``torch.compiler.is_exporting()`` that computes differently is found by comparing the traced forward with an eager
one, named at the first op site where they part, and reported in the advisor and the summary."""

import torch
from torch import nn

from quantlens.profiler import QuantAnalysis
from quantlens.profiler.eager_check import eager_divergence
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class ExportBranchNorm(nn.Module):
    """A norm that skips its centring under export (as a library's export fast path might)."""

    def forward(self, h):
        if torch.compiler.is_exporting():
            return h / h.norm(dim=-1, keepdim=True)
        return (h - h.mean(-1, keepdim=True)) / h.norm(dim=-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.q, self.dq, self.fc, self.norm, self.out = QuantStub(), DeQuantStub(), nn.Linear(8, 8), norm, \
            nn.Linear(8, 4)

    def forward(self, x):
        return self.dq(self.out(self.norm(self.fc(self.q(x)))))


class SameNorm(nn.Module):
    def forward(self, h):
        return (h - h.mean(-1, keepdim=True)) / h.norm(dim=-1, keepdim=True)


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def _analysis(norm: type, out_dir):
    """A traced fake_quant pair of ``Net(norm())``, calibrated on the bad case."""
    torch.manual_seed(0)
    model = Net(norm()).eval()
    x = _x()
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None), [x])
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case(x)
    qa.run()
    return qa


def test_the_first_op_site_where_the_export_branch_parts_is_named():
    torch.manual_seed(0)
    found = eager_divergence(Net(ExportBranchNorm()).eval(), _x())
    assert found is not None and found.site == "norm.norm_0" and found.eager == "norm.mean_0 (mean)"
    assert found.output == "0" and found.max_abs_diff > 1e-3
    torch.manual_seed(0)
    assert eager_divergence(Net(SameNorm()).eval(), _x()) is None  # one branch: nothing to say


def test_the_advisor_and_the_summary_say_the_float_model_runs_another_branch(tmp_path):
    qa = _analysis(ExportBranchNorm, tmp_path)
    qa.compare_per_layer()
    findings = [f for f in qa.advise() if f.rule == "float_model_branch"]
    assert len(findings) == 1 and findings[0].op_name == "norm.norm_0"
    assert "as you run it norm.mean_0 (mean)" in findings[0].info
    text = (tmp_path / "abnormal_layer_advisor.txt").read_text()
    assert "float_model_branch" in text and "is_exporting()" in text


def test_a_model_with_one_branch_gets_no_such_finding(tmp_path):
    qa = _analysis(SameNorm, tmp_path)
    assert not [f for f in qa.advise(qa.compare_per_layer()) if f.rule == "float_model_branch"]


def test_the_finding_is_kept_with_the_traces_for_whoever_renders_them(tmp_path):
    """A new QuantAnalysis over the saved traces writes the same advisor file, and so does `quantlens report`
    (no model at all: the divergence is saved with the traces, pair_facts.json)."""
    from quantlens.cli.report import render_pair

    qa = _analysis(ExportBranchNorm, tmp_path)
    model, prepared = qa.baseline.model, qa.analysis.model
    qa.compare_per_layer()
    written = (tmp_path / "abnormal_layer_advisor.txt").read_bytes()
    (tmp_path / "abnormal_layer_advisor.txt").unlink()
    again = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    again.compare_per_layer()
    assert (tmp_path / "abnormal_layer_advisor.txt").read_bytes() == written
    (tmp_path / "abnormal_layer_advisor.txt").unlink()
    render_pair(tmp_path, "fake_quant")
    assert (tmp_path / "abnormal_layer_advisor.txt").read_bytes() == written


_CONFIG = '''
import torch
import sys
sys.path.insert(0, {tests!r})
from test_float_model_as_run import ExportBranchNorm, Net

def float_model():
    torch.manual_seed(0)
    return Net(ExportBranchNorm()).eval()

def example_inputs():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

def calibration_data():
    return [example_inputs()]
'''


def test_the_summary_says_it_first(tmp_path):
    import json
    from pathlib import Path

    from test_cli import ql

    config = tmp_path / "branch.py"
    config.write_text(_CONFIG.format(tests=str(Path(__file__).parent)))
    res = ql("analyze", config, "--stage", "fake_quant", "--out", tmp_path / "out", "--no-sensitivity")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["headline"][0].startswith("the float model computes differently as you run it")
    assert "norm.norm_0" in summary["headline"][0] and "the float model computes differently" in res.stdout
