"""Shared ablation forwards of sensitivity(): quantizers whose effects reach disjoint outputs share a forward,
and the tables are those of one forward per quantizer."""

import warnings

import pytest
import torch
from torch import nn

from quantlens.profiler import QuantAnalysis
from quantlens.profiler import sensitivity as sensitivity_module
from quantlens.profiler.ablation import ir_cache, torch_cache
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class Heads(nn.Module):
    """A trunk and three heads (a detector's or a multi-task net's branches); ``coupled``: head c is scaled by
    a Python float read off head a's output, a dependency the reference forward's data flow does not show."""

    def __init__(self, coupled: bool = False):
        super().__init__()
        self.coupled = coupled
        self.quant = QuantStub()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.heads = nn.ModuleDict({k: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
                                    for k in "abc"})
        self.dequant = nn.ModuleDict({k: DeQuantStub() for k in "abc"})

    def forward(self, x):
        y = self.trunk(self.quant(x))
        out = {k: self.heads[k](y) for k in "abc"}
        if self.coupled:
            out["c"] = out["c"] * float(out["a"].abs().mean())
        return {k: self.dequant[k](v) for k, v in out.items()}


def _setup(coupled, tmp_path, **kwargs):
    torch.manual_seed(0)
    model = Heads(coupled).eval()
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calib = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None),
                          [(torch.randn(2, 3, 8, 8),) for _ in range(3)])
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False, **kwargs)
    qa.set_bad_case((x,))
    return qa


def _tables(result):
    return [(t.key, [(r.op_name, r.sensitive_type, r.value) for r in t]) for t in result]


def _counted(monkeypatch):
    """Counts the cached forwards (torch or IR reference) and the shared forwards that had to be run one by
    one."""
    counts = {"forwards": 0, "fallbacks": 0}
    ablate = sensitivity_module._Shared.ablate

    def counting(run):
        def counting_run(self, *a, **k):
            counts["forwards"] += 1
            return run(self, *a, **k)
        return counting_run

    def counting_ablate(self, *a, **k):
        out = ablate(self, *a, **k)
        counts["fallbacks"] += out is None
        return out

    for cache in (torch_cache.TorchAblationCache, ir_cache.IRAblationCache):
        monkeypatch.setattr(cache, "run", counting(cache.run))
    monkeypatch.setattr(sensitivity_module._Shared, "ablate", counting_ablate)
    return counts


def _unshared_and_full(qa, monkeypatch):
    monkeypatch.setattr(sensitivity_module._Shared, "plan", classmethod(lambda cls, *a, **k: None))
    unshared = _tables(qa.sensitivity(shard=False))
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", False)
    full = _tables(qa.sensitivity(shard=False))
    return unshared, full


@pytest.mark.parametrize("metric", ["L1", "Cosine"])
def test_branch_quantizers_share_forwards_and_give_the_same_tables(metric, monkeypatch, tmp_path):
    qa = _setup(False, tmp_path)
    counts = _counted(monkeypatch)
    shared = _tables(qa.sensitivity(metric=metric, shard=False))
    n = len(shared[0][1])
    # the stub's, the trunk conv's and its ReLU's quantizers reach every head: one forward each; the nine of the
    # heads (each head's two conv weights and its ReLU) go three to a forward, one from each head
    assert n == 12 and counts["fallbacks"] == 0 and counts["forwards"] == 3 + 3
    monkeypatch.undo()
    monkeypatch.setattr(sensitivity_module._Shared, "plan", classmethod(lambda cls, *a, **k: None))
    unshared = _tables(qa.sensitivity(metric=metric, shard=False))
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", False)
    full = _tables(qa.sensitivity(metric=metric, shard=False))
    assert shared == unshared == full
    assert [k for k, _ in shared] == [f"{head}_{metric}" for head in "abc"]
    # a head's own quantizers change only its output; the others' rows there read the all-off value
    a_rows = dict(((op, kind), v) for op, kind, v in shared[0][1])
    assert a_rows[("heads.a.0", "weight")] != a_rows[("heads.b.0", "weight")] == a_rows[("heads.c.0", "weight")]


def test_a_dependency_the_plan_cannot_see_is_caught_and_run_one_by_one(monkeypatch, tmp_path):
    qa = _setup(True, tmp_path)
    counts = _counted(monkeypatch)
    shared = _tables(qa.sensitivity(shard=False))
    assert counts["fallbacks"] >= 1  # head a's quantizers were grouped with head c's: c moved with both
    monkeypatch.undo()
    unshared, full = _unshared_and_full(qa, monkeypatch)
    assert shared == unshared == full
    c_rows = dict(((op, kind), v) for op, kind, v in shared[2][1])
    assert c_rows[("heads.a.0", "weight")] != c_rows[("heads.b.0", "weight")]  # a reaches c, b does not


def test_a_post_process_over_every_output_keeps_one_forward_per_quantizer(monkeypatch, tmp_path):
    qa = _setup(False, tmp_path, post_process=lambda out: {"sum": out["a"].sum() + out["b"].sum()})
    counts = _counted(monkeypatch)
    shared = _tables(qa.sensitivity(shard=False))
    assert counts["forwards"] == len(shared[0][1]) and counts["fallbacks"] == 0
    monkeypatch.undo()
    _, full = _unshared_and_full(qa, monkeypatch)
    assert shared == full


def test_the_progress_bar_counts_quantizers_not_forwards(monkeypatch, tmp_path):
    import rich.progress

    advanced, totals = [], []
    add_task, advance = rich.progress.Progress.add_task, rich.progress.Progress.advance
    monkeypatch.setattr(rich.progress.Progress, "add_task",
                        lambda self, description, total=None, **k: totals.append(total) or add_task(
                            self, description, total=total, **k))
    monkeypatch.setattr(rich.progress.Progress, "advance",
                        lambda self, task, steps=1: advanced.append(steps) or advance(self, task, steps))
    qa = _setup(False, tmp_path)
    qa.progress = True
    qa.sensitivity(shard=False)
    assert totals[-1] == 12 and sum(advanced[-6:]) == 12 and sorted(advanced[-6:]) == [1, 1, 1, 3, 3, 3]


@pytest.mark.parametrize("kind", ["export", "convert"])
def test_deployed_analyses_share_forwards_of_their_reference(kind, monkeypatch, tmp_path):
    """export: the qat IR's value of each op site replaces the pre_export model's (the torch reference's cached
    forwards, shared forwards checked by tracking); convert: the quantized IR's replaces the qat IR's (an IR
    reference: the outputs each site reaches come from the IR's data flow). The heads' sites share forwards, with
    the tables of one forward per site."""
    from quantlens.compiler import convert, export
    from quantlens.quantization.pre_export import pre_export

    qa = _setup(False, tmp_path / "calib")
    calib, x = qa.analysis.model, qa._require_bad_case()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat_ir = export(calib, (x,))
    pair = (pre_export(calib), qat_ir) if kind == "export" else (qat_ir, convert(qat_ir))
    qa = QuantAnalysis(*pair, kind, out_dir=tmp_path / kind, progress=False)
    qa.set_bad_case((x,))
    counts = _counted(monkeypatch)
    shared = _tables(qa.sensitivity(shard=False))
    assert counts["fallbacks"] == 0 and 0 < counts["forwards"] < len(shared[0][1])
    monkeypatch.undo()
    unshared, full = _unshared_and_full(qa, monkeypatch)
    assert shared == unshared == full


def test_a_sharded_run_shares_forwards_within_its_shard(monkeypatch, tmp_path):
    """shard=True (one process: rank 0 of 1, resumable) plans the shared forwards over its own quantizers: the
    same forwards and tables as the single-process run, every value in the progress file."""
    import json

    from quantlens.profiler.sharding import PROGRESS_DIR

    qa = _setup(False, tmp_path)
    single = _tables(qa.sensitivity(shard=False))
    counts = _counted(monkeypatch)
    sharded = _tables(qa.sensitivity(shard=True))
    assert sharded == single and counts["forwards"] == 3 + 3 and counts["fallbacks"] == 0
    lines = (tmp_path / PROGRESS_DIR / "rank0.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["i"] for line in lines[1:]) == list(range(12))
    # resumed: nothing left to run
    counts["forwards"] = 0
    assert _tables(qa.sensitivity(shard=True)) == single and counts["forwards"] == 0
