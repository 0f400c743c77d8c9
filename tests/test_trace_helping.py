"""Issue #25: the forward's thread computes queued sites (statistics, codes, file, output quantization split) where
it would wait for the trace writer, and the writer records every site in queue order. Whichever thread computes a
site, the trace is the same bytes and the rows the same figures; an error on the helping thread stops the run like
one on the writer's; a weight, whose statistics are now read off the forward's path, must not change meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trace_held import _as_tuples, _models  # (a small conv net with in-place ReLUs, calibrated)
from torch import nn

import quantlens.profiler.trace.writer as writer_module
from quantlens.errors import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.torch_access import TorchModelAccess
from quantlens.profiler.trace.writer import TraceWriter


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _traced(tmp_path: Path, name: str, monkeypatch, who: str):
    """run() + compare_per_layer() with every site computed by the writer thread (``who="writer"``) or by the
    forward's thread (``"forward"``: the writer claims none, so the forward computes each where it waits)."""
    model, prepared, batches = _models()
    computed_on = []
    compute = TraceWriter._compute

    def recording(self, job):
        import threading

        computed_on.append(threading.current_thread().name)
        return compute(self, job)

    with monkeypatch.context() as m:
        m.setattr(TraceWriter, "_compute", recording)
        if who == "writer":
            m.setattr(TraceWriter, "_help", lambda self: False)
        else:
            m.setattr(TraceWriter, "_claim", lambda self, job: False)
        qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path / name, progress=False)
        qa.set_bad_case(batches[1])
        qa.run()
        table = qa.compare_per_layer()
    return computed_on, table


def test_a_site_computed_by_the_forward_s_thread_is_the_writer_s_bytes_and_rows(tmp_path, monkeypatch):
    by_writer, rows_w = _traced(tmp_path, "w", monkeypatch, "writer")
    by_forward, rows_f = _traced(tmp_path, "f", monkeypatch, "forward")
    assert by_writer and all(name.startswith("quantlens-trace-") for name in by_writer)
    assert by_forward and set(by_forward) == {"MainThread"}
    assert len(by_writer) == len(by_forward)
    for folder in ("baseline_model", "analysis_model"):
        w, f = _files(tmp_path / "w" / folder), _files(tmp_path / "f" / folder)
        assert sorted(w) == sorted(f) and any(k.endswith(".safetensors") for k in w)
        assert {k for k in w if w[k] != f[k]} == set()
    assert len(rows_w) >= 5 and _as_tuples(rows_w) == _as_tuples(rows_f)


def test_an_error_on_the_helping_thread_stops_the_run_and_keeps_the_previous_trace(tmp_path, monkeypatch):
    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run()
    before = _files(tmp_path / "analysis_model")
    real_write = writer_module.write_safetensors

    def failing(path, payload):
        if Path(path).name == "00003.safetensors":
            raise OSError(28, "No space left on device")
        return real_write(path, payload)

    monkeypatch.setattr(writer_module, "write_safetensors", failing)
    monkeypatch.setattr(TraceWriter, "_claim", lambda self, job: False)  # (every site computed by the forward)
    qa.set_bad_case(batches[2])
    with pytest.raises(QuantLensError, match="No space left on device"):
        qa.run()
    assert _files(tmp_path / "analysis_model") == before


class _SelfEditingNet(nn.Module):
    """Changes its linear's weight in place after the linear has run (nothing a deployable model does)."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.fc.weight.mul_(1.0)
        return self.fc2(y)


def test_a_weight_changed_in_place_after_its_op_is_refused_whenever_it_was_read(tmp_path, monkeypatch):
    for who in ("writer", "forward"):
        with monkeypatch.context() as m:
            if who == "forward":
                m.setattr(TraceWriter, "_claim", lambda self, job: False)
            writer = TraceWriter(tmp_path / who, "baseline", "float")
            # (raised by the site stored after the writer read the changed weight, or else by finish())
            with pytest.raises(QuantLensError, match="weight of op site 'fc' was changed in place"):
                TorchModelAccess(_SelfEditingNet().eval(), "baseline").run((torch.randn(3, 4),), sink=writer)
                writer.finish({})
        assert not (tmp_path / who / "trace.json").exists()
    # an unchanged weight's statistics are those of the weight the op read
    writer = TraceWriter(tmp_path / "plain", "baseline", "float")
    net = _SelfEditingNet().eval()
    net.forward = lambda x: net.fc2(net.fc(x))
    TorchModelAccess(net, "baseline").run((torch.randn(3, 4),), sink=writer)
    writer.finish({})
    stat = next(s for s in writer.sites if s.name == "fc").stats["weight"]
    assert stat.min == float(net.fc.weight.min()) and stat.max == float(net.fc.weight.max())
    assert stat.shape == (4, 4)


def test_a_site_larger_than_the_queue_computes_its_split_now_with_the_same_figures(tmp_path, monkeypatch):
    """A site that alone exceeds the queue's budget would add its split's copy of the value to the run's peak: its
    output quantization split is computed at once instead. The same trace and rows either way."""
    import sys

    import quantlens.profiler.torch_probe as torch_probe

    model, prepared, batches = _models()
    original = torch_probe._quant_error_stats
    tables, deferred = {}, {}
    for name, budget in (("queued", 1 << 30), ("now", 1)):
        calls = []

        def recording(*args):
            frame, names = sys._getframe(1), set()
            while frame is not None:
                names.add(frame.f_code.co_name)
                frame = frame.f_back
            calls.append("_compute" in names)
            return original(*args)

        with monkeypatch.context() as m:
            m.setattr(torch_probe, "_quant_error_stats", recording)
            m.setattr(writer_module, "QUEUE_BYTES", budget)
            qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path / name, progress=False)
            qa.set_bad_case(batches[1])
            qa.run()
            tables[name] = qa.compare_per_layer()
        deferred[name] = calls
    assert deferred["queued"] and all(deferred["queued"])
    assert deferred["now"] and not any(deferred["now"])
    for folder in ("baseline_model", "analysis_model"):
        assert _files(tmp_path / "queued" / folder) == _files(tmp_path / "now" / folder)
    assert _as_tuples(tables["queued"]) == _as_tuples(tables["now"])
    assert any(r.error_kind for r in tables["now"])  # (rows that read the split)
