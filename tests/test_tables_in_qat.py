"""Consistency level 3 (``tables_in_qat``): the lookup tables computed in the QAT forward, in place.

Calibrating a level-3 model installs the table overrides of ``pre_export`` on the model itself; in QAT they give
the integer value with the float op's gradient (straight-through) and follow moving scales; export uses them.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from quantlens import zoo
from quantlens.compiler import export
from quantlens.errors import QuantLensError
from quantlens.quantization import (
    ConsistencyStrategy,
    DeQuantStub,
    FakeQuantState,
    QuantStub,
    calibrate,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.plan import fq_key
from quantlens.quantization.pre_export import install_tables, lut_sites, pre_export, set_lut_enabled
from quantlens.quantization.table_overrides import TableOverride

NAME = "tiny_transformer"


@pytest.fixture
def level3():
    ConsistencyStrategy.set_consistency_level(3)
    try:
        yield
    finally:
        ConsistencyStrategy.disable()


def _ids(batch: int, seed: int = 0) -> torch.Tensor:
    example = zoo.example_inputs(NAME, batch)
    return example[0] if isinstance(example, tuple) else example


def _prepared(seed: int = 0):
    torch.manual_seed(seed)
    return prepare(zoo.get_model(NAME), zoo.example_inputs(NAME, 2), check_result_dir=None)


def _calibrated(seed: int = 0):
    return calibrate(_prepared(seed), zoo.sample_batches(NAME, 4, 8))


def _tables(model) -> dict[str, TableOverride]:
    state = model._quantlens_state
    return {name: state.overrides[fq_key(name, "lut")] for name in lut_sites(model)}


def _same_buffers(a: TableOverride, b: TableOverride) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- (a) tables in place after calibration ---------------------------------------------------------------------


def test_calibration_installs_the_tables_in_place(level3):
    model = _calibrated()
    assert model._quantlens_state.consistency.tables_in_qat
    assert set(lut_sites(model)) >= {"norm1", "norm2", "act"}  # layer_norm and gelu tables ...
    assert any(site.endswith("softmax_0") for site in lut_sites(model))  # ... and the attention softmax
    x = _ids(4)
    with torch.no_grad():
        ours = model(x)
        table_model = pre_export(model)
        theirs = table_model(x)
    assert torch.equal(ours, theirs)  # the VALIDATION model computes the integer tables, bit for bit
    for name, table in _tables(model).items():
        assert table.rebuild_on_change
        assert _same_buffers(table, _tables(table_model)[name])
    before = _tables(model)
    assert install_tables(model) == list(before)  # idempotent: same sites, same overrides
    assert all(before[n] is t for n, t in _tables(model).items())


def test_install_tables_is_idempotent_and_keeps_disabled_sites(level3):
    model = _calibrated()
    before = _tables(model)
    set_lut_enabled(model, ["act"], False)
    assert install_tables(model) == list(before)
    assert all(before[n] is t for n, t in _tables(model).items())
    assert model._quantlens_state.plans["act"].override is None  # still off
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    assert model._quantlens_state.plans["act"].override is None


def test_float_and_calibration_compute_the_float_op(level3):
    model = _calibrated()
    x = _ids(4)

    def no_table(*args):
        raise AssertionError("a table ran")

    for table in _tables(model).values():
        table.int_op = no_table
    with torch.no_grad():
        for state in (FakeQuantState.FLOAT, FakeQuantState.CALIBRATION):  # observers see the float op
            set_fake_quantize(model, state)
            a = model(x)
            set_lut_enabled(model, None, False)
            b = model(x)
            set_lut_enabled(model, None, True)
            assert torch.equal(a, b), state
        set_fake_quantize(model, FakeQuantState.VALIDATION)
        with pytest.raises(AssertionError, match="a table ran"):
            model(x)


# -- (b) straight-through gradients ----------------------------------------------------------------------------


class _Sigmoid(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub(scale=1 / 32)  # fixed input scale: x on its grid stays there in QAT
        self.act = nn.Sigmoid()
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(self.act(self.quant(x)))


def test_qat_gradient_is_the_float_ops_gradient(level3):
    x = torch.arange(-96, 97, 3, dtype=torch.float32) / 32  # input codes -96..96: on the grid, in range
    model = prepare(_Sigmoid(), x, check_result_dir=None)
    calibrate(model, [x])
    assert lut_sites(model) == ["act"]
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    xin = x.clone().requires_grad_(True)
    out = model(xin)
    out.sum().backward()
    ref_x = x.clone().requires_grad_(True)
    torch.sigmoid(ref_x).sum().backward()
    assert torch.isfinite(xin.grad).all() and (xin.grad != 0).all()
    assert torch.equal(xin.grad, ref_x.grad)
    with torch.no_grad():  # the value is the table's: the same as VALIDATION's at the scales of the forward
        table = _tables(model)["act"]
        s_in, s_out = table.table_scales.tolist()
        codes = table.integer(torch.round(x * 32).long()).to(torch.float32)
    assert s_in == 1 / 32
    assert torch.equal(out.detach(), codes * s_out)


def test_qat_backward_reaches_the_parameters_before_the_tables(level3):
    model = _calibrated()
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    out = model(_ids(8, 1))
    out.pow(2).sum().backward()
    for name in ("fc1.weight", "tok_emb.weight", "norm1.weight", "norm2.bias"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


# -- (c) moving scales -----------------------------------------------------------------------------------------


def test_tables_follow_the_scales_in_qat(level3):
    model = _calibrated()
    calibrated_scales = {n: t.table_scales.clone() for n, t in _tables(model).items()}
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _ids(8, 2)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()  # moves the weights, so the observers move the scales on the next forward
    model(x)  # forward after the step: the tables are rebuilt, no mismatch error
    moved = [n for n, t in _tables(model).items() if not torch.equal(t.table_scales, calibrated_scales[n])]
    assert moved, "the optimizer steps moved no scale: the test does not test rebuilding"
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    with torch.no_grad():
        ours = model(x)
        fresh = pre_export(model)
        theirs = fresh(x)
    assert torch.equal(ours, theirs)
    for name, table in _tables(model).items():  # rebuilt for the frozen scales (and layer_norm's new gamma/beta)
        assert _same_buffers(table, _tables(fresh)[name]), name


def test_unchanged_scales_do_not_rebuild(level3, monkeypatch):
    model = _calibrated()
    x = _ids(4)
    with torch.no_grad():
        model(x)  # VALIDATION: frozen scales
    built = []
    for cls in {type(t) for t in _tables(model).values()}:
        original = cls.__init__

        def counting(self, *args, _original=original, **kwargs):
            built.append(args[0])
            _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    with torch.no_grad():
        model(x)
    assert built == []


# -- (d) strategy off: unchanged --------------------------------------------------------------------------------


def test_strategy_off_keeps_pre_export_as_the_only_way():
    ConsistencyStrategy.disable()
    model = _calibrated()
    assert not model._quantlens_state.consistency.tables_in_qat
    assert lut_sites(model) == []
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    assert lut_sites(model) == []
    model(_ids(4)).sum().backward()  # plain QAT
    result = pre_export(model)
    assert lut_sites(result) and not any(t.rebuild_on_change for t in _tables(result).values())
    set_fake_quantize(result, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        result(_ids(8, 3) * 0 + 63)  # new data: new scales
    set_fake_quantize(result, FakeQuantState.VALIDATION)
    with pytest.raises(QuantLensError, match="pre_export again"):
        with torch.no_grad():
            result(_ids(4))


# -- (5) pre_export and export of a level-3 model ----------------------------------------------------------------


def test_export_uses_the_in_place_tables(level3, monkeypatch):
    model = _calibrated()
    x = _ids(2)
    expected = export(pre_export(model), (x,))(x)  # the IR of the pre_export copy

    def refuse(*args, **kwargs):
        raise AssertionError("export copied the model through pre_export although it has its tables")

    monkeypatch.setattr(sys.modules["quantlens.quantization.pre_export"], "pre_export", refuse)
    ir = export(model, (x,))
    ops = [n.op for n in ir.graph.nodes]
    assert ops.count("int_layer_norm") == 2 and ops.count("int_softmax") == 1 and ops.count("lut") == 1, ops
    assert torch.equal(ir(x), expected)


class _Reciprocal(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub(scale=1 / 32)
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(torch.reciprocal(self.quant(x)))


def test_qat_value_is_the_tables_where_the_float_op_is_infinite(level3):
    calibration = torch.arange(8, 97, dtype=torch.float32) / 32  # 1/x up to 4
    model = prepare(_Reciprocal(), calibration, check_result_dir=None)
    calibrate(model, [calibration])
    (site,) = lut_sites(model)
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    x = torch.tensor([0.0, 1.0, 2.0]).requires_grad_(True)  # 1 / 0: inf in float, saturated by the table
    out = model(x)
    table = _tables(model)[site]
    s_in, s_out = table.table_scales.tolist()
    with torch.no_grad():
        codes = table.integer(torch.round(x / s_in).long()).to(torch.float32)
    assert torch.equal(out.detach(), codes * s_out)
    assert torch.isfinite(out).all()


class _Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()

    def forward(self, x):
        return self.dq(torch.exp(self.q(x)))


def test_qat_observes_a_table_site_by_its_float_op(level3):
    """In QAT a table site's output observer sees the float op, as a plain site's does: calibrated on inputs
    below 1, QAT steps on inputs up to 3 move exp's output scale from pow2(e / 127) to pow2(e**3 / 127) (level 3 has
    level 2's power-of-two scales; the table's own output saturates at 127 steps, so observing it kept the
    scale); the tables follow the new scale, and the result is on its grid."""
    torch.manual_seed(0)
    model = prepare(_Exp(), (torch.rand(64, 8),), check_result_dir=None)
    calibrate(model, [(torch.rand(64, 8),) for _ in range(2)])  # inputs in [0, 1): exp below e
    out_fq = model._quantlens_state.fq[model._quantlens_state.plans["exp_0"].output_fq]
    assert lut_sites(model) == ["exp_0"]
    before = float(out_fq.scale)
    assert before == 2.0 ** -5  # e / 127 = 0.0214 -> 1/32
    set_fake_quantize(model, FakeQuantState.QAT)
    x = torch.linspace(0, 3, 64 * 8).reshape(64, 8).requires_grad_()
    with torch.no_grad():
        for _ in range(300):  # the default observers average (constant 0.01): let them settle
            model(x)
    y = model(x)
    after = float(out_fq.scale)
    assert after == 2.0 ** -2  # e**3 / 127 = 0.158 -> 1/4
    codes = y.detach() / after
    assert torch.equal(codes, codes.round())  # the table was rebuilt for the scale the observer gave
    assert float(y.max()) == pytest.approx(float(torch.exp(torch.tensor(3.0))), abs=after)  # not 127 / 32 = 3.97
    y.sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0  # straight-through gradient of exp


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.proj = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(self.q(x)).chunk(3, dim=-1)
        return self.dq(torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_qat_sdpa_softmax_table_observes_once_per_forward(level3):
    """sdpa's decomposition at level 3: its softmax table observes the float probabilities, and the probabilities'
    fake quant then only rounds (one observation per forward, as at a plain site: not also the table's output)."""
    from quantlens.quantization.decompositions import SdpaDecomposition

    torch.manual_seed(0)
    model = prepare(_Attention(), (torch.randn(2, 5, 8),), check_result_dir=None)
    calibrate(model, [(torch.randn(2, 5, 8),) for _ in range(2)])
    sdpa = [o for o in model._quantlens_state.overrides.values() if isinstance(o, SdpaDecomposition)]
    assert len(sdpa) == 1 and sdpa[0].softmax_table is not None and sdpa[0].softmax_table.observes_output()
    observer = sdpa[0].probs_fq.observer
    seen = []
    original = observer.forward
    observer.forward = lambda x: (seen.append(x.detach().clone()), original(x))[1]
    set_fake_quantize(model, FakeQuantState.QAT)
    x = torch.randn(2, 5, 8, requires_grad=True)
    model(x).sum().backward()
    assert len(seen) == 1  # once, on the float softmax (not on grid)
    assert not torch.equal(seen[0] / sdpa[0].probs_fq.scale, (seen[0] / sdpa[0].probs_fq.scale).round())
    assert x.grad is not None and float(x.grad.abs().sum()) > 0
