"""Issue #24, bias correction: the mean output shift of weight rounding is taken out of the bias, by hand on one
linear, and it removes the mean error of a per-tensor-weight conv net on held-out data."""

import torch
from torch import nn

from quantlens.quantization import DeQuantStub, MinMaxObserver, QConfig, QuantSpec, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.search.remedies import bias_correction

PER_TENSOR = QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=None), output=QuantSpec("qint8"))


class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant, self.fc = QuantStub(), DeQuantStub(), nn.Linear(3, 2)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1.0, 0.013, -0.2], [0.5, 0.3, 0.004]]))
            self.fc.bias.zero_()

    def forward(self, x):
        return self.dequant(self.fc(self.quant(x)))


def test_the_correction_by_hand():
    """Per-tensor int8 weight scale 1/127: W = [[1, 0.013, -0.2], [0.5, 0.3, 0.004]] rounds to
    [[127, 2, -25], [64, 38, 1]] / 127; with E[x] = [1, 2, 3] the shift dW E[x] is taken out of the bias."""
    x = torch.tensor([[1.0, 2.0, 3.0]]).repeat(4, 1)
    setter = (ModuleNameQconfigSetter({"fc": PER_TENSOR}), default_calibration_qconfig_setter)
    corrected, done = bias_correction(One().eval(), (x,), [(x,)], setter)
    w = One().fc.weight
    wq = torch.tensor([[127.0, 2.0, -25.0], [64.0, 38.0, 1.0]]) / 127
    shift = (wq - w) @ torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(corrected.fc.bias, -shift, atol=1e-6)
    assert [d.module for d in done] == ["fc"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            self.conv2.weight[:, :8] *= 20.0  # a wide half: per-tensor weights round the narrow half coarsely

    def forward(self, x):
        return self.dequant(self.conv2(torch.relu(self.conv1(self.quant(x)))))


def test_it_removes_the_mean_error_of_per_tensor_weights():
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.rand(8, 3, 8, 8, generator=gen) + 0.5,) for _ in range(4)]
    held_out = torch.rand(16, 3, 8, 8, generator=gen) + 0.5
    setter = (ModuleNameQconfigSetter({"conv2": PER_TENSOR}), default_calibration_qconfig_setter)
    model = Net().eval()

    def mean_error(m):
        q = calibrate(prepare(m, batches[0], setter, check_result_dir=None), batches)
        with torch.no_grad():
            return float((q(held_out) - model(held_out)).mean((0, 2, 3)).abs().max())

    corrected, _ = bias_correction(model, batches[0], batches, setter)
    assert mean_error(corrected) < 0.5 * mean_error(model)
