"""Planted faults in small networks, two or more per stage pair (see :mod:`quantlens.zoo.faults`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    get_qconfig,
    pre_export,
    prepare,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.zoo.faults.registry import Fault, FaultCase, register_fault

Q16 = get_qconfig(out_dtype="qint16")


def _data(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _init(module: nn.Module, seed: int, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _prepared(model: nn.Module, x: torch.Tensor, mapping: dict | None = None):
    setter = (ModuleNameQconfigSetter(mapping), default_calibration_qconfig_setter) if mapping else \
        default_calibration_qconfig_setter
    return calibrate(prepare(model.eval(), (x,), setter, check_result_dir=None), [(x,)])


class Mlp(nn.Module):
    """quant -> fc1 -> relu -> fc2 -> relu -> fc3 -> dequant."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        _init(self, seed)

    def forward(self, x):
        return self.dequant(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(self.quant(x)))))))


# -- fake_quant -----------------------------------------------------------------------------------------------
def _scale_clipping() -> FaultCase:
    x = _data(64, 8)
    planted = QConfig(weight=QuantSpec("qint8", ch_axis=0),
                      output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.002)))  # +-0.25: clips
    model = Mlp()
    return FaultCase(model, _prepared(model, x, {"relu_1": planted}), (x,))


register_fault(Fault(
    "fq_output_scale_clips", "fake_quant", "MLP", ("fc2", "relu_1"),
    "fc2+relu's output scale fixed 100x too small: most of its outputs clip", _scale_clipping))


class PrunedConv(nn.Module):
    """Output channel 0 of the conv pruned (zero weights) with a large bias: its per-channel weight scale is the
    floor, and ``bias / (s_in * s_w)`` is beyond int32 only when input and weight are both quantized."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        _init(self, 0)
        with torch.no_grad():
            self.conv.weight[0] = 1e-9
            self.conv.bias[0] = 8.0

    def forward(self, x):
        y = self.conv2(torch.relu(self.conv(self.quant(x))))
        return self.dequant(self.fc(y.mean((2, 3))))


def _bias_overflow() -> FaultCase:
    x = _data(4, 3, 8, 8, seed=1)
    model = PrunedConv()
    return FaultCase(model, _prepared(model, x), (x,))


register_fault(Fault(
    "fq_int32_bias_overflow", "fake_quant", "conv net", ("conv", "relu_0"),
    "a pruned conv channel with a large bias: its int32 bias saturates only with input and weight quantized",
    _bias_overflow))


# -- pre_export -----------------------------------------------------------------------------------------------
class TwoTables(nn.Module):
    """quant -> fc1 -> sigmoid -> fc2 -> tanh, both on int16 inputs (segmented tables); cat -> fc3 -> dequant."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(32, 4)
        _init(self, 0)

    def forward(self, x):
        a = torch.sigmoid(self.fc1(self.quant(x)))
        b = torch.tanh(self.fc2(a))
        return self.dequant(self.fc3(torch.cat([a, b], 1)))


def _coarse_sigmoid() -> FaultCase:
    x = _data(64, 8)
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.25)))  # 4-5 output levels
    mapping = {"fc1": Q16, "fc2": Q16, "tanh_0": Q16, "sigmoid_0": planted}
    prepared = _prepared(TwoTables(), x, mapping)
    return FaultCase(prepared, pre_export(prepared), (x,))


register_fault(Fault(
    "pre_coarse_sigmoid_table", "pre_export", "two-table MLP", ("sigmoid_0",),
    "an int16-input sigmoid table with an output grid of 0.25: its interpolation rounds to other levels",
    _coarse_sigmoid))


class GeluMlp(nn.Module):
    """quant -> fc1 (int16 output) -> gelu -> fc2 -> relu -> fc3 -> dequant."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        _init(self, 0)

    def forward(self, x):
        return self.dequant(self.fc3(torch.relu(self.fc2(nn.functional.gelu(self.fc1(self.quant(x)))))))


def _coarse_gelu() -> FaultCase:
    x = _data(64, 8)
    planted = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=0.25)))
    prepared = _prepared(GeluMlp(), x, {"fc1": Q16, "gelu_0": planted})
    return FaultCase(prepared, pre_export(prepared), (x,))


register_fault(Fault(
    "pre_coarse_gelu_table", "pre_export", "GELU MLP", ("gelu_0",),
    "an int16-input GELU table with an output grid of 0.25", _coarse_gelu))


# -- export ---------------------------------------------------------------------------------------------------
class _FakeModeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        # library code with an export-only path: a fake-tensor check
        return torch.relu(y * (1.01 if torch._guards.detect_fake_mode(y) is not None else 1.0))


class _GainBlock(nn.Module):
    """A gain kept as a Python number: torch.export bakes the value it had at export into the graph; the user
    changed it afterwards (the eager model reads the new one)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gain = 1.05

    def forward(self, x):
        return torch.relu(self.fc(x) * self.gain)


class Wrapped(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.blk, self.fc2 = nn.Linear(8, 16), block, nn.Linear(16, 4)
        _init(self, 0)

    def forward(self, x):
        return self.dequant(self.fc2(self.blk(torch.relu(self.fc1(self.quant(x))))))


def _export_pair(block: nn.Module, after_export=None) -> FaultCase:
    x = _data(64, 8, seed=1)
    pre = pre_export(_prepared(Wrapped(block), x))
    qat_ir = export(pre, (x,))
    if after_export is not None:
        after_export(pre.blk)  # prepare worked on a copy: change the model the baseline runs
    return FaultCase(pre, qat_ir, (x,))


def _change_gain(block: nn.Module) -> None:
    block.gain = 1.15


register_fault(Fault(
    "export_fake_mode_branch", "export", "MLP with a library block", ("blk.mul_0",),
    "a block that scales by 1.01 when it sees fake tensors (an export-only path)",
    lambda: _export_pair(_FakeModeBlock())))
register_fault(Fault(
    "export_state_captured", "export", "MLP with a Python gain", ("blk.mul_0",),
    "a block's Python-number gain changed after export: the IR keeps the value captured at export",
    lambda: _export_pair(_GainBlock(), _change_gain)))


# -- convert --------------------------------------------------------------------------------------------------
class WideSum(nn.Module):
    """An int16 input of ~constant 3 into a 1024-term linear whose first rows are ~0.5: the exact int32 sum
    (~4e9) saturates."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc0, self.big, self.relu, self.fc2 = nn.Linear(8, 1024), nn.Linear(1024, 8), nn.ReLU(), nn.Linear(8, 4)
        _init(self, 0, std=0.05)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            self.fc0.bias.fill_(3.0)
            self.big.weight[:4] = 0.5 + 0.01 * torch.randn(4, 1024, generator=gen)
            self.big.weight[4:] = 0.5 * torch.randn(4, 1024, generator=gen)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.big(torch.relu(self.fc0(self.quant(x)))))))


def _accumulator() -> FaultCase:
    x = _data(16, 8, seed=1)
    qat_ir = export(pre_export(_prepared(WideSum(), x, {"fc0": Q16, "relu_0": Q16})), (x,))
    return FaultCase(qat_ir, convert(qat_ir), (x,))


register_fault(Fault(
    "convert_int32_accumulator", "convert", "wide linear", ("big", "relu"),
    "a 1024-term linear on int16 inputs whose exact sum exceeds int32 (the float fake quant has no limit)",
    _accumulator))


class Tanh16(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        _init(self, 2, std=1.5)

    def forward(self, x):
        return self.dequant(self.fc2(torch.tanh(self.fc1(self.quant(x)))))


def _narrow_table() -> FaultCase:
    x = _data(64, 8, seed=3)
    qat_ir = export(pre_export(_prepared(Tanh16(), x, {"fc1": Q16})), (x,))
    quantized = convert(qat_ir)
    (node,) = [n for n in quantized.graph.nodes if n.op == "segment_lut"]
    constants = quantized.graph.constants
    for i in (3, 4, 5):  # bounds, shifts, entries without the outer segments: the tails start earlier
        constants[node.inputs[i]] = constants[node.inputs[i]][1:-1].clone()
    return FaultCase(qat_ir, quantized, (x,))


register_fault(Fault(
    "convert_table_narrow_domain", "convert", "tanh MLP", ("tanh_0",),
    "the quantized IR's segmented tanh table lost its outer segments (built for a narrower input range)",
    _narrow_table))


# -- onnxruntime ----------------------------------------------------------------------------------------------
def _onnx_fault(edit) -> FaultCase:
    """``Mlp``'s qat IR and its ONNX file with one initializer edited by ``edit(ir, initializers)``."""
    import onnx
    from onnx import numpy_helper

    x = _data(64, 8, seed=4)
    qat_ir = export(pre_export(_prepared(Mlp(seed=1), x)), (x,))
    with tempfile.TemporaryDirectory() as tmp:
        path = to_onnx(qat_ir, Path(tmp) / "model.onnx")
        proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    name, value = edit(qat_ir, {k: numpy_helper.to_array(v) for k, v in inits.items()})
    inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return FaultCase(qat_ir, proto, (x,))


def _value_of_site(qat_ir, site: str, op: str = "fake_quant", weight: bool = False) -> str:
    """The IR value name of ``site``'s output fake quant (or its weight's fake quant)."""
    graph = qat_ir.graph
    nodes = [n for n in graph.nodes if n.site == site and n.op == op and
             (n.inputs[0] in graph.constants) == weight]
    return nodes[0].outputs[0]


def _scale_edit(qat_ir, inits):
    value = _value_of_site(qat_ir, "relu_0")
    name = next(k for k in inits if k.startswith(f"{value}/scale/"))
    return name, (inits[name] * 1.5).astype(inits[name].dtype)


def _weight_edit(qat_ir, inits):
    value = _value_of_site(qat_ir, "fc2", weight=True)
    name = next(k for k in inits if k.startswith(f"{value}/quantized/"))
    codes = inits[name].copy()
    codes[: codes.shape[0] // 2] = -codes[: codes.shape[0] // 2]
    return name, codes


register_fault(Fault(
    "onnx_dequant_scale", "onnxruntime", "MLP", ("fc1", "relu_0"),
    "the ONNX file's dequantize scale of one activation is 1.5x the IR's", lambda: _onnx_fault(_scale_edit)))
register_fault(Fault(
    "onnx_weight_codes", "onnxruntime", "MLP", ("fc2", "relu_1"),
    "half of one linear's weight codes negated in the ONNX file", lambda: _onnx_fault(_weight_edit)))
