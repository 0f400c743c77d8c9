"""A weight's scale is a function of the weight: recomputed on every call, except inside ``frozen_weights()`` (the
profiler's forwards), where each parameter's scale is computed once per window and gives the same values."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.quantization import calibrate, prepare
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
