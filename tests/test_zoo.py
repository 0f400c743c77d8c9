"""The bundled model zoo: shapes, determinism, task control flow, post-processing and the trained digits CNN."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest
import torch

from quantlens import zoo
from quantlens.errors import QuantLensError
from quantlens.sites.stubs import DeQuantStub, QuantStub
from quantlens.zoo import digits as digits_mod

# name -> {output key (None for a plain tensor): (shape at batch 2, dtype)}
EXPECTED = {
    "digits_cnn": {None: ((2, 10), torch.float32)},
    "tiny_resnet": {None: ((2, 10), torch.float32)},
    "tiny_transformer": {None: ((2, 4), torch.float32)},
    "multitask": {"cls": ((2, 5), torch.float32), "reg": ((2, 2), torch.float32)},
    "detector_postprocess": {
        "scores": ((2, 5), torch.float32),
        "boxes": ((2, 5, 4), torch.float32),
        "labels": ((2, 5), torch.int64),
    },
}


def _as_dict(out):
    return {None: out} if isinstance(out, torch.Tensor) else out


def _assert_same(a, b):
    """Exact equality of nested tuples/lists/dicts of tensors and plain values."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_registry_names():
    assert zoo.list_models() == list(EXPECTED)
    assert set(zoo.ZOO) == set(EXPECTED)
    for name, entry in zoo.ZOO.items():
        assert entry.name == name and entry.description


@pytest.mark.parametrize("name", list(EXPECTED))
def test_runs_on_example_inputs(name):
    model = zoo.get_model(name)
    assert not model.training
    args = zoo.example_inputs(name, batch_size=2)
    assert isinstance(args, tuple)
    with torch.no_grad():
        out = _as_dict(model(*args))
    assert set(out) == set(EXPECTED[name])
    for key, (shape, dtype) in EXPECTED[name].items():
        assert tuple(out[key].shape) == shape, key
        assert out[key].dtype == dtype, key
        if dtype.is_floating_point:
            assert torch.isfinite(out[key]).all(), key


@pytest.mark.parametrize("name", list(EXPECTED))
def test_deterministic_across_builds(name):
    rng_before = torch.get_rng_state()
    m1, m2 = zoo.get_model(name), zoo.get_model(name)
    # Building must not consume the caller's global RNG stream.
    assert torch.equal(torch.get_rng_state(), rng_before)
    _assert_same(dict(m1.state_dict()), dict(m2.state_dict()))
    args1, args2 = zoo.example_inputs(name), zoo.example_inputs(name)
    _assert_same(args1, args2)
    with torch.no_grad():
        _assert_same(m1(*args1), m2(*args2))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_deployment_stubs_present(name):
    kinds = {type(m) for m in zoo.get_model(name).modules()}
    assert DeQuantStub in kinds
    # The transformer takes integer token ids, which need no QuantStub; every float-input model has one.
    assert (QuantStub in kinds) == (name != "tiny_transformer")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_sample_batches(name):
    batches = zoo.sample_batches(name, num_batches=3, batch_size=4)
    assert len(batches) == 3
    _assert_same(batches, zoo.sample_batches(name, num_batches=3, batch_size=4))
    first = lambda b: b[0]["image"] if isinstance(b[0], dict) else b[0]  # noqa: E731
    assert tuple(first(batches[0]).shape)[0] == 4
    assert not torch.equal(first(batches[0]), first(batches[1]))
    assert not torch.equal(first(batches[0])[:2], first(zoo.example_inputs(name, 2)))
    model = zoo.get_model(name)
    with torch.no_grad():
        for batch in batches:
            model(*batch)


def test_digits_batches_are_real_data():
    data = zoo.load_digits_data()
    (x,) = zoo.sample_batches("digits_cnn", num_batches=1, batch_size=8)[0]
    assert torch.equal(x, data.x_train[:8])
    (ex,) = zoo.example_inputs("digits_cnn", batch_size=3)
    assert torch.equal(ex, data.x_test[:3])


def test_example_token_ids_in_range():
    (ids,) = zoo.example_inputs("tiny_transformer", batch_size=2)
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (2, 16)
    assert int(ids.min()) >= 0 and int(ids.max()) < 64


def test_unknown_model_name():
    for call in (zoo.get_model, zoo.example_inputs, lambda n: zoo.sample_batches(n, 1, 1)):
        with pytest.raises(QuantLensError, match="tiny_resnet"):
            call("resnet9000")


def test_bad_batch_size():
    with pytest.raises(QuantLensError):
        zoo.example_inputs("tiny_resnet", batch_size=0)


def test_multitask_runs_only_requested_heads():
    model = zoo.get_model("multitask")
    (inputs, task) = zoo.example_inputs("multitask")
    assert task == ["cls", "reg"]
    with torch.no_grad():
        both = model(inputs, ["cls", "reg"])
        assert set(model(inputs, ["cls"])) == {"cls"}
        assert set(model(inputs, ["reg"])) == {"reg"}
        assert model(inputs, []) == {}
        # A head's value does not depend on whether the other head ran.
        assert torch.equal(model(inputs, ["cls"])["cls"], both["cls"])
    with pytest.raises(ValueError, match="cls"):
        model(inputs, ["cls", "segmentation"])


def test_detector_postprocess():
    model = zoo.get_model("detector_postprocess")
    (x,) = zoo.example_inputs("detector_postprocess")
    with torch.no_grad():
        out = model(x)
        logits, boxes = model.head_only()(x)
    assert out["labels"].dtype == torch.int64
    assert (out["labels"] >= 0).all() and (out["labels"] < 3).all()
    scores = out["scores"]
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    assert ((scores > 0) & (scores < 1)).all()
    # Raw head: 16 anchors, 3 classes; the top score is the best anchor's best class probability.
    assert tuple(logits.shape) == (2, 16, 3) and tuple(boxes.shape) == (2, 16, 4)
    best, _ = torch.sigmoid(logits).max(dim=-1)
    assert torch.allclose(scores[:, 0], best.max(dim=1).values)
    raw = zoo.DetectorWithPostProcess(post_process=False)
    raw.load_state_dict(model.state_dict())
    with torch.no_grad():
        _assert_same(raw.eval()(x), (logits, boxes))


def test_digits_data_split():
    data = zoo.load_digits_data()
    assert tuple(data.x_train.shape) == (1437, 1, 8, 8) and tuple(data.x_test.shape) == (360, 1, 8, 8)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    assert float(data.x_train.min()) == -1.0 and float(data.x_train.max()) == 1.0
    assert set(data.y_test.tolist()) == set(range(10))
    _assert_same(vars(data), vars(zoo.load_digits_data()))


def test_pretrained_digits_accuracy():
    data = zoo.load_digits_data()
    model = zoo.get_model("digits_cnn")
    acc = zoo.evaluate_accuracy(model, data.x_test, data.y_test)
    assert isinstance(acc, float) and 0.0 <= acc <= 100.0
    assert acc >= 97.0
    assert not model.training


def test_weights_file_is_small_and_complete():
    resource = importlib.resources.files("quantlens.zoo").joinpath("weights", "digits_cnn.safetensors")
    with importlib.resources.as_file(resource) as path:
        assert Path(path).stat().st_size < 200_000
    from safetensors.torch import load_file

    with importlib.resources.as_file(resource) as path:
        keys = set(load_file(str(path)))
    assert {"bn1.running_mean", "bn1.running_var", "bn3.running_var", "fc.weight"} <= keys


def test_missing_weights_error(monkeypatch, tmp_path):
    monkeypatch.setattr(digits_mod, "_weights_resource", lambda: tmp_path / "nope.safetensors")
    with pytest.raises(QuantLensError, match="--retrain"):
        zoo.digits_cnn(pretrained=True)
    assert isinstance(zoo.digits_cnn(pretrained=False), zoo.DigitsCNN)


def test_training_is_deterministic():
    # One epoch keeps this fast; the full 30-epoch run is `python -m quantlens.zoo.digits --retrain`.
    threads = torch.get_num_threads()
    a = zoo.train_digits_cnn(epochs=1, seed=0)
    b = zoo.train_digits_cnn(epochs=1, seed=0)
    assert torch.get_num_threads() == threads
    _assert_same(dict(a.state_dict()), dict(b.state_dict()))
