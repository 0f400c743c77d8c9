"""GroupNorm, InstanceNorm, GLU (decomposed at prepare), rms_norm / F.normalize (``int_rms_norm``), the L2 norm
(``int_vector_norm``) and cumsum: their integer rules on hand-computed values, and a small model per op through
prepare -> calibration -> pre_export -> export -> convert -> save/load -> to_onnx -> onnxruntime."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.kernels import INT_KERNELS, int_layer_norm
from quantlens.kernels.norm_ops import int_rms_norm, int_vector_norm, normalize_constants
from quantlens.march import Qpp, QuantDType, rules
from quantlens.quantization import FakeQuantState, calibrate, pre_export, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.coverage import THRESHOLDS, cosine
from tests._ort import session

Q8 = QuantDType.qint8


# -- the integer rules, by hand --------------------------------------------------------------------------------
def test_rms_norm_kernel_is_the_layer_norm_without_the_mean():
    # q = [3, -4], P = 8: c = [768, -1024], V = 768² + 1024² = 1638400 = 1280²: c / sqrt(V) = [0.6, -0.8]; with
    # gain 100 and T = 23, y = rhe([60, -80]). The layer norm centres first: c = [896, -896], ±1/sqrt(2) · 100.
    q = torch.tensor([[3, -4]])
    gain, bias = torch.tensor([100, 100]), torch.tensor([0, 0])
    assert int_rms_norm(q, 1, gain, bias, 0, 8, 23, Q8).tolist() == [[60, -80]]
    assert int_layer_norm(q, 1, gain, bias, 0, 8, 23, Q8).tolist() == [[71, -71]]
    assert int_rms_norm(torch.zeros(1, 2, dtype=torch.int64), 1, gain, torch.tensor([5, -5]) << 23, 0, 8, 23,
                        Q8).tolist() == [[5, -5]]  # a zero row: the bias alone


def test_normalize_constants_and_values():
    # s_out = 2**-6: the gain 1 / s_out = 64 has max 64 = 2**6, quantize_multiplier(2**-17) = (2**30, 47): T = 47,
    # gain = 64 · 2**24 = 2**30; eps = 1e-12 is far below one code: eps_term = 0. [3, -4] / 5 · 64 = [38.4, -51.2].
    c = normalize_constants(0.5, 2.0**-6, Q8, 2, 1e-12)
    assert (c.shift, c.frac_bits, c.eps_term) == (47, 8, 0) and c.gain.tolist() == [2**30, 2**30]
    assert c.bias.tolist() == [0, 0]
    y = int_rms_norm(torch.tensor([[3, -4], [0, 0], [127, 0]]), 1, c.gain, c.bias, c.eps_term, c.frac_bits,
                     c.shift, Q8)
    assert y.tolist() == [[38, -51], [0, 0], [64, 0]]


def test_vector_norm_rule_and_kernel():
    # s_x / s_out = 1.5 = 3 · 2**-1: M = 1.5 · 2**30, shift 30
    attrs = rules.vector_norm(torch.tensor(0.375), torch.tensor(0.25), Q8)
    assert attrs == {"multiplier": 1610612736, "shift": 30, "out_dtype": "qint8"}
    m, sh = attrs["multiplier"], attrs["shift"]
    q = torch.tensor([[6, 8, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [127, 127, 127, 127], [-3, 0, 4, 0]])
    # ||q|| = 10, 2, 0, 254, 5; times 1.5: 15, 3, 0, 381 (saturates at 127), 7.5 -> 8 (half to even)
    assert int_vector_norm(q, [-1], False, m, sh, Q8).tolist() == [15, 3, 0, 127, 8]
    assert int_vector_norm(q, [1], True, m, sh, Q8).shape == (5, 1)
    assert int_vector_norm(torch.tensor([[3, 4]]), [], False, 1 << 30, 30, Q8).tolist() == 5


def test_cumsum_rule_and_kernel():
    # the sum rule with one term: requantize by s_x / s_out = 1/2; running sums [1, 3, 6, 10] -> [0.5, 1.5, 3, 5]
    attrs = {"dim": 1, **rules.average(torch.tensor(0.25), 1, torch.tensor(0.5), Q8, Qpp.DEFAULT)}
    q = torch.tensor([[1, 2, 3, 4], [100, 100, 100, -50]], dtype=torch.int8)
    assert INT_KERNELS["cumsum_int"]([q], attrs).tolist() == [[0, 2, 3, 5], [50, 100, 127, 125]]


# -- the decompositions ----------------------------------------------------------------------------------------
class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3)
        self.gn = nn.GroupNorm(2, 8)
        self.gn_c = nn.GroupNorm(8, 8)  # wav2vec2's feature extractor: one group per channel
        self.gn_1 = nn.GroupNorm(1, 8, affine=False)  # poolformer's GroupNorm(1, C), without affine
        self.inorm = nn.InstanceNorm1d(8, affine=True)
        self.inorm_rs = nn.InstanceNorm1d(8, track_running_stats=True)
        self.lin = nn.Linear(12, 6)
        with torch.no_grad():
            for m in (self.gn, self.gn_c, self.inorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
            self.inorm_rs.running_mean.uniform_(-0.2, 0.2)
            self.inorm_rs.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = self.conv(x)
        y = self.gn(y) + self.gn_c(y) + self.gn_1(y)
        y = self.inorm_rs(self.inorm(y))
        return F.glu(self.lin(y), dim=-1)


def _data(shape, n=6):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def test_decompositions_are_op_sites_of_existing_rules_and_exact_in_float():
    torch.manual_seed(0)
    model = _Norms().eval()
    x = _data((2, 4, 14))[0]
    prepared = prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    plans = prepared._quantlens_state.plans
    assert [n for n in plans if n.startswith("gn.")] == ["gn.reshape_0", "gn.layer_norm_0", "gn.reshape_1",
                                                         "gn.batch_norm_0"]
    assert [n for n in plans if n.startswith("gn_1.")] == ["gn_1.reshape_0", "gn_1.layer_norm_0", "gn_1.reshape_1"]
    assert [plans[n].op_type for n in plans if n.startswith("inorm_rs.")] == ["batch_norm"]
    assert [plans[n].op_type for n in plans if not n.startswith(("gn", "inorm", "conv", "add", "lin"))] == [
        "chunk", "sigmoid", "mul"]
    # the affine's statistics, gamma and beta are constants of the rule, not activations: no fake quant
    assert all(set(plans[n].input_fq) <= {0} for n in plans if plans[n].op_type == "batch_norm")
    set_fake_quantize(prepared, FakeQuantState.FLOAT)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), rtol=1e-5, atol=1e-5)


def test_instance_norm_with_running_stats_refuses_training():
    from quantlens.errors import QuantLensError

    x = torch.randn(4, 3, 10)
    prepared = prepare(nn.Sequential(nn.InstanceNorm1d(3, track_running_stats=True)), x,
                       default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    prepared.train()
    with pytest.raises(QuantLensError, match="keep the module in eval"):
        prepared(x)


def test_bad_group_count_is_a_clear_error():
    from quantlens.errors import QuantLensError

    class Bad(nn.Module):
        def forward(self, x):
            return F.group_norm(x, 3)

    with pytest.raises(QuantLensError, match="multiple of the 3 groups"):
        prepare(Bad(), torch.randn(1, 8, 4), default_calibration_qconfig_setter, check_result_dir=None,
                allow_no_stubs=True)


# -- end to end ----------------------------------------------------------------------------------------------------
class _Table(nn.Module):
    def __init__(self, which: str):
        super().__init__()
        self.which = which
        self.lin = nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        y = self.lin(x)
        if self.which == "rms_norm":
            return self.rms(y) + F.rms_norm(y, (8,), self.w)
        if self.which == "normalize":
            return F.normalize(y, dim=1) + F.normalize(y, dim=-1)
        if self.which == "vector_norm":
            return torch.linalg.vector_norm(y, dim=-1, keepdim=True) * y + torch.norm(y, dim=1).unsqueeze(1)
        return torch.cumsum(y, dim=-1) + y.cumsum(1)


_IR_OPS = {"rms_norm": {"int_rms_norm"}, "normalize": {"int_rms_norm", "permute"},
           "vector_norm": {"int_vector_norm"}, "cumsum": {"cumsum"}, "norms": {"int_layer_norm", "batch_norm"}}


def _run(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("which", list(_IR_OPS))
def test_small_model_through_every_stage(which):
    torch.manual_seed(0)
    model = (_Norms() if which == "norms" else _Table(which)).eval()
    data = _data((2, 4, 14) if which == "norms" else (2, 5, 8), 5)
    x, held_out = data[0], data[-1]
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=True), data[1:4])
    tables = pre_export(prepared, example_inputs=x)
    qat_ir = export(tables, x)
    int_ir = convert(qat_ir)
    feeds = {qat_ir.graph.inputs[0]: held_out}
    with torch.no_grad():
        outs = {"fake quant": _run(prepared, held_out), "pre_export": _run(tables, held_out),
                "qat IR": qat_ir.run(feeds)[0], "quantized IR": int_ir.run(feeds)[0]}
    with tempfile.TemporaryDirectory() as tmp:
        path = to_onnx(qat_ir, Path(tmp) / "m.onnx")
        for level in ("disable_all", "default"):
            outs[level] = torch.from_numpy(session(path, level).run(None, {k: v.numpy() for k, v in feeds.items()})[0])
    pairs = {"pre_export vs fake quant": ("pre_export", "fake quant"), "qat IR vs pre_export": ("qat IR", "pre_export"),
             "quantized IR vs qat IR": ("quantized IR", "qat IR"), "onnxruntime vs qat IR": ("default", "qat IR")}
    for name, (a, b) in pairs.items():
        assert cosine([outs[a]], [outs[b]]) >= THRESHOLDS[name], (name, cosine([outs[a]], [outs[b]]))
    assert cosine([outs["disable_all"]], [outs["qat IR"]]) >= THRESHOLDS["onnxruntime vs qat IR"]
    # the ops are the integer rules (not float ops left over)
    assert _IR_OPS[which] <= {n.op for n in qat_ir.graph.nodes}
    int_ops = {n.op for n in int_ir.graph.nodes}
    assert {"cumsum_int"} <= int_ops if which == "cumsum" else True
    assert {"channel_affine", "int_layer_norm"} <= int_ops if which == "norms" else True
