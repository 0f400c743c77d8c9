"""The quantization stage: op site naming, prepare, fusion, qconfig setters, fake quant states, QAT, persistence."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_hooks

from quantlens import zoo
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantize,
    FakeQuantState,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    check_qat_model,
    get_op_sites,
    get_qconfig,
    is_prepared,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.check import CHECK_FILE
from quantlens.quantization.plan import OutputMode, fq_key
from quantlens.quantization.qat_modules import QATConvBn2d, QATLinear
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    TemplateQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)

CALIB = default_calibration_qconfig_setter


# ---------------------------------------------------------------------------------------------------------------
# helpers and toy models


def _digits():
    return zoo.get_model("digits_cnn"), zoo.example_inputs("digits_cnn", batch_size=4)


def _prep(model, example, setter=CALIB, **kw):
    kw.setdefault("check_result_dir", None)
    return prepare(model, example, setter, **kw)


def _calibrate(model, batches):
    model.eval()
    set_fake_quantize(model, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    return model


def _validate(model, example):
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    with torch.no_grad():
        return model(*example)


def _fq_buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("_quantlens_state.")}


def _assert_tree_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_tree_equal(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_tree_equal(x, y)
    else:
        assert a == b


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        a = x + y  # add_0
        b = torch.add(a, y)  # add_1
        c = a.add(b)  # add_2
        c += y  # add_3 (in-place dunder)
        return self.lin(c)


class _NamingNet(nn.Module):
    """Nested submodule, a shared module, root-level function ops, and integer/shape arithmetic."""

    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.shared = nn.Linear(4, 4)
        self.block = _Inner()
        self.dequant = DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        n = x.shape[0] * 2  # python int arithmetic
        idx = torch.arange(n) * 2 + 1  # int tensor ops: no op site, no shift of the mul/add counters
        keep = (idx % 4) > 0  # int comparisons
        y = self.shared(x)
        z = self.shared(y)  # shared@1
        out = self.block(y, z)
        out = out * 2.0  # mul_0
        out = out * out  # mul_1
        out = out + float(keep.sum())  # add_0 (root)
        return self.dequant(out)


_NAMING_EXPECTED = [
    "quant", "shared", "shared@1",
    "block.add_0", "block.add_1", "block.add_2", "block.add_3", "block.lin",
    "mul_0", "mul_1", "add_0", "dequant",
]


class _ConvSharedOut(nn.Module):
    """conv output feeds a BatchNorm and an add: must not be fused."""

    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.dequant = DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        y = self.conv(x)
        return self.dequant(self.relu(self.bn(y)) + y)


class _ReorderDifferentOps(nn.Module):
    """Different op types swap order with a non-tensor flag: names stay stable (k counts per op type)."""

    def forward(self, x, flag):
        if flag:
            a = x * 2
            b = x + 1
        else:
            b = x + 1
            a = x * 2
        return a - b


class _ReorderSameOps(nn.Module):
    """Two muls swap order with a non-tensor flag: ``mul_0`` is ``x * 2`` on one input and ``x * 3`` on the other."""

    def forward(self, x, flag):
        if flag:
            a = x * 2
            b = x * 3
        else:
            b = x * 3
            a = x * 2
        return a - b


# ---------------------------------------------------------------------------------------------------------------
# 1. op site naming


def test_op_site_naming_rule_on_toy_model():
    model = _NamingNet().eval()
    x = torch.randn(2, 4)
    assert get_op_sites(model, (x,)) == _NAMING_EXPECTED
    prepared = _prep(model, (x,))
    assert get_op_sites(prepared, (x,)) == _NAMING_EXPECTED
    record = prepared._quantlens_state.record
    assert record.sites["shared"].is_module and record.sites["shared"].module_name == "shared"
    assert record.sites["block.add_1"].module_name == "block" and record.sites["block.add_1"].op_type == "add"
    assert record.sites["mul_0"].module_name == ""
    # no op site for the integer arithmetic (arange, %, >, sum of a bool tensor)
    assert all(s.inputs for s in record.sites.values() if not s.is_module)
    assert not {s.op_type for s in record.sites.values()} & {"arange", "remainder", "gt", "sum"}


def test_shared_module_sites_are_data_flow_linked():
    model = _NamingNet().eval()
    record = _prep(model, (torch.randn(2, 4),))._quantlens_state.record
    assert [i.producer for i in record.sites["shared@1"].inputs] == ["shared"]
    assert record.module_calls["shared"] == 2
    add0 = record.sites["block.add_0"]
    assert [i.producer for i in add0.inputs] == ["shared", "shared@1"]


def test_add_spellings_are_all_add():
    class M(nn.Module):
        def forward(self, x, y):
            return (x + y, torch.add(x, y), x.add(y), y.__radd__(x))

    x, y = torch.randn(3), torch.randn(3)
    assert get_op_sites(M(), (x, y)) == ["add_0", "add_1", "add_2", "add_3"]


def test_integer_and_shape_ops_create_no_site():
    class M(nn.Module):
        def forward(self, x, ids):
            b = x.shape[0] * 2
            pos = torch.arange(b).reshape(2, -1) + ids  # int tensors only
            sel = (pos > 1).long().sum()
            return x * sel.item()

    sites = get_op_sites(M(), (torch.randn(2, 3), torch.ones(2, 2, dtype=torch.long)))
    assert sites == ["mul_0"]


@pytest.mark.parametrize("name", zoo.list_models())
def test_op_sites_identical_float_and_prepared(name, tmp_path):
    model = zoo.get_model(name)
    ex = zoo.example_inputs(name)
    float_sites = get_op_sites(model, ex)
    prepared = prepare(model, ex, check_result_dir=tmp_path)
    assert get_op_sites(prepared, ex) == float_sites
    assert list(prepared._quantlens_state.record.sites) == float_sites
    assert len(set(float_sites)) == len(float_sites)
    # the check report lists exactly those sites
    text = (tmp_path / CHECK_FILE).read_text()
    for site in float_sites:
        assert f"| {site} " in text


# ---------------------------------------------------------------------------------------------------------------
# 2. the float model is untouched


@pytest.mark.parametrize("training", [False, True])
def test_prepare_leaves_original_model_untouched(training, tmp_path):
    model, ex = _digits()
    model.train(training)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs_before = {name: (type(m), set(vars(m)), m.training) for name, m in model.named_modules()}
    with torch.no_grad():
        model.eval()
        out_before = model(*ex)
        model.train(training)

    prepared = prepare(model, ex, CALIB, check_result_dir=tmp_path)
    assert prepared is not model
    assert prepared.training == training
    _calibrate(prepared, zoo.sample_batches("digits_cnn", 2, 8))
    _validate(prepared, ex)

    assert type(model) is zoo.DigitsCNN
    assert not is_prepared(model)
    assert "forward" not in vars(model)
    assert {name: (type(m), set(vars(m)), m.training) for name, m in model.named_modules()} == attrs_before
    sd_after = model.state_dict()
    assert sd_after.keys() == sd_before.keys()
    for k in sd_before:
        assert torch.equal(sd_after[k], sd_before[k]), k
    # no parameter is shared with the prepared copy
    prepared_ptrs = {p.data_ptr() for p in prepared.parameters()}
    assert not prepared_ptrs & {p.data_ptr() for p in model.parameters()}
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(*ex), out_before)
    # no tracer machinery left behind globally
    assert not _module_hooks._global_forward_hooks
    assert not _module_hooks._global_forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


# ---------------------------------------------------------------------------------------------------------------
# 3. branches and extra example inputs


def _multitask():
    model = zoo.get_model("multitask")
    inputs, _ = zoo.example_inputs("multitask")
    return model, inputs


def test_unseen_branch_raises_naming_the_site():
    model, inputs = _multitask()
    prepared = _prep(model, (inputs, ["cls"]))
    with torch.no_grad():
        out = prepared(inputs, ["cls"])
    assert set(out) == {"cls"}
    assert "reg_head" not in prepared._quantlens_state.plans
    with pytest.raises(QuantLensError, match=r"'reg_head'.*extra_example_inputs"):
        with torch.no_grad():
            prepared(inputs, ["reg"])


def test_extra_example_inputs_cover_both_heads():
    model, inputs = _multitask()
    setter = TemplateQconfigSetter("no_hp", "qint8", "qint8", MinMaxObserver, high_precision_output=False)
    prepared = _prep(model, (inputs, ["cls"]), setter, extra_example_inputs=[(inputs, ["reg"])])
    state = prepared._quantlens_state
    assert state.record.num_examples == 2
    fqs = {head: state.fq[state.plans[head].output_fq] for head in ("cls_head", "reg_head")}
    assert not any(bool(fq.calibrated) for fq in fqs.values())
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch_inputs, _ in zoo.sample_batches("multitask", 2, 4):
            prepared(batch_inputs, ["cls"])
            prepared(batch_inputs, ["reg"])
    assert all(bool(fq.calibrated) for fq in fqs.values())
    assert bool(prepared.reg_head.weight_fake_quant.calibrated)
    out = _validate(prepared, (inputs, ["cls", "reg"]))
    assert out["cls"].shape == (2, 5) and out["reg"].shape == (2, 2)
    assert get_op_sites(prepared, (inputs, ["reg"])) == get_op_sites(model, (inputs, ["reg"]))


def test_extra_example_inputs_with_default_setter_high_precision_heads():
    model, inputs = _multitask()
    prepared = _prep(model, (inputs, ["cls"]), extra_example_inputs=[(inputs, ["reg"])])
    plans = prepared._quantlens_state.plans
    assert plans["cls_head"].output is OutputMode.HIGH_PRECISION
    assert plans["reg_head"].output is OutputMode.HIGH_PRECISION
    with torch.no_grad():
        assert set(prepared(inputs, ["reg"])) == {"reg"}


# ---------------------------------------------------------------------------------------------------------------
# 4. control flow


def test_op_counters_are_per_op_type_under_reordering():
    # k counts one op type in one module, so swapping a mul and an add keeps both names
    x = torch.randn(2, 4)
    model = _ReorderDifferentOps()
    assert get_op_sites(model, (x, True)) == ["mul_0", "add_0", "sub_0"]
    assert get_op_sites(model, (x, False)) == ["add_0", "mul_0", "sub_0"]
    assert get_op_sites(_ReorderSameOps(), (x, False)) == ["mul_0", "mul_1", "sub_0"]


@pytest.mark.parametrize("model_cls", [_ReorderDifferentOps, _ReorderSameOps])
def test_control_flow_reordering_ops_raises(model_cls):
    x = torch.randn(2, 4)
    with pytest.raises(QuantLensError, match=r"(?s)control flow.*submodule"):
        _prep(model_cls(), (x, True), extra_example_inputs=[(x, False)])


def test_same_control_flow_on_every_example_is_accepted():
    # the check must not fire when every example takes the same branch (the same source line per op site)
    x = torch.randn(2, 4)
    prepared = _prep(_ReorderSameOps(), (x, False), extra_example_inputs=[(2 * x, False), (x[:1], False)],
                     allow_no_stubs=True)
    assert prepared._quantlens_state.record.sites["mul_0"].calls == 3
    _calibrate(prepared, [(x, False)])
    fq = prepared._quantlens_state.fq[fq_key("mul_0", "out")]
    assert float(fq.scale) == pytest.approx(float((3 * x).abs().max()) / 127, rel=1e-6)  # mul_0 is x * 3 here


# ---------------------------------------------------------------------------------------------------------------
# 5. fusion


def test_conv_bn_relu_fused_in_digits(tmp_path):
    model, ex = _digits()
    prepared = prepare(model, ex, CALIB, check_result_dir=tmp_path)
    state = prepared._quantlens_state
    groups = {g.members: g.bn for g in state.groups}
    assert groups == {
        ("conv1", "bn1", "relu1"): "bn1",
        ("conv2", "bn2", "relu2"): "bn2",
        ("conv3", "bn3", "relu3"): "bn3",
    }
    for i in (1, 2, 3):
        conv = getattr(prepared, f"conv{i}")
        assert type(conv) is QATConvBn2d
        assert type(getattr(prepared, f"bn{i}")) is nn.Identity
        assert isinstance(conv.bn, nn.BatchNorm2d)
        assert torch.equal(conv.bn.running_mean, getattr(model, f"bn{i}").running_mean)
        assert state.plans[f"conv{i}"].output is OutputMode.FUSED
        assert state.plans[f"bn{i}"].runtime_op_type == "identity"
        assert state.plans[f"relu{i}"].output_fq is not None
    assert type(prepared.fc) is QATLinear
    assert state.unfused == []
    text = (tmp_path / CHECK_FILE).read_text()
    assert "conv2 -> bn2 -> relu2" in text


def test_bn_folding_is_exact_in_float_state():
    model, ex = _digits()
    prepared = _prep(model, ex)
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    x = zoo.load_digits_data().x_test[:64]
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=0)
    assert prepared._quantlens_state.fake_quant_state is FakeQuantState.FLOAT


def test_conv_with_two_consumers_is_not_fused():
    torch.manual_seed(0)
    model = _ConvSharedOut().eval()
    x = torch.randn(2, 3, 6, 6)
    prepared = _prep(model, (x,))
    state = prepared._quantlens_state
    assert type(prepared.conv) is not QATConvBn2d
    assert isinstance(prepared.bn, nn.BatchNorm2d)
    assert not any("conv" in g.members for g in state.groups)
    result = check_qat_model(prepared, (x,), None)
    assert len(result.unfused) == 1
    members, reason = result.unfused[0]
    assert members == ("conv", "bn") and "also used elsewhere" in reason
    # the bn -> relu pair may still fuse; the conv keeps its own output fake quant
    assert result.site("conv").output_dtype == "qint8"
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 6. BN statistics during QAT


def test_fused_bn_running_stats_track_data_in_train_only():
    model, _ = _digits()
    x = zoo.load_digits_data().x_train[:32]
    prepared = _prep(model, (x[:2],), default_qat_qconfig_setter)
    bn = prepared.conv1.bn
    prepared.train()
    set_fake_quantize(prepared, FakeQuantState.QAT)
    before = bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)
    with torch.no_grad():
        prepared(x)
    assert not torch.equal(bn.running_mean, before[0])
    assert not torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2] + 1

    prepared.eval()
    frozen = bn.running_mean.clone(), bn.running_var.clone()
    with torch.no_grad():
        prepared(x)
    assert torch.equal(bn.running_mean, frozen[0]) and torch.equal(bn.running_var, frozen[1])


# ---------------------------------------------------------------------------------------------------------------
# 7. QAT trains


def test_qat_training_reduces_loss_and_reaches_conv_weights():
    data = zoo.load_digits_data()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = zoo.digits_cnn(pretrained=False)
        perm = torch.randperm(data.x_train.shape[0])
    # An untrained model: give its BatchNorms running statistics of the data first (as a float training run
    # would), so the eval-mode calibration below sees the ranges that QAT's batch-statistics BN produces.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None
    model.train()
    with torch.no_grad():
        for i in range(4):
            model(data.x_train[i * 64:(i + 1) * 64])
    model.eval()
    prepared = _prep(model, (data.x_train[:4],), default_qat_qconfig_setter)
    _calibrate(prepared, [(data.x_train[i * 64:(i + 1) * 64],) for i in range(3)])
    prepared.train()
    set_fake_quantize(prepared, FakeQuantState.QAT)
    opt = torch.optim.Adam(prepared.parameters(), lr=1e-2)
    w0 = prepared.conv1.weight.detach().clone()
    losses = []
    for step in range(30):
        idx = perm[(step * 64) % 1400:(step * 64) % 1400 + 64]
        opt.zero_grad()
        loss = F.cross_entropy(prepared(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        if step == 0:
            for name in ("conv1", "conv2", "conv3", "fc"):
                grad = getattr(prepared, name).weight.grad
                assert grad is not None and grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
    assert not torch.equal(prepared.conv1.weight, w0)
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    assert zoo.evaluate_accuracy(prepared, data.x_test, data.y_test) > 50.0


# ---------------------------------------------------------------------------------------------------------------
# 8. fake quant state semantics


def test_fake_quant_state_semantics():
    model, ex = _digits()
    data = zoo.load_digits_data()
    prepared = _prep(model, ex)
    _calibrate(prepared, [(data.x_train[:32],)])
    calibrated = _fq_buffers(prepared)

    # VALIDATION: frozen
    _validate(prepared, (data.x_train[32:96] * 1.5,))
    _validate(prepared, (data.x_test[:16],))
    after = _fq_buffers(prepared)
    assert after.keys() == calibrated.keys()
    for k in calibrated:
        assert torch.equal(after[k], calibrated[k]), k

    # CALIBRATION: observers move (a wider input range), output equals FLOAT exactly
    x = data.x_train[32:96] * 1.5
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        out_float = prepared(x)
    assert all(torch.equal(v, calibrated[k]) for k, v in _fq_buffers(prepared).items())
    set_fake_quantize(prepared, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        out_calib = prepared(x)
    assert torch.equal(out_calib, out_float)
    moved = _fq_buffers(prepared)
    assert not torch.equal(moved["_quantlens_state.fq.quant|out.observer.max_val"],
                           calibrated["_quantlens_state.fq.quant|out.observer.max_val"])
    assert not torch.equal(moved["_quantlens_state.fq.quant|out.scale"], calibrated["_quantlens_state.fq.quant|out.scale"])

    # VALIDATION: differs from FLOAT, and an output fake quant's output lies on its grid
    fq = prepared._quantlens_state.fq[fq_key("relu2", "out")]
    seen = []
    handle = fq.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    try:
        out_val = _validate(prepared, (x,))
    finally:
        handle.remove()
    assert not torch.equal(out_val, out_float)
    assert (out_val - out_float).abs().max() < 0.5 * out_float.abs().max()
    assert len(seen) == 1
    q = seen[0] / fq.scale
    assert torch.allclose(q, q.round(), atol=1e-4)
    assert q.min() >= QuantDType.qint8.qmin - 1e-4 and q.max() <= QuantDType.qint8.qmax + 1e-4
    assert q.min() >= -1e-4  # relu output keeps its non-negative range
    assert fq.dtype is QuantDType.qint8


def test_set_fake_quantize_flags_and_invalid_state():
    model, ex = _digits()
    prepared = _prep(model, ex)
    fqs = [m for m in prepared.modules() if isinstance(m, FakeQuantize)]
    assert fqs and prepared._quantlens_state.fake_quant_state is FakeQuantState.QAT
    expected = {"float": (False, False), "calibration": (True, False), "qat": (True, True), "validation": (False, True)}
    for state, flags in expected.items():
        assert set_fake_quantize(prepared, state) is prepared
        assert all((m.observe_enabled, m.fake_quant_enabled) == flags for m in fqs if not m.is_weight)
        # weight fake quants follow the current weights in every state but FLOAT
        weight_flags = (state != "float", flags[1])
        assert all((m.observe_enabled, m.fake_quant_enabled) == weight_flags for m in fqs if m.is_weight)
        assert prepared._quantlens_state.fake_quant_state is FakeQuantState(state)
    with pytest.raises(QuantLensError, match="Unknown fake quant state"):
        set_fake_quantize(prepared, "int8")


def test_weight_scale_follows_weights_after_an_optimizer_step():
    model, ex = _digits()
    prepared = _prep(model, ex)
    prepared.eval()
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    with torch.no_grad():
        prepared(*ex)
        before = prepared.fc.weight_fake_quant.scale.clone()
        prepared.fc.weight.mul_(0.5)  # what an optimizer step after the last QAT forward does
        prepared(*ex)
    after = prepared.fc.weight_fake_quant.scale
    assert torch.allclose(after, before * 0.5, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 9. 16-bit template and int16 x int16 GEMMs


def test_16bit_template_int16_outputs_int8_weights(tmp_path):
    model, ex = _digits()
    prepared = prepare(model, ex, calibration_8bit_weight_16bit_act_qconfig_setter, check_result_dir=tmp_path)
    result = check_qat_model(prepared, ex, None)
    state = prepared._quantlens_state
    quantized = [p for p in state.plans.values() if p.output is OutputMode.QUANTIZED]
    assert {p.name for p in quantized} == {"quant", "relu1", "relu2", "relu3", "avgpool"}
    assert all(p.output_dtype == "qint16" for p in quantized)
    assert all(state.fq[p.output_fq].dtype is QuantDType.qint16 for p in quantized)
    assert result.site("fc").output_dtype == "qint32"
    for name in ("conv1", "conv2", "conv3", "fc"):
        assert result.site(name).weight.startswith("qint8 ")
        assert getattr(prepared, name).weight_fake_quant.dtype is QuantDType.qint8
        assert result.site(name).input_dtypes.startswith("qint16")
    assert result.site("pool").input_dtypes == "qint16"
    assert "qint16" in (tmp_path / CHECK_FILE).read_text()


def test_16bit_transformer_requantizes_second_matmul_input(tmp_path):
    model = zoo.get_model("tiny_transformer")
    ex = zoo.example_inputs("tiny_transformer")
    prepared = prepare(model, ex, calibration_8bit_weight_16bit_act_qconfig_setter, check_result_dir=tmp_path)
    state = prepared._quantlens_state
    result = check_qat_model(prepared, ex, None)
    for site in ("attn.matmul_0", "attn.matmul_1"):
        plan = state.plans[site]
        assert plan.input_dtypes == ["qint16", "qint8"]
        assert list(plan.input_fq) == [1]
        assert state.fq[plan.input_fq[1]].dtype is QuantDType.qint8
        assert any(site in w and "int16 x int16" in w for w in result.warnings), site
        assert "requantized to int8" in result.site(site).input_dtypes
        assert plan.output_dtype == "qint16"
    # no GEMM site anywhere computes int16 x int16
    for site in state.record.sites.values():
        plan = state.plans[site.name]
        if not site.gemm:
            continue
        operands = list(plan.input_dtypes)
        module = prepared.get_submodule(site.module_name) if site.is_module else None
        if module is not None and hasattr(module, "weight_fake_quant"):
            operands.append(module.weight_fake_quant.dtype.value)
        assert operands.count("qint16") <= 1, (site.name, operands)
    text = (tmp_path / CHECK_FILE).read_text()
    assert "WARNING: Op site 'attn.matmul_0'" in text and "WARNING: Op site 'attn.matmul_1'" in text

    # the runtime really rounds the second operand to the int8 grid
    _calibrate(prepared, zoo.sample_batches("tiny_transformer", 2, 4))
    fq = state.fq[state.plans["attn.matmul_1"].input_fq[1]]
    seen = []
    handle = fq.register_forward_hook(lambda mod, args, out: seen.append(out / mod.scale))
    try:
        _validate(prepared, ex)
    finally:
        handle.remove()
    assert len(seen) == 1
    assert torch.allclose(seen[0], seen[0].round(), atol=1e-4) and seen[0].abs().max() <= 127 + 1e-4


# ---------------------------------------------------------------------------------------------------------------
# 10. high precision output


def test_high_precision_output_of_final_fc():
    model, ex = _digits()
    default = check_qat_model(_prep(model, ex), ex, None)
    assert default.site("fc").output_dtype == "qint32"
    assert default.site("fc").observer.startswith("int32 high precision")
    assert default.site("dequant").input_dtypes == "qint32"
    assert default.site("avgpool").output_dtype == "qint8"

    no_hp = TemplateQconfigSetter("no_hp", "qint8", "qint8", MinMaxObserver, high_precision_output=False)
    prepared = _prep(model, ex, no_hp)
    result = check_qat_model(prepared, ex, None)
    assert result.site("fc").output_dtype == "qint8"
    assert prepared._quantlens_state.plans["fc"].output_fq == fq_key("fc", "out")
    assert result.setter == "no_hp"


def test_high_precision_output_is_not_rounded():
    model, ex = _digits()
    prepared = _prep(model, ex)
    _calibrate(prepared, zoo.sample_batches("digits_cnn", 2, 16))
    out = _validate(prepared, ex)
    # the int32 output keeps its full precision: it is not on a coarse 127-level grid
    absmax = out.abs().max()
    q = out / (absmax / 127)
    assert not torch.allclose(q, q.round(), atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# 11. ModuleNameQconfigSetter


def test_module_name_setter_and_unmatched_key_warning(tmp_path):
    model, ex = _digits()
    setter = ModuleNameQconfigSetter({"conv2": get_qconfig(out_dtype="qint16"), "does.not.exist": get_qconfig()})
    prepared = prepare(model, ex, (setter, CALIB), check_result_dir=tmp_path)
    result = check_qat_model(prepared, ex, None)
    assert result.site("relu2").output_dtype == "qint16"
    assert result.site("conv2").output_dtype == "(fused)"
    assert result.site("relu1").output_dtype == "qint8"
    assert result.site("relu3").output_dtype == "qint8"
    assert result.site("conv3").input_dtypes.startswith("qint16")  # after the int16 max pool
    text = (tmp_path / CHECK_FILE).read_text()
    warning_lines = [line for line in text.splitlines() if line.startswith("WARNING:")]
    assert any("'does.not.exist'" in line for line in warning_lines)
    assert not any("'conv2'" in line for line in warning_lines)


@pytest.mark.parametrize("key", [1, None, ("conv1",), nn.Conv2d])
def test_module_name_setter_rejects_non_str_keys(key):
    with pytest.raises(QuantLensError, match="keys must be op site or module names"):
        ModuleNameQconfigSetter({key: get_qconfig()})


def test_module_name_setter_rejects_non_qconfig_value():
    with pytest.raises(QuantLensError, match=r"\['conv1'\] must be a QConfig"):
        ModuleNameQconfigSetter({"conv1": "qint16"})


def test_module_name_setter_by_container_and_site_name():
    model = zoo.get_model("tiny_resnet")
    ex = zoo.example_inputs("tiny_resnet")
    setter = ModuleNameQconfigSetter({"layer2": get_qconfig(out_dtype="qint16"), "cat_0": get_qconfig(out_dtype="qint16")})
    result = check_qat_model(_prep(model, ex, (setter, CALIB)), ex, None)
    assert result.site("layer2.relu2").output_dtype == "qint16"
    assert result.site("layer2.relu1").output_dtype == "qint16"
    assert result.site("cat_0").output_dtype == "qint16"
    assert result.site("layer1.relu2").output_dtype == "qint8"
    assert result.site("side_relu").output_dtype == "qint8"
    assert result.warnings == []


# ---------------------------------------------------------------------------------------------------------------
# 12. sensitivity table setter


_TABLE = [
    {"op_name": "avgpool", "sensitive_type": "activation"},
    {"op_name": "quant", "sensitive_type": "activation"},
    {"op_name": "conv3", "sensitive_type": "activation"},
    {"op_name": "relu1", "sensitive_type": "activation"},
]


@pytest.mark.parametrize("kwargs", [{"topk": 2}, {"ratio": 0.5}])
def test_sensitive_setter_promotes_topk(kwargs):
    model, ex = _digits()
    setter = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(_TABLE, **kwargs)
    result = check_qat_model(_prep(model, ex, setter), ex, None)
    assert result.site("avgpool").output_dtype == "qint16"
    assert result.site("quant").output_dtype == "qint16"
    for name in ("relu1", "relu2", "relu3"):
        assert result.site(name).output_dtype == "qint8", name
    assert result.site("fc").output_dtype == "qint32"
    assert result.site("conv1").input_dtypes.startswith("qint16")
    assert all(s.weight in ("-",) or s.weight.startswith("qint8") for s in result.sites)


def test_sensitive_setter_topk_covers_fused_group():
    model, ex = _digits()
    setter = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(_TABLE, topk=3)
    result = check_qat_model(_prep(model, ex, setter), ex, None)
    assert result.site("relu3").output_dtype == "qint16"
    assert result.site("relu1").output_dtype == "qint8"


@pytest.mark.parametrize("kwargs", [{}, {"topk": 2, "ratio": 0.5}, {"ratio": 0.0}, {"ratio": 1.5}, {"topk": -1}])
def test_sensitive_setter_invalid_arguments(kwargs):
    with pytest.raises(QuantLensError, match="sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter"):
        sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(_TABLE, **kwargs)


def test_sensitive_setter_row_without_op_name_and_unknown_op():
    with pytest.raises(QuantLensError, match="no 'op_name'"):
        sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter([{"sensitive_type": "activation"}], topk=1)
    model, ex = _digits()
    setter = sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter([{"op_name": "nope"}], topk=1)
    result = check_qat_model(_prep(model, ex, setter), ex, None)
    assert any("'nope'" in w for w in result.warnings)


# ---------------------------------------------------------------------------------------------------------------
# 13. qconfig attribute on a submodule


def test_submodule_qconfig_attribute_overrides_template():
    model = zoo.get_model("tiny_resnet")
    ex = zoo.example_inputs("tiny_resnet")
    model.layer1.qconfig = get_qconfig(out_dtype="qint16")
    result = check_qat_model(_prep(model, ex), ex, None)
    for name in ("layer1.relu1", "layer1.relu2"):
        assert result.site(name).output_dtype == "qint16", name
    for name in ("stem_relu", "layer2.relu1", "layer2.relu2", "side_relu"):
        assert result.site(name).output_dtype == "qint8", name
    assert result.site("layer1.conv1").input_dtypes.startswith("qint8")
    assert result.site("layer2.conv1").input_dtypes.startswith("qint16")


def test_submodule_qconfig_attribute_on_leaf_module_sets_its_weight():
    model, ex = _digits()
    model.conv2.qconfig = get_qconfig(weight_dtype="qint16")
    prepared = _prep(model, ex)
    assert prepared.conv2.weight_fake_quant.dtype is QuantDType.qint16
    assert prepared.conv1.weight_fake_quant.dtype is QuantDType.qint8


def test_submodule_qconfig_attribute_on_fused_head_sets_group_output():
    model, ex = _digits()
    model.conv2.qconfig = get_qconfig(out_dtype="qint16")
    result = check_qat_model(_prep(model, ex), ex, None)
    assert result.site("relu2").output_dtype == "qint16"


# ---------------------------------------------------------------------------------------------------------------
# 14. state dict round trip


@pytest.mark.parametrize("name", ["digits_cnn", "tiny_transformer"])
def test_state_dict_round_trip(name):
    ex = zoo.example_inputs(name)
    a = _prep(zoo.get_model(name), ex)
    _calibrate(a, zoo.sample_batches(name, 2, 8))
    sd = a.state_dict()
    assert any(k.startswith("_quantlens_state.fq.") for k in sd)
    b = _prep(zoo.get_model(name), ex)
    assert not torch.equal(_validate(b, ex), _validate(a, ex))  # placeholder scales before loading
    b.load_state_dict(sd)
    _assert_tree_equal(_validate(b, ex), _validate(a, ex))
    batch = zoo.sample_batches(name, 3, 5)[2]
    _assert_tree_equal(_validate(b, batch), _validate(a, batch))
    fqs = [m for m in b.modules() if isinstance(m, FakeQuantize)]
    assert all(bool(m.calibrated) for m in fqs)


# ---------------------------------------------------------------------------------------------------------------
# 15. determinism


@pytest.mark.parametrize("name", ["digits_cnn", "tiny_resnet", "multitask"])
def test_two_runs_are_identical(name, tmp_path):
    outs, texts = [], []
    for run in range(2):
        d = tmp_path / f"run{run}"
        d.mkdir()
        ex = zoo.example_inputs(name)
        prepared = prepare(zoo.get_model(name), ex, CALIB, check_result_dir=d)
        _calibrate(prepared, zoo.sample_batches(name, 2, 4))
        outs.append(_validate(prepared, ex))
        texts.append((d / CHECK_FILE).read_text())
    _assert_tree_equal(outs[0], outs[1])
    assert texts[0] == texts[1]
    assert "quantlens model check" in texts[0]


# ---------------------------------------------------------------------------------------------------------------
# 16. transformers BertModel


def test_bert_prepare_calibrate_qat_validate(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.BertModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)

    def batch(b=2, t=10, pad=3):
        ids = torch.randint(1, 100, (b, t), generator=gen)
        mask = torch.ones(b, t, dtype=torch.long)
        mask[-1, t - pad:] = 0
        ids[-1, t - pad:] = 0
        return ids, mask

    ex = batch()
    float_sites = get_op_sites(model, ex)
    prepared = prepare(model, ex, CALIB, check_result_dir=tmp_path)
    assert get_op_sites(prepared, ex) == float_sites

    result = check_qat_model(prepared, ex, None)
    op_types = {s.op_type for s in result.sites}
    assert {"scaled_dot_product_attention", "layer_norm", "gelu", "embedding"} <= op_types
    record = prepared._quantlens_state.record
    # the integer attention mask never becomes an op site: function-op sites all have a float input, and no
    # mask arithmetic (comparisons, rsub, masked_fill, where) was recorded
    assert all(s.inputs for s in record.sites.values() if not s.is_module)
    assert all(s.inputs or s.op_type == "embedding" for s in record.sites.values())
    assert not op_types & {"rsub", "masked_fill", "where", "eq", "ne", "lt", "gt", "to"}
    sdpa = [s for s in record.sites.values() if s.op_type == "scaled_dot_product_attention"]
    assert len(sdpa) == 2
    for site in sdpa:
        assert len(site.inputs) == 3  # q, k, v; the boolean mask is not a float operand
        assert prepared._quantlens_state.plans[site.name].input_dtypes == ["qint8"] * 3

    _calibrate(prepared, [batch() for _ in range(2)])
    prepared.train()
    set_fake_quantize(prepared, FakeQuantState.QAT)
    opt = torch.optim.SGD(prepared.parameters(), lr=1e-2)
    out = prepared(*batch())
    loss = out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()
    assert torch.isfinite(loss)
    loss.backward()
    assert prepared.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    opt.step()

    val = _validate(prepared, ex)
    assert torch.isfinite(val.last_hidden_state).all() and torch.isfinite(val.pooler_output).all()
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        flt = prepared(*ex)
    assert not torch.equal(val.last_hidden_state, flt.last_hidden_state)
    assert get_op_sites(prepared, ex) == float_sites


# ---------------------------------------------------------------------------------------------------------------
# 17. error messages


def test_prepare_rejects_non_module():
    with pytest.raises(QuantLensError, match=r"prepare expects a torch.nn.Module, got function"):
        prepare(lambda x: x, (torch.randn(2),), check_result_dir=None)


def test_set_fake_quantize_on_unprepared_model():
    with pytest.raises(QuantLensError, match=r"Linear has no FakeQuantize modules.*prepare"):
        set_fake_quantize(nn.Linear(2, 2), FakeQuantState.CALIBRATION)


def test_prepare_already_prepared_model():
    model, ex = _digits()
    prepared = _prep(model, ex)
    with pytest.raises(QuantLensError, match="already prepared; pass the float model"):
        prepare(prepared, ex, check_result_dir=None)


def test_quant_spec_non_callable_observer():
    with pytest.raises(QuantLensError, match=r"QuantSpec.observer must be an observer class or factory.*'minmax'"):
        QuantSpec(QuantDType.qint8, observer="minmax")


def test_quant_dtype_parse_int4():
    with pytest.raises(QuantLensError, match=r"Unknown quantized dtype 'int4'.*qint8"):
        QuantDType.parse("int4")
    assert QuantDType.parse("int16") is QuantDType.qint16
    assert QuantDType.parse("torch.qint8") is QuantDType.qint8


def test_model_without_float_ops_and_bad_setter():
    class IntOnly(nn.Module):
        def forward(self, ids):
            return ids * 2

    with pytest.raises(QuantLensError, match="No float tensor operation ran in IntOnly.forward"):
        prepare(IntOnly(), (torch.ones(3, dtype=torch.long),), check_result_dir=None)
    model, ex = _digits()
    with pytest.raises(QuantLensError, match="qconfig_setter entries must be qconfig setters"):
        prepare(model, ex, ("qint8",), check_result_dir=None)
    with pytest.raises(QuantLensError, match="must return a QconfigAssignment"):
        prepare(model, ex, lambda ctx: {}, check_result_dir=None)


def test_check_qat_model_on_float_model():
    model, ex = _digits()
    with pytest.raises(QuantLensError, match="check_qat_model expects a model returned by"):
        check_qat_model(model, ex, None)


# ---------------------------------------------------------------------------------------------------------------
# 18. deepcopy and pickling


def _calibrated_digits():
    model, ex = _digits()
    prepared = _prep(model, ex)
    _calibrate(prepared, zoo.sample_batches("digits_cnn", 2, 8))
    return prepared, ex


def test_deepcopy_of_prepared_model():
    prepared, ex = _calibrated_digits()
    clone = copy.deepcopy(prepared)
    assert is_prepared(clone)
    assert clone._quantlens_state.root() is clone
    assert clone.forward.model is clone
    torch.testing.assert_close(_validate(clone, ex), _validate(prepared, ex), atol=0, rtol=0)
    # the copy is independent: calibrating it leaves the original's scales alone
    before = _fq_buffers(prepared)
    _calibrate(clone, [(zoo.load_digits_data().x_train[:64] * 3,)])
    assert all(torch.equal(v, before[k]) for k, v in _fq_buffers(prepared).items())
    assert not torch.equal(clone._quantlens_state.fq[fq_key("quant", "out")].scale,
                           prepared._quantlens_state.fq[fq_key("quant", "out")].scale)


def test_torch_save_load_of_prepared_model():
    prepared, ex = _calibrated_digits()
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert is_prepared(loaded)
    assert loaded._quantlens_state.root() is loaded
    torch.testing.assert_close(_validate(loaded, ex), _validate(prepared, ex), atol=0, rtol=0)
    assert get_op_sites(loaded, ex) == get_op_sites(prepared, ex)


def test_sensitive_weight_row_does_not_undo_a_more_sensitive_activation_promotion():
    model, ex = _digits()
    table = [{"op_name": "relu2", "sensitive_type": "activation"}, {"op_name": "conv3", "sensitive_type": "weight"},
             {"op_name": "fc", "sensitive_type": "weight"}]
    prepared = _prep(model, ex, sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(table, topk=3))
    result = check_qat_model(prepared, ex, None)
    assert result.site("relu2").output_dtype == "qint16"
    assert result.site("conv3").input_dtypes.startswith("qint16")  # not demoted back to int8
    assert prepared.conv3.weight_fake_quant.dtype is QuantDType.qint8
    assert prepared.fc.weight_fake_quant.dtype is QuantDType.qint16  # its input was not promoted
    assert any("weight of 'conv3' kept int8" in w for w in result.warnings)


def test_fused_group_without_weight_quantization_stays_unfused():
    model, ex = _digits()
    setter = (ModuleNameQconfigSetter({"conv2": QConfig(output=QuantSpec(QuantDType.qint8))}),
              default_calibration_qconfig_setter)
    prepared = _prep(model, ex, setter)
    state = prepared._quantlens_state
    assert all("conv2" not in g.members for g in state.groups)
    assert any("conv2" in u.members and "no weight quantization" in u.reason for u in state.unfused)
    prepared.eval()
    with torch.no_grad():
        prepared(*ex)  # runs: conv2 and bn2 stay separate modules


def test_calibrate_helper_observes_then_validates():
    from quantlens.quantization import calibrate

    model, ex = _digits()
    prepared = _prep(model, ex)
    data = zoo.load_digits_data()
    assert calibrate(prepared, [data.x_train[:64], data.x_train[64:128]]) is prepared
    state = prepared._quantlens_state
    assert state.fake_quant_state is FakeQuantState.VALIDATION and not prepared.training
    assert bool(state.fq[state.plans["relu1"].output_fq].calibrated)
    with pytest.raises(QuantLensError, match="no batch"):
        calibrate(prepared, [])


def test_a_float_model_that_fails_on_its_own_example_gets_its_error_in_words():
    """A model that raises on its example inputs without quantlens too is the model's error (or its inputs'), said
    so with the line of the model's code; the tracer is not blamed with an unexpected error."""
    import torch.nn.functional as F

    class TooSmall(nn.Module):
        def forward(self, x):
            return F.unfold(x, 4)  # a 2x2 image has no 4x4 block

    with pytest.raises(QuantLensError, match=r"raises on example input 0 without quantlens too: RuntimeError.*"
                                             r"test_prepare\.py:\d+"):
        prepare(TooSmall(), torch.randn(1, 1, 2, 2), allow_no_stubs=True, check_result_dir=None)
