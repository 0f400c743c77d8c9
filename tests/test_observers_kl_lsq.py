"""The KL-divergence (entropy) observer and LSQ-style learned scales (issue #13, the vendor profiler's features)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from quantlens.compiler import export
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantize,
    FakeQuantState,
    KLObserver,
    MinMaxObserver,
    QuantSpec,
    QuantStub,
    calibrate,
    get_qconfig,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.observers import _kl_of_clipping
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter

I8, I16 = QuantDType.qint8, QuantDType.qint16


def test_kl_of_clipping_hand_computed():
    # bins [1, 1, 1, 1] clipped at bin 2 into 2 levels: P = [1, 1 + 2] / 4, Q = [1, 1] / 2
    kl = _kl_of_clipping(torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64), 2, 2)
    assert kl == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-12)
    # nothing above the threshold and one bin per level: Q == P
    assert _kl_of_clipping(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64), 2, 2) == pytest.approx(0.0)


def test_kl_clips_gaussian_outliers_and_keeps_a_uniform_range():
    torch.manual_seed(0)
    x = torch.randn(100_000)
    x[:10] = 40.0  # rare outliers stretch min/max 10x
    kl, minmax = KLObserver(I8), MinMaxObserver(I8)
    kl(x), minmax(x)
    threshold = float(kl.calculate_scale()) * 127
    assert 3.0 < threshold < 5.0  # about 3.75 sigma, like TensorRT's entropy calibration
    assert float(minmax.calculate_scale()) * 127 == pytest.approx(40.0)
    uniform = KLObserver(I8)
    uniform(torch.rand(100_000) * 2 - 1)
    assert float(uniform.calculate_scale()) * 127 > 0.99  # nothing to clip
    again = KLObserver(I8)
    again(x)
    assert torch.equal(again.calculate_scale(), kl.calculate_scale())  # deterministic


def test_kl_int16_keeps_the_full_range_and_refuses_per_channel():
    x = torch.randn(10_000)
    obs = KLObserver(I16)
    obs(x)
    assert float(obs.calculate_scale()) * 32767 == pytest.approx(float(x.abs().max()), rel=1e-6)
    with pytest.raises(QuantLensError, match="per-tensor only"):
        KLObserver(I8, ch_axis=0)
    with pytest.raises(QuantLensError, match="stride"):
        KLObserver(I8, stride=0)


def test_kl_observer_in_a_qconfig_calibrates_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Linear(8, 8), DeQuantStub())
    x = torch.randn(256, 8)
    x[0] = 30.0
    scales = {}
    for name, observer in (("kl", KLObserver), ("minmax", MinMaxObserver)):
        q = calibrate(prepare(model, x, ModuleNameQconfigSetter({"": get_qconfig(observer=observer)}),
                              check_result_dir=None), [x])
        scales[name] = float(q._quantlens_state.fq["0|out"].scale)
    assert scales["kl"] < 0.5 * scales["minmax"]


# -- LSQ ------------------------------------------------------------------------------------------------------------
def _lsq_fq(scale: float) -> FakeQuantize:
    fq = FakeQuantize(QuantSpec(I8, MinMaxObserver, learn_scale=True))
    fq.set_state(FakeQuantState.CALIBRATION)
    fq(torch.tensor([scale * 127, -scale * 127]))  # calibrates the scale to exactly `scale`
    fq.set_state(FakeQuantState.QAT)
    return fq


def test_lsq_value_is_the_exact_fake_quant_and_its_scale_gradient_is_lsq():
    fq = _lsq_fq(0.5)
    x = torch.tensor([0.3, 0.74, -1.6, 100.0, -100.0], requires_grad=True)
    out = fq(x)
    assert torch.equal(out.detach(), torch.tensor([0.5, 0.5, -1.5, 63.5, -64.0]))  # rhe(x / 0.5) * 0.5, clamped
    out.sum().backward()
    # d out / d s = round(x/s) - x/s inside the range, qmax / qmin where clipped; scaled by 1/sqrt(N * qmax)
    v = [0.6, 1.48, -3.2]
    expected = sum(round(t) - t for t in v) + 127 - 128
    assert float(fq.learned_scale.grad) == pytest.approx(expected / math.sqrt(5 * 127), rel=1e-5)
    # the input's gradient is the clipped straight-through one
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_lsq_trains_the_scale_and_export_uses_the_learned_value():
    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Linear(4, 4), DeQuantStub())
    x = torch.randn(64, 4)
    target = model(x).detach() * 1.7
    q = prepare(model, x, ModuleNameQconfigSetter({"": get_qconfig(learn_scale=True)}), check_result_dir=None)
    calibrate(q, [x])
    fq = q._quantlens_state.fq["0|out"]
    calibrated = float(fq.scale)
    q.train()
    set_fake_quantize(q, FakeQuantState.QAT)
    params = [p for n, p in q.named_parameters() if "learned_scale" in n]
    assert params, "the learned scales are parameters of the prepared model"
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = ((q(x) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    q.eval()
    set_fake_quantize(q, FakeQuantState.VALIDATION)
    with torch.no_grad():
        q(x)
    assert float(fq.scale) != calibrated and float(fq.scale) == pytest.approx(float(fq.learned_scale), rel=1e-6)
    qat_ir = export(q, x)
    fq_nodes = [n for n in qat_ir.graph.nodes if n.op == "fake_quant" and n.site == "0"]
    assert fq_nodes and float(qat_ir.graph.constants[fq_nodes[0].inputs[1]]) == float(fq.scale)
