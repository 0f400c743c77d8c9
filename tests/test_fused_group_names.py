"""A fused group is one op site in the reports: its row (the group's last op, where it is compared) shows its
members' op types, and no member shows as an "identity" (the folded BatchNorm's module in the prepared model):
issue #26 point 7, where a conv+BN group ranked among the worst ops as "stem.1 identity"."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))  # no ReLU: the BatchNorm ends the group
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.dequant(self.head(self.stem(self.quant(x))))


def test_a_conv_bn_group_is_named_by_its_members_never_identity(tmp_path):
    torch.manual_seed(0)
    model = _ConvBN().eval()
    with torch.no_grad():
        model.stem[1].running_var.uniform_(0.2, 3.0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 12, 12, generator=g),) for _ in range(2)]
    prepared = prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, batches)
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path)
    qa.set_bad_case(batches[0])
    qa.run()
    table = qa.compare_per_layer()
    group = table["stem.1"]
    assert group.compared and group.group == "conv2d+batch_norm" and group.op_type == "conv2d+batch_norm"
    assert group.analy_op_type == "identity"  # (the raw field: what the prepared model runs there)
    member = table["stem.0"]
    assert member.fused_into == "stem.1" and member.op_type == "conv2d" and not member.compared
    assert all(r.op_type != "identity" for r in table)
    assert "stem.1" in [r.op_name for r in table.ranked("same_input_sqnr")]
    # the sensitivity names the group's output quantizer the same way
    sens = {(r.op_name, r.sensitive_type): r.op_type for r in qa.sensitivity()[0]}
    assert sens[("stem.1", "activation")] == "conv2d+batch_norm" and sens[("stem.0", "weight")] == "conv2d"
    for report in ("compare_per_layer_out.txt", "profiler.html"):
        text = (tmp_path / report).read_text()
        assert "conv2d+batch_norm" in text and "identity" not in text, report
