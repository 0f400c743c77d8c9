"""Issue #23 point 3: the advisor knows where it is. Each rule's advice fits the stage pair and the op (from the op
set): weight advice only for ops with weights, table advice for table ops, the mechanism (never a retraining level)
for a difference beyond rounding at convert, rules for the onnxruntime pair, and the int32 bias rule."""

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.advisor import RULES, AdvisorContext, advise
from quantlens.profiler.advisor.base import OpRole, op_role
from quantlens.profiler.bias_check import bias_saturation
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def _row(i, name, op, **kw):
    base = dict(index=i, op_name=name, base_op_type=op, analy_op_type=op, module_type="", shape="2x8",
                quant_dtype="qint8", scale=0.01)
    base.update(kw)
    return LayerRow(**base)


def _findings(rows, stage, rule=None):
    ctx = AdvisorContext(LayerComparison(rows, "base", "analysis"), stage, None)
    found = advise(ctx, {rule: RULES[rule]} if rule else None)
    return found


def _bad(i, name, op, **kw):  # an op that loses precision by itself, internal error
    return _row(i, name, op, same_input_sqnr=8.0, same_input_in_scale=12.0, error_kind="internal", **kw)


def test_op_kind_comes_from_the_op_set():
    kinds = {op: op_role(_row(0, "x", op)) for op in ("linear", "conv2d", "matmul", "sigmoid", "softmax", "lut",
                                                       "add", "embedding", "relu")}
    assert kinds == {"linear": OpRole.WEIGHTED, "conv2d": OpRole.WEIGHTED, "matmul": OpRole.GEMM,
                     "sigmoid": OpRole.TABLE, "softmax": OpRole.TABLE, "lut": OpRole.TABLE,
                     "add": OpRole.ELEMENTWISE, "embedding": OpRole.WEIGHTED, "relu": kinds["relu"]}
    assert kinds["relu"] is not OpRole.WEIGHTED


def test_weight_advice_only_for_ops_with_weights():
    rows = [_bad(0, "fc", "linear"), _bad(1, "attn", "matmul"), _bad(2, "act", "sigmoid"), _bad(3, "sum", "add")]
    advice = {f.op_name: f.advice for f in _findings(rows, "fake_quant", "op_error")}
    assert set(advice) == {"fc", "attn", "act", "sum"}
    assert "int16 weights for 'fc'" in advice["fc"]
    for name in ("attn", "act", "sum"):
        assert "weight" not in advice[name].replace("no weight", ""), (name, advice[name])
    assert "two activations" in advice["attn"] and "table" in advice["act"]


def test_fused_group_takes_the_kind_of_the_op_with_the_weight():
    rows = [_row(0, "conv", "conv2d", fused_into="relu"), _bad(1, "relu", "relu")]
    (f,) = _findings(rows, "fake_quant", "op_error")
    assert f.op_name == "relu" and "int16 weights for 'conv'" in f.advice


def test_later_stages_get_mechanisms_not_precision_advice():
    rows = [_bad(0, "fc", "linear", same_input_lsb_verdict="diverged", same_input_lsb_hist="0:1|1:0|>8:5"),
            _bad(1, "act", "lut", same_input_lsb_verdict="diverged", same_input_lsb_hist="0:1|>8:9")]
    for stage in ("export", "convert", "onnxruntime"):
        assert not [f for f in _findings(rows, stage) if f.rule == "op_error"], stage
    found = _findings(rows, "convert")
    differs = {f.op_name: f for f in found if f.rule == "integer_op_differs"}
    assert set(differs) == {"fc", "act"}
    assert "accumulator" in differs["fc"].info and "lookup table" in differs["act"].info
    assert "no consistency level or retraining" in differs["act"].info
    # a table off by thousands of steps is not a consistency matter: no retraining level is suggested for it
    assert not [f for f in found if f.rule == "consistency_level"]


def test_consistency_level_still_covers_rounding_differences():
    rows = [_row(0, "sum", "add", same_input_lsb_verdict="within 1 LSB", same_input_lsb_hist="0:90|1:10")]
    (f,) = _findings(rows, "convert", "consistency_level")
    assert "set_consistency_level(2)" in f.advice
    assert not _findings(rows, "convert", "integer_op_differs")


def test_pre_export_table_rows_are_left_to_the_table_rule():
    rows = [_bad(0, "act", "sigmoid"), _bad(1, "fc", "linear")]
    assert [f.op_name for f in _findings(rows, "pre_export", "op_error")] == ["fc"]


def test_onnxruntime_rule_names_where_the_runtime_starts_to_differ():
    rows = [_row(0, "conv", "conv2d", lsb_verdict="bit-exact"),
            _row(1, "act", "lut", lsb_verdict="diverged", lsb_hist="0:3|>8:5", atol_in_scale=40.0, producer="conv"),
            _row(2, "fc", "linear", lsb_verdict="diverged", lsb_hist="0:1|>8:5", atol_in_scale=50.0, producer="act")]
    found = _findings(rows, "onnxruntime", "onnxruntime_op_differs")
    assert [f.op_name for f in found] == ["act"]  # fc only inherits act's error
    assert "float function it emulates" in found[0].info and "'convert'" in found[0].advice
    assert not _findings(rows, "convert", "onnxruntime_op_differs")


def test_onnxruntime_rule_reads_through_movement_and_ignores_amplified_rounding():
    rows = [_row(0, "add", "add", lsb_verdict="within 1 LSB", atol_in_scale=1.0),
            _row(1, "ln", "layer_norm", lsb_verdict="diverged", atol_in_scale=21.0, producer="add"),  # amplifies
            _row(2, "view", "view", lsb_verdict="", producer="ln"),  # movement: no verdict of its own
            _row(3, "fc", "linear", lsb_verdict="diverged", atol_in_scale=30.0, producer="view"),
            _row(4, "fc2", "linear", lsb_verdict="diverged", atol_in_scale=22945.0, producer="fc")]  # a fault
    found = _findings(rows, "onnxruntime", "onnxruntime_op_differs")
    assert [f.op_name for f in found] == ["fc2"] and "30 steps off" in found[0].info


class PrunedConv(nn.Module):
    """A conv whose output channel 0 is pruned (zero weights) but keeps a large bias: with per-channel weights,
    that channel's weight scale is tiny and ``bias / (s_in * s_w)`` is far beyond int32."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 2)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            self.conv.weight[0] = 1e-9
            self.conv.bias[0] = 8.0  # the weight scale floor (2**-24) times s_in: 8 / (0.026 * 6e-8) > 2**31

    def forward(self, x):
        return self.dequant(self.fc(self.conv(self.quant(x)).mean((2, 3))))


def _pruned(tmp_path):
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = PrunedConv().eval()
    prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None), [(x,)])
    return model, prepared, x


def test_bias_saturation_is_found_at_every_stage_with_the_right_advice(tmp_path):
    model, prepared, x = _pruned(tmp_path)
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path / "fq", progress=False)
    qa.set_bad_case((x,))
    qa.run()
    found = qa.advise()
    bias = [f for f in found if f.rule == "bias_saturation"]
    assert [f.op_name for f in bias] == ["conv"] and "1 of 4 channels" in bias[0].info
    assert "int16 weights make it worse" in bias[0].advice
    assert not [f for f in found if f.rule == "op_error" and f.op_name == "conv"]  # no "int16 weights" advice
    qat_ir = export(pre_export(prepared), (x,))
    for ir in (qat_ir, convert(qat_ir)):
        entry = bias_saturation(ir, [])["conv"]
        assert entry.saturated == 1 and entry.channels == 4


def test_no_bias_finding_without_saturation(tmp_path):
    model, prepared, x = _pruned(tmp_path)
    with torch.no_grad():
        model.conv.bias[0] = 0.0
    prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None), [(x,)])
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=tmp_path, progress=False)
    qa.set_bad_case((x,))
    qa.run()
    assert not [f for f in qa.advise() if f.rule == "bias_saturation"]


class Tanh16(nn.Module):
    """fc (int16 output) -> tanh: an int16-input tanh, which pre_export computes by a segmented table."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5)

    def forward(self, x):
        return self.dequant(self.fc2(torch.tanh(self.fc1(self.quant(x)))))


def test_a_table_built_for_a_narrower_input_range_is_named(tmp_path):
    """Drop the outer segments of the quantized IR's segmented tanh table (a table built for a narrower input
    range than the data): codes there get the constant tails. The convert pair names the table's input range
    (table_input_clipped), not a retraining level, and not a second finding for the same op."""
    from quantlens.quantization import get_qconfig
    from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    setter = (ModuleNameQconfigSetter({"fc1": get_qconfig(out_dtype="qint16")}), default_calibration_qconfig_setter)
    prepared = calibrate(prepare(Tanh16().eval(), (x,), setter, check_result_dir=None), [(x,)])
    qat_ir = export(pre_export(prepared), (x,))
    quantized = convert(qat_ir)
    (node,) = [n for n in quantized.graph.nodes if n.op == "segment_lut"]

    def analyse(ir, out):
        qa = QuantAnalysis(qat_ir, ir, "convert", out_dir=out, progress=False)
        qa.set_bad_case((x,))
        qa.run()
        return qa.compare_per_layer(), qa.advise()

    table, found = analyse(quantized, tmp_path / "ok")
    assert not [f for f in found if f.rule in ("table_input_clipped", "integer_op_differs")]
    constants = quantized.graph.constants
    bounds, shifts, entries = (constants[node.inputs[i]] for i in (3, 4, 5))
    assert bounds.numel() > 4
    constants[node.inputs[3]], constants[node.inputs[4]], constants[node.inputs[5]] = \
        bounds[1:-1].clone(), shifts[1:-1].clone(), entries[1:-1].clone()
    table, found = analyse(quantized, tmp_path / "narrow")
    rules = {(f.rule, f.op_name) for f in found}
    assert ("table_input_clipped", node.site) in rules, rules
    assert ("integer_op_differs", node.site) not in rules and \
        not [f for f in found if f.rule == "consistency_level" and f.op_name == node.site]
    assert table[node.site].table_input_clipped_ratio > 0.01


def test_a_clean_onnx_file_gets_no_runtime_finding(tmp_path):
    from quantlens.compiler import to_onnx
    from quantlens.zoo.faults.tiny import Mlp, _prepared

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    qat_ir = export(pre_export(_prepared(Mlp(seed=1), x)), (x,))
    path = to_onnx(qat_ir, tmp_path / "model.onnx")
    qa = QuantAnalysis(qat_ir, str(path), "onnxruntime", out_dir=tmp_path / "qa", progress=False)
    qa.set_bad_case((x,))
    qa.run()
    assert not [f for f in qa.advise() if f.rule == "onnxruntime_op_differs"]
