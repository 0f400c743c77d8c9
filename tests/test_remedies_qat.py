"""``qat_distill``: QAT by distillation from the float model as a remedy (issue #46): it trains what ``prepare`` then
reproduces, resumes from its checkpoint, uses the CONFIG's ``train_qat`` when given, and the search tries it only
when asked (``search_remedies(..., qat=True)``, ``quantlens fix --qat``) and keeps it only when it helps."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter as INT8
from quantlens.search.remedies import qat_distill as module
from quantlens.search.remedies import search_remedies
from quantlens.search.remedies.catalog import model_remedies
from quantlens.search.remedies.qat_distill import CHECKPOINT_FILE, QatBudget, qat_distill


class Blocks(nn.Module):
    """Two residual blocks in a ModuleList (the hidden states the distillation matches) whose first layer's output
    has an outlier channel: int8 per tensor loses the small channels, which QAT can move."""

    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(2)])
        self.out = nn.Linear(16, 4)
        with torch.no_grad():
            self.inp.weight[0] *= 100.0  # the outlier channel

    def forward(self, x):
        h = self.inp(self.q(x))
        for block in self.blocks:
            h = h + block(h)
        return self.dq(self.out(h))


def _data(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g),) for _ in range(n)]


def _cosine(model, setter, batches, held) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, batches[0], setter, check_result_dir=None), batches)
    with torch.no_grad():
        ours = torch.cat([prepared(*b) for b in held])
        ref = torch.cat([_float(b) for b in held])
    return float(torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=1).mean())


_FLOAT = []


def _float(batch):
    return _FLOAT[0](*batch)


@pytest.fixture
def blocks():
    torch.manual_seed(0)
    model = Blocks().eval()
    _FLOAT[:] = [model]
    return model


def test_distillation_improves_the_held_out_metric_and_prepare_reproduces_it(blocks, tmp_path):
    calib, held = _data(1), _data(2)
    before = _cosine(blocks, INT8, calib, held)
    trained, setter = qat_distill(blocks, calib[0], calib, INT8, budget=QatBudget(steps=60, lr=1e-3),
                                  out_dir=tmp_path)
    after = _cosine(trained, setter, calib, held)
    assert after > before + 0.002, (before, after)  # 0.985 -> 0.989 here
    assert setter.ranges and all(v > 0 for v in setter.ranges.values())  # the learned int8 ranges, fixed
    assert not torch.equal(trained.blocks[0][0].weight, blocks.blocks[0][0].weight)  # the weights trained
    assert (tmp_path / CHECKPOINT_FILE).is_file()


def test_a_run_resumes_from_its_checkpoint(blocks, tmp_path, monkeypatch):
    calib = _data(1)
    budget = QatBudget(steps=20, lr=3e-3, checkpoint_every=10)
    first, _ = qat_distill(blocks, calib[0], calib, INT8, budget=budget, out_dir=tmp_path)
    starts = []
    real = module._distill
    monkeypatch.setattr(module, "_distill", lambda *a, **k: starts.append(a[4]) or real(*a, **k))
    again, _ = qat_distill(blocks, calib[0], calib, INT8, budget=budget, out_dir=tmp_path)
    assert starts == [20]  # the finished checkpoint: no step trained again
    for a, b in zip(first.parameters(), again.parameters()):
        assert torch.equal(a, b)
    starts.clear()  # another budget is another run: it starts afresh
    qat_distill(blocks, calib[0], calib, INT8, budget=QatBudget(steps=5, lr=3e-3), out_dir=tmp_path)
    assert starts == [0]


def test_the_configs_train_qat_replaces_the_distillation(blocks):
    calls = []

    def train_qat(prepared):
        calls.append(prepared.training)
        with torch.no_grad():
            prepared.out.bias.add_(1.0)

    trained, _ = qat_distill(blocks, _data(1)[0], _data(1), INT8, train_qat=train_qat)
    assert calls == [True]
    assert torch.allclose(trained.out.bias, blocks.out.bias + 1.0)


def test_the_search_tries_qat_only_when_asked_and_keeps_it_when_it_helps(blocks, tmp_path):
    assert "qat_distill" not in [r.name for r in model_remedies()]
    assert "qat_distill" in [r.name for r in model_remedies(qat=True)]
    calib, held = _data(1), _data(2)

    def evaluate(prepared):
        with torch.no_grad():
            ours = torch.cat([prepared(*b) for b in held])
            ref = torch.cat([blocks(*b) for b in held])
        return float(torch.nn.functional.cosine_similarity(ours, ref, dim=1).mean())

    result = search_remedies(blocks, calib[0], calib, evaluate, 0.99999, range_sites=0, int16=False,
                             out_dir=tmp_path / "s", progress=False, report=False, qat=True,
                             qat_budget=QatBudget(steps=60, lr=1e-3))
    trial = next(t for t in result.trials if t.name == "qat_distill")
    assert trial.kept == (trial.value > trial.before if trial.before is not None else trial.kept)
    assert (tmp_path / "s" / CHECKPOINT_FILE).is_file()
    plain = search_remedies(blocks, calib[0], calib, evaluate, 0.99999, range_sites=0, int16=False,
                            out_dir=tmp_path / "p", progress=False, report=False)
    assert all(t.name != "qat_distill" for t in plain.trials)


def test_fix_takes_qat_and_refuses_a_bad_budget(tmp_path):
    """`quantlens fix --qat` runs the QAT remedy (its checkpoint in --out, its trial in the saved result) at
    consistency level 1 unless told otherwise (the integer rules in its forward, the deployed model checked); a
    budget of no step is refused in words."""
    from tests.test_cli import ql
    from tests.test_fix_newcomers import CONFIG  # a CONFIG with evaluation data: fix measures the held-out metric

    (tmp_path / "cfg.py").write_text(CONFIG)
    res = ql("fix", tmp_path / "cfg.py", "--target", "1.5", "--range-sites", "0", "--no-int16", "--qat",
             "--qat-steps", "5", "--out", tmp_path / "out")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "models prepared at consistency level 1" in res.stdout and "deployed quantized IR" in res.stdout
    assert (tmp_path / "out" / CHECKPOINT_FILE).is_file()
    assert "qat_distill" in (tmp_path / "out" / "remedies.csv").read_text()
    bad = ql("fix", tmp_path / "cfg.py", "--target", "1.5", "--qat", "--qat-steps", "0", "--out", tmp_path / "o2")
    assert bad.returncode == 2 and "--qat-steps must be >= 1" in bad.stderr


class _GeluBlocks(Blocks):
    """Blocks with a GELU (a table op: its integer table differs from the float op a level-0 QAT trains with)."""

    def forward(self, x):
        h = torch.nn.functional.gelu(self.inp(self.q(x)))
        for block in self.blocks:
            h = h + block(h)
        return self.dq(self.out(h))


@pytest.mark.parametrize("level", [4, 0])
def test_at_consistency_level_4_the_integer_model_is_what_was_trained(level):
    """QAT at level 4 trains through the march's integer rules (the GELU's table included), so the quantized IR of
    what it returns computes what the trained fake-quant model computes (to float32's last bits of the dequantized
    output, far below one output step), and the held-out metric still improves; at level 0 the two differ."""
    from quantlens.compiler import convert, export
    from quantlens.quantization import ConsistencyStrategy, pre_export

    torch.manual_seed(0)
    blocks = _GeluBlocks().eval()
    _FLOAT[:] = [blocks]
    batches, held = _data(0), _data(1, 2)
    ConsistencyStrategy.set_consistency_level(level)
    try:
        before = _cosine(blocks, INT8, batches, held)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, setter = qat_distill(blocks, batches[0], batches, INT8, budget=QatBudget(steps=30, seconds=60))
        # below level 1 it says the integer model will not be what it trained
        assert any("qat_distill trains at consistency level 0" in str(w.message) for w in caught) == (level == 0)
        after = _cosine(model, setter, batches, held)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = calibrate(prepare(model, batches[0], setter, check_result_dir=None), batches)
            q_ir = convert(export(pre_export(prepared, example_inputs=batches[0]), batches[0], dynamic_batch=True))
    finally:
        ConsistencyStrategy.disable()
    assert after > before or level != 4, (before, after)
    with torch.no_grad():
        gap = max(float((prepared(x) - q_ir(x)).abs().max() / prepared(x).abs().max()) for (x,) in held)
    assert (gap < 1e-4) == (level == 4), gap
