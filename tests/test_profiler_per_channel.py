"""Must-show acceptance for the per-channel figures: a per-channel fault that whole-tensor figures hide is found
first, and the advisor names the per-tensor weights.

The planted fault: a conv (``conv2``, fused with its ReLU) whose output channels' weights differ 100x in range,
quantized with one weight scale. Its small channels keep a step or two of weight resolution (below 0 dB) while
its whole output stays above 35 dB, and another op (``conv3``, a coarse fixed output scale) is worse by the
whole-tensor same-input SQNR.
"""

import math
import warnings

import pytest
import torch
from torch import nn

from quantlens.march import QuantDType
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.advisor import AdvisorContext, advise
from quantlens.profiler.advisor.per_channel import RULES as PER_CHANNEL_RULES
from quantlens.profiler.compare import SAME_INPUT_SQNR_LIMIT, LayerComparison, LayerRow, channel_axis
from quantlens.profiler.metrics import channel_sqnr
from quantlens.quantization import FixedScaleObserver, MinMaxObserver, QConfig, QuantSpec, calibrate, prepare
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter

RULE = "per_tensor_weight_channels"


def test_channel_sqnr_by_hand():
    """(1, 4, 2): channel 0 is 20 dB (signal norm 5, noise 0.5), channel 1 is 0 dB, channel 2 has no signal
    (left out, though it has an error), channel 3 is exact (+inf)."""
    x = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0], [2.0, -2.0]]])
    y = torch.tensor([[[3.0, 4.5], [0.0, 0.0], [0.1, 0.0], [2.0, -2.0]]])
    sq = channel_sqnr(x, y, 1)
    assert sq.shape == (3,)
    assert sq[0].item() == pytest.approx(20.0) and sq[1].item() == pytest.approx(0.0) and sq[2].item() == math.inf
    # the same channels on the last axis (a linear's layout) give the same figures
    assert torch.equal(channel_sqnr(x.transpose(1, 2), y.transpose(1, 2), -1), sq)
    assert channel_sqnr(x, torch.full_like(x, math.nan), 1) is None  # NaN: no figures (the nan_inf rule reports)
    assert channel_sqnr(torch.zeros(2, 3), torch.ones(2, 3), 1) is None  # no channel has signal


def test_channel_axis_from_op_facts():
    assert channel_axis("conv2d", (2, 16, 8, 8), (16, 8, 3, 3)) == 1
    assert channel_axis("conv1d", (2, 16, 8)) == 1
    assert channel_axis("conv_transpose2d", (2, 16, 8, 8), (8, 16, 3, 3)) == 1
    assert channel_axis("linear", (2, 5, 16), (16, 4)) == 2
    assert channel_axis("conv2d", (16, 8, 8), (16, 8, 3, 3)) is None  # unbatched: dim 1 is not the channel
    assert channel_axis("conv1d", (16, 8)) is None
    for op in ("relu", "add", "matmul", "batch_norm", "softmax", "not_an_op"):
        assert channel_axis(op, (2, 16, 8, 8)) is None


class ChannelNet(nn.Module):
    """conv1-relu -> conv2-relu (half of its output channels' weights 100x smaller) -> conv3 (1x1)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), \
            nn.Conv2d(16, 4, 1)
        self.relu = nn.ReLU()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            self.conv2.weight[8:] *= 0.01
            self.conv2.bias[8:] *= 0.01

    def forward(self, x):
        return self.conv3(self.relu(self.conv2(torch.relu(self.conv1(x)))))


def _analyse(per_channel: bool, out_dir):
    model = ChannelNet().eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    weight = QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0 if per_channel else None)
    mapping = {
        "conv2": QConfig(weight=weight, output=QuantSpec(QuantDType.qint8, MinMaxObserver)),
        # a worse op by the whole-tensor figure: a coarse output grid (3x the step its range needs, no clipping)
        "conv3": QConfig(weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0),
                         output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=0.2))),
    }
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(prepare(model, (x,), setter, check_result_dir=None, allow_no_stubs=True), [(x,)])
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case((x,))
    qa.run()
    table = qa.compare_per_layer()
    return table, qa.advise(table)


def test_per_channel_fault_is_found_first_and_the_advisor_names_per_channel_weights(tmp_path):
    table, findings = _analyse(per_channel=False, out_dir=tmp_path)
    group = table["relu"]  # conv2's fused group is compared at its last op
    assert table["conv2"].fused_into == "relu" and group.weight_per_channel is False
    # whole tensor: healthy-looking, and another op is worse
    assert table.ranked("same_input_sqnr")[0].op_name == "conv3"
    assert group.same_input_sqnr > 35 > table["conv3"].same_input_sqnr
    # per channel: the crushed half of the channels, first in the ranking
    ranked = table.ranked("same_input_worst_channel_sqnr")
    assert ranked[0].op_name == "relu"
    assert group.same_input_worst_channel_sqnr < 0 < SAME_INPUT_SQNR_LIMIT < ranked[1].same_input_worst_channel_sqnr
    assert group.same_input_inner_worst_channel_sqnr < 0  # the op's own arithmetic: its weights
    assert group.worst_channel_sqnr < 0 and group.channels_below == 0.5
    assert table["relu_0"].channels_below == 0 and table["conv3"].weight_per_channel is True
    assert table["conv2"].worst_channel_sqnr is None  # the fused member has nothing compared

    hits = [f for f in findings if f.rule == RULE]
    assert [(f.op_name, f.op_type) for f in hits] == [("conv2", "conv2d")]
    assert "ch_axis=0" in hits[0].advice and "'conv2'" in hits[0].advice
    assert "50% of its channels" in hits[0].info and "worst channel" in hits[0].info
    # the whole-tensor rules say nothing about conv2's group
    assert not [f for f in findings if f.op_name in ("conv2", "relu") and f.rule != RULE]

    text = (tmp_path / "compare_per_layer_out.txt").read_text()
    lines = [line for line in text.split("Ops with the worst single channel")[1].splitlines() if line.startswith("| ")]
    assert lines[1].split("|")[1].strip() == "relu" and "per tensor" in lines[1]  # the first row after the header
    csv_head = (tmp_path / "compare_per_layer_out.csv").read_text().splitlines()[0].split(",")
    assert {"worst_channel_sqnr", "same_input_worst_channel_sqnr", "channels_below", "weight_per_channel"} <= set(csv_head)
    page = (tmp_path / "profiler.html").read_text()
    assert '<table id="worst-channel">' in page and "same-in worst-ch SQNR" in page
    assert page.split('<table id="worst-channel">')[1].split("</tr>")[1].count(">relu</a>") == 1


def test_per_channel_weights_control_has_no_finding(tmp_path):
    """The same net with per-channel weights on conv2: its own arithmetic keeps every channel (the worst channel
    is still low after the output's per-tensor int8 rounding, which per-channel weights do not change)."""
    table, findings = _analyse(per_channel=True, out_dir=tmp_path)
    group = table["relu"]
    assert group.weight_per_channel is True and group.same_input_inner_worst_channel_sqnr > 30
    assert group.same_input_worst_channel_sqnr < SAME_INPUT_SQNR_LIMIT  # the output grid: 0 dB, all rounded to 0
    assert not [f for f in findings if f.rule == RULE]


def _row(name, op_type, **figures) -> LayerRow:
    base = dict(index=0, op_name=name, base_op_type=op_type, analy_op_type=op_type, module_type="", shape="2x16x8x8",
                quant_dtype="qint8", scale=0.1, Cosine=0.999, same_input_sqnr=36.0)
    return LayerRow(**{**base, **figures})


@pytest.mark.parametrize("figures,fires", [
    (dict(), True),
    (dict(weight_per_channel=True), False),  # already per channel
    (dict(weight_per_channel=None), False),  # not known (an IR, no weight fake quant)
    (dict(same_input_inner_worst_channel_sqnr=34.0), False),  # the output's rounding, not the weights
    (dict(same_input_inner_worst_channel_sqnr=None), True),  # no split: the same-input figure alone
    (dict(same_input_worst_channel_sqnr=30.0), False),  # not below the limit
    (dict(same_input_sqnr=22.0, same_input_worst_channel_sqnr=15.0), False),  # within 10 dB of the whole
], ids=["fault", "per-channel", "unknown", "output-rounding", "no-inner", "above-limit", "close-to-whole"])
def test_rule_conditions(figures, fires):
    fault = dict(weight_per_channel=False, same_input_worst_channel_sqnr=-5.0,
                 same_input_inner_worst_channel_sqnr=-4.0, channels_below=0.5)
    rows = [_row("fc", "linear", **{**fault, **figures}), _row("act", "mul", **fault)]  # mul: no weights
    ctx = AdvisorContext(LayerComparison(rows, "b", "a"), "fake_quant", "validation")
    found = advise(ctx, PER_CHANNEL_RULES)
    assert [f.op_name for f in found] == (["fc"] if fires else [])
    for stage in ("pre_export", "export", "convert", "onnxruntime"):  # the weights are quantized on both sides
        assert not advise(AdvisorContext(ctx.comparison, stage, "validation"), PER_CHANNEL_RULES)
