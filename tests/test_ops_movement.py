"""Issue #7 ops through every stage: conv_transpose1d/2d, 1-d pools (max, avg, adaptive avg/max), adaptive max pool
2-d, nearest upsample 1-d/2-d, pixel_shuffle / pixel_unshuffle and flip.

Each model is QuantStub -> op -> DeQuantStub; it is prepared, calibrated, ``pre_export``-ed, exported and
converted, and the quantized IR is compared with the fake-quant model (``pre_export``) on the same input: within one
output step for ops that requantize (conv_transpose, averages), bit-exact for movement ops. The integer kernels are
pinned with hand-computed values (``docs/march.md`` §6, §10.2, §11), and the qat IR is run in onnxruntime.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.compiler import convert, export, to_onnx
from quantlens.compiler.ir import Module, Node
from quantlens.compiler.kernels_int import int_dispatch
from quantlens.march import Qpp, get_march
from quantlens.march.numerics import quantize_multiplier
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qat_modules import QATConvTranspose1d, QATConvTranspose2d
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)

_MOVES = {"reshape", "permute", "expand", "slice", "select", "relu", "max_pool1d", "max_pool2d", "upsample_nearest1d",
          "upsample_nearest2d", "pixel_shuffle", "pixel_unshuffle", "flip"}


class _Wrap(nn.Module):
    """QuantStub -> body -> DeQuantStub (one DeQuantStub per output)."""

    def __init__(self, body, n_out=1):
        super().__init__()
        self.q = QuantStub()
        self.body = body
        self.dqs = nn.ModuleList(DeQuantStub() for _ in range(n_out))

    def forward(self, x):
        out = self.body(self.q(x))
        out = out if isinstance(out, tuple) else (out,)
        return tuple(dq(o) for dq, o in zip(self.dqs, out))


class _Fn(nn.Module):
    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():
            setattr(self, name, m)

    def forward(self, x):
        return self.fn(self, x)


def _pipeline(body, shape, n_out=1, setter=default_calibration_qconfig_setter, seed=0):
    torch.manual_seed(seed)
    model = _Wrap(body, n_out).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randn(*shape, generator=gen) for _ in range(4)]
    prepared = prepare(model, (batches[0],), setter, check_result_dir=None)
    calibrate(prepared, [(b,) for b in batches])
    fq_model = pre_export(prepared)
    qat_ir = export(fq_model, (batches[0],))
    q_ir = convert(qat_ir)
    test_input = torch.randn(*shape, generator=gen)
    return prepared, fq_model, qat_ir, q_ir, test_input


def _output_step(ir: Module, name: str):
    """The scale of the fake quant behind output ``name`` (through movement ops); None: high precision."""
    producers = ir.graph.producers()
    while name in producers:
        node = producers[name]
        if node.op == "fake_quant":
            return float(ir.graph.constants[node.inputs[1]].max())
        if node.op not in _MOVES:
            return None
        name = node.inputs[0]
    return None


#: one output step, measured on dequantized float32 values: each carries a relative rounding error of 2**-24, so
#: codes up to 2**15 (int16) add up to 2 · 2**15 · 2**-24 = 2**-8 of a step (int8: ~1e-5)
ONE_STEP = 1.0 + 2.0**-8
#: at most this fraction of the output codes may differ by that one step (ties decided by float rounding)...
MAX_DIFFERING = 0.01


def _max_differing(q_ir: Module, codes: torch.Tensor) -> float:
    """... plus, with a ``b``-bit multiplier (the IR's qpp, docs/march.md §8.1), the share of codes whose exact value
    lies within the multiplier's relative error ``2**-b`` of a tie: at most ``2 · max|code| · 2**-b`` (one
    requantize, uniformly spread fractions). Default profile (b = 16): +0.4% for int8, up to all codes for int16
    (the error reaches half a step); high precision (b = 31): nothing."""
    bits = get_march().spec.qpp(q_ir.meta.get("qpp", "high_precision")).multiplier_bits
    return MAX_DIFFERING + 2 * float(codes.abs().max()) * 2.0**-bits


def _compare(fq_model, qat_ir, q_ir, x, exact=False):
    """Quantized IR vs the fake-quant model on ``x``: the largest error per output in output steps (high
    precision: relative to max|output|). Grid outputs also assert that at most ``MAX_DIFFERING`` of the codes
    differ; ``exact``: bit-exact."""
    with torch.no_grad():
        ref = fq_model(x)
    assert all(torch.equal(r, g) for r, g in zip(ref, qat_ir(x)))  # the qat IR is the fake-quant model
    got = q_ir(x)
    got = got if isinstance(got, (tuple, list)) else (got,)
    errors = []
    for name, r, g in zip(qat_ir.graph.outputs, ref, got):
        assert r.shape == g.shape and r.dtype == g.dtype
        diff = (r.double() - g.double()).abs()
        step = _output_step(qat_ir, name)
        if exact:
            assert step is not None and torch.equal(r, g), (name, diff.max().item() / step if step else diff.max())
        if step is not None:
            differing = (diff > 0.5 * step).double().mean().item()
            assert differing <= _max_differing(q_ir, r.double() / step), (name, differing)
            errors.append(diff.max().item() / step)
        else:
            errors.append(diff.max().item() / max(r.abs().max().item(), 1e-30))
    return errors


# -- onnxruntime --------------------------------------------------------------------------------------------------
def _onnx_errors(qat_ir, x, tmp_path):
    """qat IR vs onnxruntime (graph as written, and its default options): errors in output steps. The optimized
    graph keeps no integer GEMM kernel (tests/_ort.py)."""
    pytest.importorskip("onnxruntime")
    from _ort import LEVELS, saturating_kernels, session

    path = to_onnx(qat_ir, tmp_path / "model.onnx")
    ref = qat_ir.run({qat_ir.graph.inputs[0]: x})
    result = {}
    for level in LEVELS:
        got = session(path, level).run(None, {qat_ir.graph.inputs[0]: x.numpy()})
        errs = []
        for name, r, g in zip(qat_ir.graph.outputs, ref, got):
            r = r.numpy()
            assert g.shape == r.shape and g.dtype == r.dtype
            diff = float(np.abs(g.astype(np.float64) - r.astype(np.float64)).max())
            step = _output_step(qat_ir, name)
            errs.append(diff / step if step is not None else diff / max(float(np.abs(r).max()), 1e-30))
        result[level] = errs
    assert saturating_kernels(path, tmp_path) == set()
    return result, path


def _onnx_ops(path) -> set:
    import onnx

    return {n.op_type for n in onnx.load(str(path)).graph.node}


# -- conv_transpose: hand-computed integer kernel (docs/march.md §6) ----------------------------------------------
def _ct_node(op, mult, shift, stride, padding=0, output_padding=0, out="qint8"):
    n = 1 if op == "conv_transpose1d" else 2
    return Node(op, ["x", "w", "b"], ["y"], {
        "stride": [stride] * n, "padding": [padding] * n, "output_padding": [output_padding] * n, "groups": 1,
        "dilation": [1] * n, "multiplier": mult, "shift": shift, "out_dtype": out})


def test_int_conv_transpose1d_kernel_hand_computed():
    # march §6 example: q = [3, -2], w = [1, 2, 3], stride 2: acc = [3, 6, 7, -4, -6]; m = 0.5 -> [2, 3, 4, -2, -3]
    x = torch.tensor([[[3, -2]]], dtype=torch.int8)
    w = torch.tensor([[[1, 2, 3]]], dtype=torch.int8)
    node = _ct_node("conv_transpose1d", [2**30], [31], stride=2)
    y = int_dispatch(node, [x, w, None])
    assert y.dtype == torch.int8 and y.flatten().tolist() == [2, 3, 4, -2, -3]
    # two output channels (weight [in=1, out=2, k=3]), per-channel requantize m = [0.5, 1.0] and bias [1, -3]:
    # channel 0: [3, 6, 7, -4, -6] + 1 = [4, 7, 8, -3, -5] * 0.5 -> rhe([2, 3.5, 4, -1.5, -2.5]) = [2, 4, 4, -2, -2]
    # channel 1: w = [-1, 0, 1]: [-3, 0, 3 + 2, 0, -2] - 3 = [-6, -3, 2, -3, -5]
    w2 = torch.tensor([[[1, 2, 3], [-1, 0, 1]]], dtype=torch.int8)
    b2 = torch.tensor([1, -3], dtype=torch.int32)
    node = _ct_node("conv_transpose1d", [2**30, 2**30], [31, 30], stride=2)
    assert int_dispatch(node, [x, w2, b2]).tolist() == [[[2, 4, 4, -2, -2], [-6, -3, 2, -3, -5]]]
    # padding 1 crops one element at each end, output_padding 1 adds one at the end: [6, 7, -4, -6]
    node = _ct_node("conv_transpose1d", [2**30], [30], stride=2, padding=1, output_padding=1)
    assert int_dispatch(node, [x, w, None]).flatten().tolist() == [6, 7, -4, -6]
    # saturation once, after the exact sum: a bias of 2**30 saturates to 127, it never wraps
    node = _ct_node("conv_transpose1d", [2**30], [30], stride=2)
    big = torch.tensor([2**30], dtype=torch.int32)
    assert int_dispatch(node, [x, w, big]).flatten().tolist() == [127] * 5


def test_int_conv_transpose2d_kernel_hand_computed():
    # q = [[1, 2], [3, 4]], w = ones(2, 2), stride 1: acc = [[1, 3, 2], [4, 10, 6], [3, 7, 4]]
    x = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8).reshape(1, 1, 2, 2)
    w = torch.ones(1, 1, 2, 2, dtype=torch.int8)
    node = _ct_node("conv_transpose2d", [2**30], [31], stride=1)  # m = 0.5
    y = int_dispatch(node, [x, w, None])
    assert y.dtype == torch.int8
    assert y[0, 0].tolist() == [[0, 2, 1], [2, 5, 3], [2, 4, 2]]  # rhe(0.5) = 0, rhe(1.5) = 2, rhe(3.5) = 4
    # int16 activations x int8 weights, stride 2: every input pixel becomes a 2x2 block, m = 1
    x16 = torch.tensor([[300, -20000], [7, 32767]], dtype=torch.int16).reshape(1, 1, 2, 2)
    node = _ct_node("conv_transpose2d", [2**30], [30], stride=2, out="qint16")
    y = int_dispatch(node, [x16, w, None])
    assert y.dtype == torch.int16
    assert y[0, 0].tolist() == [[300, 300, -20000, -20000], [300, 300, -20000, -20000],
                                [7, 7, 32767, 32767], [7, 7, 32767, 32767]]


def _ct1d_relu():
    return _Fn(lambda s, x: F.relu(s.ct(x)), ct=nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1))


@pytest.mark.parametrize("setter", [default_calibration_qconfig_setter, calibration_8bit_weight_16bit_act_qconfig_setter])
def test_conv_transpose1d_through_every_stage(setter, tmp_path):
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(_ct1d_relu(), (2, 4, 7), setter=setter)
    ct = prepared.body.ct
    assert isinstance(ct, QATConvTranspose1d)
    # per channel along axis 1 (the 3 output channels), int8
    assert ct.weight_fake_quant.ch_axis == 1 and ct.weight_fake_quant.scale.shape == (3,)
    node = next(n for n in q_ir.graph.nodes if n.op == "conv_transpose1d")
    assert len(node.attrs["multiplier"]) == 3 and q_ir.graph.values[node.inputs[1]].dtype == "int8"
    assert q_ir.graph.values[node.inputs[2]].dtype == "int32"  # the bias, at s_in * s_w[c]
    assert q_ir.graph.values[node.outputs[0]].qdtype == ("qint8" if setter is default_calibration_qconfig_setter
                                                         else "qint16")
    errors = _compare(fq_model, qat_ir, q_ir, x)
    assert max(errors) <= ONE_STEP, errors
    report, path = _onnx_errors(qat_ir, x, tmp_path)
    assert "ConvTranspose" in _onnx_ops(path)
    assert all(e <= ONE_STEP for errs in report.values() for e in errs), report


def test_conv_transpose2d_high_precision_output_and_functional_call(tmp_path):
    # a final transposed conv keeps the int32 accumulator (march §9), per output channel
    body = nn.ConvTranspose2d(3, 4, 2, stride=2)
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(body, (2, 3, 5, 4))
    assert isinstance(prepared.body, QATConvTranspose2d)
    node = next(n for n in q_ir.graph.nodes if n.op == "conv_transpose2d")
    info = q_ir.graph.values[node.outputs[0]]
    assert info.qdtype == "qint32" and info.axis == 1
    errors = _compare(fq_model, qat_ir, q_ir, x)
    assert max(errors) <= 1e-5, errors  # no rounding: float rounding only
    report, _ = _onnx_errors(qat_ir, x, tmp_path)
    assert all(e <= 1e-4 for errs in report.values() for e in errs), report

    # F.conv_transpose2d with a parameter weight: a weight fake quant along axis 1 at the site, then a ReLU
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 2, 3, 3) * 0.3)
            self.bias = nn.Parameter(torch.randn(2) * 0.1)

        def forward(self, x):
            return F.relu(F.conv_transpose2d(x, self.weight, self.bias, stride=2, padding=1))

    prepared, fq_model, qat_ir, q_ir, x = _pipeline(Functional(), (1, 3, 4, 4))
    wq = next(n for n in qat_ir.graph.nodes if n.op == "fake_quant" and n.inputs[0] in qat_ir.graph.constants
              and qat_ir.graph.constants[n.inputs[0]].dim() == 4)
    assert wq.attrs["axis"] == 1 and qat_ir.graph.constants[wq.inputs[1]].shape == (2,)
    errors = _compare(fq_model, qat_ir, q_ir, x)
    assert max(errors) <= ONE_STEP, errors
    report, _ = _onnx_errors(qat_ir, x, tmp_path)
    assert all(e <= ONE_STEP for errs in report.values() for e in errs), report


def test_grouped_conv_transpose_uses_a_per_tensor_weight():
    body = _Fn(lambda s, x: F.relu(s.ct(x)), ct=nn.ConvTranspose1d(4, 4, 2, stride=2, groups=2))
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(body, (2, 4, 5))
    assert prepared.body.ct.weight_fake_quant.ch_axis is None
    assert max(_compare(fq_model, qat_ir, q_ir, x)) <= ONE_STEP


# -- average pools: hand-computed integer kernel (docs/march.md §10.2) -----------------------------------------------
def _avg1d_node(k, stride, mult, shift, padding=0):
    return Node("avg_pool1d_int", ["x"], ["y"], {"kernel_size": [k], "stride": [stride], "padding": [padding],
                                                 "multiplier": [mult], "shift": [shift], "out_dtype": "qint8"})


def test_int_avg_pool1d_kernel_hand_computed():
    q = torch.tensor([[[10, 3, -7, -8, 127, 126]]], dtype=torch.int8)
    # k = 2, s_in = s_out: m = 1/2 = (2**30, 31); sums [13, -15, 253] -> rhe([6.5, -7.5, 126.5]) = [6, -8, 126]
    assert quantize_multiplier(0.5, Qpp.HIGH_PRECISION) == (2**30, 31)
    assert quantize_multiplier(0.5) == (2**15, 16)  # the default profile: the same 1/2
    assert int_dispatch(_avg1d_node(2, 2, 2**15, 16), [q]).flatten().tolist() == [6, -8, 126]
    y = int_dispatch(_avg1d_node(2, 2, 2**30, 31), [q])
    assert y.dtype == torch.int8 and y.flatten().tolist() == [6, -8, 126]
    # k = 3: m = 1/3 = (1431655765, 32); sums [6, 245] -> [2, 82]
    assert quantize_multiplier(1 / 3, Qpp.HIGH_PRECISION) == (1431655765, 32)
    assert int_dispatch(_avg1d_node(3, 3, 1431655765, 32), [q]).flatten().tolist() == [2, 82]
    # default profile: 1/3 = (rhe(2**17 / 3) = 43691, 17): 6 · 43691 / 2**17 = 2.00002, 245 · 43691 / 2**17 = 81.67
    assert quantize_multiplier(1 / 3) == (43691, 17)
    assert int_dispatch(_avg1d_node(3, 3, 43691, 17), [q]).flatten().tolist() == [2, 82]
    # padding 1 (zeros count), k = 2, stride 2: windows [0, 10], [3, -7], [-8, 127], [126, 0] -> [5, -2, 60, 63]
    assert int_dispatch(_avg1d_node(2, 2, 2**30, 31, padding=1), [q]).flatten().tolist() == [5, -2, 60, 63]
    # the sum is exact and rounded once: m = 1/2 * 4 = 2 saturates 253 * 2 to 127
    assert int_dispatch(_avg1d_node(2, 2, 2**30, 29), [q]).flatten().tolist() == [26, -30, 127]


def _pools():
    def fn(s, x):  # x: [N, 4, 12]
        return (s.avg(x), F.avg_pool1d(x, 2), s.aavg(x), F.adaptive_avg_pool1d(x, 3), s.mp(x), F.max_pool1d(x, 3, 2),
                s.amp(x), F.adaptive_max_pool1d(x, 4))

    return _Fn(fn, avg=nn.AvgPool1d(3, stride=2, padding=1), aavg=nn.AdaptiveAvgPool1d(4), mp=nn.MaxPool1d(2),
               amp=nn.AdaptiveMaxPool1d(6))


@pytest.mark.parametrize("setter", [default_calibration_qconfig_setter, calibration_8bit_weight_16bit_act_qconfig_setter])
def test_1d_pools_through_every_stage(setter, tmp_path):
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(_pools(), (2, 4, 12), n_out=8, setter=setter)
    stats = q_ir.statistics()
    assert stats.get("avg_pool1d_int") == 4 and stats.get("max_pool1d") == 4, stats
    assert "adaptive_max_pool1d" not in qat_ir.statistics()  # lowered to max_pool1d (even windows)
    errors = _compare(fq_model, qat_ir, q_ir, x)
    assert max(errors[:4]) <= ONE_STEP, errors  # averages: one requantize
    assert errors[4:] == [0.0] * 4, errors  # max pools: the max of the integers
    report, path = _onnx_errors(qat_ir, x, tmp_path)
    assert {"AveragePool", "MaxPool"} <= _onnx_ops(path)
    assert all(e <= ONE_STEP for errs in report.values() for e in errs), report


def test_adaptive_max_pool2d_is_a_max_pool(tmp_path):
    body = _Fn(lambda s, x: (s.amp(x), F.adaptive_max_pool2d(x, (1, 2))), amp=nn.AdaptiveMaxPool2d((2, 3)))
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(body, (2, 3, 4, 6), n_out=2)
    pools = [n for n in qat_ir.graph.nodes if n.op == "max_pool2d"]
    assert [p.attrs["kernel_size"] for p in pools] == [[2, 2], [4, 3]]
    _compare(fq_model, qat_ir, q_ir, x, exact=True)
    report, _ = _onnx_errors(qat_ir, x, tmp_path)
    assert all(e == 0.0 for errs in report.values() for e in errs), report


def test_uneven_and_varying_windows_run_on_the_host():
    # adaptive max pool 7 -> 3: uneven windows, which the IR's max pool cannot express, run on the host (the
    # partition, docs/march.md §12.1): a float op between the integer ones, and the model goes through
    _, _, qat_ir, q_ir, x = _pipeline(_Fn(lambda s, x: F.adaptive_max_pool1d(x, 3)), (1, 2, 7))
    assert any(n.op == "host_aten" and "adaptive_max_pool1d" in n.attrs["target"] for n in qat_ir.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(q_ir(x), qat_ir(x)))  # a max moves values: exact on the host
    # adaptive avg pool 7 -> 3 exports (the qat IR runs torch's op) and convert, which cannot express its uneven
    # windows, runs it on the host too, with the reason; so does an excluded padding's varying divisor
    for fn, shape, why in ((lambda s, x: F.adaptive_avg_pool1d(x, 3), (1, 2, 7), "uneven"),
                           (lambda s, x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), (1, 2, 8), "varying")):
        _, _, qat_ir, q_ir, x = _pipeline(_Fn(fn), shape)
        host = [n for n in q_ir.graph.nodes if n.attrs.get("host_reason")]
        assert len(host) == 1 and why in host[0].attrs["host_reason"] and "avg_pool1d" in host[0].op, host
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(q_ir(x), qat_ir(x)))



def test_avg_pool2d_ceil_mode_overhang_converts_with_a_divisor_per_window():
    """6x6, kernel 3, stride 2, ceil_mode: the last window overhangs (3x3 windows where the floor gives 2x2) and
    torch divides it by the elements it covers; convert gives each window its divisor's multiplier (§10.2)."""
    for pad in (0, 1):
        prepared, fq_model, qat_ir, q_ir, x = _pipeline(
            _Fn(lambda s, x, pad=pad: F.avg_pool2d(x, 3, 2, pad, ceil_mode=True)), (1, 2, 6, 6))
        assert q_ir.statistics().get("avg_pool2d_div_int") == 1
        errors = _compare(fq_model, qat_ir, q_ir, x)
        assert max(errors) <= ONE_STEP, errors


def test_avg_pool2d_ceil_mode_without_overhang_converts():
    """7x7, kernel 3, stride 2: the windows tile the input, ceil_mode changes nothing, and convert keeps the op
    (within the one requantize of an average, as without ceil_mode)."""
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(_Fn(lambda s, x: F.avg_pool2d(x, 3, 2, ceil_mode=True)),
                                                    (1, 2, 7, 7))
    assert tuple(q_ir(x)[0].shape) == (1, 2, 3, 3)
    assert q_ir.statistics().get("avg_pool2d_int") == 1
    errors = _compare(fq_model, qat_ir, q_ir, x)
    assert max(errors) <= ONE_STEP, errors


# -- nearest resize: 1-d and 2-d, scale factor or size (docs/march.md §11) --------------------------------------------
def test_int_upsample_nearest1d_kernel_hand_computed():
    q = torch.tensor([[[1, -2, 3]]], dtype=torch.int8)
    node = Node("upsample_nearest1d", ["x"], ["y"], {"output_size": [7], "scale_factors": None})
    # output i reads floor(i * 3 / 7): 0, 0, 0, 1, 1, 2, 2
    y = int_dispatch(node, [q])
    assert y.dtype == torch.int8 and y.flatten().tolist() == [1, 1, 1, -2, -2, 3, 3]
    node = Node("upsample_nearest1d", ["x"], ["y"], {"output_size": None, "scale_factors": [2.0]})
    assert int_dispatch(node, [q.to(torch.int16) * 1000]).flatten().tolist() == [1000, 1000, -2000, -2000,
                                                                                   3000, 3000]


def _nearest():
    def fn(s, x):  # x: [N, 3, 4, 5]
        flat = x.flatten(2)  # [N, 3, 20]
        return (s.up(x), F.interpolate(x, size=(7, 11), mode="nearest"), s.up(flat),
                F.interpolate(flat, size=33, mode="nearest"), F.interpolate(flat, scale_factor=3))

    return _Fn(fn, up=nn.Upsample(scale_factor=2, mode="nearest"))


def test_nearest_upsample_1d_2d_through_every_stage(tmp_path):
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(_nearest(), (2, 3, 4, 5), n_out=5)
    stats = q_ir.statistics()
    assert stats.get("upsample_nearest1d") == 3 and stats.get("upsample_nearest2d") == 2, stats
    assert "requantize" not in stats  # the values keep their grid
    _compare(fq_model, qat_ir, q_ir, x, exact=True)
    report, path = _onnx_errors(qat_ir, x, tmp_path)
    assert "Resize" in _onnx_ops(path)
    assert all(e == 0.0 for errs in report.values() for e in errs), report


# -- pixel_shuffle, pixel_unshuffle, flip: pure movement ------------------------------------------------------------
def test_int_shuffle_and_flip_hand_computed():
    q = torch.arange(16, dtype=torch.int8).reshape(1, 4, 2, 2) - 8  # channel c holds 4c - 8 ... 4c - 5
    y = int_dispatch(Node("pixel_shuffle", ["x"], ["y"], {"upscale_factor": 2}), [q])
    # out[0, 0, 2h + i, 2w + j] = in[0, 2i + j, h, w]
    assert y.dtype == torch.int8 and y[0, 0].tolist() == [[-8, -4, -7, -3], [0, 4, 1, 5], [-6, -2, -5, -1],
                                                          [2, 6, 3, 7]]
    back = int_dispatch(Node("pixel_unshuffle", ["x"], ["y"], {"downscale_factor": 2}), [y])
    assert torch.equal(back, q)
    f = int_dispatch(Node("flip", ["x"], ["y"], {"dims": [1, 3]}), [q])
    assert f.dtype == torch.int8 and f[0, 0].tolist() == [[5, 4], [7, 6]] and f[0, 3].tolist() == [[-7, -8], [-5, -6]]


def _shuffles():
    def fn(s, x):  # x: [N, 8, 4, 6]
        return s.ps(x), F.pixel_unshuffle(x, 2), s.pu(x), torch.flip(x, [1, -1]), x.flip(2)

    return _Fn(fn, ps=nn.PixelShuffle(2), pu=nn.PixelUnshuffle(2))


def test_pixel_shuffle_unshuffle_flip_through_every_stage(tmp_path):
    prepared, fq_model, qat_ir, q_ir, x = _pipeline(_shuffles(), (2, 8, 4, 6), n_out=5)
    stats = q_ir.statistics()
    assert stats.get("pixel_shuffle") == 1 and stats.get("pixel_unshuffle") == 2 and stats.get("flip") == 2, stats
    assert next(n for n in qat_ir.graph.nodes if n.op == "flip" and len(n.attrs["dims"]) == 2).attrs["dims"] == [1, 3]
    assert all(q_ir.graph.values[n.outputs[0]].dtype == "int8" for n in q_ir.graph.nodes if n.op in
               ("pixel_shuffle", "pixel_unshuffle", "flip"))
    _compare(fq_model, qat_ir, q_ir, x, exact=True)
    report, path = _onnx_errors(qat_ir, x, tmp_path)
    assert {"DepthToSpace", "Slice"} <= _onnx_ops(path)
    assert all(e == 0.0 for errs in report.values() for e in errs), report
