"""The ``onnxruntime`` analysis type: the qat IR (baseline) against its ONNX model (``to_onnx``) run by onnxruntime.

What is measured (zoo models, ``default_calibration_qconfig_setter``, 3 calibration batches), at ``ORT_DISABLE_ALL``
(onnxruntime 1.32, CPU). Characterised over 20 sample batches of 16 per model; the tests use one of them (the
first) as the bad case and assert the bounds below:

* every op site of the qat IR is traced in onnxruntime and matched by name (nothing only on one side);
* grid rows (qint8 sites; the ``lsb_verdict`` column): no row ever above 4 LSB ("diverged": never); rows bit-exact
  or within 1 LSB: at least 69% (tiny_resnet), 88% (tiny_transformer), 100% (multitask) of a run's grid rows;
  elements off by >= 1 LSB over all grid rows: at most 0.056%, 0.13%, 0.003%. Asserted: no row diverged, >= 60%
  of rows within 1 LSB, <= 0.5% of elements off (and <= 2% in any one row; measured <= 0.8%).
  Where it comes from: float ops that round differently at a half step (onnxruntime's conv/GEMM sum in another
  order) flip a code by one step, and flips compound downstream (tiny_resnet's layer2: up to 3-4 LSB). The table
  ops (softmax, layer norm, GELU) are exported as their integer arithmetic (``compiler.onnx_tables``), so they
  add no difference of their own: on tiny_transformer every row is bit-exact on 5 of 5 bad cases (it was
  within 1 LSB from ``attn.softmax_0`` on while the softmax ran as ONNX ``Softmax``). Asserted: a table row is
  bit-exact whenever every row before it is, and on the bad case every tiny_transformer row is.
* rows without a grid (a conv whose ReLU is fused after it, the float head linear, reshapes): while every grid
  row before them is bit-exact they differ by float32 summation order only (measured max |diff| / max |baseline|
  <= 6.5e-7; asserted <= 1e-5); after a flipped code they inherit it (measured cosine >= 0.999993; asserted
  >= 0.9999).

At ``ORT_ENABLE_ALL`` onnxruntime fuses Q/DQ groups into its own integer kernels, so only the model outputs are
fetched: the comparison has a row for each site whose value is a model output, every other site is listed as
only in the baseline. tiny_transformer's output then differs a little (onnxruntime's integer GEMM kernels):
asserted cosine > 0.999 and Atol > 0. tiny_resnet: cosine 1 - 7e-15, Atol 9e-8.
"""

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from quantlens.compiler import export, to_onnx  # noqa: E402
from quantlens.errors import QuantLensError  # noqa: E402
from quantlens.profiler import AnalysisType, QuantAnalysis  # noqa: E402
from quantlens.profiler import OnnxModelAccess  # noqa: E402
from quantlens.quantization import calibrate, pre_export, prepare  # noqa: E402
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter  # noqa: E402
from quantlens.zoo import example_inputs, get_model, sample_batches  # noqa: E402

#: bounds of the docstring (grid rows: LSB of the site's scale; float rows: relative to max |baseline|)
FLOAT_RTOL = 1e-5
FLOAT_COSINE = 0.9999
ROWS_WITHIN_1_LSB = 0.6
ELEMENTS_OFF = 0.005
ROW_ELEMENTS_OFF = 0.02


def _pipeline(name, tmp_path_factory):
    example = example_inputs(name)
    prepared = prepare(get_model(name), example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, sample_batches(name, 3, 4))
    qat_ir = export(pre_export(prepared), example, dynamic_batch=True)
    path = to_onnx(qat_ir, tmp_path_factory.mktemp(name) / "model.onnx")
    return prepared, qat_ir, path, example


@pytest.fixture(scope="module", params=["tiny_resnet", "tiny_transformer"])
def zoo(request, tmp_path_factory):
    return (request.param, *_pipeline(request.param, tmp_path_factory))


@pytest.fixture(scope="module")
def multitask(tmp_path_factory):
    return _pipeline("multitask", tmp_path_factory)


def _bad_case(name):
    return sample_batches(name, 1, 16)[0]


def _hist(row) -> list[int]:
    return [int(part.split(":")[1]) for part in row.lsb_hist.split("|")]


def _check_rows(table) -> dict:
    """Assert the docstring's bounds on a disable_all comparison; returns what was measured."""
    grid, within1, off, total, clean, worst_rtol = 0, 0, 0, 0, True, 0.0
    for row in table:
        assert row.compared, row
        assert "onnxruntime runs the whole graph" in row.note and row.same_input_cosine is None
        if row.scale is not None:
            hist = _hist(row)
            grid += 1
            within1 += row.lsb_verdict in ("bit-exact", "within 1 LSB")
            assert row.lsb_verdict != "diverged", (row.op_name, row.lsb_hist)
            assert 1 - hist[0] / sum(hist) <= ROW_ELEMENTS_OFF, (row.op_name, row.lsb_hist)
            off, total = off + sum(hist) - hist[0], total + sum(hist)
            clean = clean and row.lsb_verdict == "bit-exact"
        else:
            assert row.lsb_verdict == "", row
            assert row.Cosine >= FLOAT_COSINE, (row.op_name, row.Cosine)
            if clean:
                rtol = row.Atol / max(abs(row.base_min), abs(row.base_max), 1e-30)
                worst_rtol = max(worst_rtol, rtol)
                assert rtol <= FLOAT_RTOL, (row.op_name, row.Atol)
    assert within1 >= ROWS_WITHIN_1_LSB * grid, (within1, grid)
    assert off <= ELEMENTS_OFF * total, (off, total)
    return {"grid": grid, "within1": within1, "off": off, "total": total, "float_rtol": worst_rtol}


def test_analysis_type_is_deployed():
    kind = AnalysisType("onnxruntime")
    assert kind is AnalysisType.ONNXRUNTIME and kind.deployed


def test_every_site_matched_within_bounds(zoo, tmp_path):
    name, _, qat_ir, path, _ = zoo
    qa = QuantAnalysis(qat_ir, str(path), "onnxruntime", out_dir=tmp_path, progress=False)
    assert isinstance(qa.analysis, OnnxModelAccess) and qa.analysis.reference is qa.baseline
    qa.set_bad_case(_bad_case(name))
    result = qa.run()
    assert result.baseline_sites == result.analysis_sites == len(qa.baseline.sites)
    table = qa.compare_per_layer()
    assert table.only_in_baseline == [] and table.only_in_analysis == []
    assert [r.op_name for r in table] == qa.baseline.sites
    measured = _check_rows(table)
    assert measured["grid"] == {"tiny_resnet": 13, "tiny_transformer": 17}[name]
    rows = list(table)
    for k, row in enumerate(rows):  # the tables run in ONNX as their integer arithmetic: exact on exact inputs
        if row.analy_op_type in ("lut", "segment_lut", "int_softmax", "int_layer_norm") and \
                all(r.lsb_verdict in ("", "bit-exact") for r in rows[:k]):
            assert row.lsb_verdict == "bit-exact", (row.op_name, row.lsb_hist)
    if name == "tiny_transformer":
        assert any(r.analy_op_type == "int_softmax" for r in rows)
        assert all(r.lsb_verdict in ("", "bit-exact") for r in rows), [(r.op_name, r.lsb_verdict) for r in rows]
    assert (tmp_path / "compare_per_layer_out.csv").is_file() and (tmp_path / "profiler.html").is_file()


def test_a_perturbed_weight_shows_at_its_site(zoo, tmp_path):
    """The comparison really matches by site: negate one weight in the ONNX model and the rows before that op
    stay bit-exact while its first grid row diverges."""
    name, _, qat_ir, path, _ = zoo
    site = {"tiny_resnet": "layer2.conv1", "tiny_transformer": "attn.k_proj"}[name]
    proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    node = next(n for n in proto.graph.node if n.name.startswith(site + "/") and n.op_type == "DequantizeLinear"
                and n.input[0] in inits and len(inits[n.input[0]].dims) >= 2)
    weight = onnx.numpy_helper.to_array(inits[node.input[0]])
    inits[node.input[0]].CopyFrom(onnx.numpy_helper.from_array(-weight, node.input[0]))
    qa = QuantAnalysis(qat_ir, proto, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_bad_case(name))
    qa.run()
    table = qa.compare_per_layer()
    names = [r.op_name for r in table]
    before = [r for r in table[: names.index(site)] if r.scale is not None]
    assert before and all(r.lsb_verdict == "bit-exact" for r in before)
    after = next(r for r in table[names.index(site):] if r.scale is not None)
    assert after.lsb_verdict == "diverged", after
    assert table.first_diverged.op_name == after.op_name


def test_optimized_session_compares_outputs(zoo, tmp_path):
    name, _, qat_ir, path, _ = zoo
    access = OnnxModelAccess(path, "analysis", optimization="all")
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_bad_case(name))
    result = qa.run()
    out_site = {"tiny_resnet": "fc", "tiny_transformer": "classifier"}[name]
    assert result.analysis_sites == 1 and result.baseline_sites == len(qa.baseline.sites)
    table = qa.compare_per_layer()
    assert [r.op_name for r in table] == [out_site]
    assert [s for s, _ in table.only_in_baseline] == [s for s in qa.baseline.sites if s != out_site]
    assert table.only_in_analysis == []
    row = table[out_site]
    assert row.Cosine > 0.999
    if name == "tiny_transformer":  # onnxruntime's integer GEMM kernels round apart from the float ones
        assert row.Atol > 0
    # the outputs compared are the model outputs: the same tensors as a plain forward of each model
    base, analy = qa.baseline.run(qa.bad_case), access.run(qa.bad_case)
    torch.testing.assert_close(torch.tensor(row.Atol), (base - analy).abs().max(), rtol=1e-6, atol=0)
    with pytest.raises(QuantLensError, match="ORT_DISABLE_ALL"):
        OnnxModelAccess(path, "analysis", optimization="fast")


def test_multitask_input_formats_and_separate_runs(multitask, tmp_path):
    _, qat_ir, path, example = multitask
    inputs, tasks = example
    assert tasks == ["cls", "reg"]
    proto = onnx.load(str(path))
    rows = {}
    for fmt, case in (("torch", example), ("deploy", inputs)):
        qa = QuantAnalysis(qat_ir, proto, "onnxruntime", out_dir=tmp_path / fmt, progress=False)
        qa.set_bad_case(case)
        assert qa.run().outputs == ["cls", "reg"]
        table = qa.compare_per_layer()
        assert table.only_in_baseline == [] and table.only_in_analysis == []
        assert _check_rows(table)["grid"] == 7
        rows[fmt] = [(r.op_name, r.lsb_hist, r.Atol) for r in table]
    assert rows["torch"] == rows["deploy"]

    # baseline on the torch pytree, analysis later on the deployment format: the digest compares tensor values
    qa = QuantAnalysis(qat_ir, proto, "onnxruntime", out_dir=tmp_path / "split", progress=False)
    qa.set_bad_case(example)
    qa.run(run_baseline_model=True, run_analysis_model=False)
    qa.set_bad_case(inputs)
    assert qa.run(run_baseline_model=False, run_analysis_model=True).analysis_sites == 13
    assert [(r.op_name, r.lsb_hist, r.Atol) for r in qa.compare_per_layer()] == rows["torch"]
    # a different tensor is refused
    qa.set_bad_case({k: v + 1 for k, v in inputs.items()})
    with pytest.raises(QuantLensError, match="another bad case"):
        qa.run(run_baseline_model=False, run_analysis_model=True)


def test_sensitivity_and_wrong_pairs_refused(multitask, tmp_path):
    prepared, qat_ir, path, example = multitask
    qa = QuantAnalysis(qat_ir, path, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example)
    with pytest.raises(QuantLensError, match="not offered for 'onnxruntime'"):
        qa.sensitivity()
    with pytest.raises(QuantLensError, match="baseline_model must be the qat IR"):
        QuantAnalysis(prepared, path, "onnxruntime", out_dir=tmp_path, progress=False)
    with pytest.raises(QuantLensError, match="analysis_model must be the ONNX model"):
        QuantAnalysis(prepared, qat_ir, "onnxruntime", out_dir=tmp_path, progress=False)
    with pytest.raises(QuantLensError, match="analysed with 'onnxruntime'"):
        QuantAnalysis(prepared, path, "export", out_dir=tmp_path, progress=False)
    with pytest.raises(QuantLensError, match="does not exist"):
        QuantAnalysis(qat_ir, tmp_path / "missing.onnx", "onnxruntime", out_dir=tmp_path, progress=False)
    lone = OnnxModelAccess(path, "analysis")  # no reference: it cannot name the inputs or the sites
    with pytest.raises(QuantLensError, match="needs the qat IR"):
        lone.run(example)


def test_optimized_outputs_matched_by_position(multitask, tmp_path):
    """An optimized session fetches the model outputs by position, so renamed ONNX outputs still land on the op
    sites that compute them (both heads of the multi-task model)."""
    _, qat_ir, path, example = multitask
    proto = onnx.load(str(path))
    for i, out in enumerate(proto.graph.output):
        proto.graph.node.append(onnx.helper.make_node("Identity", [out.name], [f"task{i}"], name=f"rename{i}"))
        out.name = f"task{i}"
    access = OnnxModelAccess(proto, "analysis", optimization="all")
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example[0])
    assert qa.run().analysis_sites == 2
    table = qa.compare_per_layer()
    assert [r.op_name for r in table] == ["cls_head", "reg_head"]
    assert len(table.only_in_baseline) == len(qa.baseline.sites) - 2
    assert all(r.Cosine > 0.9999 for r in table)
    out = access.run(example)
    assert isinstance(out, dict) and set(out) == {"cls", "reg"}
