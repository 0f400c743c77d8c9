"""Must-show acceptance for the later stages: one planted fault per stage pair is ranked first by the error the
op adds itself (same input) and by the sensitivity table, and the advisor names it.

* pre_export (QAT model vs pre_export): a table whose output grid is too coarse. An int8-input table is the
  float op plus the output fake quant exactly (one entry per input code), so the fault sits on an int16-input
  (segmented, interpolated) sigmoid: with a planted output scale of 0.25 (4 levels for [0, 1]) the
  interpolation rounds its steep part to other levels than the float op.
* export (pre_export model vs qat IR): a submodule computes another value under ``torch.export``
  (``torch.compiler.is_exporting()``).
* convert (qat IR vs quantized IR): a linear whose exact int32 accumulator overflows (int16 activations near
  full scale times same-sign int8 weights over 1024 terms); the float fake-quant model has no such limit.
"""

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    get_qconfig,
    pre_export,
    prepare,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.zoo.faults.tiny import TwoTables, WideSum  # the fault suite's models, planted here the same way

Q16 = get_qconfig(out_dtype="qint16")


def _stages(model, x, mapping=None):
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter) if mapping else \
        default_calibration_qconfig_setter
    qat = prepare(model, (x,), setter, check_result_dir=None)
    calibrate(qat, [(x,)])
    pre = pre_export(qat)
    qat_ir = export(pre, (x,))
    return qat, pre, qat_ir


def _analyse(baseline, analysis, kind, x, out_dir):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case((x,))
    qa.run()
    table = qa.compare_per_layer()
    return qa, table, qa.advise(table)


def _init(module, seed, std=0.5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _fired(findings, rule, site):
    return [f for f in findings if f.rule == rule and f.op_name == site]


def test_pre_export_table_with_a_coarse_output_grid_is_found_first(tmp_path):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.25)))
    mapping = {"fc1": Q16, "fc2": Q16, "tanh_0": Q16, "sigmoid_0": planted}
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter)
    qat = prepare(TwoTables(), (x,), setter, check_result_dir=None)
    calibrate(qat, [(x,)])
    qa, table, findings = _analyse(qat, pre_export(qat), "pre_export", x, tmp_path)

    ranked = table.ranked("same_input_sqnr")
    assert ranked[0].op_name == "sigmoid_0"
    assert ranked[0].same_input_sqnr < 40 < 80 < ranked[1].same_input_sqnr  # the healthy int16 tanh: ~95 dB
    top = qa.sensitivity()[0]
    assert (top[0].op_name, top[0].sensitive_type) == ("sigmoid_0", "lut") and top[0].value > 10 * top[1].value
    found = _fired(findings, "table_error", "sigmoid_0")
    assert found and "levels" in found[0].info
    assert not [f for f in findings if f.rule == "table_error" and f.op_name != "sigmoid_0"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.relu = nn.Linear(16, 16), nn.ReLU()

    def forward(self, x):
        y = self.fc(x)
        # library code with an export-only path (a fake-tensor check: an is_exporting() branch is taken in every
        # traced forward, so it would not differ)
        y = y * (1.01 if torch._guards.detect_fake_mode(y) is not None else 1.0)
        return self.relu(y)


class ExportPath(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.blk, self.fc2 = nn.Linear(8, 16), Block(), nn.Linear(16, 4)
        _init(self, 0)

    def forward(self, x):
        return self.dequant(self.fc2(self.blk(torch.relu(self.fc1(self.quant(x))))))


def test_export_path_that_differs_under_torch_export_is_found_first(tmp_path):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    _, pre, qat_ir = _stages(ExportPath(), x)
    qa, table, findings = _analyse(pre, qat_ir, "export", x, tmp_path)

    ranked = table.ranked("same_input_sqnr")
    assert ranked[0].op_name == "blk.mul_0" and ranked[0].same_input_sqnr < 45
    # every op outside the block is bit-exact on the same input
    assert all(r.same_input_lsb_verdict in ("", "bit-exact") for r in table if not r.op_name.startswith("blk."))
    assert qa.sensitivity()[0][0].op_name == "blk.mul_0"
    found = _fired(findings, "export_path_differs", "blk.mul_0")
    assert found and "detect_fake_mode" in found[0].advice
    assert not [f for f in findings if f.rule == "export_path_differs" and not f.op_name.startswith("blk.")]


def test_convert_accumulator_overflow_is_found_first(tmp_path):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    _, _, qat_ir = _stages(WideSum(), x, {"fc0": Q16, "relu_0": Q16})
    qa, table, findings = _analyse(qat_ir, convert(qat_ir), "convert", x, tmp_path)

    site = "relu"  # big's requantize goes straight to the fused relu's grid: the site is the relu
    ranked = table.ranked("same_input_sqnr")
    assert ranked[0].op_name == site and ranked[0].same_input_lsb_verdict == "diverged"
    # the runner-up is only the default qpp's 16-bit multiplier at an int16 output: about 6 dB per bit, ~97 dB
    assert ranked[0].same_input_sqnr < 20 < 90 < ranked[1].same_input_sqnr
    assert table[site].acc_saturated_ratio == pytest.approx(0.5)  # the four same-sign rows, every sample
    assert all(not r.acc_saturated_ratio for r in table if r.op_name != site)
    assert qa.sensitivity()[0][0].op_name == site
    found = _fired(findings, "accumulator_saturation", site)
    assert found and "50%" in found[0].info
    assert [f.op_name for f in findings if f.rule == "accumulator_saturation"] == [site]
    # at convert the precision rule (int16 weights...) stays silent: the mechanism rule names the accumulator, and
    # no other rule gives that site a second, generic advice
    assert not [f for f in findings if f.rule in ("op_error", "integer_op_differs") and f.op_name == site]
