"""pre_export: nonlinear ops of calibrated zoo models computed by the march's integer tables."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from quantlens import zoo
from quantlens.errors import QuantLensError
from quantlens.quantization import (
    DeQuantStub,
    FakeQuantize,
    FakeQuantState,
    QuantStub,
    get_op_sites,
    get_qconfig,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.plan import fq_key
from quantlens.quantization.pre_export import (
    LutSiteInfo,
    lut_errors,
    lut_sites,
    pre_export,
    pre_export_report,
    set_lut_enabled,
)
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)

SETTERS = {"int8": default_calibration_qconfig_setter, "int16": calibration_8bit_weight_16bit_act_qconfig_setter}
TABLE_SITES = {
    "tiny_transformer": ["norm1", "attn.softmax_0", "norm2", "act"],
    "detector_postprocess": ["sigmoid_0"],
}
CASES = [(name, act) for name in TABLE_SITES for act in SETTERS]
#: a table site's output is within this many output steps of the QAT site's output on the same input
#: (measured: 0 or 1 step at every site; see the report in docs/march.md §13.8).
SITE_STEPS = 1.01


def _calibrate(model, batches):
    model.eval()
    set_fake_quantize(model, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    return model


def _setter(name: str, act: str):
    if name == "detector_postprocess":
        # The sigmoid after the DeQuantStub is host post-processing, which the templates leave float; asking for
        # it by name puts it on the NPU, where it is a table op.
        dtype = "qint8" if act == "int8" else "qint16"
        return ModuleNameQconfigSetter({"sigmoid_0": get_qconfig(out_dtype=dtype)}), SETTERS[act]
    return SETTERS[act]


@functools.lru_cache(maxsize=None)
def _calibrated(name: str, act: str):
    """A prepared, calibrated zoo model in VALIDATION (shared: tests must not modify it)."""
    model = prepare(zoo.get_model(name), zoo.example_inputs(name, 2), _setter(name, act), check_result_dir=None)
    return _calibrate(model, zoo.sample_batches(name, 4, 8))


@functools.lru_cache(maxsize=None)
def _pre_exported(name: str, act: str):
    """pre_export of the shared calibrated model (shared: tests must not modify it)."""
    return pre_export(_calibrated(name, act))


def _run(model, args):
    with torch.no_grad():
        return pytree.tree_leaves(model(*args))


def _snapshot(model):
    state = model._quantlens_state
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {name: plan.override for name, plan in state.plans.items()},
        list(state.overrides.keys()),
        [(m.observe_enabled, m.fake_quant_enabled) for m in model.modules() if isinstance(m, FakeQuantize)],
        model.training,
    )


# --- the zoo models -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, act", CASES)
def test_original_model_is_untouched(name, act):
    model = _calibrated(name, act)
    example = zoo.example_inputs(name, 2)
    out_before = _run(model, example)
    model.train()  # pre_export must not switch the original to eval either
    try:
        before = _snapshot(model)
        result = pre_export(model)
        after = _snapshot(model)
    finally:
        model.eval()
    assert result is not model
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:] == after[1:]
    assert all(v is None for v in after[1].values()) and after[2] == []
    assert all(torch.equal(a, b) for a, b in zip(out_before, _run(model, example)))


@pytest.mark.parametrize("name, act", CASES)
def test_overrides_exactly_at_table_sites_and_names_unchanged(name, act):
    model, result = _calibrated(name, act), _pre_exported(name, act)
    state = result._quantlens_state
    expected = TABLE_SITES[name]
    assert lut_sites(result) == expected
    assert sorted(state.overrides.keys()) == sorted(fq_key(s, "lut") for s in expected)
    assert {n for n, p in state.plans.items() if p.override is not None} == set(expected)
    assert all(state.plans[s].override == fq_key(s, "lut") for s in expected)
    example = zoo.example_inputs(name, 2)
    assert get_op_sites(result, example) == get_op_sites(model, example)
    # the result is a VALIDATION-state evaluation model with every observer off
    assert not result.training and state.fake_quant_state is FakeQuantState.VALIDATION
    fqs = [m for m in result.modules() if isinstance(m, FakeQuantize)]
    assert fqs and all(m.fake_quant_enabled and not m.observe_enabled for m in fqs)


@pytest.mark.parametrize("name, act", CASES)
def test_outputs_close_to_the_qat_model(name, act):
    model, result = _calibrated(name, act), _pre_exported(name, act)
    worst: dict[str, float] = {}
    for batch in zoo.sample_batches(name, 3, 8):
        for site, err in lut_errors(result, batch).items():
            worst[site] = max(worst.get(site, 0.0), err)
        for a, b in zip(_run(model, batch), _run(result, batch)):
            if a.is_floating_point():
                # model outputs: within 2% of the output range (measured: 0 for int8, < 1e-5 relative for int16)
                assert float((a - b).abs().max()) <= 0.02 * float(a.abs().max()) + 1e-6
            else:
                assert torch.equal(a, b)  # detector: top-k indices
    assert sorted(worst) == sorted(TABLE_SITES[name])
    assert all(err <= SITE_STEPS for err in worst.values()), worst


def test_float_host_code_is_left_alone():
    # with the templates only, the detector's sigmoid after the DeQuantStub stays float: no table site at all
    name = "detector_postprocess"
    model = _calibrate(
        prepare(zoo.get_model(name), zoo.example_inputs(name, 2), SETTERS["int8"], check_result_dir=None),
        zoo.sample_batches(name, 2, 8),
    )
    result = pre_export(model)
    assert lut_sites(result) == [] and pre_export_report(result) == []
    batch = zoo.sample_batches(name, 1, 8)[0]
    assert all(torch.equal(a, b) for a, b in zip(_run(model, batch), _run(result, batch)))


def test_set_lut_enabled_restores_the_qat_site():
    name = "tiny_transformer"
    model = _calibrated(name, "int16")
    result = pre_export(model)
    batch = zoo.sample_batches(name, 1, 8)[0]
    qat, tables = _run(model, batch), _run(result, batch)
    assert not all(torch.equal(a, b) for a, b in zip(qat, tables))  # the int16 tables change some bits
    set_lut_enabled(result, "act", False)
    assert lut_sites(result) == TABLE_SITES[name]  # still a table site, just off
    assert result._quantlens_state.plans["act"].override is None
    assert {i.site: i.enabled for i in pre_export_report(result)} == {
        "norm1": True, "attn.softmax_0": True, "norm2": True, "act": False}
    assert sorted(lut_errors(result, batch)) == ["attn.softmax_0", "norm1", "norm2"]
    set_lut_enabled(result, None, False)  # every table off: bit for bit the QAT model
    assert all(torch.equal(a, b) for a, b in zip(qat, _run(result, batch)))
    set_lut_enabled(result, ["norm1", "attn.softmax_0", "norm2", "act"], True)
    assert all(torch.equal(a, b) for a, b in zip(tables, _run(result, batch)))
    with pytest.raises(QuantLensError, match="not table sites"):
        set_lut_enabled(result, ["attn.q_proj"], False)


class _Wrapper(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *args):
        return self.m(*args)


@pytest.mark.parametrize("act, elementwise", [("int8", "lut"), ("int16", "segment_lut")])
def test_export_has_one_node_per_table_op(act, elementwise):
    name = "tiny_transformer"
    result = _pre_exported(name, act)
    example = zoo.example_inputs(name, 2)
    ep = torch.export.export(_Wrapper(result), example, strict=False)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function" and n.target.namespace == "quantlens"]
    tables = [str(t).split(".")[1] for t in ops if "fake_quant" not in str(t)]
    assert tables == ["int_layer_norm", "int_softmax", "int_layer_norm", elementwise]
    assert torch.equal(ep.module()(*example), _run(result, example)[0])


@pytest.mark.parametrize("name, act", CASES)
def test_report(name, act):
    result = _pre_exported(name, act)
    report = pre_export_report(result)
    assert [i.site for i in report] == TABLE_SITES[name]
    fq = result._quantlens_state.fq
    dtype = "qint8" if act == "int8" else "qint16"
    for info in report:
        assert isinstance(info, LutSiteInfo) and info.enabled
        assert info.input_dtypes == (dtype,) and info.output_dtype == dtype
        assert info.output_scale == float(fq[fq_key(info.site, "out")].scale)
        assert 0.0 <= info.max_error_steps <= 1.1  # the table against the exact function, unrounded
        assert info.table_entries > 0 and info.detail
    kinds = {i.site: i.table_kind for i in report}
    elementwise = "table256" if act == "int8" else "segmented"
    if name == "tiny_transformer":
        assert kinds == {"norm1": "layer_norm", "attn.softmax_0": "softmax", "norm2": "layer_norm",
                         "act": elementwise}
    else:
        assert kinds == {"sigmoid_0": elementwise}
        assert report[0].error_basis == "exhaustive"
        assert report[0].table_entries == (256 if act == "int8" else 520)


def test_tables_travel_in_state_dict_and_deepcopy():
    name = "detector_postprocess"
    result = _pre_exported(name, "int16")
    sd = result.state_dict()
    prefix = "_quantlens_state.overrides." + fq_key("sigmoid_0", "lut") + "."
    assert {prefix + k for k in ("table_scales", "bounds", "shifts", "entries")} <= set(sd)
    batch = zoo.sample_batches(name, 1, 4)[0]
    twin = copy.deepcopy(result)
    assert all(torch.equal(a, b) for a, b in zip(_run(result, batch), _run(twin, batch)))
    # loading the state dict into another pre_export of the same model restores the same tables
    other = pre_export(_calibrated(name, "int16"))
    other._quantlens_state.overrides[fq_key("sigmoid_0", "lut")].entries.zero_()
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(_run(result, batch), _run(other, batch)))


# --- errors ---------------------------------------------------------------------------------------------------


def test_refuses_models_that_are_not_prepared():
    with pytest.raises(QuantLensError, match="prepare"):
        pre_export(zoo.get_model("tiny_transformer"))
    with pytest.raises(QuantLensError, match="prepare"):
        pre_export_report(zoo.get_model("tiny_transformer"))


def test_refuses_uncalibrated_models():
    name = "detector_postprocess"
    model = prepare(zoo.get_model(name), zoo.example_inputs(name, 2), _setter(name, "int8"), check_result_dir=None)
    with pytest.raises(QuantLensError, match="sigmoid_0.*calibrat|calibrat.*sigmoid_0"):
        pre_export(model)


def test_scales_changed_after_pre_export_raise():
    name = "detector_postprocess"
    result = pre_export(_calibrated(name, "int8"))
    set_fake_quantize(result, FakeQuantState.CALIBRATION)  # tables compute the float op while calibrating
    with torch.no_grad():
        result(torch.full((2, 3, 16, 16), 3.0))  # a wider range: new scales
    set_fake_quantize(result, FakeQuantState.VALIDATION)
    with pytest.raises(QuantLensError, match="pre_export again"):
        _run(result, zoo.example_inputs(name, 2))


# --- function-call sites, div and reciprocal ------------------------------------------------------------------


class _Functional(nn.Module):
    """Every table op, called as functions and methods, with non-default arguments."""

    def __init__(self):
        super().__init__()
        self.quant, self.quant_y = QuantStub(), QuantStub()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.rand(8) + 0.5)
        self.b = nn.Parameter(torch.randn(8) * 0.1)
        self.dequant = DeQuantStub()

    def forward(self, x, y):
        x, y = self.quant(x), self.quant_y(y)
        h = self.lin(x)
        a = F.gelu(h, approximate="tanh") + torch.tanh(h) + F.silu(h) + F.softplus(h, beta=2.0)
        a = torch.exp(-a.sigmoid())
        n = F.layer_norm(a, (8,), self.w, self.b, 1e-3)
        s = torch.softmax(n, dim=1)
        return self.dequant(s + torch.reciprocal(y) + n / y + n / 4.0)


def _functional_batch(gen):
    x = torch.randn(4, 8, generator=gen)
    y = (torch.rand(4, 8, generator=gen) + 0.25) * torch.sign(torch.randn(4, 8, generator=gen))
    return x, y


@functools.lru_cache(maxsize=None)
def _functional(act: str):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    example = _functional_batch(gen)
    model = prepare(_Functional(), example, SETTERS[act], check_result_dir=None)
    return _calibrate(model, [_functional_batch(gen) for _ in range(4)]), example, gen


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_function_sites_div_and_reciprocal(act):
    model, example, gen = _functional(act)
    with pytest.raises(QuantLensError, match="layer_norm.*example_inputs"):
        pre_export(model)  # F.layer_norm's weight, bias and eps are only seen when it runs
    result = pre_export(model, example_inputs=example)
    expected = ["gelu_0", "tanh_0", "silu_0", "softplus_0", "sigmoid_0", "exp_0", "layer_norm_0", "softmax_0",
                "reciprocal_0", "div_0"]
    assert lut_sites(result) == expected  # n / 4.0 (div_1) is a multiply, not a table
    params = {i.site: i for i in pre_export_report(result)}
    assert params["div_0"].input_dtypes == (("qint8",) * 2 if act == "int8" else ("qint16",) * 2)
    kinds = {s: i.table_kind for s, i in params.items()}
    assert kinds["reciprocal_0"] == ("table256" if act == "int8" else "mantissa_reciprocal")
    assert kinds["div_0"] == "div" and kinds["softmax_0"] == "softmax" and kinds["layer_norm_0"] == "layer_norm"
    errors = lut_errors(result, _functional_batch(gen))
    assert sorted(errors) == sorted(expected)
    assert all(err <= SITE_STEPS for err in errors.values()), errors
    # in FLOAT state a table site computes the float op, like the prepared model
    set_fake_quantize(result, FakeQuantState.FLOAT)
    set_fake_quantize(model, FakeQuantState.FLOAT)
    try:
        assert torch.equal(_run(result, example)[0], _run(model, example)[0])
    finally:
        set_fake_quantize(model, FakeQuantState.VALIDATION)


def test_function_call_arguments_are_checked():
    class Gelu(nn.Module):
        def __init__(self, approximate):
            super().__init__()
            self.approximate = approximate
            self.quant, self.dequant = QuantStub(), DeQuantStub()

        def forward(self, x):
            return self.dequant(F.gelu(self.quant(x), approximate=self.approximate))

    x = torch.linspace(-4, 4, 64).reshape(4, 16)
    model = _calibrate(prepare(Gelu("tanh"), (x,), SETTERS["int8"], check_result_dir=None), [(x,)])
    blind = pre_export(model)  # no example inputs: built for the default approximate="none"
    with pytest.raises(QuantLensError, match="approximate"):
        _run(blind, (x,))
    seen = pre_export(model, example_inputs=(x,))
    assert pre_export_report(seen)[0].max_error_steps <= 0.5
    assert lut_errors(seen, (x,)) == {"gelu_0": 0.0}
