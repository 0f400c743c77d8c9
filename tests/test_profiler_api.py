"""QuantAnalysis end to end on zoo models: bad case, run, statistics, compare_per_layer, reports, errors."""

import csv
import json
import re

import pytest
import torch
from torch import nn

from quantlens import QuantLensError
from quantlens.profiler import LayerComparison, QuantAnalysis
from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


def calibrated(name, setter=default_calibration_qconfig_setter, model=None, extra=()):
    model = model if model is not None else get_model(name)
    calib = prepare(model, example_inputs(name), setter, extra_example_inputs=extra, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 3, 8))
    return model, calib


@pytest.fixture(scope="module")
def resnet():
    return calibrated("tiny_resnet")


@pytest.fixture(scope="module")
def resnet_run(resnet, tmp_path_factory):
    """One full analysis shared by the read-only tests below."""
    out = tmp_path_factory.mktemp("resnet")
    qa = QuantAnalysis(*resnet, "fake_quant", out_dir=out, progress=False)
    found = qa.auto_find_bad_case(sample_batches("tiny_resnet", 5, 2))
    result = qa.run()
    table = qa.compare_per_layer()
    return qa, found, result, table, out


def test_bad_case_search_writes_three_tables_and_sets_the_bad_case(resnet_run):
    qa, found, _, _, out = resnet_run
    assert found.num_samples == 5 and found.outputs == ["0"]
    assert set(found.metrics) == {"Cosine", "MSE", "L1", "KL", "SQNR", "Atol"}
    # The L1 bad case is the sample with the largest L1 (checked independently).
    base, analy = qa.baseline.model, qa.analysis.model
    with torch.no_grad():
        l1 = [float((base(*b) - analy(*b)).abs().mean()) for b in sample_batches("tiny_resnet", 5, 2)]
    assert found.bad_case_index == max(range(5), key=lambda i: l1[i])
    assert found.worst_value["0"]["L1"] == pytest.approx(max(l1), rel=1e-5)
    text = (out / "badcase.txt").read_text()
    assert text.count("==") == 6  # three titled tables
    for title in ("Worst sample index per output", "Metric value at that sample", "Worst sample per metric"):
        assert title in text
    assert torch.equal(qa.bad_case[0], sample_batches("tiny_resnet", 5, 2)[found.bad_case_index][0])
    assert (out / "badcase.pt").is_file() and (out / "all_badcase_info.pt").is_file()


def test_bad_case_custom_metric_and_num_steps(resnet, tmp_path):
    qa = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path, progress=False)
    calls = []

    def neg_max(x, y):
        calls.append(1)
        return -float((x - y).abs().max())

    found = qa.auto_find_bad_case(sample_batches("tiny_resnet", 6, 2), num_steps=3, custom_metric_func=neg_max,
                                  custom_metric_order_seq="ascending")
    assert found.num_samples == 3 and len(calls) == 3 and found.metric == "Custom"
    # smallest -Atol is the largest Atol: the custom metric agrees with Atol
    assert found.worst_index["0"]["Custom"] == found.worst_index["0"]["Atol"]
    assert "Custom" in (tmp_path / "badcase.txt").read_text()


def test_run_streams_one_file_per_op_site_and_writes_statistics(resnet_run):
    qa, _, result, _, out = resnet_run
    trace = json.loads((out / "analysis_model" / "trace.json").read_text())
    names = [s["name"] for s in trace["sites"]]
    assert result.analysis_sites == result.baseline_sites == len(names) == len(set(names))
    assert len(list((out / "analysis_model" / "tensors").glob("*.safetensors"))) == len(names)
    quant = trace["sites"][0]
    assert quant["name"] == "quant" and quant["quant_dtype"] == "qint8" and "in0" in quant["stats"]
    conv = next(s for s in trace["sites"] if s["name"] == "stem_conv")
    assert "weight" in conv["stats"] and conv["weight_scale"] is not None  # weights and their scales are traced
    for side in ("baseline_model", "analysis_model"):
        stat = (out / side / "statistic.txt").read_text()
        assert "| 0     | quant " in stat and "input" in stat and "== NaN / Inf ==" in stat
        for column in ("min", "max", "mean", "var", "shape", "scale"):
            assert f" {column} " in stat


def test_compare_per_layer_returns_rows_and_writes_files(resnet_run):
    _, _, _, table, out = resnet_run
    assert isinstance(table, LayerComparison)
    # fused conv-bn-relu: metrics at the last op only, the other members point at it
    assert table["layer1.conv1"].note == "fused into layer1.relu1" and table["layer1.conv1"].Cosine is None
    relu = table["layer1.relu1"]
    assert relu.Cosine > 0.99 and relu.quant_dtype == "qint8" and relu.scale > 0
    assert relu.atol_in_scale == pytest.approx(relu.Atol / relu.scale)
    assert relu.same_input_sqnr > 25 and relu.error_kind in ("rounding", "internal")
    # same-input error of a well-calibrated int8 op with a float input: about half a step of output rounding
    assert 0.4 < table["quant"].same_input_in_scale <= 0.5 + 1e-6
    assert table["flatten_0"].same_input_atol == 0.0  # a passthrough op adds no error
    assert table["fc"].quant_dtype == "qint32" and table["fc"].same_input_in_scale is None
    text = (out / "compare_per_layer_out.txt").read_text()
    assert "layer1.relu1" in text and "same-in SQNR" in text
    rows = list(csv.DictReader((out / "compare_per_layer_out.csv").open()))
    assert [r["op_name"] for r in rows] == [r.op_name for r in table]
    assert float(rows[0]["Cosine"]) == pytest.approx(table[0].Cosine, rel=1e-6)
    assert (out / "abnormal_layer_advisor.txt").is_file()


def test_profiler_html_is_self_contained(resnet_run):
    _, _, _, table, out = resnet_run
    page = (out / "profiler.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page and "<link" not in page
    assert page.count("<svg") == 5 and "Cosine similarity along the network" in page
    assert "Same-input error" in page and "Output ranges" in page
    assert all(f"<td data-sort=\"\">{r.op_name}</td>" in page for r in table)
    assert "addEventListener(\"click\"" in page  # sortable table


def test_compare_filters_by_prefix_and_type(resnet_run):
    qa = resnet_run[0]
    assert [r.op_name for r in qa.compare_per_layer(prefixes="layer2.")][0] == "layer2.downsample.0"
    convs = qa.compare_per_layer(types=[nn.Conv2d])
    assert convs and all(r.base_op_type == "conv2d" for r in convs)
    assert [r.op_name for r in qa.compare_per_layer(types="cat")] == ["cat_0"]


def test_reports_are_deterministic(resnet, tmp_path):
    files = ("compare_per_layer_out.txt", "compare_per_layer_out.csv", "profiler.html", "abnormal_layer_advisor.txt",
             "baseline_model/statistic.txt", "analysis_model/statistic.txt", "output_0_L1_sensitive_ops.txt")
    texts = []
    for run in ("a", "b"):
        qa = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path / run, progress=False)
        qa.set_bad_case(example_inputs("tiny_resnet"))
        qa.run()
        qa.compare_per_layer()
        qa.sensitivity()
        texts.append([(tmp_path / run / f).read_text() for f in files])
    assert texts[0] == texts[1]


def test_profiling_leaves_the_models_unchanged(resnet, tmp_path):
    float_model, calib = resnet
    calib.train()
    set_fake_quantize(calib, FakeQuantState.QAT)  # observers on: the profiler must pause them
    before = {k: v.clone() for k, v in calib.state_dict().items()}
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("tiny_resnet"))
    qa.run()
    qa.sensitivity()
    after = calib.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert calib.training and all(m.fake_quant_enabled for m in calib.modules() if hasattr(m, "fake_quant_enabled"))
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.VALIDATION)


def test_post_process_is_traced_and_compared(tmp_path):
    head = get_model("detector_postprocess").head_only()
    _, calib = calibrated("detector_postprocess", model=head)

    def post(outputs):
        logits, boxes = outputs
        return {"scores": torch.sigmoid(logits).amax(-1), "area": boxes[..., 2] * boxes[..., 3]}

    qa = QuantAnalysis(head, calib, "fake_quant", out_dir=tmp_path, post_process=post, progress=False)
    found = qa.auto_find_bad_case(sample_batches("detector_postprocess", 2, 2))
    assert found.outputs == ["0", "1", "post_process.scores", "post_process.area"]
    qa.run()
    row = qa.compare_per_layer()["post_process"]
    assert row.base_op_type == "post_process" and 0.9 < row.Cosine <= 1.0
    keys = qa.sensitivity().keys()
    assert keys == ["0_L1", "1_L1", "post_process.scores_L1", "post_process.area_L1"]
    assert (tmp_path / "output_post_process.scores_L1_sensitive_ops.txt").is_file()


def test_multitask_inputs_with_task_strings(tmp_path):
    example = example_inputs("multitask")
    float_model, calib = calibrated("multitask", extra=[(example[0], ["cls"])])
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case((example[0], ["cls"]))
    qa.run()
    names = [r.op_name for r in qa.compare_per_layer()]
    assert "cls_head" in names and "reg_head" not in names
    loaded = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False).load_bad_case()
    assert loaded[1] == ["cls"] and torch.equal(loaded[0]["image"], example[0]["image"])


def test_errors_are_clear(resnet, tmp_path):
    float_model, calib = resnet
    with pytest.raises(QuantLensError, match="Unknown analysis_model_type 'fakequant'.*fake_quant"):
        QuantAnalysis(float_model, calib, "fakequant")
    for kind, want in (("export", "qat IR"), ("convert", "quantized IR")):
        with pytest.raises(QuantLensError, match=f"analysis_model must be the {want}"):
            QuantAnalysis(float_model, calib, kind)
    with pytest.raises(QuantLensError, match="analysis_model is a float model"):
        QuantAnalysis(float_model, float_model, "fake_quant")
    with pytest.raises(QuantLensError, match="model file 'calib.pt' does not exist"):
        QuantAnalysis(float_model, "calib.pt", "fake_quant")
    with pytest.raises(QuantLensError, match="must be a torch.nn.Module"):
        QuantAnalysis(float_model, 3, "fake_quant")
    with pytest.raises(QuantLensError, match="post_process must be a callable"):
        QuantAnalysis(float_model, calib, "fake_quant", post_process=3)
    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=tmp_path, progress=False)
    with pytest.raises(QuantLensError, match="no bad case yet.*set_bad_case"):
        qa.run()
    with pytest.raises(QuantLensError, match="does not exist"):
        qa.load_bad_case()
    with pytest.raises(QuantLensError, match=r"No complete trace .*run\(\)"):
        qa.compare_per_layer()
    qa.set_bad_case(example_inputs("tiny_resnet"))
    with pytest.raises(QuantLensError, match="Unknown metric 'L2'"):
        qa.sensitivity(metric="L2")
    with pytest.raises(QuantLensError, match="without custom_metric_func"):
        qa.auto_find_bad_case(sample_batches("tiny_resnet", 1, 2), custom_metric_order_seq="ascending")


def test_models_whose_op_sites_do_not_match(tmp_path):
    _, digits_calib = calibrated("digits_cnn")
    qa = QuantAnalysis(get_model("digits_cnn"), digits_calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("digits_cnn"))
    assert qa.run(run_analysis_model=False).analysis_dir is None
    # the analysis side alone reuses the baseline trace on disk (same-input needs it)
    assert qa.run(run_baseline_model=False).analysis_sites == 15

    qa.set_bad_case(sample_batches("digits_cnn", 1, 2)[0])  # a new bad case, but only one side re-traced
    with pytest.raises(QuantLensError, match="made on another bad case"):
        qa.run(run_baseline_model=False)
    qa.run(run_analysis_model=False)  # now the analysis trace is the stale one
    with pytest.raises(QuantLensError, match="made on different bad cases"):
        qa.compare_per_layer()

    class Wrapped(nn.Module):  # same layers under another name: no op site matches
        def __init__(self):
            super().__init__()
            self.net = get_model("digits_cnn")

        def forward(self, x):
            return self.net(x)

    qa2 = QuantAnalysis(Wrapped(), digits_calib, "fake_quant", out_dir=tmp_path, progress=False)
    qa2.set_bad_case(example_inputs("digits_cnn"))
    with pytest.raises(QuantLensError, match=r"op sites of the two models do not match.*come from the baseline model"):
        qa2.run()
