"""The advisor rules of the deployed stages (export, convert) and of pre_export's tables: one test per rule, each
on a small model that triggers it, with a control that does not."""

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.advisor import THRESHOLDS
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

Q16 = get_qconfig(out_dtype="qint16")


def _init(module, seed=0, std=0.5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return module


def _data(seed=0, n=32, d=8):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _prepared(model, x, mapping=None):
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter) if mapping else \
        default_calibration_qconfig_setter
    qat = prepare(model, (x,), setter, check_result_dir=None)
    return calibrate(qat, [(x,)])


def _ir(model, x, mapping=None):
    """(pre_export model, qat IR, quantized IR)."""
    pre = pre_export(_prepared(model, x, mapping))
    qat_ir = export(pre, (x,))
    return pre, qat_ir, convert(qat_ir)


def _findings(baseline, analysis, kind, bad_case, out_dir, name):
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case((bad_case,))
    qa.run()
    table = qa.compare_per_layer()
    return [f for f in qa.advise(table) if f.rule == name], table


def test_thresholds_are_listed():
    for key in ("accumulator saturation limit (fraction)", "requantize saturation limit (fraction)",
                "table input clip limit (fraction)", "export float noise SQNR (dB)",
                "pre_export table SQNR limit (dB)"):
        assert key in THRESHOLDS


class Wide(nn.Module):
    """quant -> fc0 (~constant 3 after the relu) -> big (1024 terms, weights ~0.5) -> fc2 -> dequant."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc0, self.big, self.fc2 = nn.Linear(8, 1024), nn.Linear(1024, 2), nn.Linear(2, 2)
        _init(self, std=0.05)
        with torch.no_grad():
            self.fc0.bias.fill_(3.0)
            self.big.weight.fill_(0.5)

    def forward(self, x):
        return self.dequant(self.fc2(self.big(torch.relu(self.fc0(self.quant(x))))))


def test_accumulator_saturation(tmp_path):
    x = _data(1, n=8)
    _, qat_ir, quantized = _ir(Wide(), x, {"fc0": Q16, "relu_0": Q16})  # int16 x int8 over 1024 terms
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path / "a", "accumulator_saturation")
    assert [f.op_name for f in found] == ["big"] and table["big"].acc_saturated_ratio == 1.0
    assert "100% of the int32 accumulators" in found[0].info and "int8 instead of int16" in found[0].advice
    _, qat_ir, quantized = _ir(Wide(), x)  # int8 x int8: 1024 * 127 * 127 stays far below 2**31
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path / "b", "accumulator_saturation")
    assert not found and table["big"].acc_saturated_ratio == 0.0


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        _init(self)

    def forward(self, x):
        return self.dequant(self.fc2(self.fc1(self.quant(x))))


def test_requant_saturation(tmp_path):
    x = _data(2)
    _, qat_ir, quantized = _ir(Mlp(), x)
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path / "a", "requant_saturation")
    assert not found and table["fc1"].requant_saturated_ratio == 0.0
    # a converter bug: fc1's requantize multiplier doubled (shift one less) saturates what the fake quant kept
    node = next(n for n in quantized.graph.nodes if n.op == "linear" and n.site == "fc1")
    node.attrs["shift"] = [s - 1 for s in node.attrs["shift"]]
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path / "b", "requant_saturation")
    assert [f.op_name for f in found] == ["fc1"] and table["fc1"].requant_saturated_ratio > 0.05
    assert "multiplier, shift" in found[0].advice


class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        _init(self, std=0.3)

    def forward(self, x):
        return self.dequant(self.fc2(torch.exp(self.fc1(self.quant(x)))))


def test_table_input_clipped(tmp_path):
    x = _data(3)
    planted = QConfig(weight=QuantSpec("qint8", ch_axis=0),
                      output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.004)))  # range +-0.5
    for kind in ("export", "convert"):
        pre, qat_ir, quantized = _ir(Exp(), x, {"fc1": planted})
        base, analysis = (pre, qat_ir) if kind == "export" else (qat_ir, quantized)
        found, table = _findings(base, analysis, kind, x, tmp_path / kind, "table_input_clipped")
        assert [f.op_name for f in found] == ["exp_0"], kind
        assert table["exp_0"].table_input_clipped_ratio > 0.2 and "beyond the range the table" in found[0].info
    pre, qat_ir, quantized = _ir(Exp(), x)  # calibrated: only the extreme values sit at the limit codes
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path / "c", "table_input_clipped")
    assert not found and table["exp_0"].table_input_clipped_ratio < 0.01


class Sigmoid(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        _init(self)

    def forward(self, x):
        return self.dequant(self.fc2(torch.sigmoid(self.fc1(self.quant(x)))))


def test_table_input_clipped_ignores_a_flat_table_end(tmp_path):
    """sigmoid of an int8 input of scale 1/16 saturates at code +-128 (entries equal there): clipping is free."""
    x = _data(4) * 4
    planted = QConfig(weight=QuantSpec("qint8", ch_axis=0),
                      output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=1 / 8)))  # +-16: flat ends
    _, qat_ir, quantized = _ir(Sigmoid(), x, {"fc1": planted})
    found, table = _findings(qat_ir, quantized, "convert", x, tmp_path, "table_input_clipped")
    assert not found and table["sigmoid_0"].table_input_clipped_ratio == 0.0


def test_table_error_at_pre_export(tmp_path):
    x = _data(5, n=64)
    mapping = {"fc1": Q16}
    qat = _prepared(Sigmoid(), x, mapping)
    found, table = _findings(qat, pre_export(qat), "pre_export", x, tmp_path / "a", "table_error")
    assert not found and table["sigmoid_0"].same_input_sqnr > 60
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.3)))  # 4 levels for [0, 1]
    qat = _prepared(Sigmoid(), x, {**mapping, "sigmoid_0": planted})
    found, table = _findings(qat, pre_export(qat), "pre_export", x, tmp_path / "b", "table_error")
    assert [f.op_name for f in found] == ["sigmoid_0"] and "levels" in found[0].info
    assert "finer output scale" in found[0].advice


class Block(nn.Module):
    def __init__(self, export_gain: float, signal: str = "fake"):
        super().__init__()
        self.fc, self.export_gain, self.signal = nn.Linear(8, 8), export_gain, signal

    def forward(self, x):
        y = self.fc(x)
        under_export = (torch._guards.detect_fake_mode(y) is not None if self.signal == "fake"
                        else torch.compiler.is_exporting())
        return y * (self.export_gain if under_export else 1.0)


class ExportGain(nn.Module):
    def __init__(self, export_gain: float, signal: str = "fake"):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.blk, self.fc2 = Block(export_gain, signal), nn.Linear(8, 4)
        _init(self)

    def forward(self, x):
        return self.dequant(self.fc2(torch.relu(self.blk(self.quant(x)))))


def test_export_path_differs(tmp_path):
    x = _data(6)
    pre, qat_ir, _ = _ir(ExportGain(1.05), x)
    found, table = _findings(pre, qat_ir, "export", x, tmp_path / "a", "export_path_differs")
    assert found and found[0].op_name == "blk.mul_0" and "detect_fake_mode" in found[0].advice
    pre, qat_ir, _ = _ir(ExportGain(1.0), x)
    found, table = _findings(pre, qat_ir, "export", x, tmp_path / "b", "export_path_differs")
    assert not found
    assert all(r.same_input_lsb_verdict in ("", "bit-exact") for r in table)
    # an is_exporting() branch is no difference: every traced forward takes it, as export does
    pre, qat_ir, _ = _ir(ExportGain(1.05, signal="is_exporting"), x)
    found, table = _findings(pre, qat_ir, "export", x, tmp_path / "c", "export_path_differs")
    assert not found
    assert all(r.same_input_lsb_verdict in ("", "bit-exact") for r in table)


def test_nonfinite_to_integer(tmp_path):
    x = _data(7)
    _, qat_ir, quantized = _ir(Mlp(), x)
    found, _ = _findings(qat_ir, quantized, "convert", x, tmp_path / "a", "nonfinite_to_integer")
    assert not found
    bad = x.clone()
    bad[0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
    found, table = _findings(qat_ir, quantized, "convert", bad, tmp_path / "b", "nonfinite_to_integer")
    assert [f.op_name for f in found] == ["quant"] and table["quant"].nonfinite_to_int == 3
    assert "3 NaN/Inf values" in found[0].info and "QuantStub" in found[0].advice
