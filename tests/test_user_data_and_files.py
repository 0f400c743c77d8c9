"""The user's data is theirs, out_dir and files, names and determinism (docs/guarantees.md)."""

from __future__ import annotations

import gc
import hashlib
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from quantlens import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.outputs import named_outputs
from quantlens.profiler.report import safe_name, save_pt
from quantlens.profiler.trace.reader import TraceReader
from quantlens.quantization import FakeQuantState, calibrate, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.sites.tracer import TensorMarks

CALIB = default_calibration_qconfig_setter


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) + 0.5)


class _Heads(nn.Module):
    """Outputs whose names collide once printed (dict paths) or made file-safe."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.h = nn.ModuleList(nn.Linear(8, 2) for _ in range(4))

    def forward(self, x):
        y = torch.relu(self.body(x))
        return {"cls/score": self.h[0](y), "cls_score": self.h[1](y), "a": {"b": self.h[2](y)}, "a.b": self.h[3](y)}


def _batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g),) for _ in range(n)]


def _pair(model_cls=_Net):
    torch.manual_seed(0)
    model = model_cls().eval()
    calib = prepare(model, _batches(1)[0], CALIB, check_result_dir=None, allow_no_stubs=True)
    calibrate(calib, _batches())
    return model, calib


def _quantlens_attrs(t: torch.Tensor) -> list[str]:
    return [k for k in getattr(t, "__dict__", {}) if k.startswith("_ql")] + \
        [k for k in dir(t) if k.startswith("_ql")]


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 6. the user's data is theirs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("state", [FakeQuantState.CALIBRATION, FakeQuantState.FLOAT, FakeQuantState.VALIDATION])
def test_tensors_that_pass_through_a_prepared_model_carry_nothing_of_quantlens(state, tmp_path):
    model, calib = _pair()
    set_fake_quantize(calib, state)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = calib(x)
    assert _quantlens_attrs(x) == [] and _quantlens_attrs(out) == []
    assert x.__dict__ == {}
    # A calibration batch saved by quantlens loads back with weights_only (no FakeQuantize pickled with it).
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case((x,))
    loaded = qa.load_bad_case()
    assert torch.equal(loaded[0], x)


def test_prepare_and_profiling_leave_the_inputs_untouched(tmp_path):
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x.mul_(2)  # the user's forward changes its input in place
            return self.fc(x)

    example = torch.randn(4, 8)
    before = example.clone()
    calib = prepare(InPlace().eval(), (example,), CALIB, check_result_dir=tmp_path, allow_no_stubs=True)
    assert torch.equal(example, before), "prepare changed the example inputs"
    assert example.__dict__ == {}
    model, calib = _pair()
    batch = _batches(1)[0]
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / "qa", progress=False)
    qa.set_bad_case(batch)
    qa.run()
    assert batch[0].__dict__ == {} and qa.load_bad_case()[0].__dict__ == {}


def test_tensor_marks_answer_only_for_the_marked_object():
    marks = TensorMarks()
    a = torch.randn(3)
    marks.set(a, "site")
    assert marks.get(a) == "site" and a in marks and a.__dict__ == {}
    assert marks.get(a.view(3)) is None  # another object (same storage) has no mark
    key = id(a)
    del a
    gc.collect()
    assert len(marks) == 0  # a dead tensor leaves the table: an id reused later finds nothing
    b = torch.randn(3)
    if id(b) == key:
        assert marks.get(b) is None


# -- 7. out_dir and files -------------------------------------------------------------------------------------------
def _counting(batches, seen):
    for b in batches:
        seen.append(1)
        yield b


@pytest.mark.parametrize("where", ["file", "below_a_file"])
def test_an_out_dir_that_cannot_be_a_folder_is_refused_before_any_model_runs(where, tmp_path):
    model, calib = _pair()
    (tmp_path / "f").write_text("mine\n")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "reports"
    seen: list[int] = []
    with pytest.raises(QuantLensError, match="out_dir"):
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out, progress=False)
        qa.auto_find_bad_case(_counting(_batches(), seen))
    assert seen == [] and (tmp_path / "f").read_text() == "mine\n"


def test_an_unwritable_out_dir_is_refused_before_any_model_runs(tmp_path, monkeypatch):
    model, calib = _pair()
    locked = tmp_path / "locked"
    locked.mkdir()
    # root may write into a read-only folder, so the permission answer is what the OS says for an ordinary user
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    with pytest.raises(QuantLensError, match="locked is not writable, so the folder .*reports cannot be created"):
        QuantAnalysis(model, calib, "fake_quant", out_dir=locked / "reports", progress=False)
    assert not (locked / "reports").exists()


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_written_files_follow_the_umask(mask, tmp_path):
    model, calib = _pair()
    old = os.umask(mask)
    try:
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
        qa.set_bad_case(_batches(1)[0])
        qa.run()
        prepare(_Net().eval(), _batches(1)[0], CALIB, check_result_dir=tmp_path, allow_no_stubs=True)
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".pt" for p in files) and any(p.name == "model_check_result.txt" for p in files)
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~mask}


def test_foreign_files_in_a_trace_folder_are_kept(tmp_path):
    model, calib = _pair()
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_batches(1)[0])
    qa.run()
    mine = [tmp_path / "baseline_model" / "notes.txt", tmp_path / "baseline_model" / "tensors" / "README",
            tmp_path / "analysis_model" / "tensors" / "keep.safetensors"]
    for path in mine:
        path.write_text("the user's\n")
    stale = tmp_path / "baseline_model" / "tensors" / "99999.safetensors"  # a name quantlens gives its files
    stale.write_bytes(b"")
    qa.run()
    assert all(p.read_text() == "the user's\n" for p in mine)
    assert not stale.exists()
    assert len(TraceReader(tmp_path / "baseline_model").sites) == len(
        list((tmp_path / "baseline_model" / "tensors").glob("0*.safetensors")))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_an_interrupted_run_keeps_the_previous_complete_trace(tmp_path):
    model, calib = _pair()
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_batches(1)[0])
    qa.run()
    before = {d: _digests(tmp_path / d) for d in ("baseline_model", "analysis_model")}

    def boom(*_):
        raise KeyboardInterrupt

    qa.set_bad_case(_batches(1, seed=5)[0])
    for target in (model, calib):  # interrupt the baseline run, then the analysis run
        handle = target.fc2.register_forward_pre_hook(boom)
        try:
            with pytest.raises(KeyboardInterrupt):
                qa.run(run_baseline_model=target is model)
        finally:
            handle.remove()
        for d, digests in before.items():
            if d == "analysis_model" or target is model:
                assert _digests(tmp_path / d) == digests
                TraceReader(tmp_path / d)  # still complete
        if target is model:
            qa.run(run_analysis_model=False)  # the new baseline is complete: the analysis run is interrupted next
    qa.run()
    assert TraceReader(tmp_path / "analysis_model").input_digest == TraceReader(tmp_path / "baseline_model").input_digest


def test_an_unwritable_check_report_is_a_warning(tmp_path):
    (tmp_path / "f").write_text("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = prepare(_Net().eval(), _batches(1)[0], CALIB, check_result_dir=tmp_path / "f", allow_no_stubs=True)
    assert any("check report" in str(w.message) for w in caught)
    with torch.no_grad():
        prepared(torch.randn(2, 8))


# -- 8. names and determinism ---------------------------------------------------------------------------------------
def test_colliding_output_names_keep_distinct_names_and_files(tmp_path):
    t = [torch.full((1,), float(i)) for i in range(4)]
    named = named_outputs({"cls/score": t[0], "cls_score": t[1], "a": {"b": t[2]}, "a.b": t[3]})
    assert len(named) == 4 and sorted(float(v) for v in named.values()) == [0.0, 1.0, 2.0, 3.0]
    assert len({safe_name(n) for n in named}) == 4 and all("/" not in safe_name(n) for n in named)
    assert safe_name("cls_score") == "cls_score" and safe_name("post_process.scores") == "post_process.scores"

    model, calib = _pair(_Heads)
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_batches(1)[0])
    result = qa.run()
    assert len(result.outputs) == len(set(result.outputs)) == 4
    tables = qa.sensitivity()
    assert len({t.output for t in tables}) == 4
    assert len(list(tmp_path.glob("output_*_L1_sensitive_ops.pt"))) == 4


def test_every_file_is_byte_identical_for_the_same_inputs(tmp_path):
    data = {"rows": [{"op_name": "fc1", "value": 0.5}], "t": torch.arange(6.0).reshape(2, 3)}
    a, b = save_pt(data, tmp_path / "x" / "a.pt"), save_pt(data, tmp_path / "y" / "b.pt")
    assert a.read_bytes() == b.read_bytes()

    model, calib = _pair()
    digests = []
    for name in ("one", "two"):
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / name, progress=False)
        qa.auto_find_bad_case(_batches())
        qa.run()
        qa.compare_per_layer()
        qa.sensitivity()
        digests.append(_digests(tmp_path / name))
    assert any(k.endswith(".pt") for k in digests[0])
    assert digests[0] == digests[1]


def test_a_model_output_named_like_the_post_processing_keeps_its_own_name(tmp_path):
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return {"post_process": self.fc(x)}

    model, calib = _pair(Named)
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False,
                       post_process=lambda out: out["post_process"].softmax(-1))
    qa.set_bad_case(_batches(1)[0])
    outputs = qa.run().outputs
    assert outputs == ["post_process", "post_process#1"]  # the model's own output, then the post-processing's
    traced = TraceReader(tmp_path / "analysis_model").outputs()
    assert torch.allclose(traced["post_process#1"].sum(-1), torch.ones(4))
