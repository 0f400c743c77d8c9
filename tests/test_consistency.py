"""The consistency strategy (issue #9): levels 0-4, the integer rules in the QAT forward, bit-exact level 4."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import quantlens.zoo as zoo
from quantlens.compiler import convert, export
from quantlens.errors import QuantLensError
from quantlens.quantization import (
    ConsistencyStrategy,
    DeQuantStub,
    FakeQuantize,
    FakeQuantState,
    QConfig,
    QuantSpec,
    QuantStub,
    calibrate,
    pre_export,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)

SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}


@pytest.fixture(autouse=True)
def _strategy_off_afterwards():
    yield
    ConsistencyStrategy.disable()


def _build(name: str, setter: str, level: int | None):
    """prepare at ``level``, calibrate, export, convert; returns (model, quantized IR, held-out batches), copies of
    this process's one build per (name, setter, level): several tests read the same builds (tiny_resnet at int8
    and level 4: three tests), and a test may change what it gets (the QAT state, gradients)."""
    return copy.deepcopy(_built(name, setter, level))


@functools.lru_cache(maxsize=None)
def _built(name: str, setter: str, level: int | None, batch: int = 8):
    batches = zoo.sample_batches(name, 6, batch)
    ConsistencyStrategy.set_consistency_level(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = calibrate(prepare(zoo.get_model(name), batches[0], SETTERS[setter], check_result_dir=None),
                              batches[:4])
            qir = convert(export(model, batches[0]))
    finally:
        ConsistencyStrategy.disable()
    return model, qir, batches[4:]


def _exact_share(model, qir, batches) -> float:
    equal = total = 0
    for args in batches:
        with torch.no_grad():
            ref = pytree.tree_leaves(model(*args))
        out = pytree.tree_leaves(qir(*args))
        for r, o in zip(ref, out):
            if isinstance(r, torch.Tensor) and r.is_floating_point():
                equal += int((r == o).sum())
                total += r.numel()
    return equal / total


# -- the strategy object -----------------------------------------------------------------------------------------
def test_levels_are_recorded_by_prepare_and_carried_to_the_irs():
    ConsistencyStrategy.set_consistency_level(0)
    assert ConsistencyStrategy.get_consistency_level() == 0
    model, qir, _ = _build("digits_cnn", "int8", 0)
    assert model._quantlens_state.consistency.level == 0
    qat_ir = export(model, zoo.example_inputs("digits_cnn", 8))
    assert qat_ir._high_precision_qpp is True and qat_ir.consistency_level == 0
    assert qir._high_precision_qpp is True and qir.meta["qpp"] == "high_precision"
    # a multiplier of the high-precision profile has 31 bits
    gemm = next(n for n in qir.graph.nodes if n.op == "conv2d")
    assert all(m >= 2**30 for m in gemm.attrs["multiplier"])
    ConsistencyStrategy.disable()
    assert ConsistencyStrategy.get_consistency_level() is None
    off, off_ir, _ = _build("digits_cnn", "int8", None)
    assert off._quantlens_state.consistency.level is None and off_ir._high_precision_qpp is False
    gemm = next(n for n in off_ir.graph.nodes if n.op == "conv2d")
    assert all(m < 2**16 for m in gemm.attrs["multiplier"])


@pytest.mark.parametrize("bad", [-1, 5, 2.0, "2", True])
def test_a_bad_level_is_refused_naming_the_range(bad):
    with pytest.raises(QuantLensError, match=r"0\.\.4"):
        ConsistencyStrategy.set_consistency_level(bad)
    assert ConsistencyStrategy.get_consistency_level() is None


def test_each_level_switches_on_what_the_docs_say():
    from quantlens.quantization.consistency import ConsistencyConfig

    configs = [ConsistencyConfig.for_level(level) for level in range(5)]
    assert configs[0].high_precision_qpp and not configs[0].needs_retraining
    assert [c.emulate_integer_rules for c in configs] == [False, True, True, True, True]
    assert [c.pow2_activation_scales for c in configs] == [False, False, True, True, True]
    assert [c.shared_elementwise_scales for c in configs] == [False, False, True, True, True]
    assert [c.tables_in_qat for c in configs] == [False, False, False, True, True]
    assert [c.exact_validation for c in configs] == [False, True, True, True, True]
    assert [c.exact_training for c in configs] == [False, False, False, False, True]
    assert all(c.needs_retraining for c in configs[1:])


# -- the integer rules in the forward: hand-computed -----------------------------------------------------------------
class _Add(nn.Module):
    def __init__(self):
        super().__init__()
        self.qa, self.qb = QuantStub(scale=2**-4), QuantStub(scale=2**-5)
        self.dequant = DeQuantStub()

    def forward(self, a, b):
        return self.dequant(self.qa(a) + self.qb(b))


def _add_model(level):
    out = QConfig(output=QuantSpec("qint8", FixedScaleObserver.with_args(scale=2**-3)))
    ConsistencyStrategy.set_consistency_level(level)
    model = prepare(_Add(), (torch.zeros(1), torch.zeros(1)), (ModuleNameQconfigSetter({"add_0": out}),
                                                                default_calibration_qconfig_setter),
                    check_result_dir=None)
    ConsistencyStrategy.disable()
    return calibrate(model, [(torch.zeros(1), torch.zeros(1))])


def test_level_1_adds_like_the_cheap_kernel():
    """docs/march.md §10: q_a = 5 at 2^-4, q_b = 2 at 2^-5, output at 2^-3. The default qpp rounds each term to
    whole output steps (F = 0): rhe(2.5) + rhe(0.5) = 2 + 0 = 2 steps; the fake quant rounds the sum once: 3."""
    a, b = torch.tensor([5 * 2**-4]), torch.tensor([2 * 2**-5])
    off, level1 = _add_model(None), _add_model(1)
    with torch.no_grad():
        assert float(off(a, b)) == 3 * 2**-3
        assert float(level1(a, b)) == 2 * 2**-3
    qir = convert(export(level1, (a, b)))
    assert float(qir(a, b)) == 2 * 2**-3  # what the NPU computes


def test_level_1_qat_gradients_are_the_fake_quant_straight_through_ones():
    """The value follows the integer rule, the gradient is the fake quant's STE: for a loss linear in the
    output, the gradients equal those of the strategy-off model with the same weights and scales."""
    torch.manual_seed(0)
    float_model = nn.Sequential(QuantStub(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), DeQuantStub())
    x = torch.randn(32, 16)
    grads = {}
    for level in (None, 1):
        ConsistencyStrategy.set_consistency_level(level)
        model = prepare(float_model, x, default_calibration_qconfig_setter, check_result_dir=None)
        ConsistencyStrategy.disable()
        calibrate(model, [x])
        model.train()
        set_fake_quantize(model, FakeQuantState.QAT)
        for m in model.modules():  # freeze the scales: both runs see the same grids
            if hasattr(m, "observe_enabled") and not m.is_weight:
                m.observe_enabled = False
        out = model(x)
        out.sum().backward()
        grads[level] = [p.grad.clone() for p in model.parameters()]
        values = out.detach()
        if level is None:
            first_values = values
        if level == 1:  # the QAT forward computed the integer rules, as the VALIDATION forward does
            model.eval()
            set_fake_quantize(model, FakeQuantState.VALIDATION)
            with torch.no_grad():
                assert torch.equal(values, model(x))
            off_values = values
    assert not torch.equal(off_values, first_values)  # the values differ (integer rules vs float) ...
    for g_off, g_1 in zip(grads[None], grads[1]):  # ... the gradients do not
        assert torch.isfinite(g_1).all() and g_1.abs().sum() > 0
        torch.testing.assert_close(g_1, g_off)


# -- what the levels achieve --------------------------------------------------------------------------------------
@pytest.mark.parametrize("setter", ["int8", "w8a16"])
@pytest.mark.parametrize("name", zoo.list_models())
def test_level_4_quantized_ir_equals_the_model_bit_for_bit(name, setter):
    model, qir, held_out = _build(name, setter, 4)
    assert _exact_share(model, qir, held_out) == 1.0
    # the strategy off: the same model is not bit-exact (the level is what made it so)
    off, off_ir, _ = _build(name, setter, None)
    assert _exact_share(off, off_ir, held_out) < 1.0


@pytest.mark.parametrize("setter", ["int8", "w8a16"])
def test_exact_match_never_falls_as_the_level_rises(setter):
    shares = []
    for level in (None, 0, 1, 2, 3, 4):
        model, qir, held_out = _build("tiny_resnet", setter, level)
        shares.append(_exact_share(model, qir, held_out))
    assert shares == sorted(shares), shares
    assert shares[-1] == 1.0 and shares[0] < shares[-1]


def test_latency_level_0_costs_more_and_level_2_less_than_the_strategy_off():
    latency = {level: _build("tiny_resnet", "int8", level)[1].latency_estimate().cycles for level in (None, 0, 2)}
    assert latency[0] > latency[None] > latency[2]


def test_export_captures_float_and_fake_quant_semantics_at_every_level():
    """The emulation runs in eager forwards only: the qat IR of a level-4 model has the same ops as the
    strategy-off model's (convert implements the integer rules)."""
    level4 = _build("tiny_resnet", "int8", 4)[0]
    off = _build("tiny_resnet", "int8", None)[0]
    example = zoo.sample_batches("tiny_resnet", 1, 8)[0]
    assert export(level4, example).statistics() == export(off, example).statistics()


def test_level_4_bert_is_bit_exact_int8_and_w8a16():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    bert = transformers.BertModel(config).eval()

    class Embedder(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[2:, 9:] = 0
    batches = [(torch.randint(0, 300, (4, 12), generator=g), mask) for _ in range(4)]
    for setter in ("int8", "w8a16"):
        ConsistencyStrategy.set_consistency_level(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = calibrate(prepare(Embedder(), batches[0], SETTERS[setter], check_result_dir=None), batches[:3])
        ConsistencyStrategy.disable()
        qir = convert(export(model, batches[0]))
        assert _exact_share(model, qir, batches[3:]) == 1.0, setter


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("name", ["tiny_resnet", "multitask"])
def test_from_level_1_validation_sums_exactly_so_w8a16_cnns_are_bit_exact(name, level):
    """float32 cannot hold an int16 x int8 sum: VALIDATION sums the integers exactly from level 1, so a w8a16 CNN
    (no tables) equals its quantized IR at level 1 and 2 already, int32 high-precision heads included."""
    model, qir, held_out = _build(name, "w8a16", level)
    assert _exact_share(model, qir, held_out) == 1.0


@pytest.mark.parametrize("level", [1, 2])
def test_below_level_3_the_pre_export_model_equals_the_quantized_ir(level):
    """The strategy covers convert's arithmetic, not the table conversion: below level 3 the QAT model computes
    the nonlinear ops in float (not bit-exact), the pre_export model (its tables) equals the quantized IR."""
    model, qir, held_out = _build("tiny_transformer", "w8a16", level)
    assert _exact_share(model, qir, held_out) < 1.0
    assert _exact_share(pre_export(model), qir, held_out) == 1.0


def _frozen_qat(model):
    """The QAT forward with its observers paused: the scales of VALIDATION, the training forward's arithmetic."""
    set_fake_quantize(model, FakeQuantState.QAT)
    for module in model.modules():
        if isinstance(module, FakeQuantize):
            module.observe_enabled = False
    return model


def test_level_4_trains_on_the_exact_sums_and_level_3_on_float32():
    exact = {}
    for level in (3, 4):
        model, qir, held_out = _build("tiny_resnet", "w8a16", level)
        _frozen_qat(model)
        exact[level] = _exact_share(model, qir, held_out)
        # the straight-through gradient still reaches the weights
        model.zero_grad()
        out = model(*held_out[0])
        pytree.tree_leaves(out)[0].float().square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert exact[4] == 1.0
    assert exact[3] < 1.0  # float32 sums of int16 x int8 products flip a step now and then


def test_level_3_warns_when_its_tables_cannot_be_built():
    """A level-3 model switched to VALIDATION with uncalibrated activations has no tables (they need the scales):
    a warning names the fake quants and the fix; a fresh prepare (nothing calibrated, QAT) does not warn, nor does
    a model without table ops, and calibrate installs the tables."""
    from quantlens.quantization.pre_export import lut_sites

    ConsistencyStrategy.set_consistency_level(3)
    try:
        example = zoo.sample_batches("tiny_transformer", 1, 4)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            model = prepare(zoo.get_model("tiny_transformer"), example, SETTERS["int8"], check_result_dir=None)
            cnn = prepare(zoo.get_model("tiny_resnet"), zoo.sample_batches("tiny_resnet", 1, 2)[0], SETTERS["int8"],
                          check_result_dir=None)
            set_fake_quantize(cnn, FakeQuantState.VALIDATION)  # no table op: nothing to warn about
        with pytest.warns(UserWarning, match=r"consistency level 3 .* not calibrated .*calibrate\(model, batches\)"):
            set_fake_quantize(model, FakeQuantState.VALIDATION)
        assert lut_sites(model) == []
        calibrate(model, zoo.sample_batches("tiny_transformer", 2, 4))
        assert lut_sites(model)
    finally:
        ConsistencyStrategy.disable()
