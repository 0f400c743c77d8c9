"""sensitivity(): ablation per quantizer, index substitution, ordering, the setter format, pre_export LUTs."""

import pytest
import torch
from torch import nn

from quantlens import QuantLensError
from quantlens.march import QuantDType
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.index_ops import substitute_indices
from quantlens.profiler.sensitivity import IndexRecorder
from quantlens.profiler.torch_access import TorchModelAccess
from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    prepare,
)
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization.pre_export import lut_sites, pre_export, set_lut_enabled
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.zoo import example_inputs, get_model, sample_batches


def calibrated(name, setter=default_calibration_qconfig_setter, model=None):
    model = model if model is not None else get_model(name)
    calib = prepare(model, example_inputs(name), setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 3, 8))
    return model, calib


@pytest.fixture(scope="module")
def digits():
    return calibrated("digits_cnn")


def test_activation_and_weight_ranked_separately_and_reverse(digits, tmp_path):
    qa = QuantAnalysis(*digits, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("digits_cnn", 8))
    table = qa.sensitivity(metric="Cosine")[0]
    keys = [(r.op_name, r.sensitive_type) for r in table]
    assert ("conv1", "weight") in keys and ("relu1", "activation") in keys and ("fc", "weight") in keys
    assert ("fc", "activation") not in keys  # int32 high-precision output: no activation fake quant
    assert len(keys) == len(set(keys)) == 9
    values = [r.value for r in table]
    assert values == sorted(values)  # Cosine: lower is more sensitive
    least_first = qa.sensitivity(metric="Cosine", reverse=True)[0]
    assert [r.op_name for r in least_first] == [r.op_name for r in reversed(table.rows)]
    rows = torch.load(tmp_path / "output_0_Cosine_sensitive_ops.pt", weights_only=True)
    assert rows[0] == least_first[0].to_dict()  # the files hold the latest call's order
    assert set(rows[0]) == {"op_name", "sensitive_type", "op_type", "metric", "value", "quant_dtype"}


def test_one_quantizer_alone_reproduces_its_effect(digits, tmp_path):
    """The ablation value of a quantizer equals a forward with only that fake quant enabled."""
    float_model, calib = digits
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    example = example_inputs("digits_cnn", 8)
    qa.set_bad_case(example)
    row = next(r for r in qa.sensitivity()[0] if (r.op_name, r.sensitive_type) == ("relu2", "activation"))
    fqs = [m for m in calib.modules() if hasattr(m, "fake_quant_enabled")]
    saved = [m.fake_quant_enabled for m in fqs]
    try:
        for m in fqs:
            m.fake_quant_enabled = False
        calib._quantlens_state.fq["relu2|out"].fake_quant_enabled = True
        with torch.no_grad():
            expected = float((float_model(*example) - calib(*example)).abs().mean())
    finally:
        for m, flag in zip(fqs, saved):
            m.fake_quant_enabled = flag
    assert row.value == pytest.approx(expected, rel=1e-6)


def test_result_feeds_the_sensitive_op_setter_unchanged(digits, tmp_path):
    float_model, calib = digits
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("digits_cnn", 8))
    result = qa.sensitivity()
    assert result.keys() == ["0_L1"] and result["0_L1"] is result[0]
    act = next(r for r in result[0] if r.sensitive_type == "activation")
    rank = list(result[0]).index(act) + 1
    for table in (result, result[0]):  # the whole result (a list of tables) or one table
        promoted = prepare(float_model, example_inputs("digits_cnn"),
                           sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(table, topk=rank),
                           check_result_dir=None)
        assert promoted._quantlens_state.plans[act.op_name].output_dtype == "qint16"


class Capture:
    """A trace sink that keeps the first output of one op site."""

    def __init__(self, site):
        self.site, self.value = site, None

    def on_site(self, event):
        if event.name == self.site:
            self.value = event.outputs[0].clone()


def test_index_ops_take_the_baseline_indices(tmp_path):
    """With a badly planted scale the detector's top-k flips; during the ablation it must not."""
    name = "detector_postprocess"
    model = get_model(name)
    planted = QConfig(weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0),
                      output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=0.3)))
    _, calib = calibrated(name, (ModuleNameQconfigSetter({"relu2": planted}), default_calibration_qconfig_setter),
                          model=model)
    example = sample_batches(name, 1, 4)[0]
    base, analy = TorchModelAccess(model, "baseline"), TorchModelAccess(calib, "analysis")
    recorder = IndexRecorder()
    ref = base.run(example, sink=recorder)
    assert {"max_0", "topk_0"} <= set(recorder.indices)
    free = analy.run(example)
    assert not torch.equal(free["labels"], ref["labels"])  # the fault flips the selection...
    probs = Capture("sigmoid_0")
    pinned = analy.run(example, sink=probs, indices=recorder.indices)
    assert torch.equal(pinned["labels"], ref["labels"])  # ...the baseline's indices pin it
    assert not torch.allclose(pinned["scores"], ref["scores"])  # values still come from the analysis model
    labels, idx = recorder.indices["max_0"][0], recorder.indices["topk_0"][0]
    best = torch.gather(probs.value, 2, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(pinned["scores"], torch.gather(best, 1, idx))


class ArgmaxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.fc, self.dequant = QuantStub(), nn.Linear(4, 6), DeQuantStub()

    def forward(self, x):
        y = self.dequant(self.fc(self.quant(x)))
        return y, y.argmax(dim=1)


def test_argmax_takes_the_baseline_indices():
    torch.manual_seed(0)
    model = ArgmaxNet().eval()
    x = torch.randn(64, 4)
    calib = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None)
    with torch.no_grad():
        calib.fc.weight.add_(torch.randn_like(calib.fc.weight))  # a different model: argmax flips
    recorder = IndexRecorder()
    _, ref = TorchModelAccess(model, "b").run((x,), sink=recorder)
    assert list(recorder.indices) == ["argmax#0"]
    access = TorchModelAccess(calib, "a")
    assert not torch.equal(access.run((x,))[1], ref)
    assert torch.equal(access.run((x,), indices=recorder.indices)[1], ref)


def test_substitute_indices_keepdim_and_unmatched_shapes():
    x = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]])
    out = x.max(dim=1)
    new = substitute_indices("max", (x,), {"dim": 1}, out, [torch.tensor([0, 1])])
    assert new.values.tolist() == [1.0, 2.0] and new.indices.tolist() == [0, 1]
    kept = substitute_indices("max", (x, 1, True), {}, x.max(1, True), [torch.tensor([[2], [0]])])
    assert kept.values.tolist() == [[3.0], [4.0]]
    assert substitute_indices("max", (x,), {"dim": 1}, out, [torch.tensor([0, 1, 2])]) is out


# -- pre_export: lookup tables, one at a time ------------------------------------------------------------
@pytest.fixture(scope="module")
def int16_transformer():
    """QAT stand-in (calibrated, int16 activations: segmented tables with interpolation) and its pre_export."""
    model, qat = calibrated("tiny_transformer", calibration_8bit_weight_16bit_act_qconfig_setter)
    return model, qat, pre_export(qat)


def test_pre_export_compare_and_lut_sensitivity(int16_transformer, tmp_path):
    float_model, qat, pre = int16_transformer
    with pytest.raises(QuantLensError, match="baseline_model must be the QAT"):
        QuantAnalysis(float_model, pre, "pre_export")
    set_lut_enabled(pre, ["norm2"], False)  # a table the user switched off stays off afterwards
    qa = QuantAnalysis(qat, pre, "pre_export", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("tiny_transformer", 4))
    qa.run()
    table = qa.compare_per_layer()
    tables = set(lut_sites(pre))
    worst = table.ranked("same_input_sqnr")
    assert {r.op_name for r in worst[:3]} <= tables  # the table sites are where pre_export adds error
    assert table["fc1"].same_input_atol == 0.0  # ops without a table compute exactly as in the QAT model
    assert table["norm2"].same_input_atol == 0.0
    sens = qa.sensitivity()[0]
    assert {r.op_name for r in sens} == tables and {r.sensitive_type for r in sens} == {"lut"}
    assert sens[0].value > 0 and [r.value for r in sens] == sorted((r.value for r in sens), reverse=True)
    state = pre._quantlens_state
    assert [n for n in lut_sites(pre) if state.plans[n].override is None] == ["norm2"]  # restored as it was
    set_lut_enabled(pre, None, True)


def test_pre_export_sensitivity_matches_one_table_alone(int16_transformer, tmp_path):
    _, qat, pre = int16_transformer
    example = example_inputs("tiny_transformer", 4)
    qa = QuantAnalysis(qat, pre, "pre_export", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    row = next(r for r in qa.sensitivity()[0] if r.op_name == "act")
    set_lut_enabled(pre, None, False)
    set_lut_enabled(pre, ["act"], True)
    with torch.no_grad():
        expected = float((qat(*example) - pre(*example)).abs().mean())
    set_lut_enabled(pre, None, True)
    assert row.value == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_sensitivity_moves_no_scale_and_restores_every_switch(tmp_path):
    """The ablation forwards measure the model as it is: a model left in CALIBRATION (observers on) keeps its
    scales through sensitivity() on a bad case wider than its calibration data, gets the same table as in
    VALIDATION, and every fake quant's switches come back as they were."""
    from quantlens.quantization import FakeQuantState, set_fake_quantize

    float_model, calib = calibrated("digits_cnn")
    example = tuple(t * 3 for t in example_inputs("digits_cnn", 8))  # beyond the calibrated ranges
    fqs = [m for m in calib.modules() if hasattr(m, "fake_quant_enabled")]
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    validation = [(r.op_name, r.sensitive_type, r.value) for r in qa.sensitivity()[0]]
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    switches = [(m.fake_quant_enabled, m.observe_enabled) for m in fqs]
    scales = [m.scale.clone() for m in fqs]
    table = [(r.op_name, r.sensitive_type, r.value) for r in qa.sensitivity()[0]]
    assert [(m.fake_quant_enabled, m.observe_enabled) for m in fqs] == switches
    assert any(on for _, on in switches)
    assert all(torch.equal(m.scale, s) for m, s in zip(fqs, scales))
    assert table == validation
