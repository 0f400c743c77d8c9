"""Models that do not correspond, and NaN/Inf: refused or reported with the op site (issue #10, items 4-5)."""

import dataclasses
import math
import warnings

import pytest
import torch

from quantlens import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import (
    FakeQuantState,
    NonFiniteError,
    calibrate,
    check_qat_model,
    detect_nonfinite,
    find_nonfinite,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import (
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.zoo import TinyResNet, digits_cnn, example_inputs, get_model, sample_batches

NAN = float("nan")


def calibrated(model, name):
    calib = prepare(model, example_inputs(name), default_calibration_qconfig_setter, check_result_dir=None)
    return calibrate(calib, sample_batches(name, 2, 8))


# -- 4. models that do not correspond --------------------------------------------------------------------------
def test_other_weights_of_the_same_class_are_refused_with_the_reason(tmp_path):
    trained = get_model("digits_cnn")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        untrained = digits_cnn(pretrained=False)
    with pytest.raises(QuantLensError, match=r"do not correspond: 4 of 4 weights differ entirely.*'conv1.weight'"):
        QuantAnalysis(trained, calibrated(untrained, "digits_cnn"), "fake_quant", out_dir=tmp_path)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        other = TinyResNet().eval()
    with pytest.raises(QuantLensError, match=r"'stem_conv.weight' \(relative difference 1\.\d\d\).*prepare\(baseline"):
        QuantAnalysis(get_model("tiny_resnet"), calibrated(other, "tiny_resnet"), "fake_quant", out_dir=tmp_path)


def test_pre_export_of_another_model_is_refused(tmp_path):
    from quantlens.quantization import pre_export

    name = "tiny_transformer"
    qat = calibrated(get_model(name), name)
    other = get_model(name)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.std().clamp_min(0.1))
    QuantAnalysis(qat, pre_export(qat), "pre_export", out_dir=tmp_path, progress=False)  # its own copy: accepted
    with pytest.raises(QuantLensError, match=r"'pre_export'\): the two models do not correspond.*'tok_emb.weight'"):
        QuantAnalysis(qat, pre_export(calibrated(other, name)), "pre_export", out_dir=tmp_path)


def test_corresponding_models_are_still_accepted(tmp_path):
    model = get_model("tiny_resnet")
    calib = calibrated(model, "tiny_resnet")  # its BatchNorms are folded into the convs: compared by float name
    QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    with torch.no_grad():  # what QAT fine-tuning does: the weights move a little
        gen = torch.Generator().manual_seed(0)
        for p in calib.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("tiny_resnet"))
    assert qa.run().analysis_sites > 0


# -- 5. non-finite values -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_fc():
    """tiny_resnet whose classifier has one NaN weight: its outputs are NaN in one column."""
    model = get_model("tiny_resnet")
    with torch.no_grad():
        model.fc.weight[0, 0] = NAN
    calib = prepare(model, example_inputs("tiny_resnet"), default_calibration_qconfig_setter, check_result_dir=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(calib, sample_batches("tiny_resnet", 2, 8))
    return model, calib, [str(w.message) for w in caught]


def test_sensitivity_refuses_a_non_finite_baseline_and_names_the_site(nan_fc, tmp_path):
    model, calib, _ = nan_fc
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)  # NaN on both sides: same model
    qa.set_bad_case(example_inputs("tiny_resnet"))
    with pytest.raises(QuantLensError, match=r"output\(s\) \['0'\] hold NaN/Inf.*first op site whose output is "
                                             r"non-finite in the baseline is 'fc'"):
        qa.sensitivity()


def test_sensitive_op_setter_skips_non_finite_rows_with_a_warning(tmp_path):
    model = get_model("digits_cnn")
    qa = QuantAnalysis(model, calibrated(model, "digits_cnn"), "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("digits_cnn", 8))
    rows = list(qa.sensitivity()[0])
    acts = [r for r in rows if r.sensitive_type == "activation"]
    poisoned = [dataclasses.replace(acts[0], value=NAN)] + [r for r in rows if r is not acts[0]]
    with pytest.warns(UserWarning, match=rf"1 sensitivity row\(s\) with a NaN/Inf value were not promoted: "
                                         rf"{acts[0].op_name} \(activation: nan\)"):
        setter = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(poisoned, topk=2)
    promoted = prepare(model, example_inputs("digits_cnn"), setter, check_result_dir=tmp_path)
    plans = promoted._quantlens_state.plans
    assert plans[acts[0].op_name].output_dtype == "qint8"  # the NaN row is not promoted...
    top = [r for r in poisoned if not math.isnan(r.value)][:2]  # ...the top two finite rows are
    for row in top:
        if row.sensitive_type == "activation":
            assert plans[row.op_name].output_dtype == "qint16"
    assert "were not promoted" in (tmp_path / "model_check_result.txt").read_text()
    # +inf SQNR means "unchanged", a finite verdict: kept
    kept = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(
        [{"op_name": "relu1", "sensitive_type": "activation", "metric": "SQNR", "value": math.inf}], topk=1)
    assert kept.setters[0].selected == [("relu1", "activation")]


def test_calibration_reports_non_finite_op_sites(nan_fc, tmp_path):
    _, calib, messages = nan_fc
    nan_warnings = [m for m in messages if "NaN/Inf" in m]
    assert len(nan_warnings) == 1 and "op site(s) saw NaN/Inf values: 'fc' (weight)" in nan_warnings[0]
    result = check_qat_model(calib, example_inputs("tiny_resnet"), tmp_path)
    assert result.nonfinite == {"fc": ["weight"]}
    text = (tmp_path / "model_check_result.txt").read_text()
    section = text.split("== Op sites whose observers saw NaN/Inf (left out of the statistics) ==")[1]
    assert section.splitlines()[1] == "fc: weight"
    clean = calibrated(get_model("tiny_resnet"), "tiny_resnet")
    assert check_qat_model(clean, example_inputs("tiny_resnet"), None).nonfinite == {}


def test_all_nan_first_batch_names_the_op_site():
    calib = prepare(get_model("tiny_resnet"), example_inputs("tiny_resnet"), default_calibration_qconfig_setter,
                    check_result_dir=None)
    batch = torch.full_like(example_inputs("tiny_resnet")[0], NAN)
    with pytest.raises(QuantLensError, match=r"fake quant of op site 'quant' \(output, key 'quant\|out'\): "
                                             r"MinMaxObserver saw only NaN/Inf"):
        calibrate(calib, [(batch,)])
    # NaN made inside the model: the error names the observer that found nothing finite and the op where it began
    model = get_model("tiny_resnet")
    with torch.no_grad():
        model.layer1.conv2.weight[0, 0, 0, 0] = NAN
    calib = prepare(model, example_inputs("tiny_resnet"), default_calibration_qconfig_setter, check_result_dir=None)
    with pytest.raises(QuantLensError, match=r"batch 0: The fake quant of op site '[\w.]+' .*first appeared .*at op "
                                             r"site 'layer1.conv2'"):
        calibrate(calib, sample_batches("tiny_resnet", 1, 8))


def test_nan_in_qat_is_flagged_at_the_step_and_op_site():
    qat = prepare(get_model("tiny_resnet"), example_inputs("tiny_resnet"), default_qat_qconfig_setter,
                  check_result_dir=None)
    qat.train()
    set_fake_quantize(qat, FakeQuantState.QAT)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    batches = sample_batches("tiny_resnet", 3, 8)
    with detect_nonfinite(qat) as found:
        for step, (x,) in enumerate(batches):
            if step == 2:
                with torch.no_grad():  # an exploding update
                    qat.layer1.conv2.weight[0, 0, 0, 0] = NAN
            try:
                loss = qat(x).square().mean()
            except NonFiniteError as exc:
                assert step == 2 and exc.site.site == "layer1.conv2" and exc.site.forward == 3
                assert exc.site.inputs_finite and "op site 'layer1.conv2' (conv2d)" in str(exc)
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            pytest.fail("the NaN was not flagged")
    assert [s.site for s in found] == ["layer1.conv2"]
    assert qat._quantlens_state.runtimes == []  # nothing left behind

    running = qat.layer1.conv1.bn.running_mean.clone()
    hit = find_nonfinite(qat, batches[0])  # one diagnostic forward, model left as it was
    assert (hit.site, hit.op_type, hit.inputs_finite) == ("layer1.conv2", "conv2d", True)
    assert torch.equal(running, qat.layer1.conv1.bn.running_mean)
    # the NaN batch statistics reached conv2's BatchNorm, so its whole folded channel is NaN now: the next plain
    # QAT forward stops at its weight observer, which names the op site
    with pytest.raises(QuantLensError, match=r"fake quant of op site 'layer1.conv2' \(weight"):
        qat(batches[0][0])
    clean = prepare(get_model("tiny_resnet"), example_inputs("tiny_resnet"), default_qat_qconfig_setter,
                    check_result_dir=None)
    assert find_nonfinite(clean, example_inputs("tiny_resnet")) is None


def test_all_finite_is_the_element_test_whatever_the_sum_does():
    """quantlens._finite.all_finite (the IR input check, the metrics, the profiler): a finite sum answers at once,
    anything else takes the element test."""
    from quantlens._finite import all_finite

    big = torch.full((64,), 3e38)  # finite, its float32 sum overflows to inf
    assert not torch.isfinite(big.sum()) and all_finite(big)
    assert all_finite(torch.full((10,), 60000.0, dtype=torch.float16))  # float16 sum overflows too
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(100, dtype=torch.float64)
        t[17] = bad
        assert not all_finite(t)
    both = torch.tensor([float("inf"), -float("inf"), 1.0])  # their sum is NaN, not Inf
    assert not all_finite(both)
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))  # empty; integers are always finite
    assert all_finite(torch.randn(3, 4)) and not all_finite(torch.tensor([[1.0, float("nan")]]).t())
