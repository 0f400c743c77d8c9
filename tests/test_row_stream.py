"""Issue #25 deliverable 1: compare_per_layer()'s rows are computed on the analysis trace's writer thread while the
model runs (profiler/row_stream.py), with the same function as the comparison itself. The rows must be the very
rows the comparison computes from the traces on disk, and the textbook formulas' values up to float64 summation
order (the rows sum chunk by chunk, pair_sums); rows of traces written again since are never reused."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import quantlens.profiler.compare as compare_module
from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.compare import compare_traces
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.skip = nn.Identity()  # its output is the stem's tensor: stored by reference to the stem's file
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = self.stem(self.quant(x))
        h = self.skip(torch.relu(self.conv(h) + h))
        return self.dequant(self.fc(h.mean((2, 3))))


def _models():
    torch.manual_seed(0)
    model = _Net().eval()
    with torch.no_grad():
        model.stem[1].running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 10, 10, generator=g),) for _ in range(3)]
    prepared = calibrate(prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None),
                         batches)
    return model, prepared, batches


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _assert_rows_equal(got, want):
    assert [r.op_name for r in got] == [r.op_name for r in want]
    for g, w in zip(got, want):
        diff = {k: (getattr(g, k), getattr(w, k)) for k in g.__dataclass_fields__
                if not _same(getattr(g, k), getattr(w, k))}
        assert not diff, (g.op_name, diff)


@pytest.mark.parametrize("kind", ["fake_quant", "convert"])
def test_streamed_rows_are_the_comparisons_rows_and_are_not_computed_again(kind, tmp_path, monkeypatch):
    model, prepared, batches = _models()
    if kind == "convert":
        qat_ir = export(pre_export(prepared), batches[0])
        model, prepared = qat_ir, convert(qat_ir)
    qa = QuantAnalysis(model, prepared, kind, tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    traces = qa._open_traces()
    early = qa._row_stream.rows_for(*traces)
    computed = []
    real = compare_module.site_row
    monkeypatch.setattr(compare_module, "site_row", lambda *a, **k: computed.append(a[2].name) or real(*a, **k))
    table = qa.compare_per_layer()
    compared = [r for r in table if not r.fused_into]
    assert all(s.index in early for s in traces[1].sites if s.name in {r.op_name for r in compared})
    if kind == "fake_quant":  # (an IR has no identity op)
        assert "skip" in {r.op_name for r in compared} and traces[1].by_name["skip"].refs  # a reference, streamed
    assert len(compared) >= 5
    assert len(computed) == len(table) - sum(s.index in early for s in traces[1].sites if s.name in
                                             {r.op_name for r in table})
    monkeypatch.setattr(compare_module, "site_row", real)
    exact = compare_traces(*traces, deployed=kind == "convert")  # every row from the files, on this thread
    _assert_rows_equal([r for r in table], [_with_reach(r, table) for r in exact])


def _with_reach(row, table):
    from dataclasses import replace

    return replace(row, reaches_output=table[row.op_name].reaches_output, host_side=table[row.op_name].host_side)


def _reference(x: torch.Tensor, y: torch.Tensor) -> dict:
    """The metrics as written in the docs, plainly (float64, one formula each)."""
    x, y = x.double(), y.double()
    dim = 1 if x.dim() > 2 else -1
    lp, lq = torch.log_softmax(x, dim), torch.log_softmax(y, dim)
    return {"Cosine": float((x.flatten() @ y.flatten()) / (x.norm() * y.norm())),
            "MSE": float(((x - y) ** 2).mean()), "L1": float((x - y).abs().mean()),
            "KL": float((lp.exp() * (lp - lq)).sum(dim).mean()),
            "SQNR": float(20.0 * torch.log10(x.norm() / (x - y).norm())), "Atol": float((x - y).abs().max())}


def _close(got: dict, want: dict) -> bool:
    """Equal to float64 summation order: the rows sum chunk by chunk (pair_sums), the formulas over the whole
    tensor; a maximum is exact."""
    return got.keys() == want.keys() and all(
        got[k] == want[k] if k == "Atol" or math.isinf(want[k]) else got[k] == pytest.approx(want[k], rel=1e-12)
        for k in want)


def test_streamed_rows_equal_the_textbook_formulas(tmp_path):
    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    base, analy = qa._open_traces()
    table = qa.compare_per_layer()
    checked = 0
    for row in table:
        if row.fused_into or row.Cosine is None or row.op_name not in analy.by_name:
            continue
        at, bt = analy.tensors(row.op_name), base.tensors(row.op_name)
        x, y = bt["out0"], at["out0"]
        want = _reference(x, y)
        got = {k: getattr(row, k) for k in want}
        assert _close(got, want), (row.op_name, got, want)
        if "same0" in at and row.same_input_sqnr is not None and row.same_input_sqnr != math.inf:
            same = _reference(x, at["same0"])
            got = {"Cosine": row.same_input_cosine, "SQNR": row.same_input_sqnr, "Atol": row.same_input_atol}
            assert _close(got, {k: same[k] for k in got}), row.op_name
            if "samepre0" in at:
                xd, p, s = x.double().reshape(-1), at["samepre0"].double().reshape(-1), at["same0"].double().reshape(-1)
                assert row.same_input_inner_mse == pytest.approx(float(((xd - p) ** 2).mean()), rel=1e-12), \
                    row.op_name
                assert row.same_input_clip_mse + row.same_input_round_mse == pytest.approx(
                    float(((p - s) ** 2).mean()), rel=1e-12), row.op_name
        checked += 1
    assert checked >= 5


def test_rows_of_traces_written_again_are_not_reused(tmp_path):
    model, prepared, batches = _models()
    first = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    first.set_bad_case(batches[1])
    first.run()
    streamed = first._row_stream.rows_for(*first._open_traces())
    assert streamed
    # another analysis model (calibrated on one batch: other scales) traced into the same out_dir
    other = calibrate(prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None),
                      batches[2:])
    second = QuantAnalysis(model, other, "fake_quant", tmp_path, progress=False)
    second.set_bad_case(batches[1])
    second.run()
    assert first._row_stream.rows_for(*second._open_traces()) == {}
    rows = {r.op_name: r.Cosine for r in first.compare_per_layer()}  # the files' rows, not the streamed ones
    assert rows == {r.op_name: r.Cosine for r in second.compare_per_layer()}
    assert rows != {r.op_name: r.Cosine for r in streamed.values()}


def test_a_tensor_file_changed_after_the_run_is_read_again_and_refused(tmp_path):
    """The streamed rows stand for the files as written: a tensor file damaged in place since (same trace.json)
    makes compare_per_layer() read the files, which refuses the damage, naming the folder."""
    from quantlens.errors import QuantLensError

    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    conv = next(s for s in qa._open_traces()[1].sites if s.name == "conv")
    path = tmp_path / "analysis_model" / conv.file
    path.write_bytes(path.read_bytes()[:-16])  # truncated in place: its header promises more bytes
    assert qa._row_stream.rows_for(*qa._open_traces()) == {}
    with pytest.raises(QuantLensError, match="analysis_model"):
        qa.compare_per_layer()


def test_rows_past_the_memory_budget_wait_for_the_comparison(tmp_path, monkeypatch):
    """A row whose baseline values would take more than ROW_BYTES to read back is not computed beside the forward
    (its memory would add to the forward's); compare_per_layer() computes it from the files, to the same values."""
    import quantlens.profiler.row_stream as row_stream

    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    monkeypatch.setattr(row_stream, "ROW_BYTES", 2 * 5 * 4)  # only rows of at most 10 elements (fc's output)
    qa.run()
    traces = qa._open_traces()
    early = qa._row_stream.rows_for(*traces)
    assert {traces[1].sites[i].name for i in early} == {"fc", "dequant"}
    table = qa.compare_per_layer()
    _assert_rows_equal(list(table), [_with_reach(r, table) for r in compare_traces(*traces)])


def test_the_output_quantization_split_is_computed_by_the_writer_not_in_the_forward(tmp_path, monkeypatch):
    """The analysis run's sink is a tee that also records the data flow (reach.ReachTee); it must still tell the
    probes that the writer takes the split as a callable, or the split is computed inside the forward. The writer
    computes it as part of storing its site: on its thread, or on the forward's while that would wait for it."""
    import sys

    import quantlens.profiler.torch_probe as torch_probe

    callers = []
    original = torch_probe._quant_error_stats

    def recording(*args):
        frame, names = sys._getframe(1), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        callers.append("_compute" in names)  # (TraceWriter._compute: the writer's step, whichever thread runs it)
        return original(*args)

    monkeypatch.setattr(torch_probe, "_quant_error_stats", recording)
    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(batches[0])
    qa.run()
    assert callers and all(callers), callers
    rows = {r.op_name: r for r in qa.compare_per_layer()}
    assert rows["conv"].raw_error_kind in ("rounding", "clipping")  # the split reached the row


@pytest.mark.parametrize("kind", ["fake_quant", "convert"])
def test_the_one_pass_rows_equal_the_rows_figure_by_figure(kind, tmp_path, monkeypatch):
    """compare.site_row's fast path (every sum of a row in one pass: pair_sums.row_sums) against its exact path
    (each figure from its own function), on the same traces: every field equal, floats to 1e-12."""
    model, prepared, batches = _models()
    if kind == "convert":
        base_model = export(pre_export(prepared), batches[0])
        qa = QuantAnalysis(base_model, convert(base_model), "convert", tmp_path, progress=False)
    else:
        qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    base, analy = qa._open_traces()
    fast = compare_traces(base, analy, deployed=kind == "convert")
    fused = []
    real = compare_module._fused_sums
    monkeypatch.setattr(compare_module, "_fused_sums", lambda *a: fused.append(real(*a)) or None)
    exact = compare_traces(base, analy, deployed=kind == "convert")
    assert sum(f is not None for f in fused) >= 4  # the fast path was taken on most rows
    assert [r.op_name for r in fast] == [r.op_name for r in exact]
    for f, e in zip(fast, exact):
        for k in f.__dataclass_fields__:
            got, want = getattr(f, k), getattr(e, k)
            if isinstance(want, float) and math.isfinite(want):
                assert got == pytest.approx(want, rel=1e-12, abs=1e-300), (f.op_name, k)
            else:
                assert _same(got, want), (f.op_name, k, got, want)


def test_compare_per_layer_reuses_runs_readers_until_a_trace_json_changes(tmp_path, monkeypatch):
    """compare_per_layer() takes the readers run() opened instead of parsing trace.json again, as long as each
    folder's trace.json is the very file they read; a trace written again (another run, or an edit) is read anew."""
    import quantlens.profiler.quant_analysis as qa_module
    from quantlens.profiler.trace.format import TRACE_FILE

    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(batches[0])
    qa.run()
    opened = []
    real = qa_module.TraceReader
    monkeypatch.setattr(qa_module, "TraceReader", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    first = {r.op_name: r.SQNR for r in qa.compare_per_layer()}
    assert opened == []  # both of run()'s readers stood
    path = tmp_path / "analysis_model" / TRACE_FILE
    text = path.read_text()
    path.write_text(text.replace('"description": "', '"description": "edited ', 1))
    qa.compare_per_layer()
    assert [Path(p).name for p in opened] == ["analysis_model"]  # the edited trace only
    assert {r.op_name: r.SQNR for r in qa.compare_per_layer()} == first


def test_rows_computed_on_two_threads_are_the_rows_of_one(tmp_path, monkeypatch):
    """compare_traces() computes the rows left to it two at a time where a core is free: every figure is the one a
    single thread computes (each row by the same function, from the same files)."""
    import quantlens._threads as threads

    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    traces = qa._open_traces()
    calls = []
    real = threads.map_ordered
    monkeypatch.setattr(compare_module, "map_ordered", lambda fn, items, workers: calls.append(workers) or
                        real(fn, items, workers))
    monkeypatch.setattr(compare_module, "side_workers", lambda most: most)
    monkeypatch.setattr(compare_module, "ROW_WORKERS", 2)
    two = compare_traces(*traces)
    monkeypatch.setattr(compare_module, "ROW_WORKERS", 1)
    one = compare_traces(*traces)
    assert calls == [2, 1] and len(two.rows) >= 5
    _assert_rows_equal(list(two), list(one))
