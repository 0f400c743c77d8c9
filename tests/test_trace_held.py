"""Issue #25: a baseline trace's values are kept in memory under a budget (trace.writer.HOLD_BYTES) for the analysis
run that follows, which reads them there instead of from the files: the same rows and same-input values as from
the files, never changed by the analysis model's in-place ops, never more than the budget, and freed after run()."""

import math

import torch
from torch import nn

import quantlens.profiler.quant_analysis as qa_module
import quantlens.profiler.trace.reader as reader_module
import quantlens.profiler.trace.writer as writer_module
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.trace.writer import TraceWriter
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


class _InPlaceNet(nn.Module):
    """ReLUs that work in place on a conv's output: the same-input run of each one overwrites its input."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv1, self.act1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True)
        self.conv2, self.act2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.act1(self.conv1(self.quant(x)))
        h = self.act2(self.conv2(h) - 0.1)  # (a subtraction between: the ReLU is not fused into the conv)
        return self.dequant(self.fc(h.mean((2, 3))))


def _models():
    torch.manual_seed(0)
    model = _InPlaceNet().eval()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 12, 12, generator=g),) for _ in range(3)]
    prepared = calibrate(prepare(model, batches[0], default_calibration_qconfig_setter, check_result_dir=None),
                         batches)
    return model, prepared, batches


def _rows(model, prepared, case, out_dir):
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir, progress=False)
    qa.set_bad_case(case)
    qa.run()
    return qa, qa.compare_per_layer()


def _as_tuples(table):
    return [tuple(v if not (isinstance(v, float) and math.isnan(v)) else "nan" for v in vars(r).values())
            for r in table]


def test_held_values_give_the_rows_of_the_files(tmp_path, monkeypatch):
    model, prepared, batches = _models()
    from_memory = []
    real_load = reader_module.TraceReader._load

    def counting_load(self, site, keys, copy=False):
        from_memory.extend(tuple(site.refs.get(k, (site.file, k))) in self._held for k in keys)
        return real_load(self, site, keys, copy)

    monkeypatch.setattr(reader_module.TraceReader, "_load", counting_load)
    qa, held_rows = _rows(model, prepared, batches[1], tmp_path / "held")
    assert sum(from_memory) >= 4  # the same-input runs' inputs and the rows' baseline values
    assert qa._row_stream.base._held == {}  # freed once the analysis run is traced
    monkeypatch.setattr(qa_module, "HOLD_BYTES", 0)
    from_memory.clear()
    _, file_rows = _rows(model, prepared, batches[1], tmp_path / "files")
    assert from_memory and not any(from_memory)
    same = [r for r in file_rows if r.same_input_sqnr is not None]
    assert len(same) >= 3  # rows whose same-input run read the baseline's inputs
    assert _as_tuples(held_rows) == _as_tuples(file_rows)


def test_the_writer_holds_whole_sites_within_its_budget(tmp_path):
    model, prepared, batches = _models()
    from quantlens.profiler.torch_access import TorchModelAccess

    sizes = []
    for budget in (0, 20_000, 1 << 30):
        writer = TraceWriter(tmp_path / f"t{budget}", "baseline", "float", hold_bytes=budget)
        TorchModelAccess(model, "baseline").run(batches[1], sink=writer)
        writer.finish({})
        held = sum(t.numel() * t.element_size() for t in writer.held.values())
        assert held <= budget
        # each held value owns its memory: no pool buffer (possibly an earlier, larger site's) is pinned by it
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in writer.held.values())
        files = {f for f, _ in writer.held}
        # a site is held whole: every key its file holds, or none
        for f in files:
            site = next(s for s in writer.sites if s.file == f)
            stored = {k for k in site.stats if k not in site.refs and k not in site.stats_only}
            assert {k for ff, k in writer.held if ff == f} == stored
        sizes.append(held)
    assert sizes[0] == 0 and 0 < sizes[1] < sizes[2]


def test_a_large_site_is_not_held_whatever_the_budget(tmp_path, monkeypatch):
    """Holding a large activation raised bench_profiler's peak memory (1.17x -> 1.21x a plain forward): only sites up
    to HOLD_SITE_BYTES are held."""
    model, prepared, batches = _models()
    from quantlens.profiler.torch_access import TorchModelAccess

    monkeypatch.setattr(writer_module, "HOLD_SITE_BYTES", 2 * 8 * 12 * 12 * 4 - 1)  # under a conv's output
    writer = TraceWriter(tmp_path / "t", "baseline", "float", hold_bytes=1 << 30)
    TorchModelAccess(model, "baseline").run(batches[1], sink=writer)
    writer.finish({})
    held_files = {f for f, _ in writer.held}
    big = {s.file for s in writer.sites if s.name in ("conv1", "act1", "conv2")}
    assert big and not big & held_files
    assert held_files  # the small sites (the linear, the mean) still are


def test_a_held_value_is_handed_to_the_same_input_run_as_a_copy(tmp_path):
    """The same-input run feeds the baseline's inputs to the analysis model's op, which may work in place: it gets
    its own copy, as from a file, and the held value stays as written."""
    model, prepared, batches = _models()
    qa = QuantAnalysis(model, prepared, "fake_quant", tmp_path, progress=False)
    qa.set_bad_case(batches[1])
    qa.run(run_analysis_model=False)
    plain = reader_module.TraceReader(tmp_path / "baseline_model")
    value = plain.inputs("act1")[0]
    held = reader_module.TraceReader(tmp_path / "baseline_model", held={("x", "y"): value})
    site = held.by_name["act1"]
    key = next(k for k in site.stats if k.startswith("in"))
    held._held = {tuple(site.refs.get(key, (site.file, key))): value}
    got = held.inputs("act1")[0]
    assert torch.equal(got, value) and got.data_ptr() != value.data_ptr()
    assert held.tensors("act1")[key] is value  # (read-only readers get the held tensor itself)
    held.drop_held()
    assert torch.equal(held.inputs("act1")[0], value)

