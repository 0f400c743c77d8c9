"""A model without QuantStub / DeQuantStub (a newcomer's first try, and every third-party model whose code we do not
change) goes through every analysis: its inputs are quantized at their first op site, which is the NPU's
boundary, not host-side work (issue #26 point 7: it used to crash the convert sensitivity with a channel
mismatch, and to mark the first conv host-side)."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class _NoStubs(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.body(self.stem(x))).mean((2, 3)))


def test_a_model_without_stubs_goes_through_every_analysis(tmp_path):
    torch.manual_seed(0)
    model = _NoStubs().eval()
    with torch.no_grad():  # a BatchNorm that changes the values, so folding it matters
        model.stem[1].running_var.uniform_(0.5, 2.0)
        model.stem[1].running_mean.uniform_(-0.3, 0.3)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16, generator=g),) for _ in range(3)]
    prepared = prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)
    calibrate(prepared, batches)
    staged = pre_export(prepared)
    qat_ir = export(staged, batches[0])
    quantized_ir = convert(qat_ir)
    for kind, base, analysed in (("fake_quant", model, prepared), ("export", staged, qat_ir),
                                 ("convert", qat_ir, quantized_ir)):
        qa = QuantAnalysis(base, analysed, kind, tmp_path / kind)
        qa.set_bad_case(batches[1])
        qa.run()
        table = qa.compare_per_layer()
        assert not any(r.host_side for r in table), (kind, [r.op_name for r in table if r.host_side])
        sens = qa.sensitivity()
        assert len(sens[0]) >= 3, kind
        if kind == "convert":
            # the first conv group's own error is measured on the qat IR's input: the implicit boundary's quantize
            # belongs to the group's site on both sides
            first = table[table.rows[0].op_name]
            assert first.op_name == "stem.2" and first.same_input_sqnr is not None and first.same_input_sqnr > 30
            assert all(r.value >= 0 for r in sens[0])


def test_the_check_report_names_the_implicit_boundary(tmp_path):
    """model_check_result.txt says where the inputs become integers: the QuantStub, or (without one) the first op
    sites, with the fix."""
    from quantlens.quantization import DeQuantStub, QuantStub, check_qat_model

    x = torch.randn(2, 3, 12, 12)
    prepared = prepare(_NoStubs().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=tmp_path,
                       allow_no_stubs=True)
    text = (tmp_path / "model_check_result.txt").read_text()
    section = text.split("== Where the model inputs are quantized (the NPU boundary) ==")[1].split("==")[0]
    assert "no QuantStub" in section and "stem.0 (input 0)" in section and "wrap the inputs in QuantStub" in section
    assert check_qat_model(prepared, (x,), None).implicit_boundary

    class WithStubs(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.body, self.dequant = QuantStub(), _NoStubs(), DeQuantStub()

        def forward(self, x):
            return self.dequant(self.body(self.quant(x)))

    stubbed = prepare(WithStubs().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None)
    result = check_qat_model(stubbed, (x,), None)
    assert result.boundary == ["quant"] and not result.implicit_boundary


def test_a_model_without_stubs_is_refused_at_prepare_with_the_fix():
    """A newcomer's model without QuantStub is refused at prepare, naming where its float inputs enter and both fixes
    (issue #26 point 7); ``allow_no_stubs=True`` (third-party code) accepts it; a model with a QuantStub is never
    refused, even where a second input enters unmarked."""
    import pytest

    from quantlens.errors import QuantLensError
    from quantlens.quantization import QuantStub

    x = torch.randn(2, 3, 12, 12)
    with pytest.raises(QuantLensError) as err:
        prepare(_NoStubs().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None)
    text = str(err.value)
    assert "no QuantStub" in text and "stem.0 (input 0)" in text
    assert "QuantStub()" in text and "allow_no_stubs=True" in text
    assert prepare(_NoStubs().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None,
                   allow_no_stubs=True) is not None

    class OneStub(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.fc = QuantStub(), nn.Linear(4, 4)

        def forward(self, x, y):
            return self.fc(self.quant(x)) + y

    prepare(OneStub().eval(), (torch.randn(2, 4), torch.randn(2, 4)), default_calibration_qconfig_setter,
            check_result_dir=None)
