"""The march's partition (issue #41): what the march cannot compute runs on the host in float at every stage, values
made inside ``forward`` are no model inputs, and index arithmetic is never fake-quantized.

Each reduction of a model that stopped before goes through prepare, calibration, pre_export, export, convert,
save/load, to_onnx and onnxruntime at its default options (``quantlens.zoo.coverage.run_stages``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.compiler.cost import estimate_latency
from quantlens.errors import QuantLensError
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.coverage import ONNXRUNTIME_PAIR, THRESHOLDS, run_stages


class _Convs(nn.Module):
    def __init__(self, out: int = 8):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, out, 3, padding=1)


class OnesLike(_Convs):
    def forward(self, x):
        y = self.conv(self.q(x))
        return self.dq(self.conv2(y * torch.ones_like(y)))


class FullLike(_Convs):
    def forward(self, x):
        y = self.conv(self.q(x))
        return self.dq(self.conv2(y + torch.full_like(y, 0.5)))


class CastRoundTrip(_Convs):
    def forward(self, x):
        y = self.conv(self.q(x))
        return self.dq(self.conv2(y.to(torch.float64).to(torch.float32)))


class BufferTransposePow(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(8, 8)
        self.register_buffer("buf", torch.randn(8, 8))

    def forward(self, x):
        return self.dq(self.lin(self.q(x)) + self.buf.t().pow(2)[0])


class EmbeddingTimesOnes(nn.Module):
    """Integer ids only: nothing for a QuantStub to mark."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.dq = nn.Embedding(20, 8), nn.Linear(8, 4), DeQuantStub()

    def forward(self, ids):
        return self.dq(self.lin(self.emb(ids) * torch.ones(ids.shape).unsqueeze(-1)))


from test_log_softmax import _Head as LogSoftmaxInSequential  # noqa: E402  (an nn.LogSoftmax inside a Sequential)


class PixelShuffleLast(_Convs):
    def __init__(self):
        super().__init__(out=12)

    def forward(self, x):
        return self.dq(torch.pixel_shuffle(self.conv2(self.conv(self.q(x))), 2))


class HostOps(_Convs):
    """Ops the march has no rule for between integer ops: an FFT's magnitude and a running product."""

    def forward(self, x):
        y = self.conv(self.q(x))
        spectrum = torch.fft.rfft(y, dim=-1).abs()
        running = torch.cumprod(torch.sigmoid(y), dim=-1)
        ordered, _ = torch.sort(y, dim=-1)
        return self.dq(self.conv2(spectrum[..., :4].repeat(1, 1, 1, 2) + running + ordered))


def _image():
    return torch.randn(2, 3, 8, 8)


CASES = {
    "ones_like": (OnesLike, _image), "full_like": (FullLike, _image), "cast": (CastRoundTrip, _image),
    "buf_t_pow": (BufferTransposePow, lambda: torch.randn(2, 8)),
    "embedding_ones": (EmbeddingTimesOnes, lambda: torch.randint(0, 20, (2, 6))),
    "log_softmax": (LogSoftmaxInSequential, lambda: torch.randn(2, 8)),
    "pixel_shuffle": (PixelShuffleLast, _image),
}


def _run(cls, make, onnx: bool = True):
    torch.manual_seed(0)
    model = cls().eval()
    return run_stages(cls.__name__, model, make(), [make() for _ in range(3)], make(), onnx=onnx)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reduction_goes_through_every_stage(name):
    result = _run(*CASES[name])
    assert result.failed_stage is None, result.error
    assert result.passed, {k: v for k, v in result.agreements.items() if v < THRESHOLDS[k]}


def test_host_ops_go_through_every_stage():
    """fft (a complex intermediate), cumprod and a sort between integer ops: float on the host through save/load, and
    in ONNX by torch's own exporter (cumprod through torch's decomposition, its prims.prod as a ReduceProd)."""
    result = _run(HostOps, _image)
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements


def _pipeline(cls, make, check_dir=None):
    torch.manual_seed(0)
    model, x = cls().eval(), make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = prepare(model, x, default_calibration_qconfig_setter, check_result_dir=check_dir)
    calibrated = calibrate(prepared, [make() for _ in range(2)])
    qat_ir = export(pre_export(calibrated, example_inputs=x), x)
    return prepared, qat_ir, convert(qat_ir), [str(w.message) for w in caught]


def test_host_sites_are_labelled_counted_and_costed(tmp_path):
    prepared, qat_ir, quantized, said = _pipeline(HostOps, _image, tmp_path)
    plans = prepared._quantlens_state.plans
    host = {n for n, p in plans.items() if p.host}
    assert host == {"fft_rfft_0", "cumprod_0"}
    assert all(not p.output_fq and not p.input_fq for n, p in plans.items() if n in host)  # no fake quant inside
    assert plans["add_0"].input_fq  # the host results are quantized where the integer region reads them
    line = [s for s in said if "run on the host" in s]
    assert len(line) == 1 and "2 op site(s)" in line[0] and "cumprod" in line[0]
    report = (tmp_path / "model_check_result.txt").read_text()
    assert "cumprod_0: no integer rule for 'cumprod'" in report
    rows = [line.split("|") for line in report.splitlines() if line.startswith(("| fft_rfft_0 ", "| cumprod_0 "))]
    assert [r[3].strip() for r in rows] == ["host", "host"]
    assert {n.site for n in qat_ir.graph.nodes if n.attrs.get("host")} >= {"fft_rfft_0", "cumprod_0"}
    estimate = estimate_latency(quantized)
    assert estimate.host_cycles > 0 and estimate.crossings >= 2
    assert estimate.crossing_cycles == estimate.crossings * 2000
    assert estimate.npu_mac_share == 1.0  # both convs stay on the NPU


def test_a_later_rule_moves_an_op_to_the_npu(monkeypatch):
    """The partition follows the op set: cumprod has no row, so it runs on the host; an op set row whose IR op
    convert lowers moves it to the NPU, with nothing else changed (log_softmax went that way with its rule)."""
    from quantlens.march import opset
    from quantlens.quantization.plan import march_lacks_rule

    prepared, *_ = _pipeline(HostOps, _image)
    site = prepared._quantlens_state.record.sites["cumprod_0"]
    assert prepared._quantlens_state.plans["cumprod_0"].host and march_lacks_rule(site)
    monkeypatch.setitem(opset.OPS, "cumprod", opset.OpDef("cumprod", opset.Category.REDUCTION, "§10.2", ("cumsum",)))
    assert not march_lacks_rule(site)
    log_softmax, *_ = _pipeline(LogSoftmaxInSequential, lambda: torch.randn(2, 8))
    assert not log_softmax._quantlens_state.plans["net.4.log_softmax_0"].host  # its rule: on the NPU


def test_integer_inputs_are_never_refused_for_missing_stubs():
    model = EmbeddingTimesOnes().eval()
    prepare(model, torch.randint(0, 20, (2, 6)), default_calibration_qconfig_setter, check_result_dir=None)


def test_real_float_inputs_without_stubs_are_still_refused_and_named():
    class NoStub(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x) * torch.ones(4)

    with pytest.raises(QuantLensError, match=r"no QuantStub.*lin \(input 0\)"):
        prepare(NoStub().eval(), torch.randn(2, 8), default_calibration_qconfig_setter, check_result_dir=None)


def test_values_made_inside_forward_run_on_the_host_exactly():
    """A mask and positions made inside forward (arange, a cast, log, ceil: index arithmetic) get no fake quant, so
    the gather reads exact indices at every stage."""

    class RelativePositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(self.q(x))
            pos = torch.arange(8)
            rel = (pos[:, None] - pos[None, :]).to(h.dtype)
            bucket = torch.ceil(torch.log(rel.abs() + 1) * 2.5).to(torch.long).clamp(max=7)
            return self.dq(torch.gather(h, 1, bucket[None].expand(h.shape[0], 8, 8)))

    torch.manual_seed(0)
    prepared, qat_ir, quantized, _ = _pipeline(RelativePositions, lambda: torch.randn(2, 8, 8))
    plans = prepared._quantlens_state.plans
    arithmetic = [n for n in plans if n.startswith(("log_", "ceil_", "abs_", "add_"))]
    assert arithmetic and all(plans[n].host or not plans[n].output_fq for n in arithmetic)
    assert not any(plans[n].output_fq for n in arithmetic)
    x = torch.randn(2, 8, 8)
    # the int32 accumulator against the float linear: float rounding only; a shifted index moves whole values
    assert torch.allclose(qat_ir(x), quantized(x), rtol=0, atol=1e-5)


_GROUPNORM_GRU = """
import torch
from torch import nn
from quantlens.quantization import QuantStub, DeQuantStub

class ConvGroupNormGRU(nn.Module):
    # a small CNN + GRU net with nn.GroupNorm, which calls layer_norm as a function
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(self.conv(self.q(x))).permute(0, 2, 1)
        out, _ = self.gru(h)
        return self.dq(self.head(out))

def float_model():
    torch.manual_seed(0)
    return ConvGroupNormGRU().eval()

def example_inputs():
    return torch.randn(2, 4, 6)

def calibration_data():
    return [torch.randn(2, 4, 6) for _ in range(2)]
"""


def test_groupnorm_and_a_gru_through_analyze_all(tmp_path):
    """`quantlens analyze --stage all` builds every stage as the Python flow does (pre_export gets the example
    inputs, so GroupNorm's functional layer_norm gets its table; the CONFIG's default dynamic batch) and analyses
    every pair."""
    from test_cli import ql

    config = tmp_path / "gru.py"
    config.write_text(_GROUPNORM_GRU)
    res = ql("analyze", config, "--stage", "all", "--out", tmp_path / "out", "--no-sensitivity")
    assert res.returncode in (0, 1), res.stdout[-2000:] + res.stderr
    for pair in ("fake_quant", "pre_export", "export", "convert", "onnxruntime"):
        assert (tmp_path / "out" / pair / "profiler.html").is_file(), pair


def test_the_profiler_labels_host_ops_and_gives_them_no_lsb_verdict(tmp_path):
    """The convert pair on a model with host ops: they are labelled host-side in the rows, and no LSB verdict
    (the integer model's figure of merit) is given to a float op on the host."""
    from quantlens.profiler import QuantAnalysis

    _, qat_ir, quantized, _ = _pipeline(HostOps, _image)
    qa = QuantAnalysis(qat_ir, quantized, "convert", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_image())
    qa.run()
    rows = {r.op_name: r for r in qa.compare_per_layer()}
    for site in ("fft_rfft_0", "cumprod_0"):
        assert rows[site].host_side, site
        assert rows[site].lsb_verdict == "" and rows[site].same_input_lsb_verdict == "", rows[site]
    assert not rows["conv"].host_side and rows["conv"].lsb_verdict  # the NPU op next to them has one


def test_inspect_shows_host_ops_with_their_cost(tmp_path):
    from test_cli import ql

    from quantlens.compiler import save

    _, _, quantized, _ = _pipeline(HostOps, _image)
    path = save(quantized, tmp_path / "quantized_ir.qlir")
    res = ql("inspect", path)
    assert res.returncode == 0, res.stderr
    assert "host ops (float, docs/march.md §12.1): 2 op site(s): cumprod_0, fft_rfft_0" in res.stdout
    assert "NPU-host crossing(s)" in res.stdout and "MACs on the NPU: 100.0 %" in res.stdout
    graph_rows = [line for line in res.stdout.splitlines() if "fft_rfft_0" in line and "│" in line]
    assert graph_rows and all("host" in line for line in graph_rows)


def _ids():
    return torch.randint(0, 99, (2, 8))


def test_gpt2_with_its_cache_goes_through_every_stage():
    """``use_cache=True``: the empty cache made inside forward is no model input, and the DynamicCache it returns is
    an IR output through transformers' own pytree form."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=True)
    model = transformers.GPT2Model(cfg).eval()
    result = run_stages("gpt2_cache", model, _ids(), [_ids() for _ in range(3)], _ids())
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements


def _deberta():
    """The tiny DeBERTa-v2 a newcomer brought (tests/newcomers/deberta.py, its CONFIG)."""
    pytest.importorskip("transformers")
    from newcomers.deberta import float_model

    return float_model()


def test_deberta_relative_positions_stay_exact():
    """DeBERTa-v2's relative-position buckets (sign, abs, log, ceil on positions made inside forward, then a cast and
    a gather) run on the host: no fake quant on them, so the gathers read exact indices at every stage."""
    model = _deberta()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, _ids(), default_calibration_qconfig_setter, check_result_dir=None)
    record, plans = prepared._quantlens_state.record, prepared._quantlens_state.plans
    arithmetic = [n for n, s in record.sites.items() if s.op_type in ("log", "ceil", "sign", "abs")]
    assert arithmetic and all(plans[n].host and not plans[n].output_fq for n in arithmetic)
    result = run_stages("deberta_v2", model, _ids(), [_ids() for _ in range(3)], _ids())
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements


def test_deberta_with_a_dynamic_batch_goes_through_every_stage_at_another_batch_size():
    """``pos.repeat(q.size(0) // heads, 1, 1)`` repeats by a count made from the dynamic batch: an index_select of
    one row per batch row. Exported at batch 2, every stage (onnxruntime too) runs batch 3 within the criteria."""
    model = _deberta()
    result = run_stages("deberta_v2_dynamic", model, _ids(), [_ids() for _ in range(3)],
                        torch.randint(0, 99, (3, 8)), dynamic_batch=True)
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements
    assert ONNXRUNTIME_PAIR in result.agreements


@pytest.mark.parametrize("count", ["batch", "batch // 2", "2 * batch"])
def test_repeat_by_a_count_made_from_the_dynamic_batch_matches_torch(count):
    class RepeatByBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.dq, self.lin = QuantStub(), DeQuantStub(), nn.Linear(4, 4)
            self.register_buffer("table", torch.randn(3, 4))

        def forward(self, x):
            n = eval(count, {"batch": x.size(0)})  # noqa: S307 - one of three fixed test expressions
            rows = self.lin(self.q(self.table)).repeat(n, 2)
            return self.dq(rows), self.dq(self.lin(self.q(x)))

    torch.manual_seed(0)
    model = RepeatByBatch().eval()
    make = lambda b=4: torch.randn(b, 4)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, make(), default_calibration_qconfig_setter, check_result_dir=None),
                             [make() for _ in range(3)])
    qat = export(pre_export(prepared, example_inputs=make()), make(), dynamic_batch=True)
    quantized = convert(qat)
    for batch in (2, 6):
        x = make(batch)
        expected = prepared(x)[0]
        assert expected.shape[0] == 3 * eval(count, {"batch": batch})  # noqa: S307
        assert torch.equal(qat(x)[0], expected)
        assert quantized(x)[0].shape == expected.shape
        assert torch.equal(quantized(x)[0], qat(x)[0])


def test_analyze_reports_the_pairs_built_before_a_stage_that_fails(tmp_path):
    """A host op torch's ONNX exporter has no form for (erfinv): the ONNX stage fails, and `quantlens analyze
    --stage all` still writes the reports of every pair built before it, names the stage and why, and exits 2."""
    from test_cli import ql

    body = ("import torch\n"
            "from quantlens.quantization import QuantStub, DeQuantStub\n"
            "class Net(torch.nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.q, self.dq = QuantStub(), DeQuantStub()\n"
            "        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)\n"
            "    def forward(self, x):\n"
            "        return self.dq(self.b(torch.special.erfinv(torch.tanh(self.a(self.q(x))) * 0.9)))\n"
            "def float_model():\n"
            "    torch.manual_seed(0)\n"
            "    return Net().eval()\n"
            "def example_inputs():\n    return torch.randn(4, 6)\n"
            "def calibration_data():\n    return [torch.randn(4, 6) for _ in range(2)]\n"
            "dynamic_batch = False\n")
    config = tmp_path / "erfinv.py"
    config.write_text(body)
    res = ql("analyze", config, "--stage", "all", "--out", tmp_path / "out", "--no-sensitivity")
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr
    assert "stage onnx failed" in res.stderr and "erfinv" in res.stderr and "Traceback" not in res.stderr
    for pair in ("fake_quant", "pre_export", "export", "convert"):
        assert (tmp_path / "out" / pair / "profiler.html").is_file(), pair
    assert not (tmp_path / "out" / "onnxruntime" / "profiler.html").exists()
    import json

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failed_stage"]["stage"] == "onnx"


@torch.library.custom_op("qltest::scaled_cumsum", mutates_args=())
def _scaled_cumsum(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, dim=-1) * offs.to(x.dtype).sum()


@_scaled_cumsum.register_fake
def _(x, offs):
    return torch.empty_like(x)


class LibraryOp(_Convs):
    """A library's custom operator (as transformers' MoE layers call one) between integer ops, fed an integer
    tensor made inside forward with a dtype argument (cumsum(..., dtype=int32))."""

    def forward(self, x):
        y = self.conv(self.q(x))
        offs = torch.cumsum(torch.ones(3), dim=0, dtype=torch.int32)
        return self.dq(self.conv2(torch.ops.qltest.scaled_cumsum(y, offs)))


def test_a_library_custom_op_runs_on_the_host(tmp_path):
    result = _run(LibraryOp, _image, onnx=False)
    assert result.failed_stage is None, result.error
    prepared, qat_ir, quantized, _ = _pipeline(LibraryOp, _image)
    assert prepared._quantlens_state.plans["scaled_cumsum_0"].host
    assert any(n.op == "host_aten" and n.attrs["target"] == "qltest::scaled_cumsum.default" for n in qat_ir.graph.nodes)
    x = _image()
    assert torch.allclose(quantized(x), qat_ir(x), atol=0.05)
    with pytest.raises(QuantLensError, match=r"scaled_cumsum.*torch's ONNX exporter has no form"):
        from quantlens.compiler import to_onnx

        to_onnx(qat_ir, tmp_path / "m.onnx")


def test_analyze_writes_each_pair_as_soon_as_its_two_models_exist(tmp_path, monkeypatch):
    """`--stage all` analyses a pair right after its second model is built: when export starts, the fake_quant and
    pre_export pairs' reports are already on disk (a slow or failing export holds nothing back)."""
    from rich.console import Console

    from quantlens.cli import stages as stages_mod
    from quantlens.cli.analyze import analyze_config
    from quantlens.cli.config import load_config

    config = tmp_path / "small.py"
    config.write_text(
        "import torch\n"
        "from quantlens.quantization import QuantStub, DeQuantStub\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.q, self.dq, self.a = QuantStub(), DeQuantStub(), torch.nn.Linear(6, 3)\n"
        "    def forward(self, x):\n"
        "        return self.dq(self.a(self.q(x)))\n"
        "def float_model():\n    torch.manual_seed(0)\n    return Net().eval()\n"
        "def example_inputs():\n    return torch.randn(4, 6)\n"
        "def calibration_data():\n    return [torch.randn(4, 6) for _ in range(2)]\n"
        "dynamic_batch = False\n")
    out = tmp_path / "out"
    seen = {}
    real_export = stages_mod._export

    def export_after_looking(flow, s):
        seen.update({pair: (out / pair / "profiler.html").is_file() for pair in ("fake_quant", "pre_export", "export")})
        raise RuntimeError("export stopped by the test")

    steps = tuple((st, name, export_after_looking if run is real_export else run) for st, name, run in stages_mod._STEPS)
    monkeypatch.setattr(stages_mod, "_STEPS", steps)
    code = analyze_config(load_config(config), ["fake_quant", "pre_export", "export", "convert"], out,
                          sensitivity=False, console=Console(file=open(tmp_path / "log.txt", "w")), progress=False)
    assert seen == {"fake_quant": True, "pre_export": True, "export": False}
    assert code == 2
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_stage"]["stage"] == "export"
    assert [p["analysis_type"] for p in summary["pairs"]] == ["fake_quant", "pre_export", "export", "convert"]
