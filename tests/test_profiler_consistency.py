"""The profiler and the consistency strategy (issue #9): the analyses report the level the models were built
with, and the ``consistency_level`` advisor rule suggests the level that removes the convert mismatches."""

import copy
import dataclasses
import re

import pytest

import quantlens.zoo as zoo
from quantlens.compiler import convert, export, save
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.advisor import AdvisorContext
from quantlens.profiler.advisor.consistency import consistency_level
from quantlens.profiler.compare import LayerComparison
from quantlens.profiler.model_access import ConsistencyInfo
from quantlens.quantization import ConsistencyStrategy, calibrate, prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


@pytest.fixture(scope="module")
def stages():
    """tiny_resnet built with the strategy off: (float model, calibration model, qat IR, quantized IR, example)."""
    ConsistencyStrategy.disable()
    example = zoo.example_inputs("tiny_resnet")
    model = zoo.get_model("tiny_resnet")
    calib = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(calib, zoo.sample_batches("tiny_resnet", 8, 16))
    qat_ir = export(pre_export(calib), example)
    return model, calib, qat_ir, convert(qat_ir), example


def _with_meta(ir, **meta):
    """A copy of an IR module whose meta says it was built at another consistency level (the graph is shared)."""
    other = copy.copy(ir)
    other.meta = {**ir.meta, **meta}
    return other


def _convert_analysis(qat_ir, quantized_ir, example, out_dir):
    qa = QuantAnalysis(qat_ir, quantized_ir, "convert", out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    result = qa.run()
    table = qa.compare_per_layer()
    return qa, result, table, [f for f in qa.advise(table) if f.rule == "consistency_level"]


def _reported(out_dir) -> tuple[str, str, str]:
    """The consistency line of the text summary, the advisor file and the HTML header."""
    text = (out_dir / "compare_per_layer_out.txt").read_text().splitlines()
    advisor = (out_dir / "abnormal_layer_advisor.txt").read_text().splitlines()
    page = re.findall(r'<span id="consistency">([^<]*)</span>', (out_dir / "profiler.html").read_text())
    line = lambda lines: next((x for x in lines if x.startswith("consistency level")), "")  # noqa: E731
    return line(text), line(advisor), page[0] if page else ""


def _add_sites(table) -> list[str]:
    return [r.op_name for r in table if r.analy_op_type == "add"]


def test_convert_reports_off_when_built_with_the_strategy_off(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    assert qat_ir.consistency_level is None and quantized_ir.consistency_level is None
    qa, result, table, _ = _convert_analysis(qat_ir, quantized_ir, example, tmp_path)
    assert result.consistency == qa.consistency == table.consistency
    assert result.consistency.level is None and result.consistency.known
    assert result.consistency.describe() == "consistency level: off"
    text, advisor, page = _reported(tmp_path)
    assert text.startswith("consistency level: off") and "quantized IR meta" in text
    assert advisor == text and page == text


def test_convert_reports_the_level_recorded_in_the_ir_meta(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    meta = dict(consistency_level=0, high_precision_qpp=True)
    qat0, quantized0 = _with_meta(qat_ir, **meta), _with_meta(quantized_ir, **meta, qpp="high_precision")
    _, result, _, _ = _convert_analysis(qat0, quantized0, example, tmp_path / "level0")
    assert (result.consistency.level, result.consistency.qpp) == (0, "high_precision")
    assert result.consistency.describe() == "consistency level 0 (qpp high_precision)"
    assert all(line.startswith("consistency level 0 (qpp high_precision)") for line in _reported(tmp_path / "level0"))
    # a saved .qlir file keeps it (read through ir_access); level 2 lists its switches
    meta2 = dict(consistency_level=2, high_precision_qpp=False)
    qat_path = save(_with_meta(qat_ir, **meta2), tmp_path / "qat.qlir")
    quantized_path = save(_with_meta(quantized_ir, **meta2, qpp="default"), tmp_path / "quantized.qlir")
    _, result, _, _ = _convert_analysis(qat_path, quantized_path, example, tmp_path / "level2")
    assert result.consistency.level == 2
    text, _, page = _reported(tmp_path / "level2")
    assert text.startswith("consistency level 2 (qpp default; emulate integer rules, exact validation, "
                           "pow2 activation scales, shared elementwise scales)") and page == text


def test_prepared_model_state_is_read_and_onnx_is_unknown(stages):
    model, calib, _, _, example = stages
    assert QuantAnalysis(model, calib, "fake_quant", progress=False).consistency.level is None
    ConsistencyStrategy.set_consistency_level(0)
    try:
        calib0 = prepare(zoo.get_model("tiny_resnet"), example, default_calibration_qconfig_setter,
                         check_result_dir=None)
    finally:
        ConsistencyStrategy.disable()
    info = QuantAnalysis(model, calib0, "fake_quant", progress=False, allow_uncalibrated=True).consistency
    assert (info.level, info.qpp) == (0, "high_precision") and "prepared model state" in info.source

    class Access:  # what of_pair sees of a model: its consistency()
        def __init__(self, info):
            self.info = info

        def consistency(self):
            return self.info

    onnx = ConsistencyInfo(known=False, qpp="")
    assert onnx.describe() == "consistency level: unknown"
    qat = ConsistencyInfo(level=3)
    assert ConsistencyInfo.of_pair(Access(qat), Access(onnx)) is qat  # the qat IR baseline's level
    assert ConsistencyInfo.of_pair(Access(None), Access(onnx)) is onnx
    assert ConsistencyInfo.of_pair(Access(None), Access(None)) is None


def test_advisor_suggests_level_2_for_the_inexact_adds(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    _, _, table, found = _convert_analysis(qat_ir, quantized_ir, example, tmp_path)
    adds = _add_sites(table)
    assert adds and all(table[name].same_input_lsb_verdict == "within 1 LSB" for name in adds)
    level2 = [f for f in found if "set_consistency_level(2)" in f.advice]
    assert len(level2) == 1
    f = level2[0]
    # an add whose ReLU the quantized IR fused is that group's row, named by its members ("add+relu")
    assert f.op_name == adds[0] and f.op_type == table[adds[0]].op_type and f.op_type.split("+")[0] == "add"
    assert all(f"'{name}' ({table[name].op_type})" in f.info for name in adds)
    assert "needs retraining" in f.advice and "consistency off" in f.info
    # what consistency off defines is advice (listed, not a problem: `quantlens analyze` exits 0 on it)
    assert f.severity == "advice" and not f.is_problem
    # every suggestion is based on op sites whose own kernel is not bit-exact
    inexact = {r.op_name for r in table if r.same_input_lsb_verdict not in ("", "bit-exact")}
    for finding in found:
        assert finding.op_name in inexact
        assert re.search(r"set_consistency_level\([0-4]\)", finding.advice)
    assert "consistency_level" in (tmp_path / "abnormal_layer_advisor.txt").read_text()


def test_advisor_suggests_only_levels_above_the_models_own(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    meta = dict(consistency_level=2, high_precision_qpp=False)
    _, _, table, found = _convert_analysis(_with_meta(qat_ir, **meta), _with_meta(quantized_ir, **meta), example,
                                           tmp_path / "level2")
    assert found and all(re.search(r"set_consistency_level\(([34])\)", f.advice) for f in found)
    adds = _add_sites(table)
    at_add = [f for f in found if f.op_name == adds[0]]
    assert at_add and "set_consistency_level(4)" in at_add[0].advice and "should already" in at_add[0].advice
    assert at_add[0].is_problem  # what the model's own level should remove is a problem, not advice
    # at level 4 a mismatch is a bug: one finding naming the first diverged (else first inexact) op
    meta4 = dict(consistency_level=4, high_precision_qpp=False)
    _, _, table, found = _convert_analysis(_with_meta(qat_ir, **meta4), _with_meta(quantized_ir, **meta4), example,
                                           tmp_path / "level4")
    # against the qat IR (float + fake quant), a conv's 1-LSB sum is level 4's own exact-sum rule: the adds (not
    # on one shared scale, as level 4 would put them) are the first rows the level does not explain
    first = table.first_diverged or next(r for r in table if r.same_input_lsb_verdict not in ("", "bit-exact")
                                         and r.analy_op_type == "add")
    assert len(found) == 1 and "bug" in found[0].advice and found[0].op_name == first.op_name
    assert found[0].is_problem
    assert f"'{first.op_name}'" in found[0].advice and "set_consistency_level" not in found[0].advice


def test_advisor_int16_default_qpp_suggests_level_0_without_retraining(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    _, _, table, _ = _convert_analysis(qat_ir, quantized_ir, example, tmp_path)
    add = table[_add_sites(table)[0]]
    rows = [dataclasses.replace(add, quant_dtype="qint16") if r is add else r for r in table]
    ctx = lambda info: AdvisorContext(LayerComparison(rows, "b", "a"), "convert", None, info)  # noqa: E731
    found = consistency_level(ctx(ConsistencyInfo()))
    level0 = [f for f in found if "set_consistency_level(0)" in f.advice]
    assert len(level0) == 1 and level0[0].op_name == add.op_name and "no retraining" in level0[0].advice
    # level 0 already (high-precision qpp): not suggested again
    found = consistency_level(ctx(ConsistencyInfo(level=0, qpp="high_precision")))
    assert found and not any("set_consistency_level(0)" in f.advice for f in found)


def test_advisor_is_silent_when_every_row_is_bit_exact(stages, tmp_path):
    _, _, qat_ir, quantized_ir, example = stages
    _, _, table, found = _convert_analysis(qat_ir, quantized_ir, example, tmp_path)
    assert found  # the real tiny_resnet has inexact rows ...
    exact = [dataclasses.replace(r, lsb_verdict="bit-exact" if r.lsb_verdict else "",
                                 same_input_lsb_verdict="bit-exact" if r.same_input_lsb_verdict else "")
             for r in table]
    for info in (None, ConsistencyInfo(), ConsistencyInfo(level=2), ConsistencyInfo(level=4)):
        ctx = AdvisorContext(LayerComparison(exact, "b", "a"), "convert", None, info)
        assert consistency_level(ctx) == []  # ... the same rows all bit-exact give no suggestion
    # other analysis types: never
    assert consistency_level(AdvisorContext(table, "export", None, ConsistencyInfo())) == []
