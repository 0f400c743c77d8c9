"""joint_sensitivity(): one op at a time (the quantizers its integer kernel sees, so its int32 bias is quantized),
pairs with their interaction, and the share of the model's error the top rows explain.

Each planted fault is one that sensitivity() (one quantizer at a time) does not rank first."""

import math

import pytest
import torch
from torch import nn

from quantlens import QuantLensError
from quantlens.compiler import convert, export
from quantlens.march import QuantDType
from quantlens.profiler import QuantAnalysis
from quantlens.profiler import sensitivity as sensitivity_module
from quantlens.profiler.ablation import ir_cache, torch_cache
from quantlens.quantization import (
    DeQuantStub,
    FixedScaleObserver,
    MinMaxObserver,
    QConfig,
    QuantSpec,
    QuantStub,
    prepare,
)
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization.fake_quantize import int32_bias
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import (
    ModuleNameQconfigSetter,
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.zoo import example_inputs, get_model, sample_batches
from quantlens.zoo.faults import FAULTS


def _fixed(scale, weight=False):
    """A qconfig whose output fake quant has a fixed scale (a planted grid)."""
    return QConfig(weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0) if weight else None,
                   output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=scale)))


def _keys(rows):
    return [(r.op_name, r.sensitive_type) for r in rows]


# -- (a) an int32 bias that overflows --------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.relu = nn.ReLU()
        self.dq = DeQuantStub()

    def forward(self, x):
        return self.dq(self.relu(self.conv2(self.conv(self.q(x)))))


def _conv_net(prune: bool, relu_scale: float):
    torch.manual_seed(0)
    model = ConvNet().eval()
    if prune:
        with torch.no_grad():
            model.conv.weight[1].zero_()  # a pruned output channel: weight scale min_scale (2^-24) there
            model.conv.bias[1] = 5.0
    example = (torch.randn(2, 3, 8, 8),)
    calib = prepare(model, example, (ModuleNameQconfigSetter({"relu": _fixed(relu_scale, weight=True)}),
                                     default_calibration_qconfig_setter), check_result_dir=None)
    calibrate_model(calib, [(torch.randn(2, 3, 8, 8),) for _ in range(3)])
    return model, calib, example


@pytest.fixture(scope="module")
def bias_overflow():
    # relu's grid is coarse (0.08): an ordinary, visible rounding error that outranks the conv's rows one by one
    return _conv_net(prune=True, relu_scale=0.08)


def test_bias_overflow_found_first_by_op_level(bias_overflow, tmp_path):
    """Channel 1 of ``conv`` is pruned (zero weights) but keeps a bias of 5: its per-channel weight scale is
    min_scale, so the int32 bias step ``s_in * s_w`` is ~1e-9 and 5 saturates at int32 (~2.5). The bias is
    quantized only when the input's fake quant (``q``'s output) and the weight's are both on: no single quantizer
    shows it, the op row of ``conv`` (both on, as the kernel runs) does."""
    model, calib, example = bias_overflow
    state = calib._quantlens_state
    # the mechanism: with both fake quants on, the bias the kernel adds is clipped far below 5
    clipped = int32_bias(calib.conv.bias.detach(), state.fq["q|out"], calib.conv.weight_fake_quant)
    assert float(clipped[1]) < 4.0 and torch.allclose(clipped[[0, 2, 3]], calib.conv.bias[[0, 2, 3]], atol=1e-3)

    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    plain = qa.sensitivity()[0]
    assert plain[0].op_name != "conv" and _keys(plain)[0] == ("relu", "activation")  # the old ranking misses it
    joint = qa.joint_sensitivity()
    table = joint[0]
    assert _keys(table.quantizer_rows) == _keys(plain)  # the quantizer rows are sensitivity()'s, value for value
    assert [r.value for r in table.quantizer_rows] == [r.value for r in plain]
    assert [(r.op_name, r.value) for r in joint.sensitivity[0]] == [(r.op_name, r.value) for r in plain]
    top = table.op_rows[0]
    assert (top.op_name, top.sensitive_type) == ("conv", "op")
    assert set(top.members) == {"q:activation", "conv:activation", "conv:weight"}
    assert top.value > 10 * plain[0].value and top.share > 0.9
    assert max(r.share for r in table.quantizer_rows) < 0.1  # one quantizer at a time explains almost nothing
    assert not table.small_share and table.warning == ""  # the op row explains the error
    # the pair of the input's and the weight's quantizer shows the same cause as an interaction
    pair = next(r for r in table.pair_rows if set(r.members) == {"q:activation", "conv:weight"})
    assert pair.interaction > 0.9 * pair.value
    text = (tmp_path / "output_0_L1_joint_sensitivity.txt").read_text()
    assert "== One op at a time" in text and "q:activation, conv:activation, conv:weight" in text
    saved = torch.load(tmp_path / "output_0_L1_joint_sensitivity.pt", weights_only=True)
    assert saved["op_rows"][0]["op_name"] == "conv" and saved["op_share"] == pytest.approx(table.op_share)


# -- (b) two changes, each harmless, severe together -----------------------------------------------------------
@pytest.fixture(scope="module")
def interaction():
    """The planted two-change interaction of the fault suite (``quantlens.zoo.faults.unseen``): two linear
    branches ``la``, ``lb`` whose int8 weight roundings each lift a pre-ReLU sum sitting at ``-0.9 δ`` by ``δ``
    (alone to ``+0.1 δ``, together to ``+1.1 δ``), and a side branch ``ld`` with a coarse output grid that
    outranks each rounding alone but not the two together."""
    case = FAULTS["fq_two_change_interaction"].build()
    return case.baseline, case.analysis, case.bad_case


def test_two_change_interaction_found_first_by_pairs(interaction, tmp_path):
    model, calib, example = interaction
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    plain = qa.sensitivity()[0]
    assert _keys(plain)[0] == ("ld", "activation")  # the old ranking puts the side branch first
    table = qa.joint_sensitivity(pairs=6)[0]
    assert table.op_rows[0].op_name in ("ld", "add_1")  # no op holds both roundings
    top = table.pair_rows[0]
    assert {"la:weight", "lb:weight"} <= set(top.members)
    assert top.interaction > 0 and top.value > 5 * max(top.value_first, top.value_second)
    exact = next(r for r in table.pair_rows if set(r.members) == {"la:weight", "lb:weight"})
    # L1 with an all-off value of 0: interaction = joint - first - second
    assert table.reference == 0.0
    assert exact.interaction == pytest.approx(exact.value - exact.value_first - exact.value_second)
    assert exact.share > 0.9


def test_interaction_is_relative_to_the_all_off_value(interaction, tmp_path):
    """Cosine: the all-off value is 1 and lower is worse, so effect = r - value and the interaction is
    ``(r - joint) - (r - first) - (r - second)``; the same pair still comes first, with a positive interaction."""
    model, calib, example = interaction
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    table = qa.joint_sensitivity(metric="Cosine", pairs=4)[0]
    r = table.reference
    assert r == pytest.approx(1.0, abs=1e-9)
    top = table.pair_rows[0]
    assert {"la:weight", "lb:weight"} <= set(top.members)
    assert top.interaction == pytest.approx((r - top.value) - (r - top.value_first) - (r - top.value_second))
    assert top.interaction > 0
    assert table.total_effect == pytest.approx(r - table.total)


# -- (c) the explained-share flag ------------------------------------------------------------------------------
def test_share_flag_fires_on_the_interaction(interaction, tmp_path):
    model, calib, example = interaction
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    table = qa.joint_sensitivity()[0]
    assert table.small_share and table.explained_share < 0.5
    assert table.explained_share == max(table.quantizer_share, table.op_share)
    assert table.pair_share > 0.9
    assert "explains only" in table.warning and "see the pair rows" in table.warning
    assert "la:weight" in table.warning and "lb:weight" in table.warning  # names the top pair
    assert "WARNING: the best single row" in (tmp_path / "output_0_L1_joint_sensitivity.txt").read_text()
    # without pairs the flag still fires, and says none ran
    quiet = qa.joint_sensitivity(pairs=0)[0]
    assert quiet.small_share and quiet.pair_rows == () and "pass pairs=k > 0" in quiet.warning
    with pytest.raises(QuantLensError, match="pairs must be an int >= 0"):
        qa.joint_sensitivity(pairs=-1)


def test_share_flag_quiet_on_a_single_cause(tmp_path):
    """One planted fault (relu's fixed grid 0.001 clips its outputs at 0.127): one quantizer explains it."""
    model, calib, example = _conv_net(prune=False, relu_scale=0.001)
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    table = qa.joint_sensitivity(pairs=2)[0]
    assert _keys(table.quantizer_rows)[0] == ("relu", "activation")
    assert table.quantizer_share > 0.9 and not table.small_share and table.warning == ""


# -- the cache, the other analysis types ----------------------------------------------------------------------
def _cached_and_full(monkeypatch, tmp_path, baseline, analysis, kind, example, cache_cls):
    """(cached rows, full-forward rows, the cached table, forwards with several quantizers on from the cache)."""
    shared = []
    original = cache_cls.run_shared

    def counting(self, qs):
        shared.append(len(qs))
        return original(self, qs)

    monkeypatch.setattr(cache_cls, "run_shared", counting)

    def rows(folder):
        qa = QuantAnalysis(baseline, analysis, kind, out_dir=tmp_path / folder, progress=False)
        qa.set_bad_case(example)
        t = qa.joint_sensitivity(pairs=2)[0]
        return [(r.op_name, r.sensitive_type, r.members, r.value) for r in
                t.quantizer_rows + t.op_rows + t.pair_rows], t

    cached, table = rows("cached")
    used = len(shared)
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", False)
    full, _ = rows("full")
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", True)
    assert [c[:3] for c in cached] == [f[:3] for f in full]
    assert all(math.isclose(c[3], f[3], rel_tol=1e-9, abs_tol=1e-12) for c, f in zip(cached, full))
    return table, used


def test_cached_joint_forwards_equal_full_forwards(monkeypatch, tmp_path):
    """Op and pair forwards from the ablation cache (several quantizers on) give the values of full forwards,
    on a model with fused groups, a residual add and a side branch."""
    name = "tiny_resnet"
    model = get_model(name)
    calib = prepare(model, example_inputs(name), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 2, 4))
    table, used = _cached_and_full(monkeypatch, tmp_path, model, calib, "fake_quant", example_inputs(name, 2),
                                   torch_cache.CachedAblations)
    # one cached forward per distinct set of several quantizers (a pair whose set is an op's reuses its value)
    assert used == len({frozenset(r.members) for r in table.op_rows + table.pair_rows if len(r.members) > 1}) > 10
    unit = next(r for r in table.op_rows if r.op_name == "layer1.conv1")
    # a fused conv-bn-relu: its weight, the group's output quantizer, and the producer's output quantizer
    assert set(unit.members) == {"stem_relu:activation", "layer1.conv1:weight", "layer1.relu1:activation"}
    # pairs are of candidates with no quantizer in common (their members would repeat one)
    assert table.pair_rows and all(len(set(r.members)) == len(r.members) for r in table.pair_rows)


def test_pre_export_op_rows_are_the_quantizer_rows(tmp_path):
    name = "tiny_transformer"
    model = get_model(name)
    qat = prepare(model, example_inputs(name), calibration_8bit_weight_16bit_act_qconfig_setter,
                  check_result_dir=None)
    calibrate_model(qat, sample_batches(name, 2, 4))
    qa = QuantAnalysis(qat, pre_export(qat), "pre_export", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs(name, 2))
    table = qa.joint_sensitivity(pairs=2)[0]
    assert [(r.op_name, r.value) for r in table.quantizer_rows] == [(r.op_name, r.value) for r in table.op_rows]
    assert all(r.sensitive_type == "lut" for r in table.quantizer_rows)
    assert all(r.sensitive_type == "op" and len(r.members) == 1 for r in table.op_rows)
    assert "one quantizer per op" in table.op_note
    assert table.pair_rows and all(r.sensitive_type == "pair" for r in table.pair_rows)


def test_convert_pairs_from_the_ir_cache(monkeypatch, tmp_path):
    """convert (qat IR vs quantized IR): one quantizer per IR site, so op rows are the quantizer rows; the pairs run
    from the IR cache with two sites replaced, and equal full runs."""
    name = "tiny_resnet"
    example = example_inputs(name)
    calib = prepare(get_model(name), example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 2, 8))
    qat_ir = export(pre_export(calib), example)
    table, used = _cached_and_full(monkeypatch, tmp_path, qat_ir, convert(qat_ir), "convert", example,
                                   ir_cache.IRCachedAblations)
    assert used == len(table.pair_rows) > 0
    assert [(r.op_name, r.value) for r in table.quantizer_rows] == [(r.op_name, r.value) for r in table.op_rows]
    assert "convert has one quantizer per op" in table.op_note
