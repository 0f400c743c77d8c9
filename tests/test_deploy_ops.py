"""The ops real models use, through every stage: pad, a BatchNorm after an activation, prelu / leaky_relu,
relu6, and in-place ops (functionalized at export). Integer rules: docs/march.md §10.3, §10.4, §11."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.compiler.ir import Module, Node
from quantlens.compiler.kernels_int import INT_KERNELS
from quantlens.march import Qpp
from quantlens.march.numerics import quantize_multiplier
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)


def _pipeline(model, example, batches, setter=default_calibration_qconfig_setter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, example, setter, check_result_dir=None)
    calibrate(prepared, batches)
    table_model = pre_export(prepared)
    qat_ir = export(table_model, example)
    return prepared, table_model, qat_ir, convert(qat_ir)


def _out_step(prepared, site: str) -> float:
    state = prepared._quantlens_state
    return float(state.fq[state.plans[site].output_fq].scale)


# -- integer kernels pinned to hand-computed values --------------------------------------------------------------


def test_pad_kernel_reflect_replicate_and_a_constant_on_the_grid():
    q = torch.tensor([[[1, 2, 3]]], dtype=torch.int8)
    reflect = INT_KERNELS["pad_int"](Node("pad_int", [], [], {"pad": [2, 1], "mode": "reflect", "value": 0}), [q])
    assert reflect.tolist() == [[[3, 2, 1, 2, 3, 2]]] and reflect.dtype == torch.int8
    edge = INT_KERNELS["pad_int"](Node("pad_int", [], [], {"pad": [1, 2], "mode": "replicate", "value": 0}), [q])
    assert edge.tolist() == [[[1, 1, 2, 3, 3, 3]]]
    const = INT_KERNELS["pad_int"](Node("pad_int", [], [], {"pad": [1, 0], "mode": "constant", "value": 5}), [q])
    assert const.tolist() == [[[5, 1, 2, 3]]]


def _requant_attrs(real: float, dtype="qint8") -> dict:
    m, s = quantize_multiplier(real, Qpp.HIGH_PRECISION)  # the spec examples pin the 31-bit multipliers
    return {"multiplier": [m], "shift": [s], "out_dtype": dtype}


def test_channel_affine_kernel_is_the_spec_example():
    # docs/march.md §10.3: a = 0.5, b = 0.25, s_x = s_out = 2**-4, q = 3: w = 127, B = 1016, acc = 1397,
    # m = 1/254 = (1082196484, 38): 1397 * 1082196484 / 2**38 = 5.49999999984 -> 5.
    attrs = {"channel_dim": 1, **_requant_attrs(1 / 254)}
    assert attrs["multiplier"] == [1082196484] and attrs["shift"] == [38]
    q = torch.tensor([[3], [-3]], dtype=torch.int8)  # [N=2, C=1]
    out = INT_KERNELS["channel_affine"](Node("channel_affine", [], [], attrs),
                                        [q, torch.tensor([127], dtype=torch.int8), torch.tensor([1016], dtype=torch.int32)])
    # -3: acc = -381 + 1016 = 635, 635 / 254 = 2.4999999999 -> 2
    assert out.tolist() == [[5], [2]]


def test_prelu_kernel_both_signs_of_the_slope():
    # §10.4: q = -7, α = 0.25, s_x = s_out: requantize(-7, 0.25) = rhe(-1.75) = -2; q >= 0 passes (m = 1).
    pos_m, pos_s = quantize_multiplier(1.0)
    neg = [quantize_multiplier(0.25), quantize_multiplier(0.5)]
    attrs = {"multiplier": [pos_m], "shift": [pos_s], "out_dtype": "qint8", "channel_dim": 1,
             "neg_multiplier": [m for m, _ in neg], "neg_shift": [s for _, s in neg], "neg_sign": [1, -1]}
    q = torch.tensor([[-7, -8], [7, 100]], dtype=torch.int8)  # channel 1 has α = -0.5: -8 -> +4
    out = INT_KERNELS["prelu_int"](Node("prelu_int", [], [], attrs), [q])
    assert out.tolist() == [[-2, 4], [7, 100]]


# -- through every stage ---------------------------------------------------------------------------------------


class _DeployOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.prelu = nn.PReLU(4)
        self.conv1d = nn.Conv1d(4, 4, 3)
        self.bn1d = nn.BatchNorm1d(4)
        self.dequant = DeQuantStub()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(-2.0, 2.0)
            self.bn1d.running_mean.uniform_(-0.5, 0.5)
            self.prelu.weight.uniform_(-0.5, 0.5)

    def forward(self, x):
        x = self.quant(x)
        x = F.pad(x, (1, 1, 1, 1), mode="reflect")
        x = F.pad(x, (1, 2), value=0.3)
        x = F.pad(x, (1, 1, 2, 0), mode="replicate")
        x = self.bn(F.relu(self.conv(x)))  # a BatchNorm after an activation: not folded
        x = self.prelu(x)
        x = F.leaky_relu(x, 0.1)
        x = F.relu6(x)
        x += 1.0
        x.mul_(2)
        x[:, 0] = 0
        x = x.clamp_(0, 3)
        y = x.mean(dim=2)  # [N, C, W]
        y = F.pad(y, (2, 2), mode="reflect")
        y = self.bn1d(F.relu(self.conv1d(y)))
        return self.dequant(y)


@pytest.mark.parametrize("setter", [default_calibration_qconfig_setter, calibration_8bit_weight_16bit_act_qconfig_setter],
                         ids=["int8", "int16act"])
def test_deploy_ops_through_every_stage_and_onnxruntime(setter, tmp_path):
    torch.manual_seed(0)
    model = _DeployOps()
    x = torch.randn(2, 3, 8, 8)
    prepared, table_model, qat_ir, quantized = _pipeline(model, x, [torch.randn(2, 3, 8, 8) for _ in range(4)],
                                                         setter)
    ops = {n.op for n in qat_ir.graph.nodes}
    assert {"pad", "batch_norm", "prelu", "leaky_relu", "hardtanh", "select_scatter", "fill"} <= ops
    int_ops = {n.op for n in quantized.graph.nodes}
    assert {"pad_int", "channel_affine", "prelu_int", "select_scatter", "fill_int"} <= int_ops
    assert not int_ops & {"batch_norm", "prelu", "leaky_relu", "pad"}  # no float op is left
    held_out = torch.randn(2, 3, 8, 8)
    expected = table_model(held_out).detach()
    assert torch.equal(qat_ir(held_out), expected)
    step = _out_step(prepared, "bn1d")
    # 14 ops in a chain: a one-step flip at a tie early on can reach the output as two (measured 2 with the default
    # qpp, whose 16-bit multipliers and F = 0 adds flip more often, for int8 and int16; 0 / 1 with high precision).
    # Dequantized float32 values carry 2**-24 relative rounding: for int16 codes (~2**15) that is 2**-9 of a step.
    tolerance = 2 * step * (1 + 2.0**-8)
    assert quantized.meta["qpp"] == "default"
    assert (quantized(held_out) - expected).abs().max() <= tolerance
    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    assert (high(held_out) - expected).abs().max() <= tolerance
    path = to_onnx(qat_ir, tmp_path / "m.onnx")
    from _ort import LEVELS, saturating_kernels, session

    assert saturating_kernels(path, tmp_path) == set()
    for level in LEVELS:
        ort_session = session(path, level)
        got = ort_session.run(None, {ort_session.get_inputs()[0].name: held_out.numpy()})[0]
        assert np.abs(got - qat_ir(held_out).numpy()).max() <= step * 1.001, level


_SINGLE_OPS = {
    "pad_reflect_2d": lambda m, x: F.pad(x, (1, 2, 2, 1), mode="reflect"),
    "pad_replicate_1d": lambda m, x: F.pad(x.flatten(2), (3, 1), mode="replicate"),
    "pad_constant": lambda m, x: F.pad(x, (1, 1, 1, 1), value=-0.7),
    "batch_norm_after_relu": lambda m, x: m.bn(F.relu(x)),
    "prelu": lambda m, x: m.prelu(x),
    "leaky_relu": lambda m, x: F.leaky_relu(x, 0.2),
    "relu6": lambda m, x: F.relu6(x * 4),
    "hardtanh": lambda m, x: F.hardtanh(x, -0.5, 0.8),
}


class _Single(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.bn, self.prelu = nn.BatchNorm2d(3), nn.PReLU(3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.weight.uniform_(-2.0, 2.0)
            self.prelu.weight.copy_(torch.tensor([0.25, -0.3, 0.0]))

    def forward(self, x):
        return self.dequant(_SINGLE_OPS[self.op](self, self.quant(x)))


@pytest.mark.parametrize("setter", [default_calibration_qconfig_setter, calibration_8bit_weight_16bit_act_qconfig_setter],
                         ids=["int8", "int16act"])
@pytest.mark.parametrize("op", sorted(_SINGLE_OPS))
def test_each_op_is_within_one_output_step_of_the_fake_quant_on_the_same_input(op, setter):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 6, 6)
    prepared, table_model, qat_ir, quantized = _pipeline(_Single(op), x, [torch.randn(2, 3, 6, 6) for _ in range(3)],
                                                         setter)
    state = prepared._quantlens_state
    site = [n for n, p in state.plans.items() if p.output_fq and n != "dequant"][-1]  # pads: the input grid
    step = float(state.fq[state.plans[site].output_fq].scale)
    held_out = torch.randn(2, 3, 6, 6)
    expected = table_model(held_out).detach()
    assert torch.equal(qat_ir(held_out), expected)
    diff = (quantized(held_out) - expected).abs()
    assert diff.max() <= step * 1.001, (site, float(diff.max() / step))


def test_constant_pad_writes_the_value_on_the_input_grid():
    class Pad(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(scale=0.25), DeQuantStub()

        def forward(self, x):
            return self.dequant(F.pad(self.quant(x), (1, 1), value=0.3))

    x = torch.tensor([[1.0, -0.5]])
    _, table_model, _, quantized = _pipeline(Pad(), x, [x])
    # the integer pad writes rhe(0.3 / 0.25) = 1, i.e. 0.25; the fake-quant model writes 0.3 itself
    assert quantized(x).tolist() == [[0.25, 1.0, -0.5, 0.25]]
    assert torch.allclose(table_model(x), torch.tensor([[0.3, 1.0, -0.5, 0.3]]))


def test_inplace_ops_write_the_fake_quantized_result_back():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x):
            x = self.quant(x)
            y = x * 1.5
            y += x  # the user reads y, not the op's return value
            y.mul_(0.5)
            return self.dequant(y)

    torch.manual_seed(1)
    x = torch.randn(4, 8)
    prepared, table_model, qat_ir, quantized = _pipeline(InPlace(), x, [x])
    state = prepared._quantlens_state
    add_step = float(state.fq[state.plans["add_0"].output_fq].scale)
    expected = table_model(x).detach()
    # y after `y += x` is on add_0's grid: y.mul_(0.5) halves grid values, then mul_0's fake quant
    assert torch.equal(qat_ir(x), expected)
    assert (quantized(x) - expected).abs().max() <= _out_step(prepared, "mul_0") * 1.001
    with torch.no_grad():
        xq = state.fq[state.plans["quant"].output_fq](x)
        y = state.fq[state.plans["mul_0"].output_fq](xq * 1.5) if "mul_0" in state.plans else None
    assert add_step > 0 and y is not None


def test_prepare_says_which_ops_run_on_the_host(tmp_path):
    """roll (no IR form) is no longer refused by a later stage: it runs on the host in float (the march's partition,
    docs/march.md §12.1), which prepare says in one line and the check report lists, and the model goes through
    every stage. log_softmax has its table (§13.6.1): it stays on the NPU."""
    class Later(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x = self.lin(self.quant(x))
            x = torch.roll(x, 1, dims=1)
            x = torch.log_softmax(x, dim=1)
            return self.dequant(self.lin(x))

    with pytest.warns(UserWarning, match=r"1 op site\(s\) run on the host in float \(roll\)"):
        prepare(Later(), torch.randn(2, 4), default_calibration_qconfig_setter, check_result_dir=str(tmp_path))
    text = (tmp_path / "model_check_result.txt").read_text()
    assert "roll_0: no integer form for 'roll'" in text and "will refuse" not in text
    assert "log_softmax_0: no integer rule" not in text
    from quantlens.zoo.coverage import run_stages

    torch.manual_seed(0)
    result = run_stages("later", Later().eval(), torch.randn(2, 4), [torch.randn(2, 4) for _ in range(3)],
                        torch.randn(2, 4))
    assert result.failed_stage is None and result.passed, (result.error, result.agreements)


def test_unbind_lowers_to_parts_without_the_dim():
    class Unbind(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x):
            a, b, c = self.quant(x).unbind(1)
            return self.dequant(a + 2 * b - c)

    torch.manual_seed(3)
    x = torch.randn(2, 3, 4)
    _, table_model, qat_ir, quantized = _pipeline(Unbind(), x, [x])
    assert qat_ir.graph.values[qat_ir.graph.outputs[0]].shape == (2, 4)
    assert torch.equal(qat_ir(x), table_model(x).detach())
    # the high-precision qpp rounds the adds once, like the fake-quant model: equal on this input; the default
    # qpp (F = 0) rounds each of the three terms to whole steps first: at most one step away per add (two adds)
    high = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                          meta={**qat_ir.meta, "high_precision_qpp": True}))
    assert torch.equal(high(x), table_model(x).detach())
    out = quantized.graph.producers()[quantized.graph.outputs[0]]  # the boundary dequantize
    step = float(quantized.graph.constants[out.inputs[1]])
    assert (quantized(x) - table_model(x).detach()).abs().max() <= 2 * step * 1.001
