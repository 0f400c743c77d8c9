"""Issue #23 point 4: what does not matter is marked. An op whose output reaches no compared output (an unused
pooler) is listed apart and never ranked; an op computed on the model's inputs alone is labelled host-side; the
summary leads with the sensitivity ranking once sensitivity has run, the same-input ranking second."""

import torch
from torch import nn

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    prepare,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter


class WithPooler(nn.Module):
    """An encoder whose pooler runs but whose output is dropped (as a wrapper that returns only the hidden
    states does), and an additive mask computed from a model input."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.pool, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x, mask):
        h = torch.relu(self.fc1(self.quant(x)))
        pooled = torch.tanh(self.pool(h))  # noqa: F841 - computed, never used (the wrapper drops it)
        bias = (1.0 - mask) * -10.0
        return self.dequant(self.fc2(h) + bias)


def _analysis(tmp_path):
    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
    # the pooler's output scale is far too small: alone it would top the same-input ranking
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=1e-4)))
    setter = (ModuleNameQconfigSetter({"pool": planted}), default_calibration_qconfig_setter)
    model = WithPooler().eval()
    prepared = calibrate(prepare(model, (x, mask), setter, check_result_dir=None), [(x, mask)])
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case((x, mask))
    qa.run()
    return qa


def test_an_op_reaching_no_output_is_listed_apart_and_never_ranked(tmp_path):
    qa = _analysis(tmp_path)
    table = qa.compare_per_layer()
    assert table["pool"].same_input_sqnr < 10  # it does lose precision by itself ...
    assert {r.op_name for r in table.unreached} >= {"pool", "tanh_0"}  # ... but nothing compared depends on it
    assert table["fc2"].reaches_output and table["fc1"].reaches_output
    ranked = [r.op_name for r in table.ranked("same_input_sqnr")]
    assert "pool" not in ranked and "tanh_0" not in ranked
    assert not [f for f in qa.advise(table) if f.op_name in ("pool", "tanh_0")]
    text = (tmp_path / "compare_per_layer_out.txt").read_text()
    assert "pool (linear)" in text.split("== Ops whose output reaches no compared output")[1]


def test_host_side_ops_are_labelled(tmp_path):
    qa = _analysis(tmp_path)
    table = qa.compare_per_layer()
    host = {r.op_name for r in table if r.host_side}
    assert "rsub_0" in host and "fc1" not in host and "quant" not in host
    assert "rsub_0 (host-side)" in (tmp_path / "compare_per_layer_out.txt").read_text()


def test_summary_leads_with_sensitivity(tmp_path):
    qa = _analysis(tmp_path)
    qa.compare_per_layer()
    before = (tmp_path / "compare_per_layer_out.txt").read_text()
    assert "most sensitive to" not in before
    qa.sensitivity()
    after = (tmp_path / "compare_per_layer_out.txt").read_text()
    summary = after.split("== Ops the outputs are most sensitive to")[1]
    assert summary.index("same-input SQNR") > 0  # the same-input ranking comes second
    assert "pool " not in summary.split("== Ops that lose")[0]  # an unreached op is not in the ranking


def test_the_traced_run_gives_the_reach_without_another_forward(tmp_path):
    """run() records the data flow as it traces the analysis model, so compare_per_layer() runs no model, and the
    reach it reports is the one a separate forward gives."""
    from quantlens.profiler.reach import site_reach

    qa = _analysis(tmp_path)
    calls = []
    for model in (qa.analysis.model, qa.baseline.model):
        model.register_forward_hook(lambda *args: calls.append(1))
    table = qa.compare_per_layer()
    assert calls == []
    separate = site_reach(qa._reach_access(), qa._sensitivity_case())
    assert {r.op_name for r in table.unreached} == {r.op_name for r in table if r.op_name not in separate.reaching}
    assert qa._reach() == separate


def test_an_empty_bad_case_or_dataset_is_refused(tmp_path):
    """Issue #26: an empty batch used to give a report of zeros; an empty dataset, nothing to search."""
    import pytest

    from quantlens.errors import QuantLensError

    qa = _analysis(tmp_path)
    with pytest.raises(QuantLensError, match="every input tensor is empty"):
        qa.set_bad_case((torch.zeros(0, 8), torch.zeros(0, 4)))
    with pytest.raises(QuantLensError):
        qa.auto_find_bad_case([])


def test_a_never_calibrated_model_is_refused_by_the_profiler_and_warned_at_export(tmp_path):
    """Issue #26: a prepared model that never saw data ran with the placeholder scale 1.0 without a word, and the
    profiler blamed those scales. Now QuantAnalysis refuses it (naming the op sites) unless told, and export warns;
    a model calibrated on data that reaches every site is neither."""
    import pytest

    from quantlens.compiler import export
    from quantlens.errors import QuantLensError
    from quantlens.quantization import FakeQuantState, set_fake_quantize, uncalibrated_sites

    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(16, 8, generator=gen), (torch.rand(16, 4, generator=gen) > 0.3).float()
    model = WithPooler().eval()
    raw = set_fake_quantize(prepare(model, (x, mask), check_result_dir=None), FakeQuantState.VALIDATION)
    assert {"quant", "fc2"} <= set(uncalibrated_sites(raw))
    with pytest.raises(QuantLensError, match=r"never saw data \('quant'.*allow_uncalibrated=True"):
        QuantAnalysis(model, raw, "fake_quant", out_dir=tmp_path / "a", progress=False)
    QuantAnalysis(model, raw, "fake_quant", out_dir=tmp_path / "b", progress=False, allow_uncalibrated=True)
    with pytest.warns(UserWarning, match="export: .* never saw data"):
        with pytest.raises(QuantLensError, match="no calibrated scale"):  # then pre_export's tables refuse
            export(raw, (x, mask))
    calibrated = calibrate(prepare(model, (x, mask), check_result_dir=None), [(x, mask)])
    assert uncalibrated_sites(calibrated) == []


def test_a_long_output_name_gives_a_short_stable_distinct_file_name():
    """Issue #26: an output name too long for a file name failed after sensitivity had computed everything."""
    from quantlens.profiler.report import safe_name

    long_a, long_b = "head." + "x" * 400 + ".a", "head." + "x" * 400 + ".b"
    assert len(safe_name(long_a)) <= 120 and safe_name(long_a) == safe_name(long_a)
    assert safe_name(long_a) != safe_name(long_b) and safe_name(long_a).startswith("head.xxx")
    assert safe_name("cls/score") == "cls%2Fscore"  # short names as before


def test_a_trace_folder_is_untrusted_input(tmp_path):
    """Issue #26 point 3: a trace.json entry pointing out of its folder, a FIFO in place of a trace file, a damaged
    index or file: each a QuantLensError naming the folder and the file, never a hang or a raw error."""
    import json
    import os

    import pytest

    from quantlens.errors import QuantLensError
    from quantlens.profiler.trace import TraceReader

    qa = _analysis(tmp_path)
    folder = tmp_path / "analysis_model"
    index = json.loads((folder / "trace.json").read_text())
    site = next(s for s in index["sites"] if s["name"] == "fc2")

    def reader_with(change):
        data = json.loads(json.dumps(index))
        change(data, next(s for s in data["sites"] if s["name"] == "fc2"))
        (folder / "trace.json").write_text(json.dumps(data))
        return TraceReader(folder)

    for bad in ("../baseline_model/" + site["file"], "/etc/passwd"):
        with pytest.raises(QuantLensError, match="not inside its folder"):
            reader_with(lambda d, s, bad=bad: s.update(file=bad))
    with pytest.raises(QuantLensError, match="damaged"):
        reader_with(lambda d, s: d.pop("sites"))
    reader = reader_with(lambda d, s: None)  # the index as written
    os.replace(folder / site["file"], tmp_path / "kept")
    os.mkfifo(folder / site["file"])
    with pytest.raises(QuantLensError, match="not a regular file"):
        reader.site_outputs("fc2")
    os.unlink(folder / site["file"])
    (folder / site["file"]).write_bytes(b"\x00" * 3)
    with pytest.raises(QuantLensError, match=f"{site['file']} cannot be read"):
        reader.site_outputs("fc2")
    assert qa is not None
