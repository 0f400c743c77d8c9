"""Issue #43 (searches): a resumed search replays only what was measured with the same evaluate and evaluation
data; a user's evaluate that fails, or returns something other than one finite number, is an error naming it
and the configuration; remedies.json names its float model; damaged progress files are set aside; an output
folder that cannot be written and a hand-edited remedies.json are refused in words."""

import json
import math
import os
import textwrap

import pytest
import torch

from quantlens.errors import QuantLensError
from quantlens.search import search_mixed_precision
from quantlens.search.evaluation import EvaluateError
from quantlens.search.remedies import RemedyResult, load_remedies, save_remedies, search_remedies
from quantlens.search.remedies.search import PROGRESS_FILE as REMEDIES_PROGRESS
from tests._remedy_models import Outliers, _cosine, _data
from tests.test_cli import ql

MP_PROGRESS = "mixed_precision_progress.json"


@pytest.fixture(autouse=True)
def no_model_remedies(monkeypatch):
    """The whole-model remedies train for seconds and decide nothing here: the searches run without them."""
    monkeypatch.setattr("quantlens.search.remedies.search.model_remedies", lambda qat=False: ())


@pytest.fixture(scope="module")
def setup():
    model = Outliers().eval()
    batches, held_out = _data()
    return model, batches, held_out


def _ql(*args):
    run = ql(*args)
    return run.returncode, run.stdout, run.stderr


def _counting(evaluate, calls):
    def counted(prepared):
        calls.append(1)
        return evaluate(prepared)
    return counted


def _mp(setup, evaluate, out, **kw):
    model, batches, _ = setup
    cands = ["quant", ("fc3", "weight")]
    return search_mixed_precision(model, batches[0], batches, evaluate, 0.99999, budget=1, ranking=cands,
                                  candidates=cands, tries=2, out_dir=out, progress=False, **kw)


def _remedies(setup, evaluate, out):
    model, batches, _ = setup
    return search_remedies(model, batches[0], batches[:2], evaluate, 2.0, range_sites=0, int16=False,
                           out_dir=out, progress=False, report=False)


# -- the resume key ------------------------------------------------------------------------------------------------

def test_mixed_precision_resume_is_keyed_on_evaluate_and_its_data(setup, tmp_path):
    model, _, held_out = setup
    calls = []
    _mp(setup, _counting(_cosine(model, held_out), calls), tmp_path)
    first = len(calls)
    _mp(setup, _counting(_cosine(model, held_out), calls), tmp_path)
    assert len(calls) == first  # the same evaluate on the same data: replayed
    with pytest.warns(UserWarning, match="other inputs"):
        other = _mp(setup, _counting(_cosine(model, held_out[:64] * 2), calls), tmp_path)
    assert len(calls) == 2 * first  # other evaluation data: every configuration measured again
    fresh = _mp(setup, _cosine(model, held_out[:64] * 2), tmp_path / "fresh")
    assert other.base_metric == fresh.base_metric
    calls.clear()
    with pytest.warns(UserWarning, match="other inputs"):
        _mp(setup, _counting(_cosine(model, held_out[:64] * 2), calls), tmp_path, evaluation_key="other data")
    assert len(calls) == first


def test_fix_again_with_other_evaluation_data_measures_again(tmp_path):
    """The issue's run: quantlens fix twice into one --out, the CONFIG's evaluation_data() changed in between."""
    cfg = tmp_path / "cfg.py"
    out = tmp_path / "fix"
    values = []
    for seed, folder in ((1, out), (2, out), (2, tmp_path / "fresh")):
        cfg.write_text(_CONFIG.format(seed=seed, evaluate=""))
        code, _, err = _ql("fix", cfg, "--target", "2", "--range-sites", "0", "--no-int16", "--out", folder)
        assert code == 1, err
        values.append(json.loads((folder / "remedies.json").read_text())["base_value"])
    assert values[1] != values[0] and values[1] == values[2]


_CONFIG = textwrap.dedent('''
    import torch
    from torch import nn
    from quantlens.quantization import DeQuantStub, QuantStub


    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.dequant(self.fc2(torch.relu(self.fc1(self.quant(x)))))


    def float_model():
        torch.manual_seed(0)
        return M().eval()


    def example_inputs():
        return (torch.randn(8, 8, generator=torch.Generator().manual_seed(3)),)


    def calibration_data():
        gen = torch.Generator().manual_seed(4)
        return [(torch.randn(16, 8, generator=gen) * 3,) for _ in range(2)]


    def evaluation_data():
        gen = torch.Generator().manual_seed({seed})
        return [(torch.randn(32, 8, generator=gen) * 3,)]
    {evaluate}
''')


# -- what evaluate returns -----------------------------------------------------------------------------------------

BAD_VALUES = {
    "inf": (lambda p: math.inf, "returned inf"),
    "nan": (lambda p: float("nan"), "returned nan"),
    "tensor": (lambda p: torch.ones(4), r"returned a tensor of 4 elements \(shape \(4,\)\)"),
    "string": (lambda p: "0.9", r"returned '0.9' \(str\), not a number"),
    "none": (lambda p: None, r"returned None \(NoneType\), not a number"),
    "raises": (lambda p: {}["accuracy"], "raised KeyError: 'accuracy'"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_evaluate_is_an_error_naming_it_and_the_configuration(setup, tmp_path, case):
    evaluate, words = BAD_VALUES[case]
    with pytest.raises(EvaluateError, match=rf"evaluate\(prepared\) {words} on the configuration 'the base setter"):
        _mp(setup, evaluate, tmp_path / "mp")
    with pytest.raises(EvaluateError, match=rf"evaluate\(prepared\) {words} on the configuration 'base' of the "
                                            "remedy search"):
        _remedies(setup, evaluate, tmp_path / "remedies")


@pytest.mark.parametrize("body, words", [
    ("return float('inf')", "returned inf"),
    ("return float('nan')", "returned nan"),
    ("raise RuntimeError('labels missing')", "raised RuntimeError: labels missing"),
    ("return torch.ones(4)", "returned a tensor of 4 elements (shape (4,))"),
])
def test_fix_with_a_bad_evaluate_exits_2_naming_the_configs_evaluate(tmp_path, body, words):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(_CONFIG.format(seed=1, evaluate=f"\n\ndef evaluate(model):\n    {body}\n"))
    code, out, err = _ql("fix", cfg, "--target", "0.5", "--range-sites", "0", "--no-int16", "--out", tmp_path / "o")
    text = " ".join((out + err).split())
    assert code == 2, text
    assert f"CONFIG {cfg}: its evaluate(model) {words} on the configuration 'base' of the remedy search" in text
    assert "reached" not in text and "Traceback" not in text


# -- remedies.json names its model ---------------------------------------------------------------------------------

def test_load_remedies_refuses_another_float_model(setup, tmp_path):
    model, _, held_out = setup
    save_remedies(_remedies(setup, _cosine(model, held_out), tmp_path), tmp_path)
    loaded, _ = load_remedies(model, tmp_path)  # the model the search ran on
    assert torch.equal(loaded.fc1.weight, model.fc1.weight)
    other = Outliers().eval()
    with torch.no_grad():
        other.fc1.weight.mul_(1.5)
    with pytest.raises(QuantLensError, match=r"remedies\.json was written by a search on another float model"):
        load_remedies(other, tmp_path)
    assert json.loads((tmp_path / "remedies.json").read_text())["model_digest"]


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(observers=[["fc1", "kl"]]), "field 'observers' is a list where an object mapping op "
                                                    "sites to observer names was expected"),
    (lambda d: d.pop("transforms"), "has no field 'transforms' (a list of remedy names was expected)"),
    (lambda d: d.update(int16=[["fc1", "int4"]]), "field 'int16' is a list where a list of [op site"),
])
def test_a_hand_edited_remedies_file_is_refused_in_words(setup, tmp_path, edit, words):
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    save_remedies(RemedyResult(setup[0], default_calibration_qconfig_setter, 0.9, 0.8, {"fc1": "kl"}), tmp_path)
    path = tmp_path / "remedies.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(QuantLensError) as info:
        load_remedies(setup[0], tmp_path)
    assert str(path) in str(info.value) and words in str(info.value)


# -- damaged progress files ----------------------------------------------------------------------------------------

def _damage(text, measured):
    """The progress file's text damaged as ``how``: not JSON, a list, or a field of another type."""
    return {
        "not json": lambda: text[: len(text) // 2],
        "a list": lambda: "[1, 2]",
        "a string value": lambda: json.dumps({**json.loads(text), "measurements": {k: "high" for k in measured}}),
        "a null value": lambda: json.dumps({**json.loads(text), "measurements": {k: None for k in measured}}),
    }


@pytest.mark.parametrize("how", ["not json", "a list", "a string value", "a null value"])
@pytest.mark.parametrize("search", ["remedies", "mixed precision"])
def test_a_damaged_progress_file_is_set_aside(setup, tmp_path, search, how):
    model, _, held_out = setup
    run = (lambda out: _remedies(setup, _cosine(model, held_out), out)) if search == "remedies" else \
        (lambda out: _mp(setup, _cosine(model, held_out), out))
    name = REMEDIES_PROGRESS if search == "remedies" else MP_PROGRESS
    first = run(tmp_path)
    path = tmp_path / name
    text = path.read_text()
    damaged = _damage(text, json.loads(text)["measurements"])[how]()
    path.write_text(damaged)
    with pytest.warns(UserWarning, match=rf"{name} is damaged .*; set aside as {name}\.damaged and the search "
                                         "starts afresh"):
        again = run(tmp_path)
    assert (tmp_path / f"{name}.damaged").read_text() == damaged  # kept, not deleted
    assert json.loads(path.read_text())["measurements"]  # written afresh
    assert (again.value, again.base_value) == (first.value, first.base_value) if search == "remedies" else \
        (again.chosen, again.metric) == (first.chosen, first.metric)


# -- the output folder ---------------------------------------------------------------------------------------------

def test_an_out_dir_that_cannot_be_written_is_refused_before_any_work(setup, tmp_path, monkeypatch):
    calls = []
    evaluate = _counting(lambda p: 1.0, calls)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(QuantLensError, match=r"search_mixed_precision: cannot write its files into out_dir: .*a_file "
                                             "exists and is not a folder"):
        _mp(setup, evaluate, a_file)
    with pytest.raises(QuantLensError, match="search_remedies: cannot write its files into out_dir: .*a_file exists "
                                             "and is not a folder"):
        _remedies(setup, evaluate, a_file)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    real_access = os.access
    # root writes into a mode-0500 folder anyway: the folder is made read-only as the check sees it
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(read_only) else real_access(p, mode))
    with pytest.raises(QuantLensError, match=r"search_remedies: cannot write its files into out_dir: .*read_only is "
                                             "not writable"):
        _remedies(setup, evaluate, read_only)
    assert not calls and not list(read_only.iterdir())


def test_fix_refuses_an_out_that_is_a_file(tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(_CONFIG.format(seed=1, evaluate=""))
    (tmp_path / "o").write_text("x")
    code, out, err = _ql("fix", cfg, "--target", "0.5", "--out", tmp_path / "o")
    text = " ".join((out + err).split())
    assert code == 2 and f"--out {tmp_path / 'o'}: {tmp_path / 'o'} exists and is not a folder" in text, text
    assert not (tmp_path / "o.profiler").exists() and "Traceback" not in text
