"""Issue #24: the remedies as objects (one registry, each answering advisor rules that exist), per-channel weights
as a searched remedy, the search's report and saved result, and ``quantlens fix``."""

import csv
import json
import warnings

import pytest
import torch
from torch import nn

from quantlens.profiler.advisor import RULES, Finding
from quantlens.quantization import DeQuantStub, MinMaxObserver, QConfig, QuantSpec, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter, default_calibration_qconfig_setter
from quantlens.search.remedies import (
    REMEDIES,
    PerChannelWeightQconfigSetter,
    Remedy,
    RemedyKind,
    load_remedies,
    per_tensor_weight_sites,
    register_remedy,
    remedies_for,
    save_remedies,
    search_remedies,
)

PER_TENSOR = QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=None), output=QuantSpec("qint8"))


class WideRow(nn.Module):
    """fc1 -> relu -> fc2 with fc1's first weight row 60x wider than the others: one per-tensor weight scale
    leaves the other rows a few int8 steps. Its bias keeps that channel below zero, so the ReLU's output range
    (per tensor) is the other channels': only the weight's scale suffers."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 8)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            self.fc1.weight[0] *= 60.0
            self.fc1.bias[0] = -1000.0

    def forward(self, x):
        return self.dequant(self.fc2(torch.relu(self.fc1(self.quant(x)))))


PER_TENSOR_SETTER = (ModuleNameQconfigSetter({"fc1": PER_TENSOR, "fc2": PER_TENSOR}),
                     default_calibration_qconfig_setter)


def _data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 16, generator=gen),) for _ in range(3)], torch.randn(128, 16, generator=gen)


def _cosine(model, held_out):
    with torch.no_grad():
        ref = model(held_out)
    def evaluate(prepared):
        with torch.no_grad():
            return float(nn.functional.cosine_similarity(prepared(held_out).double(), ref.double(), dim=1).mean())
    return evaluate


def test_every_remedy_is_declared_once_and_answers_rules_the_advisor_has():
    assert set(REMEDIES) >= {"cross_layer_equalization", "smooth_activations", "per_channel_weights",
                             "bias_correction", "learned_ranges", "range", "int16_activation", "int16_weight", "consistency_level"}
    for remedy in REMEDIES.values():
        assert remedy.findings and remedy.findings <= set(RULES), remedy.name
        assert remedy.latency and remedy.where and isinstance(remedy.qat_keeps, bool)
    finding = Finding("per_tensor_weight_channels", "fc1", "linear", "", "")
    assert {"per_channel_weights", "cross_layer_equalization"} <= {r.name for r in remedies_for(finding)}
    assert [r.name for r in remedies_for("consistency_level")] == ["consistency_level"]
    with pytest.raises(Exception, match="already registered"):
        register_remedy(Remedy("range", RemedyKind.RANGE, "", "", "", False, frozenset()))


def test_per_channel_weights_where_the_setter_has_per_tensor_ones():
    model = WideRow().eval()
    batches, held_out = _data()
    assert per_tensor_weight_sites(model, batches[0], PER_TENSOR_SETTER) == ["fc1", "fc2"]
    assert per_tensor_weight_sites(model, batches[0], default_calibration_qconfig_setter) == []
    evaluate = _cosine(model, held_out)
    values = {}
    for name, setter in (("per_tensor", PER_TENSOR_SETTER),
                         ("fc1", PerChannelWeightQconfigSetter(["fc1"], PER_TENSOR_SETTER))):
        prepared = calibrate(prepare(model, batches[0], setter, check_result_dir=None), batches)
        scale = prepared.fc1.weight_fake_quant.scale
        assert scale.numel() == (1 if name == "per_tensor" else 16)
        values[name] = evaluate(prepared)
    assert 1 - values["fc1"] < (1 - values["per_tensor"]) / 4


def test_the_search_keeps_per_channel_weights_and_its_files_reproduce_it(tmp_path):
    model = WideRow().eval()
    batches, held_out = _data()
    evaluate = _cosine(model, held_out)
    result = search_remedies(model, batches[0], batches, evaluate, 0.9999, base_setter=PER_TENSOR_SETTER,
                             range_sites=1, int16=False, out_dir=tmp_path, progress=False)
    kept = {t.name: t for t in result.trials if t.kept and not t.site}
    assert "per_channel_weights" in result.transforms  # (cross-layer equalization helps here too)
    assert kept["per_channel_weights"].value > kept["per_channel_weights"].before

    rows = list(csv.DictReader((tmp_path / "remedies.csv").open()))
    assert any(r["name"] == "per_channel_weights" and r["kept"] == "True" and float(r["gain"]) > 0 for r in rows)
    page = (tmp_path / "remedies.html").read_text()
    assert "per_channel_weights" in page and "Findings" in page

    save_remedies(result, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "remedies.json").read_text())
    assert saved["transforms"] == list(result.transforms)
    assert saved["weights_file"] == ("remedied_weights.safetensors" if "cross_layer_equalization" in result.transforms
                                     else None)
    again_model, setter = load_remedies(model, tmp_path / "saved", PER_TENSOR_SETTER)
    again = calibrate(prepare(again_model, batches[0], setter, check_result_dir=None), batches)
    assert evaluate(again) == pytest.approx(result.value, abs=1e-12)


def test_saved_weights_come_back_with_the_bias_bias_correction_added(tmp_path):
    """A weight transform is saved as the float model's new state dict; a bias created on a bias-free layer is
    created again on load, and a file from another model is refused."""
    from quantlens.search.remedies import RemedyResult

    model = WideRow().eval()
    model.fc2.bias = None
    changed = WideRow().eval()
    with torch.no_grad():
        changed.fc1.weight.mul_(0.5)
        changed.fc2.bias.fill_(0.25)
    result = RemedyResult(changed, default_calibration_qconfig_setter, 0.9, 0.8, {"fc1": "kl"},
                          transforms=("bias_correction",), target=0.95)
    save_remedies(result, tmp_path)
    loaded, setter = load_remedies(model, tmp_path)
    assert torch.equal(loaded.fc1.weight, changed.fc1.weight) and torch.equal(loaded.fc2.bias, changed.fc2.bias)
    assert model.fc2.bias is None  # the caller's model is not changed
    assert setter.observers["fc1"] is not None
    other = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(Exception, match="another model"):
        load_remedies(other, tmp_path)


def test_weights_tied_across_layers_are_saved_and_come_back_tied(tmp_path):
    """A state dict whose parameters share memory (an embedding tied to its LM head, BART's encoder and decoder
    embeddings) is written, each name with its values, and loading keeps the tie (found on transformers' BART:
    the search ended in safetensors' "Some tensors share memory" and wrote nothing)."""
    from quantlens.search.remedies import RemedyResult

    def tied():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)).eval()
        model[1].weight = model[0].weight
        return model

    changed = tied()
    with torch.no_grad():
        changed[0].weight.mul_(0.5)
    result = RemedyResult(changed, default_calibration_qconfig_setter, 0.9, 0.8, {},
                          transforms=("learned_rounding",), target=0.95)
    save_remedies(result, tmp_path)
    loaded, _ = load_remedies(tied(), tmp_path)
    assert torch.equal(loaded[0].weight, changed[0].weight)
    assert loaded[1].weight is loaded[0].weight


def test_the_saved_search_names_its_consistency_level_and_loading_at_another_warns(tmp_path):
    """The integer model the search measured is the one prepared at its level: remedies.json keeps the level, and
    load_remedies warns where the level set now differs (the figure would belong to another integer model)."""
    from quantlens.errors import QuantLensWarning
    from quantlens.quantization import ConsistencyStrategy

    model = WideRow().eval()
    batches, held_out = _data()
    before = ConsistencyStrategy.get_consistency_level()
    try:
        ConsistencyStrategy.set_consistency_level(0)
        result = search_remedies(model, batches[0], batches, _cosine(model, held_out), 0.9999, range_sites=0,
                                 int16=False, out_dir=tmp_path, progress=False, report=False)
        assert result.consistency_level == 0
        save_remedies(result, tmp_path)
        assert json.loads((tmp_path / "remedies.json").read_text())["consistency_level"] == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_remedies(model, tmp_path)  # the same level: no warning
        ConsistencyStrategy.set_consistency_level(None)
        with pytest.warns(QuantLensWarning, match=r"measured at consistency level 0, and the level set now is off"):
            load_remedies(model, tmp_path)
    finally:
        ConsistencyStrategy.set_consistency_level(before)


def test_quantlens_fix_on_the_template(tmp_path, few_learning_epochs):
    from quantlens.cli import main

    cfg = tmp_path / "cfg.py"
    assert main(["analyze", "--gen", str(cfg)]) == 0
    out = tmp_path / "fix"
    # an accuracy above 1 cannot be reached: exit 1, and the best found is still written
    assert main(["fix", str(cfg), "--target", "1.5", "--range-sites", "1", "--no-int16", "--out", str(out)]) == 1
    saved = json.loads((out / "remedies.json").read_text())
    assert saved["target"] == 1.5 and 0.9 < saved["base_value"] <= 1.0 and saved["value"] >= saved["base_value"]
    assert (out / "remedies.html").is_file() and (out / "remedies.csv").is_file()
    assert main(["fix", str(cfg), "--target", "nan", "--out", str(out)]) == 2


def test_a_fixed_range_keeps_its_range_at_any_dtype():
    """absmax 2.54: int8 scale 2.54 / 127 = 0.02; int16 2.54 / 32767; a bad range is refused where it is written."""
    from quantlens.quantization import FixedRangeObserver

    assert float(FixedRangeObserver("qint8", absmax=2.54).calculate_scale()) == pytest.approx(0.02, rel=1e-6)
    assert float(FixedRangeObserver("qint16", absmax=2.54).calculate_scale()) == pytest.approx(2.54 / 32767,
                                                                                              rel=1e-6)
    with pytest.raises(Exception, match="absmax"):
        FixedRangeObserver("qint8", absmax=float("nan"))


def test_learned_ranges_beat_each_sites_own_best_range(tmp_path):
    """On the MLP whose calibration data has rare outliers, the ranges trained together to the float outputs do
    better than min/max and than the best per-site observer search; given as fixed ranges, prepare reproduces
    them."""
    from quantlens.search.remedies.learned_ranges import FixedRangeQconfigSetter, learn_ranges
    from tests._remedy_models import Outliers
    from tests._remedy_models import _data as outlier_data

    model = Outliers().eval()
    batches, held_out = outlier_data()
    evaluate = _cosine(model, held_out)
    ranges = learn_ranges(model, batches[0], batches)
    assert set(ranges) == {"quant", "relu_0", "relu_1"}  # (fc3 before the DeQuantStub: a high-precision output)
    prepared = calibrate(prepare(model, batches[0], FixedRangeQconfigSetter(ranges), check_result_dir=None), batches)
    got = {p.name: float(prepared._quantlens_state.fq[p.output_fq].scale) * 127
           for p in prepared._quantlens_state.plans.values() if p.name in ranges}
    assert all(got[s] == pytest.approx(a, rel=1e-5) for s, a in ranges.items())
    int8 = evaluate(calibrate(prepare(model, batches[0], check_result_dir=None), batches))
    learned = evaluate(prepared)
    per_site = search_remedies(model, batches[0], batches, evaluate, 1.0, range_sites=3, int16=False,
                               out_dir=tmp_path, progress=False, report=False)
    assert 1 - learned < (1 - int8) / 10
    assert "learned_ranges" in per_site.transforms


def test_learned_rounding_puts_weights_on_their_levels_and_beats_nearest():
    """Per-tensor int8 weights with one wide row (few levels for the others): the learned rounding's weights are
    integer multiples of the scale prepare finds for them (exact), and on held-out data the output error is below
    nearest rounding's (measured: 1 - cosine 0.032 against 0.040)."""
    from quantlens.search.remedies.learned_rounding import learn_rounding

    qconfig = QConfig(weight=QuantSpec("qint8", MinMaxObserver, ch_axis=None), output=QuantSpec("qint16"))
    setter = (ModuleNameQconfigSetter({"fc1": qconfig, "fc2": qconfig}), default_calibration_qconfig_setter)
    model = WideRow().eval()
    batches, held_out = _data()
    evaluate = _cosine(model, held_out)
    nearest = evaluate(calibrate(prepare(model, batches[0], setter, check_result_dir=None), batches))
    rounded, layers = learn_rounding(model, batches[0], batches, setter)
    assert layers == ["fc1", "fc2"] and torch.equal(model.fc1.weight, WideRow().fc1.weight)  # a copy
    prepared = calibrate(prepare(rounded, batches[0], setter, check_result_dir=None), batches)
    for name in layers:
        qat = prepared.get_submodule(name)
        w = qat.weight.detach()
        assert torch.equal(qat.weight_fake_quant(w), w)  # on the levels: prepare quantizes them exactly
        assert not torch.equal(w, getattr(model, name).weight.detach())
    assert 1 - evaluate(prepared) < 0.9 * (1 - nearest)


def test_learned_rounding_on_a_model_whose_forward_reads_a_layers_weight():
    """The rounding's ops run outside the model's forward (transformers' ViT reads its patch projection's weight
    dtype in its own forward: the rounding's sigmoid was traced as an op site prepare never saw)."""
    from quantlens.search.remedies.learned_rounding import learn_rounding

    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x.to(self.proj.weight.dtype))

    torch.manual_seed(0)
    model = ReadsWeight().eval()
    batches = [(torch.randn(4, 8),) for _ in range(2)]
    learned, layers = learn_rounding(model, batches[0], batches, epochs=2)
    assert layers == ["proj"] and not torch.equal(learned.proj.weight, model.proj.weight)


def test_a_setter_key_that_matches_no_op_site_is_warned_with_the_closest_names():
    """A typo in a setter's op site name used to be dropped silently (issue #26): prepare warns, naming the
    closest op sites, for every setter that takes names."""
    from quantlens.search import MixedPrecisionQconfigSetter
    from quantlens.search.remedies import ObserverQconfigSetter

    model = WideRow().eval()
    batches, _ = _data()
    for setter in (ModuleNameQconfigSetter({"fc22": PER_TENSOR}), MixedPrecisionQconfigSetter(["relu_00"]),
                   ObserverQconfigSetter({"fc_1": "kl"}), PerChannelWeightQconfigSetter(["fc11"])):
        with pytest.warns(UserWarning, match=r"matched no op site; its setting was not applied\. Closest op site "
                                             r"names: \['(fc2|relu_0|fc1)'"):
            prepare(model, batches[0], (setter, default_calibration_qconfig_setter), check_result_dir=None)


def test_mixed_precision_progress_knows_its_base_setter_by_content(tmp_path):
    """Issue #26 point 1: the mixed-precision progress file keyed the base setter by its name, so another mapping
    of a ModuleNameQconfigSetter (the same name) replayed the old measurements."""
    from quantlens.search import search_mixed_precision

    model = WideRow().eval()
    batches, held_out = _data()
    calls = []
    evaluate = _cosine(model, held_out)

    def counting(prepared):
        calls.append(1)
        return evaluate(prepared)

    def search(site):
        setter = (ModuleNameQconfigSetter({site: PER_TENSOR}), default_calibration_qconfig_setter)
        return search_mixed_precision(model, batches[0], batches, counting, 0.9999, base_setter=setter, budget=1,
                                      ranking=["fc1", "relu_0", "fc2"], out_dir=tmp_path, progress=False)

    search("fc1")
    first = len(calls)
    search("fc1")
    assert len(calls) == first  # the same setter: replayed
    search("fc2")
    assert len(calls) > first  # another mapping under the same name: measured again


def test_fix_says_when_the_deployed_model_cannot_be_checked(tmp_path, capsys, few_learning_epochs):
    """The template's own metric runs on the quantized IR (the deployed value is printed); a metric that only reads
    a prepared model fails there: the search ends on its fake-quant value and says why the deployed model was not
    checked, naming the error."""
    from quantlens.cli import main

    cfg = tmp_path / "cfg.py"
    assert main(["analyze", "--gen", str(cfg)]) == 0
    args = ["--target", "0.5", "--range-sites", "0", "--no-int16"]
    assert main(["fix", str(cfg), *args, "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "deployed quantized IR" in printed and "not checked" not in printed
    assert "models prepared at consistency level off" in printed  # (without --qat: the strategy as it was)
    assert json.loads((tmp_path / "a" / "remedies.json").read_text())["deployed_value"] > 0.5
    cfg.write_text(cfg.read_text() + "\n\n_evaluate = evaluate\n\n\ndef evaluate(model):\n"
                   "    if not hasattr(model, '_quantlens_state'):\n"
                   "        raise AttributeError('this metric reads a prepared model only')\n"
                   "    return _evaluate(model)\n")
    assert main(["fix", str(cfg), *args, "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert "the deployed model was not checked: AttributeError: this metric reads a prepared model" in " ".join(
        printed.split())
    assert json.loads((tmp_path / "b" / "remedies.json").read_text())["deployed_value"] is None
