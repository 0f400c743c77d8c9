"""The abnormal-layer advisor: one test per rule, each on a small model that triggers it (and a control)."""

import pytest
import torch
from torch import nn

from quantlens.march import QuantDType
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantState,
    FixedScaleObserver,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    get_qconfig,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter


class Small(nn.Module):
    """quant -> fc1 -> relu (fused) -> fc2 -> dequant; ``gain`` scales fc1 (and so the relu's range)."""

    def __init__(self, gain: float = 1.0):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.quant = QuantStub()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)
        self.dequant = DeQuantStub()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            self.fc1.weight.mul_(gain)
            self.fc1.bias.mul_(gain)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


class Sqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()

    def forward(self, x):
        return self.dequant(torch.sqrt(self.quant(x)))


def _data(seed, low=-1.0, high=1.0, n=64):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 8, generator=gen) * (high - low) + low


def analyze(model, calib, bad_case, tmp_path, setter=default_calibration_qconfig_setter,
            state=FakeQuantState.VALIDATION):
    prepared = prepare(model, (calib,), setter, check_result_dir=None)
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        prepared(calib)
    set_fake_quantize(prepared, state)
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case((bad_case,))
    qa.run()
    table = qa.compare_per_layer()
    return [f for f in qa.advise(table)], table, prepared


def rule(findings, name):
    return [f for f in findings if f.rule == name]


def test_input_asymmetric_about_zero(tmp_path):
    x = _data(0, 0.0, 1.0)
    found = rule(analyze(Small(), x, x, tmp_path / "a")[0], "input_asymmetric")
    assert [f.op_name for f in found] == ["quant"] and "asymmetric about 0" in found[0].info
    assert "normalize the input symmetrically" in found[0].advice
    x = _data(0)
    assert not rule(analyze(Small(), x, x, tmp_path / "b")[0], "input_asymmetric")


def test_input_range_too_large_for_int8(tmp_path):
    x = _data(0) * 300
    found = rule(analyze(Small(), x, x, tmp_path / "a")[0], "input_range_int8")
    assert [f.op_name for f in found] == ["quant"] and "qint16" in found[0].advice
    x = _data(0) * 100
    assert not rule(analyze(Small(), x, x, tmp_path / "b")[0], "input_range_int8")


def test_scale_not_covering_the_range_clipping_dominated(tmp_path):
    x = _data(0)
    _, table, _ = analyze(Small(), x, x, tmp_path / "ok")
    correct = table["relu"].scale
    weight = QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0)
    small = QConfig(weight=weight, output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=correct / 100)))
    setter = (ModuleNameQconfigSetter({"relu": small}), default_calibration_qconfig_setter)
    findings, table, _ = analyze(Small(), x, x, tmp_path / "bad", setter)
    found = rule(findings, "scale_coverage")
    assert [f.op_name for f in found] == ["relu"]
    assert found[0].info.startswith("clipping-dominated") and "FixedScaleObserver" in found[0].advice
    assert table["relu"].raw_error_kind == "clipping" and table["relu"].clipped_ratio > 0.3


def test_scale_not_covering_the_range_rounding_dominated(tmp_path):
    calib = _data(0)
    calib[0, 0], calib[0, 1] = 1.0, -1.0  # the QuantStub scale becomes exactly 1/127
    bad = calib.clone()
    bad[1, 0] = 1.0 + 3 / 127  # one value 3 steps beyond the range: it saturates, everything else rounds
    findings, table, _ = analyze(Small(), calib, bad, tmp_path)
    found = [f for f in rule(findings, "scale_coverage") if f.op_name == "quant"]
    assert found and found[0].info.startswith("rounding-dominated") and "int16" in found[0].advice
    assert table["quant"].raw_error_kind == "rounding" and table["quant"].clipped_ratio == pytest.approx(1 / 512)


def test_op_error_classifies_bad_layers(tmp_path):
    x = _data(0)
    _, table, _ = analyze(Small(), x, x, tmp_path / "ok")
    correct = table["relu"].scale
    weight = QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0)
    small = QConfig(weight=weight, output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=correct / 100)))
    findings, _, _ = analyze(Small(), x, x, tmp_path / "clip",
                             (ModuleNameQconfigSetter({"relu": small}), default_calibration_qconfig_setter))
    found = rule(findings, "op_error")
    assert [f.op_name for f in found] == ["relu"] and "clipping-dominated" in found[0].info
    # one huge weight per output row, on a dead input: per-channel int8 weights round the row's other weights,
    # which carry the whole signal, to 0 -- the error is inside the op, not in its output rounding
    model = Small()
    with torch.no_grad():
        model.fc1.bias[0] = -100.0
        model.fc2.weight[:, 0] = 1000.0
    found = rule(analyze(model, x, x, tmp_path / "weight")[0], "op_error")
    assert [f.op_name for f in found] == ["fc2"] and "internal-dominated" in found[0].info
    assert "int16 weights for 'fc2'" in found[0].advice


def test_int8_layer_whose_range_asks_for_int16(tmp_path):
    x = _data(0)
    findings, table, _ = analyze(Small(gain=200.0), x, x, tmp_path)
    found = rule(findings, "int8_range_needs_int16")
    assert [f.op_name for f in found] == ["relu"] and "qint16" in found[0].advice
    assert 128 < table["relu"].base_max <= 32768 and not rule(findings, "range_too_large")


def test_range_too_large_even_for_int16(tmp_path):
    x = _data(0)
    findings, table, _ = analyze(Small(gain=1e5), x, x, tmp_path)
    assert "relu" in [f.op_name for f in rule(findings, "range_too_large")]
    assert "int8_range_needs_int16" not in {f.rule for f in findings if f.op_name == "relu"}
    assert table["relu"].base_max > 32768


def test_nan_inf_is_flagged_where_it_first_appears(tmp_path):
    calib = _data(0, 0.1, 1.0)
    bad = _data(1)  # negative values: sqrt gives NaN in both models
    findings, table, prepared = analyze(Sqrt(), calib, bad, tmp_path)
    found = rule(findings, "nan_inf")
    assert [f.op_name for f in found] == ["sqrt_0"] and "baseline and analysis" in found[0].info
    assert table["sqrt_0"].nonfinite == "both"
    assert "NaN x" in (tmp_path / "analysis_model" / "statistic.txt").read_text()


def test_dequant_input_not_high_precision(tmp_path):
    x = _data(0)
    setter = (ModuleNameQconfigSetter({"fc2": get_qconfig()}), default_calibration_qconfig_setter)  # int8 output
    found = rule(analyze(Small(), x, x, tmp_path / "int8", setter)[0], "dequant_not_high_precision")
    assert [f.op_name for f in found] == ["dequant"] and "from 'fc2'" in found[0].info
    assert "int32 high-precision output" in found[0].advice
    assert not rule(analyze(Small(), x, x, tmp_path / "default")[0], "dequant_not_high_precision")


def test_fake_quant_disabled(tmp_path):
    x = _data(0)
    findings, table, _ = analyze(Small(), x, x, tmp_path, state=FakeQuantState.CALIBRATION)
    assert [f.rule for f in findings] == ["fake_quant_disabled"]
    assert table["relu"].Atol == 0.0
    assert "fake_quant_disabled" in (tmp_path / "abnormal_layer_advisor.txt").read_text()


def test_docs_describe_every_rule_and_metric():
    from pathlib import Path

    from quantlens.profiler.advisor import RULES
    from quantlens.profiler.metrics import METRICS

    docs = (Path(__file__).resolve().parent.parent / "docs" / "profiler.md").read_text()
    for name in list(RULES) + list(METRICS):
        assert f"`{name}`" in docs or f"| {name} |" in docs, name
