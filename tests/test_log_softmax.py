"""log_softmax's integer rule (``docs/march.md`` §13.6.1): the softmax's exp table and sum, ``ln`` of the sum by its
mantissa and exponent, one rounded shift. Its sites run on the NPU at every stage, and pre_export, the qat IR, the
quantized IR and onnxruntime compute the same integers."""

from __future__ import annotations

import math

import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.compiler.onnx.tables import EXACT_TABLE_EXPORTS
from quantlens.errors import QuantLensError
from quantlens.kernels import int_log_softmax, ln_mantissa_table, softmax_exp_table
from quantlens.kernels.log_softmax_ops import LN2_FIXED, log_sum_exp
from quantlens.march import QuantDType, rules
from quantlens.march.opset import OPS, Stage
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, pre_export_report, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.zoo.coverage import THRESHOLDS, run_stages

I8, I16 = QuantDType.qint8, QuantDType.qint16
SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}


def _rule_and_table(s_in, s_out, in_dtype=I8, out_dtype=I8):
    p = rules.log_softmax(s_in, s_out, out_dtype)
    table = softmax_exp_table(s_in, in_dtype, out_dtype)
    return lambda q, dim=-1: int_log_softmax(torch.as_tensor(q), dim, table, p["multiplier"], p["ln_multiplier"],
                                             p["shift"], out_dtype)


# -- the rule, by hand --------------------------------------------------------------------------------------------
def test_rule_constants_and_ln_table_by_hand():
    # s_x / s_out = 1 = 0.5 * 2**1: T_x = 44 - 1 = 43; 2**-24 / s_out = 2**-20 = 0.5 * 2**-19: T_l = 31 + 19 = 50;
    # T = min(43, 50, 62) = 43, M_x = 2**43, M_l = 2**-20 * 2**43 = 2**23
    assert rules.log_softmax(1 / 16, 1 / 16, I8) == {"multiplier": 2**43, "ln_multiplier": 2**23, "shift": 43,
                                                     "out_dtype": "qint8"}
    # s_x / s_out = 0.078125 / 0.125 = 0.625 * 2**0: T_x = 44; 2**-24 / 0.125 = 2**-21 = 0.5 * 2**-20: T_l = 51;
    # T = 44, M_x = 0.625 * 2**44 = 5 * 2**41, M_l = 2**-21 * 2**44 = 2**23
    assert rules.log_softmax(0.078125, 0.125, I16) == {"multiplier": 5 * 2**41, "ln_multiplier": 2**23,
                                                     "shift": 44, "out_dtype": "qint16"}
    with pytest.raises(QuantLensError, match="orders of\\s+magnitude"):
        rules.log_softmax(1.0, 1e-30, I8)  # s_x / s_out = 1e30 needs T < 0
    entries = ln_mantissa_table().entries[0]
    # LN(2**23 + j * 2**14) = rhe(log1p(j / 512) * 2**24): 0, 32736.04 -> 32736, ln(1.5) * 2**24 = 6802576.4 -> 6802576
    assert entries[:2].tolist() == [0, 32736] and int(entries[256]) == 6802576
    assert int(entries[512]) == LN2_FIXED == 11629080  # ln 2 * 2**24 = 11629079.66


def test_kernel_hand_example():
    """int8 in and out, s_x = s_out = 1/16, so y = rhe(d - L / 2**20) (``M_x / 2**T = 1``, ``M_l / 2**T = 2**-20``)."""
    log_softmax = _rule_and_table(1 / 16, 1 / 16)
    # q = [16, 0, -16] (x = [1, 0, -1]): d = [0, -16, -32], e = [32768, 12055, 4435] (the §13.6 softmax example),
    # S = 49258 (16 bits): k = -8, m = 49258 << 8 = 12610048 = 2**23 + 257 * 2**14 + 10752, and k + 23 - X = 0
    # (X = 15). LN(m) interpolates entries 257 and 258, 6824407 and 6846210:
    # (6824407 * 5632 + 6846210 * 10752) / 2**14 = 112045510144 / 16384 = 6838715.22 -> L = 6838715
    # (ln(49258 / 32768) * 2**24 = 6838718.07). L / 2**20 = 6.52191: y = rhe([-6.52, -22.52, -38.52]) = [-7, -23, -39]
    assert log_sum_exp(torch.tensor([49258.0], dtype=torch.float64), 15).tolist() == [6838715]
    assert log_softmax([[16, 0, -16]]).tolist() == [[-7, -23, -39]]  # float: 16 * [-0.4076, -1.4076, -2.4076]
    # q = [3, 3, 3, 3]: e = 4 * 32768 = 2**17 (18 bits): k = -6, m = 2**23, LN(m) = 0, k + 23 - X = 2:
    # L = 2 * LN2 = 23258160, L / 2**20 = 22.18 (16 ln 4 = 22.18): y = -22 everywhere
    assert log_softmax([[3, 3, 3, 3]]).tolist() == [[-22] * 4]
    # q = [127, -128]: d = [0, -255], E(-255) = rhe(exp(-15.94) * 2**15) = 0, S = 2**15: L = 0, y = [0, -255 -> -128]
    assert log_softmax([[127, -128]]).tolist() == [[0, -128]]
    # along dim 0: the same rows as columns
    assert log_softmax([[16], [0], [-16]], 0).reshape(-1).tolist() == [-7, -23, -39]


@pytest.mark.parametrize("in_dtype,out_dtype", [(I8, I8), (I8, I16), (I16, I8), (I16, I16)])
def test_kernel_follows_the_float_log_softmax(in_dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    s_in = 8.0 / in_dtype.qmax
    s_out = 24.0 / out_dtype.qmax  # outputs down to -24
    q = (torch.randn(64, 40, generator=gen) * in_dtype.qmax / 3).round().clamp(in_dtype.qmin, in_dtype.qmax)
    y = _rule_and_table(s_in, s_out, in_dtype, out_dtype)(q.to(torch.int64), 1)
    exact = (torch.log_softmax(q.double() * s_in, dim=1) / s_out).clamp(out_dtype.qmin, out_dtype.qmax)
    assert float((y - exact).abs().max()) <= 0.51  # the output rounding, and ln's 2**-21 far below a step
    assert int(y.max()) <= 0


# -- every stage --------------------------------------------------------------------------------------------------
class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.LogSoftmax(dim=-1),
                                 DeQuantStub())

    def forward(self, x):
        return self.net(x)


class _Dim1(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()

    def forward(self, x):
        return self.dq(F.log_softmax(self.q(x) * 3.0, dim=1))


def _pipeline(model, make, qconfig):
    torch.manual_seed(0)
    x = make()
    prepared = prepare(model.eval(), x, SETTERS[qconfig], check_result_dir=None)
    calibrated = calibrate(prepared, [make() for _ in range(3)])
    pre = pre_export(calibrated, example_inputs=x)
    qat_ir = export(pre, x)
    return prepared, pre, qat_ir, convert(qat_ir)


def _site(prepared) -> str:
    (site,) = [n for n, p in prepared._quantlens_state.plans.items() if p.op_type == "log_softmax"]
    return site


def _override(pre, site):
    state = pre._quantlens_state
    return state.overrides[state.plans[site].override]


def _node_codes(ir, x):
    """The input and output of the IR's int_log_softmax node on ``x``."""
    seen = []

    def observer(node, inputs, outputs):
        if node.op == "int_log_softmax":
            seen.append((node, inputs, outputs[0]))

    ir.run(ir.feeds(x), observer)
    (found,) = seen
    return found


@pytest.mark.parametrize("qconfig", ["int8", "w8a16"])
def test_sequential_head_runs_on_the_npu_through_every_stage(qconfig):
    make = lambda: torch.randn(4, 8)  # noqa: E731
    torch.manual_seed(0)
    result = run_stages("log_softmax_head", _Head(), make(), [make() for _ in range(3)], make(), qconfig)
    assert result.failed_stage is None, result.error
    assert result.passed, {k: v for k, v in result.agreements.items() if v < THRESHOLDS[k]}
    assert OPS["log_softmax"].on_npu and OPS["log_softmax"].refused_by() == []
    torch.manual_seed(0)
    prepared, pre, qat_ir, quantized = _pipeline(_Head(), make, qconfig)
    site = _site(prepared)
    assert prepared._quantlens_state.plans[site].host is False
    assert pre._quantlens_state.plans[site].output_fq  # the output fake quant's observer set the output scale
    assert [n.op for n in qat_ir.graph.nodes if n.site == site] == ["int_log_softmax", "fake_quant"]
    assert not any(n.attrs.get("host") or n.op in ("log_softmax", "host_aten") for n in quantized.graph.nodes)
    x = make()
    # the quantized IR's node and pre_export's custom op on the same input codes: bit for bit
    node, inputs, out_codes = _node_codes(quantized, x)
    override = _override(pre, site)
    s_in, s_out = (torch.tensor(v) for v in override.table_scales.tolist())
    ours = torch.ops.quantlens.int_log_softmax(
        inputs[0].to(torch.float32) * s_in, s_in, s_out, override.exp_bounds, override.exp_shifts,
        override.exp_entries, override.exp_tails, override.params_q, -1, override.exp_frac_bits,
        *(node.attrs[k] for k in ("in_qmin", "in_qmax", "out_qmin", "out_qmax")))
    assert torch.equal(torch.round(ours / s_out).to(torch.int64), out_codes.to(torch.int64))
    assert int(out_codes.max()) <= 0 and int(out_codes.min()) < 0
    with torch.no_grad():  # and the qat IR is pre_export's custom op, exported
        assert torch.equal(pre(x), qat_ir(x))


@pytest.mark.parametrize("qconfig", ["int8", "w8a16"])
def test_functional_log_softmax_on_dim_1_is_bit_exact_at_every_stage(qconfig, tmp_path):
    make = lambda: torch.randn(2, 6, 4)  # noqa: E731
    torch.manual_seed(0)
    result = run_stages("log_softmax_dim1", _Dim1(), make(), [make() for _ in range(3)], make(), qconfig)
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements
    prepared, pre, qat_ir, quantized = _pipeline(_Dim1(), make, qconfig)
    site = _site(prepared)
    assert prepared._quantlens_state.plans[site].host is False
    (node,) = [n for n in quantized.graph.nodes if n.op == "int_log_softmax"]
    assert node.attrs["dim"] == 1
    x = make()
    with torch.no_grad():
        reference = pre(x)
    assert torch.equal(qat_ir(x), reference)
    assert torch.equal(quantized(x), reference)  # quantize, int_log_softmax, dequantize: pre_export's integers
    s_in, s_out = _override(pre, site).table_scales.tolist()
    exact = torch.log_softmax(x * 3.0, dim=1)
    inside = reference > (-32767 if qconfig == "w8a16" else -127) * s_out  # not saturated
    assert float((reference - exact)[inside].abs().max()) <= 0.51 * s_out + 1.01 * s_in  # output and input rounding
    # onnxruntime: the exact integer arithmetic (no float LogSoftmax), bit for bit
    path = to_onnx(qat_ir, tmp_path / "log_softmax.onnx")
    import onnx

    assert "LogSoftmax" not in {n.op_type for n in onnx.load(str(path)).graph.node}
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {qat_ir.graph.inputs[0]: x.numpy()})[0]
        assert torch.equal(torch.from_numpy(got), qat_ir(x)), level


def test_onnx_writes_the_float_log_softmax_where_the_exact_form_does_not_apply(tmp_path, monkeypatch):
    make = lambda: torch.randn(2, 6, 4)  # noqa: E731
    prepared, pre, qat_ir, _ = _pipeline(_Dim1(), make, "int8")
    monkeypatch.setitem(EXACT_TABLE_EXPORTS, "int_log_softmax", lambda b, node: False)
    path = to_onnx(qat_ir, tmp_path / "log_softmax_float.onnx")
    import onnx

    graph = onnx.load(str(path)).graph
    (ls,) = [n for n in graph.node if n.op_type == "LogSoftmax"]
    assert [a.i for a in ls.attribute if a.name == "axis"] == [1]
    x = make()
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {qat_ir.graph.inputs[0]: x.numpy()})[0]
    s_out = float(_override(pre, _site(prepared)).table_scales[-1])
    assert float((torch.from_numpy(got) - qat_ir(x)).abs().max()) <= 1.01 * s_out  # one output step at most


def test_report_and_stage_support():
    make = lambda: torch.randn(2, 6, 4)  # noqa: E731
    prepared, pre, _, _ = _pipeline(_Dim1(), make, "w8a16")
    (info,) = [i for i in pre_export_report(pre) if i.op_type == "log_softmax"]
    assert info.table_kind == "log_softmax" and info.error_basis == "probe"
    assert info.max_error_steps <= 0.51, info
    assert "M_x=" in info.detail and "segmented" in info.detail  # an int16 input: the segmented exp table
    assert Stage.CONVERT in OPS["log_softmax"].stages() and OPS["log_softmax"].march == "§13.6.1"
    assert math.isclose(LN2_FIXED / 2**24, math.log(2), rel_tol=1e-7)
