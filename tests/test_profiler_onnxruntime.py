"""The ``onnxruntime`` analysis type: the qat IR (baseline) against its ONNX model (``to_onnx``) run by onnxruntime.

What is measured (zoo models, ``default_calibration_qconfig_setter``, 3 calibration batches, ``to_onnx``'s default
``Q -> Cast -> Mul`` form; onnxruntime 1.32, CPU: an AMD EPYC with AVX-512 and VNNI) at both levels the access runs
with: ``"all"`` (``ORT_ENABLE_ALL``, onnxruntime's default and ``OnnxModelAccess``'s) and ``"disable_all"``.
Characterised over 20 sample batches of 16 per model (``sample_batches(name, 20, 16)``); the tests use one of them
(the first) as the bad case and assert the bounds below:

* every op site of the qat IR is traced in onnxruntime at both levels and matched by name (nothing only on one
  side); at ``"all"`` the traced session's model outputs equal a plain session's bit for bit on 20 of 20 batches
  of every model (the per-op graph outputs block no fusion that changes a value);
* grid rows (qint8 sites; the ``lsb_verdict`` column): no row ever above 4 LSB ("diverged": never). Rows bit-exact
  or within 1 LSB, the least over the 20 batches: tiny_resnet 69% (``disable_all``) / 61.5% (``all``),
  tiny_transformer 100% / 100%, multitask 100% / 100%; every grid row bit-exact on 15 / 16 of 20 batches
  (tiny_resnet), 20 / 20 (tiny_transformer), 19 / 20 (multitask). Elements off by >= 1 LSB over all grid rows: at
  most 0.056% / 0.14% (tiny_resnet), 0 (tiny_transformer), 0.003% / 0 (multitask); in any one row at most 0.52% /
  0.67%. Asserted: no row diverged, >= 50% of rows within 1 LSB, <= 0.5% of elements off (and <= 2% in any one
  row). Where it comes from: float ops that round differently at a half step (onnxruntime's conv/GEMM sum in
  another order; at ``"all"`` also its NCHWc convolutions and ``FusedMatMul``) flip a code by one step, and flips
  compound downstream (tiny_resnet's layer2: up to 3-4 LSB). The table ops (softmax, layer norm, GELU) are exported
  as their integer arithmetic (``compiler.onnx.tables``), so they add no difference of their own. Asserted: a table
  row is bit-exact whenever every row before it is, and on the bad case every tiny_transformer grid row is.
* rows without a grid (a conv whose ReLU is fused after it, the float head linear, reshapes): while every grid
  row before them is bit-exact they differ by float32 summation order only (measured max |diff| / max |baseline|
  <= 6.5e-7; asserted <= 1e-5); after a flipped code they inherit it (measured cosine >= 0.9999956; asserted
  >= 0.9999). Some of them always differ (tiny_transformer's classifier on every batch), so the pipeline's
  ``onnxruntime`` pair is "differs", not "exact", even where every grid row is bit-exact.

A model written with ``standard_qdq=True`` (``DequantizeLinear``) is fused by onnxruntime into its integer kernels
at ``"all"``, so only the model outputs are fetched there: the comparison has a row for each site whose value is
a model output (its note says why), every other site is listed as only in the baseline. Measured on the bad case:
cosine >= 1 - 2e-14 and Atol 5e-8 to 9e-8 for every zoo model (onnxruntime's integer kernels; with VNNI they do not
saturate). Asserted: cosine > 0.999 and the row equals a plain forward of both models.
"""

import json

import pytest
import torch
from rich.console import Console

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from _ort import saturating_kernels  # noqa: E402

from quantlens.cli.pipeline import PairVerdict, analyze_pair, print_losses, write_index, write_summary  # noqa: E402
from quantlens.compiler import export, to_onnx  # noqa: E402
from quantlens.errors import QuantLensError  # noqa: E402
from quantlens.profiler import (  # noqa: E402
    AnalysisType,
    OnnxModelAccess,  # noqa: E402
    QuantAnalysis,
)
from quantlens.profiler.ir_access import IRModelAccess  # noqa: E402
from quantlens.quantization import calibrate, pre_export, prepare  # noqa: E402
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter  # noqa: E402
from quantlens.zoo import example_inputs, get_model, sample_batches  # noqa: E402

#: bounds of the docstring (grid rows: LSB of the site's scale; float rows: relative to max |baseline|)
FLOAT_RTOL = 1e-5
FLOAT_COSINE = 0.9999
ROWS_WITHIN_1_LSB = 0.5
LEVELS = ("all", "disable_all")
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
    """Assert the docstring's bounds on a comparison of every op site; returns what was measured."""
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


def test_default_level_is_onnxruntimes_default(multitask):
    _, qat_ir, path, _ = multitask
    assert OnnxModelAccess(path).optimization == "all"
    qa = QuantAnalysis(qat_ir, str(path), "onnxruntime", progress=False)
    assert qa.analysis.optimization == "all" and "ORT_ENABLE_ALL" in qa.analysis.describe()
    assert qa.analysis.form == "exact" and not qa.analysis.outputs_only


@pytest.mark.parametrize("level", LEVELS)
def test_every_site_matched_within_bounds(zoo, level, tmp_path):
    name, _, qat_ir, path, _ = zoo
    access = OnnxModelAccess(path, "analysis", optimization=level)
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path, progress=False)
    assert qa.analysis is access and access.reference is qa.baseline
    qa.set_bad_case(_bad_case(name))
    result = qa.run()
    assert result.baseline_sites == result.analysis_sites == len(qa.baseline.sites)
    table = qa.compare_per_layer()
    assert table.only_in_baseline == [] and table.only_in_analysis == []
    assert [r.op_name for r in table] == qa.baseline.sites
    measured = _check_rows(table)
    assert measured["grid"] == {"tiny_resnet": 13, "tiny_transformer": 17}[name]
    # above disable_all the traced session (every site a graph output) is checked against a plain one
    if level == "disable_all":
        assert access.output_check is None
    else:
        assert access.output_check.equal and access.output_check.max_abs_diff == 0.0, access.output_check
        assert all("differ from a plain" not in r.note for r in table)
    rows = list(table)
    for k, row in enumerate(rows):  # the tables run in ONNX as their integer arithmetic: exact on exact inputs
        if row.analy_op_type in ("lut", "segment_lut", "int_softmax", "int_layer_norm") and \
                all(r.lsb_verdict in ("", "bit-exact") for r in rows[:k]):
            assert row.lsb_verdict == "bit-exact", (row.op_name, row.lsb_hist)
    if name == "tiny_transformer":
        assert any(r.analy_op_type == "int_softmax" for r in rows)
        assert all(r.lsb_verdict in ("", "bit-exact") for r in rows), [(r.op_name, r.lsb_verdict) for r in rows]
    assert (tmp_path / "compare_per_layer_out.csv").is_file() and (tmp_path / "profiler.html").is_file()
    # no same-input data is said as such, not as "(none)"
    assert "first op whose own kernel is not bit-exact: (no same-input data)" in \
        (tmp_path / "compare_per_layer_out.txt").read_text()
    assert "not bit-exact: <b>(no same-input data)</b>" in (tmp_path / "profiler.html").read_text()


def _perturbed(path, site):
    """The ONNX model at ``path`` with the weight of ``site`` negated: its int8 initializer, read by the ``Cast``
    of the weight's dequantization (``Cast -> Mul(scale)``)."""
    proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    node = next(n for n in proto.graph.node if n.name.startswith(site + "/") and n.op_type == "Cast"
                and n.input[0] in inits and len(inits[n.input[0]].dims) >= 2)
    weight = onnx.numpy_helper.to_array(inits[node.input[0]])
    assert weight.dtype.name == "int8"
    inits[node.input[0]].CopyFrom(onnx.numpy_helper.from_array(-weight, node.input[0]))
    return proto


PERTURBED_SITE = {"tiny_resnet": "layer2.conv1", "tiny_transformer": "attn.k_proj"}


@pytest.mark.parametrize("level", LEVELS)
def test_a_perturbed_weight_shows_at_its_site(zoo, level, tmp_path):
    """The comparison really matches by site: negate one weight in the ONNX model and the rows before that op
    stay bit-exact while its first grid row diverges."""
    name, _, qat_ir, path, _ = zoo
    site = PERTURBED_SITE[name]
    access = OnnxModelAccess(_perturbed(path, site), "analysis", optimization=level)
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_bad_case(name))
    qa.run()
    table = qa.compare_per_layer()
    names = [r.op_name for r in table]
    before = [r for r in table[: names.index(site)] if r.scale is not None]
    assert before and all(r.lsb_verdict == "bit-exact" for r in before)
    after = next(r for r in table[names.index(site):] if r.scale is not None)
    assert after.lsb_verdict == "diverged", after
    assert table.first_diverged.op_name == after.op_name


def test_pair_verdict_names_the_perturbed_op(zoo, tmp_path):
    """The pipeline's onnxruntime pair (onnxruntime's default level) on an ONNX file with one weight negated is
    not called exact: it differs, and its worst op is the first op that diverges, in every summary."""
    name, _, qat_ir, path, _ = zoo
    bad = tmp_path / "perturbed.onnx"
    onnx.save(_perturbed(path, PERTURBED_SITE[name]), str(bad))
    result = analyze_pair("onnxruntime", qat_ir, str(bad), tmp_path / "onnxruntime", None, _bad_case(name),
                          sensitivity=False)
    assert result.verdict is PairVerdict.DIFFERS and result.worst_op is not None
    assert result.worst_op == result.lsb["first_diverged"], result
    assert result.worst_diff == "diverged: > 4 LSB" and result.worst_sqnr is None
    assert result.compared == len(IRModelAccess(qat_ir, "baseline").sites) and 0 < result.differing <= result.compared
    assert "ORT_ENABLE_ALL" in result.note and "equal a plain session's" in result.note
    meta = json.loads((tmp_path / "onnxruntime" / "quantlens_pair.json").read_text())
    assert meta["onnxruntime"]["optimization"] == "all" and meta["onnxruntime"]["output_check"]["equal"]
    index = write_index([result], tmp_path).read_text()
    assert "none (exact)" not in index and f"{result.worst_op} (diverged: &gt; 4 LSB)" in index
    summary = json.loads(write_summary([result], tmp_path).read_text())
    assert summary["pairs"][0]["verdict"] == "differs" and summary["culprit"]["op"] == result.worst_op
    console = Console(record=True, width=200)
    print_losses(console, [result])
    text = console.export_text()
    assert f"precision is lost most at {result.worst_op}" in text and "none (exact)" not in text


def test_outputs_check_reports_a_difference(multitask, tmp_path):
    """When the plain session's model outputs differ from the traced session's (a fusion the per-op outputs
    blocked), the access says so on every row; it does not pass the traced values off as the plain session's. A
    plain session of a perturbed model stands for that fusion here."""
    _, qat_ir, path, example = multitask
    access = OnnxModelAccess(path, "analysis")
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path / "same", progress=False)
    qa.set_bad_case(example)
    qa.run()
    assert access.output_check.equal
    rows = [(r.op_name, r.Atol) for r in qa.compare_per_layer()]
    access._sessions[()] = OnnxModelAccess(_perturbed(path, "cls_head"), "analysis")._session(())
    qa.run()
    check = access.output_check
    assert not check.equal and check.max_abs_diff > 0 and check.level == "ORT_ENABLE_ALL"
    table = qa.compare_per_layer()
    assert [(r.op_name, r.Atol) for r in table] == rows  # the rows are still the traced session's
    assert all("differ from a plain ORT_ENABLE_ALL session's" in r.note for r in table)


@pytest.mark.parametrize("level", LEVELS)
def test_standard_qdq_form(zoo, level, tmp_path):
    """A standard-QDQ model (DequantizeLinear) is fused into onnxruntime's integer kernels at the default level,
    so there only its model outputs are fetched (the rows say why); at disable_all every site is traced."""
    name, _, qat_ir, _, _ = zoo
    path = to_onnx(qat_ir, tmp_path / "standard.onnx", standard_qdq=True)
    access = OnnxModelAccess(path, "analysis", optimization=level)
    assert access.form == "standard_qdq" and access.outputs_only == (level != "disable_all")
    qa = QuantAnalysis(qat_ir, access, "onnxruntime", out_dir=tmp_path, progress=False)
    qa.set_bad_case(_bad_case(name))
    result = qa.run()
    table = qa.compare_per_layer()
    if level == "disable_all":
        assert result.analysis_sites == len(qa.baseline.sites) and table.only_in_baseline == []
        assert all("standard QDQ form" not in r.note for r in table)
        return
    assert saturating_kernels(path, tmp_path), "onnxruntime no longer fuses the standard form"
    out_site = {"tiny_resnet": "fc", "tiny_transformer": "classifier"}[name]
    assert result.analysis_sites == 1 and result.baseline_sites == len(qa.baseline.sites)
    assert [r.op_name for r in table] == [out_site]
    assert [s for s, _ in table.only_in_baseline] == [s for s in qa.baseline.sites if s != out_site]
    assert table.only_in_analysis == []
    row = table[out_site]
    assert "standard QDQ form at ORT_ENABLE_ALL: only the model outputs" in row.note
    assert row.Cosine > 0.999
    # the outputs compared are the model outputs: the same tensors as a plain forward of each model
    base, analy = qa.baseline.run(qa.bad_case), access.run(qa.bad_case)
    torch.testing.assert_close(torch.tensor(row.Atol), (base - analy).abs().max(), rtol=1e-6, atol=0)
    with pytest.raises(QuantLensError, match="ORT_DISABLE_ALL"):
        OnnxModelAccess(path, "analysis", optimization="fast")


def test_exact_form_is_not_fused(zoo, tmp_path):
    """Why every site can be traced at the default level: onnxruntime leaves no integer kernel in the default
    form's graph, so a per-op output has no integer fusion to block."""
    _, _, _, path, _ = zoo
    assert saturating_kernels(path, tmp_path) == set()


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
    """An outputs-only session (standard QDQ form at the default level) fetches the model outputs by position, so
    renamed ONNX outputs still land on the op sites that compute them (both heads of the multi-task model)."""
    _, qat_ir, _, example = multitask
    proto = onnx.load(str(to_onnx(qat_ir, tmp_path / "standard.onnx", standard_qdq=True)))
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
