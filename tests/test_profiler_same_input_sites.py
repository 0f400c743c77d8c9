"""A site that means another value in the two IRs: a conv that quantizes its own float input (no QuantStub), its
output attributed to the fused BatchNorm's site. In the quantized IR the conv's site holds the quantize node (the
input's codes); in the qat IR its last node is the conv itself. The same-input run of the next site must not
take the qat IR's conv output as the quantized input (it crashed with a channel mismatch on LeViT/MobileViT)."""

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 2, 3, stride=2, padding=1), nn.BatchNorm2d(2), nn.Hardswish()
        self.conv2 = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.bn(self.conv(x))))


def test_convert_pair_on_a_conv_that_quantizes_its_own_input(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    model = Stem().eval()
    prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True), [(x,)])
    qat_ir = export(pre_export(prepared), (x,))
    qa = QuantAnalysis(qat_ir, convert(qat_ir), "convert", out_dir=tmp_path, progress=False)
    qa.set_bad_case((x,))
    qa.run()
    table = qa.compare_per_layer()
    assert all(r.same_input_in_scale is None or r.same_input_in_scale <= 1 for r in table), \
        [(r.op_name, r.same_input_in_scale, r.note) for r in table]
    assert any(r.same_input_in_scale is not None for r in table)
