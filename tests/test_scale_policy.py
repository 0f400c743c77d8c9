"""Consistency level 2 scale policies: power-of-two activation scales and shared scales at add/sub/cat."""

import copy
import math

import pytest
import torch
from torch import nn

import quantlens.zoo as zoo
from quantlens.compiler import convert, export
from quantlens.march import QuantDType
from quantlens.quantization import (
    ConsistencyStrategy,
    DeQuantStub,
    FakeQuantize,
    FakeQuantState,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    check_qat_model,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, TemplateQconfigSetter
from quantlens.quantization.scale_groups import pow2_ceil

NAME = "tiny_resnet"
#: int8 everywhere, the final linear included (its output has a fake quant, so "one output step" is defined)
INT8_OUT = TemplateQconfigSetter("int8_out", "qint8", "qint8", MinMaxObserver, high_precision_output=False)


@pytest.fixture
def level2():
    ConsistencyStrategy.set_consistency_level(2)
    try:
        yield
    finally:
        ConsistencyStrategy.disable()


def _is_pow2(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


def _activation_fqs(model):
    return {k: fq for k, fq in model._quantlens_state.fq.items() if not fq.is_weight}


def _prepare(model, example, setter=INT8_OUT):
    return prepare(model, example, setter, check_result_dir=None)


def _calibrated_resnet(setter=INT8_OUT):
    model = _prepare(zoo.get_model(NAME), zoo.example_inputs(NAME, 2), setter)
    return calibrate(model, zoo.sample_batches(NAME, 4, 8))


def _add_sites(state):
    return [p for p in state.plans.values() if p.op_type == "add"]


def _add_keys(state, plan):
    """The fake quants an add site's inputs and output are on (tiny_resnet: producers quantize, add + relu)."""
    site = state.record.sites[plan.name]
    keys = [state.plans[i.producer].output_fq for i in site.inputs]
    return keys + [state.plans[plan.fused_into].output_fq]


# -- power-of-two rule --------------------------------------------------------------------------------------------

def test_pow2_ceil_rounds_up_exactly():
    values = torch.tensor([2.0**-24, 2.0**-30, 3e-6, 0.0078125, 0.0078126, 0.01, 0.5, 0.75, 1.0, 1.0000001, 3.0,
                           1000.0], dtype=torch.float32)
    got = pow2_ceil(values)
    for v, g in zip(values.tolist(), got.tolist()):
        want = max(2.0 ** math.ceil(math.log2(v)), 2.0**-24)
        assert g == want, (v, g, want)
        assert g >= v or v < 2.0**-24
    assert got.dtype == torch.float32


# -- tiny_resnet at level 2 ----------------------------------------------------------------------------------------

def test_level2_scales_are_pow2_and_shared_at_adds(level2):
    model = _calibrated_resnet()
    state = model._quantlens_state
    acts = _activation_fqs(model)
    assert acts
    for key, fq in acts.items():
        assert fq.pow2_scale and bool(fq.calibrated), key
        assert _is_pow2(fq.scale.item()), (key, fq.scale.item())
    # weights keep their per-channel observed scales
    assert not all(_is_pow2(v) for v in model.fc.weight_fake_quant.scale.tolist())
    adds = _add_sites(state)
    assert len(adds) == 2
    for plan in adds:
        keys = _add_keys(state, plan)
        scales = [state.fq[k].scale for k in keys]
        assert all(torch.equal(scales[0], s) for s in scales), (plan.name, keys, scales)
        assert len({state.fq[k].scale_group for k in keys}) == 1
    # every shared group's buffers are bit-identical after calibration
    assert state.scale_groups and all(g.shared for g in state.scale_groups)
    for group in state.scale_groups:
        first = state.fq[group.members[0]].scale
        assert all(torch.equal(state.fq[k].scale, first) for k in group.members), group.describe()


def test_level2_add_rescale_is_identity_and_ir_matches(level2):
    model = _calibrated_resnet()
    state = model._quantlens_state
    q_ir = convert(export(model, zoo.example_inputs(NAME, 2), dynamic_batch=True))
    adds = [n for n in q_ir.graph.nodes if n.op == "add"]
    cats = [n for n in q_ir.graph.nodes if n.op == "cat"]
    assert len(adds) == 2 and len(cats) == 1
    for node in adds + cats:
        for m, s in zip(node.attrs["multipliers"], node.attrs["shifts"]):
            assert m * 2.0**-s == 1.0, node
    step = state.fq[state.plans["fc"].output_fq].scale
    within = total = 0
    with torch.no_grad():
        for (batch,) in zoo.sample_batches(NAME, 4, 64):
            ref, got = model(batch), q_ir(batch)
            err = (ref - got).abs()
            within += int((err <= step * (1 + 1e-6)).sum())
            total += err.numel()
    assert within / total >= 0.999, within / total


def test_strategy_off_changes_nothing():
    ConsistencyStrategy.disable()
    model = _calibrated_resnet()
    state = model._quantlens_state
    acts = _activation_fqs(model)
    assert not any(fq.pow2_scale or fq.scale_group is not None for fq in acts.values())
    assert not state.scale_groups
    assert not all(_is_pow2(fq.scale.item()) for fq in acts.values())
    plan = _add_sites(state)[0]
    scales = [state.fq[k].scale.item() for k in _add_keys(state, plan)]
    assert len(set(scales)) > 1
    q_ir = convert(export(model, zoo.example_inputs(NAME, 2)))
    add = next(n for n in q_ir.graph.nodes if n.op == "add")
    assert any(m * 2.0**-s != 1.0 for m, s in zip(add.attrs["multipliers"], add.attrs["shifts"]))


def test_qat_forward_uses_one_scale_per_group(level2):
    model = _calibrated_resnet()
    state = model._quantlens_state
    group = max(state.scale_groups, key=lambda g: len(g.members))
    used: dict[str, list[float]] = {}

    def hook(key):
        return lambda module, args, out: used.setdefault(key, []).append(module.scale.item())

    handles = [state.fq[k].register_forward_hook(hook(k)) for k in group.members]
    model.eval()  # BatchNorm on running statistics, so the growing inputs reach every member
    set_fake_quantize(model, FakeQuantState.QAT)
    per_forward = []
    for i, (batch,) in enumerate(zoo.sample_batches(NAME, 3, 8)):
        used.clear()
        model(batch * (4.0**i)).sum().backward()  # growing ranges: the observers move during QAT
        assert set(used) == set(group.members)
        values = {v for vs in used.values() for v in vs}
        assert len(values) == 1, used
        per_forward.append(values.pop())
    for h in handles:
        h.remove()
    assert per_forward[-1] > per_forward[0]  # the group followed its observers
    set_fake_quantize(model, FakeQuantState.VALIDATION)
    first = state.fq[group.members[0]].scale
    assert all(torch.equal(state.fq[k].scale, first) for k in group.members)


def test_state_dict_and_deepcopy_keep_shared_pow2_scales(level2):
    model = _calibrated_resnet()
    state = model._quantlens_state
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _prepare(zoo.get_model(NAME), zoo.example_inputs(NAME, 2))
    fresh.load_state_dict(saved)
    set_fake_quantize(fresh, FakeQuantState.VALIDATION)
    for key, fq in _activation_fqs(fresh).items():
        assert torch.equal(fq.scale, state.fq[key].scale), key
        assert _is_pow2(fq.scale.item())
    batch = zoo.sample_batches(NAME, 1, 8)[0][0]
    with torch.no_grad():
        assert torch.equal(fresh(batch), model(batch))

    twin = copy.deepcopy(model)
    before = {k: fq.scale.clone() for k, fq in state.fq.items()}
    set_fake_quantize(twin, FakeQuantState.QAT)
    twin(batch * 16).sum().backward()
    tstate = twin._quantlens_state
    for group in tstate.scale_groups:
        first = tstate.fq[group.members[0]].scale
        assert all(torch.equal(tstate.fq[k].scale, first) for k in group.members)
    assert any(not torch.equal(tstate.fq[k].scale, before[k]) for k in before)  # the copy moved ...
    assert all(torch.equal(fq.scale, before[k]) for k, fq in state.fq.items())  # ... the original did not


# -- group construction on a hand-written model -------------------------------------------------------------------

class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = QuantStub()
        self.c1, self.c2, self.c3, self.side = (nn.Conv2d(4, 4, 1) for _ in range(4))
        self.c4, self.c5, self.c6 = (nn.Conv2d(4, 4, 1) for _ in range(3))
        self.dq = DeQuantStub()

    def forward(self, x):
        x = self.q(x)
        a = self.c1(x)
        y = a + self.c2(a)                          # add_0
        z = y + self.c3(y)[:, :]                    # add_1 (its input through a passthrough getitem)
        w = torch.cat([z, self.side(x)], dim=1)     # cat_0
        u = self.c4(x) + 0.5                        # add_2: one tensor input
        v = self.c5(x) - self.c6(x)                 # sub_0: a group of its own
        return self.dq(w), self.dq(u), self.dq(v)


def _chain_example():
    torch.manual_seed(0)
    return (torch.randn(2, 4, 5, 5),)


def test_group_construction_chains_adds_and_cat(level2):
    model = _prepare(_Chain(), _chain_example())
    state = model._quantlens_state
    groups = {tuple(g.sites): g for g in state.scale_groups}
    assert set(groups) == {("add_0", "add_1", "cat_0"), ("add_2",), ("sub_0",)}
    chain = groups[("add_0", "add_1", "cat_0")]
    assert set(chain.members) == {"c1|out", "c2|out", "add_0|out", "c3|out", "add_1|out", "side|out", "cat_0|out"}
    assert set(groups[("add_2",)].members) == {"c4|out", "add_2|out"}
    assert set(groups[("sub_0",)].members) == {"c5|out", "c6|out", "sub_0|out"}
    assert all(g.shared for g in groups.values())
    for group in groups.values():
        assert {state.fq[k].scale_group for k in group.members} == {group.index}
    assert "quant|out" not in {k for g in groups.values() for k in g.members}  # conv inputs are not grouped

    calibrate(model, [(torch.randn(2, 4, 5, 5) * s,) for s in (1.0, 3.0)])
    for group in groups.values():
        scales = {state.fq[k].scale.item() for k in group.members}
        assert len(scales) == 1 and _is_pow2(scales.pop()), group.describe()
        # the group scale covers its widest member: the max of the members' observed scales, rounded up
        widest = max(state.fq[k].observer.calculate_scale().item() for k in group.members)
        assert state.fq[group.members[0]].scale.item() == pow2_ceil(torch.tensor(widest)).item()
    text = check_qat_model(model, _chain_example(), None).to_text()
    assert "== Scale groups" in text and chain.describe() in text


def test_mixed_dtypes_and_fixed_scales_are_reported_not_shared(level2):
    int16 = QConfig(input=QuantSpec(QuantDType.qint16, MinMaxObserver), output=QuantSpec(QuantDType.qint16, MinMaxObserver),
                    weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0))
    setter = (ModuleNameQconfigSetter({"c5": int16}), INT8_OUT)
    chain = _Chain()
    chain.q = QuantStub(scale=0.3)
    model = _prepare(chain, _chain_example(), setter)
    state = model._quantlens_state
    sub = next(g for g in state.scale_groups if g.sites == ["sub_0"])
    assert not sub.shared and any("qint16" in r for r in sub.reasons)
    assert all(state.fq[k].scale_group is None for k in sub.members)
    assert any("scale group" in w and "sub_0" in w and "not shared" in w for w in state.warnings)
    assert any("'q'" in w and "0.3" in w and "power of two" in w for w in state.warnings)
    calibrate(model, [_chain_example()])
    assert state.fq["q|out"].scale.item() == pytest.approx(0.3)  # the user's fixed scale is kept
    assert len({state.fq[k].scale.item() for k in sub.members}) > 1


def test_fixed_pow2_scale_needs_no_warning(level2):
    chain = _Chain()
    chain.q = QuantStub(scale=1 / 128)
    model = _prepare(chain, _chain_example())
    assert not any("power of two" in w for w in model._quantlens_state.warnings)
    calibrate(model, [_chain_example()])
    assert model._quantlens_state.fq["q|out"].scale.item() == 1 / 128
    assert isinstance(model._quantlens_state.fq["q|out"], FakeQuantize)
