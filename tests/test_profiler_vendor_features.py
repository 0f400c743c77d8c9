"""The vendor profiler's remaining features (issue #13 item 2): auto_find_bad_case(topk=k) with set_bad_case(rank=r),
set_model_profiler_dir (compare traces made earlier), cached_attrs (stateful sequence models) and the per-table
error histogram of pre_export sensitivity."""

import pytest
import torch
from torch import nn

from quantlens import QuantLensError
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import DeQuantStub, QuantStub, prepare
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


@pytest.fixture(scope="module")
def resnet():
    model = get_model("tiny_resnet")
    calib = prepare(model, example_inputs("tiny_resnet"), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches("tiny_resnet", 3, 8))
    return model, calib


# -- 1. topk -------------------------------------------------------------------------------------------------
def test_topk_keeps_the_k_worst_samples_and_set_bad_case_takes_a_rank(resnet, tmp_path):
    data = sample_batches("tiny_resnet", 6, 2)
    qa = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path, progress=False)
    found = qa.auto_find_bad_case(data, topk=3)
    base, analy = resnet
    with torch.no_grad():
        l1 = [float((base(*b) - analy(*b)).abs().mean()) for b in data]
    order = sorted(range(6), key=lambda i: -l1[i])[:3]
    assert [i for i, _ in found.topk["0"]["L1"]] == order
    assert [v for _, v in found.topk["0"]["L1"]] == pytest.approx([l1[i] for i in order], rel=1e-5)
    assert [i for i, _, _ in found.overall_topk["L1"]] == order  # one output: the same ranking
    # Cosine: smaller is worse
    cos = found.values["0"]["Cosine"]
    assert [i for i, _ in found.topk["0"]["Cosine"]] == sorted(range(6), key=lambda i: cos[i])[:3]
    assert found.bad_case_index == order[0] and found.k == 3
    with pytest.raises(Exception):  # frozen
        found.k = 1
    # all three kept samples' inputs are kept, reported in both files
    assert set(order) <= set(found.inputs)
    info = torch.load(tmp_path / "all_badcase_info.pt", weights_only=True)
    assert info["topk"] == 3 and [i for i, _ in info["topk_index"]["0"]["L1"]] == order
    text = (tmp_path / "badcase.txt").read_text()
    assert "Top 3 worst samples per output and metric" in text and "Top 3 worst samples per metric" in text
    # set_bad_case(rank=r): the r-th worst
    qa.set_bad_case(rank=2)
    assert torch.equal(qa.bad_case[0], data[order[1]][0])
    qa.set_bad_case(rank=1, metric="Cosine", output="0")
    assert torch.equal(qa.bad_case[0], data[found.topk["0"]["Cosine"][0][0]][0])
    assert torch.equal(torch.load(tmp_path / "badcase.pt", weights_only=True)[0], qa.bad_case[0])
    with pytest.raises(QuantLensError, match="ranks 1..3"):
        qa.set_bad_case(rank=4)
    with pytest.raises(QuantLensError, match="topk"):
        qa.auto_find_bad_case(data, topk=0)


def test_topk_default_is_one_and_rank_needs_a_search(resnet, tmp_path):
    qa = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path, progress=False)
    with pytest.raises(QuantLensError, match="auto_find_bad_case"):
        qa.set_bad_case(rank=1)
    found = qa.auto_find_bad_case(sample_batches("tiny_resnet", 3, 2))
    assert found.k == 1 and len(found.topk["0"]["L1"]) == 1
    assert (tmp_path / "badcase.txt").read_text().count("==") == 6  # unchanged layout for topk=1


# -- 2. set_model_profiler_dir --------------------------------------------------------------------------------
def test_set_model_profiler_dir_compares_traces_of_another_analysis(resnet, tmp_path):
    data = sample_batches("tiny_resnet", 2, 2)
    first = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path / "a", progress=False)
    first.set_bad_case(data[0])
    first.run()
    expected = first.compare_per_layer()
    # a new QuantAnalysis (as in another process) that never runs the models: they must not be called
    model, calib = resnet


    second = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / "b", progress=False)
    second.baseline.run = second.analysis.run = lambda *a, **k: (_ for _ in ()).throw(AssertionError("model run"))
    second.set_model_profiler_dir(tmp_path / "a" / "baseline_model", tmp_path / "a" / "analysis_model")
    table = second.compare_per_layer()
    assert [r.op_name for r in table] == [r.op_name for r in expected]
    assert [r.Cosine for r in table] == [r.Cosine for r in expected]
    assert (tmp_path / "b" / "compare_per_layer_out.txt").is_file()
    # missing trace: the error names the folder
    with pytest.raises(QuantLensError, match="nowhere"):
        second.set_model_profiler_dir(tmp_path / "nowhere", tmp_path / "a" / "analysis_model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(QuantLensError, match="empty"):
        second.set_model_profiler_dir(tmp_path / "a" / "baseline_model", tmp_path / "empty")
    with pytest.raises(QuantLensError, match="baseline folder first"):
        second.set_model_profiler_dir(tmp_path / "a" / "analysis_model", tmp_path / "a" / "baseline_model")
    # a trace of another bad case
    other = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path / "c", progress=False)
    other.set_bad_case(data[1])
    other.run()
    with pytest.raises(QuantLensError, match="different bad cases") as err:
        second.set_model_profiler_dir(tmp_path / "a" / "baseline_model", tmp_path / "c" / "analysis_model")
    assert str(tmp_path / "c" / "analysis_model") in str(err.value)
    # a QuantAnalysis whose current bad case is another one refuses the traces too
    third = QuantAnalysis(*resnet, "fake_quant", out_dir=tmp_path / "d", progress=False)
    third.set_bad_case(data[1])
    with pytest.raises(QuantLensError, match="another bad case"):
        third.set_model_profiler_dir(tmp_path / "a" / "baseline_model", tmp_path / "a" / "analysis_model")


# -- 3. cached_attrs ------------------------------------------------------------------------------------------
class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.memory = torch.zeros(1, 8)

    def forward(self, x):
        out = self.fc(x) + 4.0 * self.memory
        self.memory = out.detach()  # a temporal memory: the next call starts from this output
        return out


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.decoder, self.dequant = QuantStub(), Decoder(), DeQuantStub()

    def forward(self, x):
        return self.dequant(self.decoder(self.quant(x)))


def _stateful_pair():
    torch.manual_seed(0)
    model = Sequence()
    calib = prepare(model, (torch.randn(1, 8),), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, [(torch.randn(1, 8),) for _ in range(4)])
    assert calib is not model
    model.decoder.memory = torch.full((1, 8), 1.0)
    calib.decoder.memory = torch.full((1, 8), -1.0)  # as if it had processed other frames
    return model, calib


def test_cached_attrs_start_both_models_from_the_baseline_state(tmp_path):
    frame = (torch.randn(1, 8),)
    model, calib = _stateful_pair()
    plain = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / "plain", progress=False)
    plain.set_bad_case(frame)
    plain.run()
    off = plain.compare_per_layer()["decoder.add_0"].L1

    model, calib = _stateful_pair()
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / "cached", progress=False,
                       cached_attrs=["decoder.memory"])
    assert qa.cached_attrs == ("decoder.memory",)
    qa.set_bad_case(frame)
    qa.run()
    row = qa.compare_per_layer()["decoder.add_0"]
    assert row.L1 < off / 10  # only quantization is left (8.2 vs 0.47)
    # the analysis model advanced from the baseline's state (memory 1 -> about 4), not from its own (-1 -> about -4)
    assert bool((calib.decoder.memory > 2).all()) and bool((model.decoder.memory > 2).all())
    # a bad case search over frames: each analysis call starts from the baseline's state before that frame
    model, calib = _stateful_pair()
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path / "search", progress=False,
                       cached_attrs="decoder.memory")
    found = qa.auto_find_bad_case([(torch.randn(1, 8),) for _ in range(3)])
    assert found.worst_value["0"]["L1"] < off / 10


def test_cached_attrs_missing_attribute_is_named(tmp_path):
    model, calib = _stateful_pair()
    del calib.decoder.memory
    with pytest.raises(QuantLensError, match=r"analysis model .*decoder\.memory"):
        QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, cached_attrs=["decoder.memory"])
    model, calib = _stateful_pair()
    with pytest.raises(QuantLensError, match=r"baseline model .*'decoder\.state'"):
        QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, cached_attrs=["decoder.state"])


# -- 4. pre_export: each table's own error, in output steps ----------------------------------------------------
def test_pre_export_sensitivity_rows_carry_each_tables_error_histogram(tmp_path):
    from quantlens.profiler.trace.reader import TraceReader
    from quantlens.quantization.pre_export import lut_sites, pre_export, set_lut_enabled
    from quantlens.quantization.qconfig_template import calibration_8bit_weight_16bit_act_qconfig_setter

    model = get_model("tiny_transformer")
    qat = prepare(model, example_inputs("tiny_transformer"), calibration_8bit_weight_16bit_act_qconfig_setter,
                  check_result_dir=None)
    calibrate_model(qat, sample_batches("tiny_transformer", 3, 8))
    pre = pre_export(qat)
    set_lut_enabled(pre, ["norm2"], False)  # switched off by the user: measured on, as in its ablation
    qa = QuantAnalysis(qat, pre, "pre_export", out_dir=tmp_path, progress=False)
    qa.set_bad_case(example_inputs("tiny_transformer", 4))
    qa.run()
    base, analy = TraceReader(tmp_path / "baseline_model"), TraceReader(tmp_path / "analysis_model")
    sens = qa.sensitivity()
    rows = {r.op_name: r for r in sens[0]}
    assert set(rows) == set(lut_sites(pre))
    measured = 0
    for name, row in rows.items():
        site = analy.by_name[name]
        if name == "norm2":  # off in the trace (0 steps there), on for its row
            assert row.table_error_hist.startswith("0:") and row.table_error_max_steps is not None
            continue
        if site.scale is None or isinstance(site.scale, list):
            assert row.table_error_hist == "" and row.table_error_max_steps is None
            continue
        # independently: the traced same-input output (the table on the baseline's inputs) vs the baseline output
        x, y = base.tensors(name)["out0"].double(), analy.tensors(name)["same0"].double()
        steps = torch.round((x - y).abs() / float(site.scale))
        assert row.table_error_max_steps == float(steps.max()), name
        counts = dict(part.split(":") for part in row.table_error_hist.split("|"))
        assert list(counts) == ["0", "1", "2", "3-4", "5-8", ">8"]
        assert sum(map(int, counts.values())) == x.numel()
        assert int(counts["0"]) == int((steps == 0).sum()) and int(counts["1"]) == int((steps == 1).sum())
        measured += 1
    assert measured >= 2
    assert base.tensors("norm2")["out0"].equal(analy.tensors("norm2")["same0"])  # the user's switch is kept
    assert any(r.table_error_max_steps > 0 for r in rows.values() if r.table_error_max_steps is not None)
    text = (tmp_path / f"output_{sens[0].output}_L1_sensitive_ops.txt").read_text()
    assert "table err hist (steps)" in text and rows["act"].table_error_hist in text
    pt = torch.load(tmp_path / f"output_{sens[0].output}_L1_sensitive_ops.pt", weights_only=True)
    assert {d["op_name"]: d["table_error_hist"] for d in pt} == {n: r.table_error_hist for n, r in rows.items()}
    set_lut_enabled(pre, None, True)
