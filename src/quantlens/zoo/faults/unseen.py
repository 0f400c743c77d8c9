"""Planted faults that one quantizer at a time or a whole-tensor figure cannot see: per-channel damage under
per-tensor weights, and two roundings that are each harmless and severe together (see
:mod:`quantlens.zoo.faults`)."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    prepare,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.zoo.faults.registry import Fault, FaultCase, register_fault


class ChannelNet(nn.Module):
    """conv1-relu -> conv2-relu (half of its output channels' weights 100x smaller) -> conv3 (1x1), whose weights
    read those channels 100x larger (as a folded BatchNorm that rescaled them would): the small channels matter
    to the output as much as the large ones."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1), \
            nn.Conv2d(16, 4, 1)
        self.relu = nn.ReLU()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            self.conv2.weight[8:] *= 0.01
            self.conv2.bias[8:] *= 0.01
            self.conv3.weight[:, 8:] *= 100.0

    def forward(self, x):
        return self.dequant(self.conv3(self.relu(self.conv2(torch.relu(self.conv1(self.quant(x)))))))


def _per_tensor_channels() -> FaultCase:
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    mapping = {
        "conv2": QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=None), output=QuantSpec("qint8")),
        # an op worse by the whole-tensor figure: a coarse output grid (no clipping)
        "conv3": QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=0),
                         output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.2))),
    }
    model = ChannelNet().eval()
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter)
    return FaultCase(model, calibrate(prepare(model, (x,), setter, check_result_dir=None), [(x,)]), (x,))


register_fault(Fault(
    "fq_per_tensor_weight_channels", "fake_quant", "conv net", ("conv2", "relu"),
    "per-tensor weights on a conv whose output channels differ 100x in range (another op is worse overall)",
    _per_tensor_channels))

_N, _C = 8, 4


class BranchNet(nn.Module):
    """relu(la(x) + lb(x)) + ld(x): two branches whose sum sits just below the ReLU's kink."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.la, self.lb, self.ld = nn.Linear(_N, _C), nn.Linear(_N, _C), nn.Linear(_N, _C)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.quant(x)
        return self.dequant(self.relu(self.la(x) + self.lb(x)) + self.ld(x))


def _inputs(n: int, generator: torch.Generator) -> torch.Tensor:
    return 0.95 + 0.1 * torch.rand(n, _N, generator=generator)


def _fixed(scale: float, weight: bool = False) -> QConfig:
    out = QuantSpec("qint8", FixedScaleObserver.with_args(scale=scale))
    return QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=0), output=out) if weight else QConfig(output=out)


def _interaction() -> FaultCase:
    """In float ``la(x) + lb(x)`` sits at ``-0.9 δ``. Every weight of ``la`` lies 0.55 steps above a grid point and
    every weight of ``lb`` 0.45 steps above one (the per-channel scale is 1/127, set by the ±1 first column), so
    each one's int8 rounding raises the sum by ``δ`` for inputs near 1: alone to ``+0.1 δ`` (a small error past
    the ReLU), together to ``+1.1 δ``. ``ld`` has a coarse output grid: an ordinary error that outranks each
    rounding alone but not the two together."""
    torch.manual_seed(0)
    model = BranchNet().eval()
    step = 1 / 127
    delta = 0.45 * (_N - 1) * step
    with torch.no_grad():
        for r in range(_C):
            k = 5 + 3 * r
            model.la.weight[r, 0], model.lb.weight[r, 0] = 1.0, -1.0
            model.la.weight[r, 1:] = (k + 0.55) * step
            model.lb.weight[r, 1:] = -(k + 0.45) * step
            model.la.bias[r] = -(1 + (_N - 1) * (k + 0.55) * step)
            model.lb.bias[r] = (1 + (_N - 1) * (k + 0.45) * step) - 0.9 * delta
    generator = torch.Generator().manual_seed(1)
    example = (_inputs(16, generator),)
    # relu's fixed grid keeps a range for the positive values the rounded model produces (calibration sees none)
    setter = ModuleNameQconfigSetter({"ld": _fixed(0.04, weight=True), "relu": _fixed(0.002)})
    prepared = prepare(model, example, (setter, default_calibration_qconfig_setter), check_result_dir=None)
    calibrate(prepared, [(_inputs(16, generator),) for _ in range(3)])
    return FaultCase(model, prepared, example)


register_fault(Fault(
    "fq_two_change_interaction", "fake_quant", "two-branch MLP", ("la", "lb"),
    "two weight roundings, each harmless alone, that together push a sum past a ReLU's kink", _interaction,
    interaction=("la", "lb"), per_op_finding=False))
