"""A weight's scale is a function of the weight: recomputed on every call, except inside ``frozen_weights()`` (the
profiler's forwards), where each parameter's scale is computed once per window and gives the same values."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from quantlens.quantization import calibrate, fake_quantize, prepare
from quantlens.quantization.fake_quantize import FakeQuantize, frozen_weights
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def _prepared():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    return calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None,
                             allow_no_stubs=True), [(x,)]), x


def _count_observer_calls(model, monkeypatch) -> list:
    calls = []
    for fq in model.modules():
        if isinstance(fq, FakeQuantize) and fq.is_weight:
            real = fq.observer.forward
            monkeypatch.setattr(fq.observer, "forward", lambda t, real=real: calls.append(1) or real(t))
    return calls


def test_inside_a_window_each_weight_scale_is_computed_once_with_the_same_result(monkeypatch):
    model, x = _prepared()
    with torch.no_grad():
        reference = model(x)
    calls = _count_observer_calls(model, monkeypatch)
    with torch.no_grad(), frozen_weights():
        outs = [model(x) for _ in range(3)]
    assert len(calls) == 2  # two weights, once each, not 2 x 3
    assert all(torch.equal(o, reference) for o in outs)


def test_a_weight_edited_through_data_is_seen_outside_and_in_a_new_window(monkeypatch):
    model, x = _prepared()
    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad(), frozen_weights():
        before = model(x)
    linear.weight.data.mul_(3.0)  # no version counter sees this
    with torch.no_grad():
        outside = model(x)
    with torch.no_grad(), frozen_weights():
        inside = model(x)
    assert not torch.equal(outside, before) and torch.equal(inside, outside)
    # an in-place edit inside a window bumps the version: seen as well
    with torch.no_grad(), frozen_weights():
        model(x)
        linear.weight.mul_(0.5)
        again = model(x)
    with torch.no_grad():
        assert torch.equal(again, model(x))


def test_a_profiler_run_folds_each_conv_bn_once_and_computes_its_scale_once(monkeypatch, tmp_path):
    """run() traces the model and re-runs each op on the baseline's input: a conv + BN folded for that call
    (qat_modules.frozen_folds) is folded once and its folded weight's scale computed once, with the rows of a run
    that folds at every call."""
    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import qat_modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4),
                          nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).eval()
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 9, 9)
    prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True), [(x,)])
    folded = [m for m in prepared.modules() if isinstance(m, qat_modules._FoldedBnMixin)]
    assert len(folded) == 4
    calls = _count_observer_calls(prepared, monkeypatch)
    folds, live = [], []
    real_fold = qat_modules._FoldedBnMixin._fold

    def counting_fold(self):
        frozen = qat_modules._FROZEN_FOLDS.get()
        live.append(len(frozen.folds) if frozen is not None else 0)
        folds.append(1)
        return real_fold(self)

    monkeypatch.setattr(qat_modules._FoldedBnMixin, "_fold", counting_fold)
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path / "a", progress=False)
    qa.set_bad_case((x,))
    qa.run()
    assert len(folds) == 4 and len(calls) == 4  # not once per forward (traced and same-input): 8 each
    # folded at first use, the last two kept: a layer's weights held, not a second copy of the model's
    assert max(live) == 2 and qat_modules._FROZEN_FOLDS.get() is None
    assert not fake_quantize._HELD  # every fold released after the call
    rows = qa.compare_per_layer()

    # the same rows as forwards that fold and observe at every call
    import quantlens.profiler.torch_access as torch_access

    monkeypatch.setattr(torch_access, "frozen_folds", lambda modules, keep=None: contextlib.nullcontext())
    qa2 = QuantAnalysis(model, prepared, "fake_quant", tmp_path / "b", progress=False)
    qa2.set_bad_case((x,))
    before = len(folds)
    qa2.run()
    assert len(folds) - before == 8
    again = qa2.compare_per_layer()
    assert [(r.op_name, r.SQNR, r.same_input_sqnr, r.Atol) for r in rows] == \
        [(r.op_name, r.SQNR, r.same_input_sqnr, r.Atol) for r in again]
