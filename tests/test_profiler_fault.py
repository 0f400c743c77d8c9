"""Must-show acceptance: a planted fault is localized, and the sensitivity table closes the loop."""

import pytest
import torch

from quantlens.march import QuantDType
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    FakeQuantState,
    FixedScaleObserver,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    default_calibration_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.zoo import evaluate_accuracy, example_inputs, get_model, load_digits_data, sample_batches

SITE = "layer1.relu1"  # last op of the fused conv-bn-relu group, carrying its int8 output fake quant


def _calibrate(model, example, batches, setter):
    calib = prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in batches:
            calib(*batch)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    return calib


@pytest.fixture(scope="module")
def correct_scale():
    model = get_model("tiny_resnet")
    good = _calibrate(model, example_inputs("tiny_resnet"), sample_batches("tiny_resnet", 3, 8),
                      default_calibration_qconfig_setter)
    return float(good._quantlens_state.fq["layer1/relu1|out"].scale)


@pytest.mark.parametrize("factor", [0.01, 100.0], ids=["scale_100x_too_small", "range_100x_too_large"])
def test_planted_scale_fault_is_found_first(factor, correct_scale, tmp_path):
    model = get_model("tiny_resnet")
    planted = QConfig(
        weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0),
        output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=correct_scale * factor)),
    )
    setter = (ModuleNameQconfigSetter({SITE: planted}), default_calibration_qconfig_setter)
    calib = _calibrate(model, example_inputs("tiny_resnet"), sample_batches("tiny_resnet", 3, 8), setter)
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("tiny_resnet"))
    qa.run()
    table = qa.compare_per_layer()

    ranked = table.ranked("same_input_sqnr")
    assert ranked[0].op_name == SITE
    assert ranked[0].same_input_sqnr < 5 < 25 < ranked[1].same_input_sqnr  # far ahead of every other op
    if factor < 1:  # clipping: also first in output steps, and classified as such
        assert table.ranked("same_input_in_scale")[0].op_name == SITE
        assert table[SITE].error_kind == "clipping" and table[SITE].same_input_in_scale > 1000
    # The accumulated error cannot localize it: downstream layers look as bad or worse.
    assert table.ranked("Cosine")[0].Cosine <= table[SITE].Cosine

    top = qa.sensitivity()[0][0]
    assert (top.op_name, top.sensitive_type) == (SITE, "activation")
    assert SITE in (tmp_path / "compare_per_layer_out.txt").read_text().split("Ops that lose")[1].splitlines()[4]


def test_sensitivity_table_restores_accuracy_of_digits_cnn(tmp_path):
    """A planted outlier channel: relu2's per-tensor int8 scale must cover a 100x larger channel."""
    data = load_digits_data()
    model = get_model("digits_cnn")
    with torch.no_grad():  # the float function is unchanged: ReLU commutes with a positive scale
        model.bn2.weight[5] *= 100
        model.bn2.bias[5] *= 100
        model.conv3.weight[:, 5] /= 100
    batches = [(data.x_train[i : i + 128],) for i in range(0, 512, 128)]
    example = (data.x_train[:8],)
    float_acc = evaluate_accuracy(model, data.x_test, data.y_test)
    int8 = _calibrate(model, example, batches, default_calibration_qconfig_setter)
    int8_acc = evaluate_accuracy(int8, data.x_test, data.y_test)
    assert float_acc > 98 and int8_acc < float_acc - 20

    qa = QuantAnalysis(model, int8, "fake_quant", out_dir=tmp_path, progress=False)
    qa.auto_find_bad_case([(data.x_test[i : i + 32],) for i in range(0, 320, 32)])
    table = qa.sensitivity()
    assert (table[0][0].op_name, table[0][0].sensitive_type) == ("relu2", "activation")

    fixed = _calibrate(model, example, batches,
                       sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(table, topk=1))
    assert fixed._quantlens_state.plans["relu2"].output_dtype == "qint16"
    fixed_acc = evaluate_accuracy(fixed, data.x_test, data.y_test)
    assert fixed_acc >= float_acc - 1.0
    # the .pt table feeds the setter unchanged too
    rows = torch.load(tmp_path / "output_0_L1_sensitive_ops.pt", weights_only=True)
    again = _calibrate(model, example, batches, sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(rows, topk=1))
    assert evaluate_accuracy(again, data.x_test, data.y_test) == fixed_acc


def test_in_place_op_same_input_reads_the_value_before_the_op(small_conv_analysis, tmp_path):
    """``y.mul_(3)`` and ``y += 1`` in the float model: the baseline trace keeps the value each op read, so the
    same-input run of the quantized op is a small error (it read the result, 3x its input, before: -3 dB)."""

    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.conv2 = torch.nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.conv(x)
            y.mul_(3.0)
            y += 1.0
            return self.conv2(torch.relu_(y))

    torch.manual_seed(0)
    model = InPlace().eval()
    calib, x, qa = small_conv_analysis(model)
    table = qa.compare_per_layer()
    rows = {r.analy_op_type: r for r in table if r.analy_op_type in ("mul", "add", "relu")}
    assert set(rows) == {"mul", "add", "relu"} and rows["add"].fused_into == rows["relu"].op_name
    for op in ("mul", "relu"):  # the add's error shows at the end of its fused add-ReLU group
        row = rows[op]
        assert row.same_input_sqnr is not None and row.same_input_sqnr > 30, (row.op_name, row.same_input_sqnr)
    # a prepared baseline too (pre_export: the same fake quants, no table here): every row identical, same-input too
    from quantlens.quantization.pre_export import pre_export

    qa = QuantAnalysis(calib, pre_export(calib), "pre_export", out_dir=tmp_path / "pe", progress=False)
    qa.set_bad_case((x,))
    qa.run()
    for row in qa.compare_per_layer():
        if row.same_input_sqnr is not None:
            assert row.same_input_sqnr == float("inf"), (row.op_name, row.same_input_sqnr)


@pytest.mark.parametrize("act", ["silu_module", "hardswish_module", "leaky_relu_function", "elu_positional"])
def test_in_place_activations_same_input(act, small_conv_analysis):
    """nn.SiLU(inplace=True), nn.Hardswish(inplace=True) (MobileNetV3, EfficientNet), F.leaky_relu(..., inplace=True)
    and F.elu(x, 1.0, True): the same-input run reads the activation's input, not its result (which gave 7-20 dB
    at a fine layer, pointing the user at it)."""
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.conv2 = torch.nn.Conv2d(4, 4, 1)
            self.act = {"silu_module": torch.nn.SiLU(inplace=True),
                        "hardswish_module": torch.nn.Hardswish(inplace=True)}.get(act, torch.nn.Identity())

        def forward(self, x):
            y = self.conv(x)
            if act == "leaky_relu_function":
                y = F.leaky_relu(y, 0.1, inplace=True)
            elif act == "elu_positional":
                y = F.elu(y, 1.0, True)
            else:
                y = self.act(y)
            return self.conv2(y)

    torch.manual_seed(0)
    table = small_conv_analysis(Net().eval())[2].compare_per_layer()
    rows = [r for r in table if r.op_name not in ("conv", "conv2") and r.same_input_sqnr is not None]
    assert rows, "the activation has a row"
    for row in rows:
        assert row.same_input_sqnr > 30, (row.op_name, row.same_input_sqnr)
