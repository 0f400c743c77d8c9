"""The deployed stages of QuantAnalysis: ``export`` (pre_export model vs qat IR) and ``convert`` (qat IR or
pre_export model vs quantized IR), on the zoo's tiny_resnet and multitask, in every accepted input format."""

import csv
import re
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from quantlens import QuantLensError
from quantlens.compiler import Module, convert, export, save
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.trace.reader import TraceReader
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization import prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


@dataclass
class Stages:
    name: str
    pre_export: torch.nn.Module
    qat_ir: object
    quantized_ir: object
    formats: dict  # input format -> one call's inputs in that format (the same tensors)


def _stages(name: str) -> Stages:
    example = example_inputs(name)
    extra = [(example[0], ["cls"])] if name == "multitask" else []
    calib = prepare(get_model(name), example, default_calibration_qconfig_setter, extra_example_inputs=extra,
                    check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 8, 16))
    pe = pre_export(calib)
    qat_ir = export(pe, example)
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor)]
    formats = {"torch": example, "by_name": dict(zip(qat_ir.input_names, tensors))}
    if name == "multitask":
        formats["deployment"] = (example[0],)  # the dict without the task list
    return Stages(name, pe, qat_ir, convert(qat_ir), formats)


@pytest.fixture(scope="module")
def tiny_resnet():
    return _stages("tiny_resnet")


@pytest.fixture(scope="module")
def multitask():
    return _stages("multitask")


@pytest.fixture(params=["tiny_resnet", "multitask"])
def stages(request):
    return request.getfixturevalue(request.param)


def _ir_format(s: Stages) -> str:
    return "deployment" if "deployment" in s.formats else "by_name"


def _analyse(baseline, analysis, kind, out_dir, base_case, analy_case=None):
    """run() with each side on its own input format (two calls when they differ), then compare_per_layer()."""
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=out_dir, progress=False)
    qa.set_bad_case(base_case)
    if analy_case is None:
        qa.run()
    else:
        qa.run(run_baseline_model=True, run_analysis_model=False)
        qa.set_bad_case(analy_case)
        qa.run(run_baseline_model=False, run_analysis_model=True)
    return qa, qa.compare_per_layer()


def _torch_fused_members(out_dir) -> set[str]:
    """Op sites a torch baseline trace (in ``out_dir``) computes inside a fused group's last op."""
    return {s.name for s in TraceReader(out_dir / "baseline_model").sites if s.fused_into}


def _assert_every_site_matched_or_listed(out_dir, table):
    base = {s.name for s in TraceReader(out_dir / "baseline_model").sites}
    analy = {s.name for s in TraceReader(out_dir / "analysis_model").sites}
    rows = {r.op_name for r in table}
    only_b, only_a = {n for n, _ in table.only_in_baseline}, {n for n, _ in table.only_in_analysis}
    assert rows == base & analy
    assert only_b == base - analy and only_a == analy - base
    assert rows | only_a == analy and rows | only_b == base
    assert len(rows) >= 0.5 * len(analy)


def _verdicts(table, column="lsb_verdict") -> Counter:
    return Counter(getattr(r, column) for r in table if getattr(r, column))


# -- export -----------------------------------------------------------------------------------------------
def test_export_qat_ir_equals_pre_export_at_every_row(stages, tmp_path):
    qa, table = _analyse(stages.pre_export, stages.qat_ir, "export", tmp_path, stages.formats["torch"],
                         stages.formats[_ir_format(stages)])
    _assert_every_site_matched_or_listed(tmp_path, table)
    assert table.only_in_analysis == []
    fused = _torch_fused_members(tmp_path)
    for name, op_type in table.only_in_baseline:  # BatchNorms folded into their conv, DeQuantStubs
        assert (name in fused and "fused into" in op_type) or op_type == "dequant_stub", (name, op_type)
    scored = [r for r in table if r.lsb_verdict]
    assert len(scored) >= 7 and len(scored) >= 0.5 * len(table)
    for row in scored:
        assert row.lsb_verdict == "bit-exact" and row.same_input_lsb_verdict == "bit-exact", row.op_name
        zero, *rest = row.lsb_hist.split("|")
        assert zero.startswith("0:") and int(zero[2:]) > 0 and rest == ["1:0", "2:0", "3-4:0", "5-8:0", ">8:0"]
    for row in table:  # rows without a grid (float conv outputs, float heads): identical values
        assert row.compared and row.Atol == 0, row.op_name
    assert table.first_diverged is None and table.first_inexact is None


def test_export_sensitivity_is_zero_for_every_op_site(stages, tmp_path):
    qa, table = _analyse(stages.pre_export, stages.qat_ir, "export", tmp_path, stages.formats["torch"])
    sens = qa.sensitivity()
    outputs = ["cls", "reg"] if stages.name == "multitask" else ["0"]
    assert sens.keys() == [f"{o}_L1" for o in outputs]
    rows = {r.op_name for r in table}
    for t in sens:
        assert len(t) >= 9
        assert {r.sensitive_type for r in t} == {"activation"}
        assert {r.op_name for r in t} <= rows
        assert all(r.value == 0 for r in t), [(r.op_name, r.value) for r in t if r.value]
        assert (tmp_path / f"output_{t.output}_L1_sensitive_ops.txt").is_file()


# -- convert ----------------------------------------------------------------------------------------------
def test_convert_tiny_resnet_is_within_one_lsb_and_never_diverges(tiny_resnet, tmp_path):
    s = tiny_resnet
    qa, table = _analyse(s.qat_ir, s.quantized_ir, "convert", tmp_path, s.formats["by_name"])
    _assert_every_site_matched_or_listed(tmp_path, table)
    scored = [r for r in table if r.lsb_verdict]
    # 14 rows on a grid (fc, int32 with a per-channel scale, has none). Spec v5's default qpp (16-bit multiplier,
    # add terms rounded to whole steps) makes a few convs and the adds round 1 LSB differently on the same input;
    # accumulated over the net a few rows reach 2-4 LSB, none diverges.
    assert len(scored) >= 12
    acc = _verdicts(table)
    assert set(acc) <= {"bit-exact", "within 1 LSB", "within 4 LSB"} and acc["bit-exact"] >= 2
    same = _verdicts(table, "same_input_lsb_verdict")
    assert set(same) <= {"bit-exact", "within 1 LSB"} and same["bit-exact"] >= 0.5 * len(scored)
    assert table.first_diverged is None
    first = table.first_inexact
    assert first is not None and first.same_input_lsb_verdict == "within 1 LSB"
    # with the high-precision qpp (consistency level 0) only the adds' own kernels are inexact, as in spec v4
    hp_ir = Module("qat", s.qat_ir.graph, s.qat_ir.input_leaves, s.qat_ir.input_spec, s.qat_ir.output_spec,
                   meta={**s.qat_ir.meta, "high_precision_qpp": True})
    _, hp_table = _analyse(s.qat_ir, convert(hp_ir), "convert", tmp_path / "hp", s.formats["by_name"])
    inexact = {r.analy_op_type for r in hp_table if r.same_input_lsb_verdict not in (None, "bit-exact")}
    assert inexact == {"add"}, inexact
    assert set(_verdicts(hp_table)) <= {"bit-exact", "within 1 LSB"}
    ones = sum(int(part.split(":")[1]) for r in scored for part in r.lsb_hist.split("|") if part.startswith("1:"))
    total = sum(int(part.split(":")[1]) for r in scored for part in r.lsb_hist.split("|"))
    # the default add rule rounds each term (F = 0): about a quarter of an add's outputs, and what they feed,
    # differ by 1 LSB (measured 11.5 % of all elements); most elements are exact
    assert 0 < ones < 0.25 * total
    for row in scored:
        assert row.atol_in_scale <= 4 + 1e-4, row.op_name  # "within 4 LSB" at most, as the verdicts say


def test_convert_only_in_lists_hold_fused_sites(stages, tmp_path):
    # the torch model tells which op sites are fused members
    _, from_torch = _analyse(stages.pre_export, stages.quantized_ir, "convert", tmp_path / "pe",
                             stages.formats["torch"], stages.formats[_ir_format(stages)])
    _assert_every_site_matched_or_listed(tmp_path / "pe", from_torch)
    fused = _torch_fused_members(tmp_path / "pe")
    for name, op_type in from_torch.only_in_baseline:
        assert (name in fused and "fused into" in op_type) or op_type == "dequant_stub", (name, op_type)
    _, from_ir = _analyse(stages.qat_ir, stages.quantized_ir, "convert", tmp_path / "ir",
                          stages.formats[_ir_format(stages)])
    _assert_every_site_matched_or_listed(tmp_path / "ir", from_ir)
    assert from_ir.only_in_analysis == [] and from_torch.only_in_analysis == []
    # the qat IR keeps the convs (and adds) whose value the quantized IR writes straight to the fused ReLU's grid
    assert from_ir.only_in_baseline and {n for n, _ in from_ir.only_in_baseline} <= fused
    # ... and says so: each is labelled with the site whose value holds it (trace.json's "folded")
    assert all("(fused into " in op_type for _, op_type in from_ir.only_in_baseline), from_ir.only_in_baseline
    # ... and the row holding each is named by the group's op types, as the fake_quant report names it
    for name, op_type in from_ir.only_in_baseline:
        into = op_type.split("(fused into ")[1].rstrip(")")
        assert from_ir[into].op_type.startswith(op_type.split(" ")[0] + "+"), (name, from_ir[into].op_type)
    # the qat IR computes what pre_export computes: same rows, same verdicts from either baseline
    assert [r.op_name for r in from_ir] == [r.op_name for r in from_torch]
    for a, b in zip(from_ir, from_torch):
        assert (a.lsb_verdict, a.lsb_hist, a.same_input_lsb_hist) == (b.lsb_verdict, b.lsb_hist, b.same_input_lsb_hist)


def test_convert_every_input_format_gives_the_same_report(stages, tmp_path):
    results = {}
    for fmt, case in stages.formats.items():
        _, table = _analyse(stages.qat_ir, stages.quantized_ir, "convert", tmp_path / fmt, case)
        results[fmt] = [(r.op_name, r.lsb_verdict, r.lsb_hist, r.same_input_lsb_hist) for r in table]
    assert len(results) == (3 if stages.name == "multitask" else 2)
    first = next(iter(results.values()))
    assert sum(1 for _, verdict, _, _ in first if verdict) >= 7
    for fmt, rows in results.items():
        assert rows == first, fmt
    # one side per format: the traces hold the same tensors, so the analysis run reuses the baseline trace
    _, mixed = _analyse(stages.qat_ir, stages.quantized_ir, "convert", tmp_path / "mixed", stages.formats["torch"],
                        stages.formats["by_name"])
    assert [(r.op_name, r.lsb_verdict, r.lsb_hist, r.same_input_lsb_hist) for r in mixed] == first


def test_convert_sensitivity_ranks_op_sites(stages, tmp_path):
    qa, table = _analyse(stages.qat_ir, stages.quantized_ir, "convert", tmp_path, stages.formats[_ir_format(stages)])
    sens = qa.sensitivity()
    outputs = ["cls", "reg"] if stages.name == "multitask" else ["0"]
    assert sens.keys() == [f"{o}_L1" for o in outputs]
    rows = {r.op_name: r for r in table}
    for t in sens:
        assert len(t) >= 7
        assert {r.sensitive_type for r in t} == {"activation"}
        assert {r.op_name for r in t} <= set(rows)
        values = [r.value for r in t]
        assert values == sorted(values, reverse=True) and values[0] > 0
        top = rows[t[0].op_name]  # the op whose integer value alone moves the output most is an inexact one
        assert top.lsb_verdict not in ("", "bit-exact"), (t[0].op_name, top.lsb_verdict)
        assert t[0].op_type == top.analy_op_type
        saved = torch.load(tmp_path / f"output_{t.output}_L1_sensitive_ops.pt", weights_only=True)
        assert [r["op_name"] for r in saved] == [r.op_name for r in t]


# -- reports and files ------------------------------------------------------------------------------------
def test_reports_carry_the_lsb_verdicts(tiny_resnet, tmp_path):
    s = tiny_resnet
    _, table = _analyse(s.qat_ir, s.quantized_ir, "convert", tmp_path, s.formats["torch"])
    with open(tmp_path / "compare_per_layer_out.csv", newline="") as f:
        csv_rows = {r["op_name"]: r for r in csv.DictReader(f)}
    assert set(csv_rows) == {r.op_name for r in table}
    for row in table:
        got = csv_rows[row.op_name]
        assert (got["lsb_verdict"], got["lsb_hist"]) == (row.lsb_verdict, row.lsb_hist)
        assert (got["same_input_lsb_verdict"], got["same_input_lsb_hist"]) == (row.same_input_lsb_verdict,
                                                                                 row.same_input_lsb_hist)
    assert {r["lsb_verdict"] for r in csv_rows.values()} >= {"bit-exact", "within 1 LSB"}
    page = (tmp_path / "profiler.html").read_text()
    assert "quantized IR" in page and "qat IR" in page
    section = page.split("Integer comparison", 1)[1]  # the page's LSB section: summary, then one row per op
    assert f"<b>{table.first_inexact.op_name}</b>" in section and "<b>(none)</b>" in section  # nothing diverged
    shown = dict(re.findall(r"<tr><td>([^<]+)</td><td>[^<]*</td><td>[^<]*</td><td><span[^>]*></span>([^<]*)</td>",
                            section))
    assert shown == {r.op_name: r.lsb_verdict for r in table if r.lsb_verdict or r.same_input_lsb_verdict}


def test_saved_ir_files_are_accepted_by_path(stages, tmp_path):
    qat_path = save(stages.qat_ir, tmp_path / "qat.qlir")
    quantized_path = save(stages.quantized_ir, tmp_path / "quantized.qlir")
    case = stages.formats[_ir_format(stages)]
    _, by_path = _analyse(str(qat_path), quantized_path, "convert", tmp_path / "path", case)
    _, in_memory = _analyse(stages.qat_ir, stages.quantized_ir, "convert", tmp_path / "memory", case)
    key = lambda t: [(r.op_name, r.lsb_verdict, r.lsb_hist, r.same_input_lsb_hist, r.Atol) for r in t]  # noqa: E731
    assert key(by_path) == key(in_memory) and len(by_path) >= 8
    # the reports name the files (by base name: the same analysis gives the same reports wherever it runs)
    assert "from quantized.qlir" in by_path.analysis and "from qat.qlir" in by_path.baseline
    assert str(tmp_path) not in by_path.analysis
    _, export_by_path = _analyse(stages.pre_export, qat_path, "export", tmp_path / "export",
                                 stages.formats["torch"], case)
    assert _verdicts(export_by_path) == Counter({"bit-exact": len([r for r in export_by_path if r.lsb_verdict])})
    with pytest.raises(QuantLensError, match="does not exist"):
        QuantAnalysis(qat_path, tmp_path / "missing.qlir", "convert")
    with pytest.raises(QuantLensError, match="must be the quantized IR"):
        QuantAnalysis(stages.pre_export, qat_path, "convert")


def test_lsb_report_per_channel_scales_divide_along_their_axis():
    from quantlens.profiler.compare import lsb_report

    base = torch.zeros(2, 3)
    analy = torch.tensor([[0.0, 0.2, 3.0], [0.0, 0.4, 0.0]])  # channel steps 1, 0.1, 1 along dim 1
    report = lsb_report([base], [analy], [1.0, 0.1, 1.0], axis=1)
    assert report == {"verdict": "within 4 LSB", "hist": "0:3|1:0|2:1|3-4:2|5-8:0|>8:0"}
    assert lsb_report([base], [analy], [1.0, 0.1], axis=1) == {}  # a scale that does not fit the axis
    assert lsb_report([base], [base], 0.5)["verdict"] == "bit-exact"
