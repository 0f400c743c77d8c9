"""Weighted modules are quantized by what they compute, not by their exact type.

* a subclass of nn.Conv1d / nn.Linear with a ``forward`` of its own is traced op by op: its functional conv/linear
  quantizes the parameter weight at its op site (per channel), so convert finds every weight quantized;
* a subclass that computes as its base (an ``__init__`` of its own) is swapped for a QAT class derived from it;
* weight_norm / spectral_norm (parametrizations and the old hooks) are folded into a plain weight in prepare's copy;
* a functional op whose rule declares weight arguments (F.linear, torch.addmm as in GPT-2's ``Conv1D``) gets a
  weight fake quant for its parameter, wherever it lives;
* a module registered under two names is prepared once and found under both, through export and convert.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.plan import fq_key
from quantlens.quantization.qat_modules import QATConv1d, QATConvBn2d
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.quantization.runtime import Runtime
from quantlens.quantization.state import use_runtime


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _prepared(model: nn.Module, example: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the deprecated hook-based weight_norm warns)
        return prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)


def _through_convert(model: nn.Module, example: torch.Tensor) -> tuple[nn.Module, float]:
    """prepare -> calibrate -> export -> convert; the prepared model and the quantized IR vs qat IR cosine."""
    torch.manual_seed(1)
    prepared = _prepared(model, example)
    calibrated = calibrate(prepared, [torch.randn_like(example) for _ in range(4)])
    qat_ir = export(calibrated, example)
    quantized = convert(qat_ir)
    held_out = torch.randn_like(example)
    with torch.no_grad():
        return calibrated, _cos(quantized(held_out), qat_ir(held_out))


def _weight_fqs(prepared: nn.Module, site: str) -> list:
    plan = prepared._quantlens_state.plans[site]
    return [prepared._quantlens_state.fq[key] for key in plan.weight_fq.values()]


# ---------------------------------------------------------------------------------------------------------------
# (a) subclasses of nn.Conv1d / nn.Linear


class CausalConv1d(nn.Conv1d):
    """A conv with a forward of its own (left padding, then the functional conv on its own parameters)."""

    def forward(self, x):
        x = F.pad(x, (self.dilation[0] * (self.kernel_size[0] - 1), 0))
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 0.5


class OwnForwardNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = CausalConv1d(4, 8, 3)
        self.fc = ScaledLinear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(self.quant(x))).mean(-1))


def test_subclass_with_own_forward_gets_its_weight_quantized_per_channel():
    torch.manual_seed(0)
    prepared, agreement = _through_convert(OwnForwardNet().eval(), torch.randn(2, 4, 12))
    sites = prepared._quantlens_state.plans
    assert "conv.conv1d_0" in sites and "fc.linear_0" in sites  # traced op by op, not one opaque site
    (conv_wfq,) = _weight_fqs(prepared, "conv.conv1d_0")
    (fc_wfq,) = _weight_fqs(prepared, "fc.linear_0")
    weight = prepared.conv.weight.detach()
    # per output channel: scale_c = max|w[c]| / 127
    assert conv_wfq.scale.shape == (8,)
    torch.testing.assert_close(conv_wfq.scale.flatten(), weight.abs().amax(dim=(1, 2)) / 127)
    assert fc_wfq.scale.shape == (5,)
    # the fake-quant model runs the quantized weight: what its conv computes is on that grid
    assert not torch.equal(conv_wfq(weight), weight)
    assert agreement >= 0.998  # convert found every weight quantized (it refused the float weight before)


# ---------------------------------------------------------------------------------------------------------------
# a subclass that computes as its base: the QAT class derives from it


class Conv2dWithInit(nn.Conv2d):
    def __init__(self, cin, cout):
        super().__init__(cin, cout, 3, padding=1, bias=False)
        self.tag = "mine"

    def describe(self) -> str:
        return f"{self.tag}:{self.out_channels}"


class InitSubclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = Conv2dWithInit(3, 6)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_subclass_computing_as_its_base_is_swapped_fused_and_pickles():
    torch.manual_seed(0)
    model = InitSubclassNet().eval()
    model.bn.running_mean.uniform_(-0.5, 0.5)
    prepared, agreement = _through_convert(model, torch.randn(2, 3, 8, 8))
    conv = prepared.conv
    assert isinstance(conv, QATConvBn2d) and isinstance(conv, Conv2dWithInit)  # folded BN, user's class kept
    assert conv.describe() == "mine:6" and type(model.conv) is Conv2dWithInit  # the user's model is unchanged
    assert prepared._quantlens_state.groups[0].members == ("conv", "bn", "relu_0")
    assert agreement >= 0.998
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.conv) is type(conv)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), prepared(x))


# ---------------------------------------------------------------------------------------------------------------
# (b) weight_norm / spectral_norm


class NormedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.old = nn.utils.weight_norm(nn.Conv1d(8, 8, 3, padding=1))
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 5))

    def forward(self, x):
        return self.fc(self.old(torch.relu(self.conv(x))).mean(-1))


def test_weight_norm_and_spectral_norm_are_folded_into_quantized_weights():
    torch.manual_seed(0)
    model = NormedNet().eval()
    example = torch.randn(2, 4, 10)
    with torch.no_grad():
        expected = {name: getattr(model, name).weight.detach().clone() for name in ("conv", "old", "fc")}
    prepared, agreement = _through_convert(model, example)
    for name, weight in expected.items():
        module = getattr(prepared, name)
        assert isinstance(module.weight, nn.Parameter)  # a plain weight, quantized by the QAT module
        torch.testing.assert_close(module.weight.detach(), weight)
        assert module.weight_fake_quant.scale.numel() == weight.shape[0]
    assert type(prepared.conv) is QATConv1d
    notes = [w for w in prepared._quantlens_state.warnings if "folded" in w]
    assert [n.split("'")[1] for n in notes] == ["conv", "old", "fc"]  # the check report names each module
    # the user's model keeps its parametrizations and its hook
    assert nn.utils.parametrize.is_parametrized(model.conv, "weight")
    assert nn.utils.parametrize.is_parametrized(model.fc, "weight")
    assert hasattr(model.old, "weight_g") and "weight" not in model.old._parameters
    assert agreement >= 0.998


# ---------------------------------------------------------------------------------------------------------------
# (c) functional conv/linear/addmm on a module's own parameters


class GPT2Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear with a transposed weight ``[in, out]``, through torch.addmm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.nf = weight.shape[1]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class AddmmNet(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.quant = QuantStub()
        self.proj = GPT2Conv1D(weight, bias)
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(self.proj(self.quant(x)))


class _InputsSeen(Runtime):
    """The plain runtime, keeping what each op site's op received (after its fake quants)."""

    def __init__(self, state):
        super().__init__(state)
        self.seen: dict[str, tuple] = {}

    def _quantize_inputs(self, plan, args, kwargs):
        args, kwargs, first = super()._quantize_inputs(plan, args, kwargs)
        self.seen[plan.name] = args
        return args, kwargs, first


def test_addmm_weight_gets_a_weight_fake_quant_along_its_output_channels():
    weight = torch.tensor([[0.5, -1.1], [0.3, 2.0]])  # [in, out]
    bias = torch.tensor([0.4, -0.3])
    model = AddmmNet(weight, bias).eval()
    prepared = _prepared(model, torch.randn(3, 2))
    state = prepared._quantlens_state
    plan = state.plans["proj.addmm_0"]
    assert plan.weight_fq == {2: fq_key("proj.addmm_0", "w2")} and plan.bias_position == 0
    assert not plan.input_fq  # x arrives on the QuantStub's grid
    x = torch.tensor([[1.0, -0.5], [0.25, 0.75], [-1.0, 0.5]])
    calibrated = calibrate(prepared, [x])
    (wfq,) = _weight_fqs(calibrated, "proj.addmm_0")
    # scales per output channel (axis 1): 0.5/127 and 2.0/127; 0.3 -> round(76.2) = 76, -1.1 -> round(-69.85) = -70
    torch.testing.assert_close(wfq.scale.flatten(), torch.tensor([0.5 / 127, 2.0 / 127]))
    w_q = torch.tensor([[127 * 0.5 / 127, -70 * 2.0 / 127], [76 * 0.5 / 127, 127 * 2.0 / 127]])
    torch.testing.assert_close(wfq(weight), w_q)
    s_x = state.fq[state.plans["quant"].output_fq].scale.item()
    assert s_x == pytest.approx(1 / 127)
    # the bias (addmm's first argument) is int32 at s_x * s_w[c]: 0.4 / (1/127 * 0.5/127) = 12903.2 -> 12903
    s_b = s_x * wfq.scale.flatten()
    b_q = torch.round(bias / s_b) * s_b
    assert torch.round(bias / s_b).tolist() == [12903.0, -2419.0]  # -0.3 / (1/127 * 2/127) = -2419.35
    runtime = _InputsSeen(state)
    with torch.no_grad(), use_runtime(calibrated, runtime):
        out = calibrated(x)
    bias_in, x_in, weight_in = runtime.seen["proj.addmm_0"]
    torch.testing.assert_close(bias_in, b_q, rtol=0, atol=0)
    torch.testing.assert_close(weight_in, w_q)
    out_fq = state.fq[plan.output_fq]
    torch.testing.assert_close(out, out_fq(torch.round(x / s_x) * s_x @ w_q + b_q))


class GPT2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = GPT2Conv1D(torch.randn(8, 16) * 0.3, torch.randn(16) * 0.1)
        self.c_proj = GPT2Conv1D(torch.randn(16, 8) * 0.3, torch.randn(8) * 0.1)

    def forward(self, x):
        return self.c_proj(torch.relu(self.c_fc(x)))


def test_addmm_module_through_convert():
    from quantlens.compiler.lowering import LOWERINGS

    if torch.ops.aten.addmm.default not in LOWERINGS:
        pytest.skip("aten.addmm has no IR lowering in this tree")
    torch.manual_seed(0)
    prepared, agreement = _through_convert(GPT2MLP().eval(), torch.randn(2, 5, 8))
    (wfq,) = _weight_fqs(prepared, "c_fc.addmm_0")
    assert wfq.scale.numel() == 16  # along the output channels of the [in, out] weight
    assert agreement >= 0.998  # (before: "the bias of op site 'c_fc.addmm_0' is not int32-quantized")


class FunctionalNet(nn.Module):
    """Modules that call functional ops on their own parameters (no nn.Linear / nn.Conv2d object)."""

    def __init__(self):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.w = nn.Parameter(torch.randn(4, 6) * 0.3)
        self.b = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x):
        y = torch.relu(F.conv2d(x, self.kernel, None, 1, 1))
        return F.linear(y.mean((2, 3)), self.w, self.b)


def test_functional_ops_on_own_parameters_quantize_the_weight_at_the_site():
    torch.manual_seed(0)
    prepared, agreement = _through_convert(FunctionalNet().eval(), torch.randn(2, 3, 6, 6))
    (conv_wfq,) = _weight_fqs(prepared, "conv2d_0")
    (fc_wfq,) = _weight_fqs(prepared, "linear_0")
    torch.testing.assert_close(conv_wfq.scale.flatten(), prepared.kernel.detach().abs().amax(dim=(1, 2, 3)) / 127)
    assert fc_wfq.scale.numel() == 4
    assert agreement >= 0.998


# ---------------------------------------------------------------------------------------------------------------
# (d) one module under two names


class AliasedNet(nn.Module):
    def __init__(self):
        super().__init__()
        conv = nn.Conv1d(4, 4, 3, padding=1)
        self.conv1 = conv
        self.seq = nn.Sequential(conv, nn.ReLU(), nn.Conv1d(4, 3, 1))

    def forward(self, x):
        return self.seq(x)


def test_module_registered_under_two_names_is_prepared_once():
    torch.manual_seed(0)
    model = AliasedNet().eval()
    prepared, agreement = _through_convert(model, torch.randn(2, 4, 10))
    assert prepared.conv1 is prepared.seq[0] and type(prepared.conv1) is QATConv1d  # one module, both names
    assert model.conv1 is model.seq[0] and type(model.conv1) is nn.Conv1d
    plans = prepared._quantlens_state.plans
    assert "conv1" in plans and "seq.0" not in plans  # named by its first name
    weight_fqs = [n for n, m in prepared.named_modules() if n.endswith("weight_fake_quant")]
    assert weight_fqs == ["conv1.weight_fake_quant", "seq.2.weight_fake_quant"]  # one set of fake quants
    assert agreement >= 0.998


def test_folding_a_parametrization_leaves_the_users_model_working():
    from torch.nn.utils.parametrizations import weight_norm

    from quantlens.quantization import prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 3))).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = model(x)
    prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    with torch.no_grad():
        assert torch.equal(model(x), before)  # its class still has the parametrized 'weight'
    assert torch.nn.utils.parametrize.is_parametrized(model[0], "weight")
