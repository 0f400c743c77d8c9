"""The rules of onnxruntime's CPU int8 kernels (``march/ort_cpu.py``, ``kernels/ort_cpu.py``) held against the real
runtime at its default options, op by op, bit for bit.

Each test builds a small QDQ model the way a user's int8 model reaches the runtime (int8 symmetric activations and
weights, int32 biases on ``s_x * s_w``), checks in the runtime's optimized graph that the fused kernel ran (not a
float fallback), and compares the runtime's output with the kernel run on the same codes: 0 differences. The
inputs are drawn to put values on rounding ties and at saturation, where a wrong rule shows.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from quantlens.kernels import ort_cpu as K  # noqa: E402
from quantlens.march import ort_cpu as R  # noqa: E402

SHIFT = R.X86_ACTIVATION_SHIFT
#: the largest weight code drawn: full range where this CPU sums u8 x s8 products exactly (VNNI); elsewhere within
#: +-64, where no pair of products can saturate, so the exact kernel is still the one under test
W_MAX = 127 if R.detect_variant() is R.KernelVariant.VNNI else 64
#: (s_x, s_y, z_y) of a sigmoid whose table the exact logistic and the runtime's polynomial fill differently
_SIGMOID_CASE = (0.12581442296504974, 0.00630908040329814, 15 - 128)


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _qdq(prefix, value, scale, zp, dtype=np.int8, axis=None):
    """Q then DQ of ``value`` with initializers ``<prefix>_s``/``<prefix>_z``; returns (nodes, inits, output)."""
    kw = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node("QuantizeLinear", [value, f"{prefix}_s", f"{prefix}_z"], [f"{prefix}_q"], **kw),
             helper.make_node("DequantizeLinear", [f"{prefix}_q", f"{prefix}_s", f"{prefix}_z"], [f"{prefix}_dq"], **kw)]
    inits = [_init(f"{prefix}_s", np.float32(scale)), _init(f"{prefix}_z", dtype(zp))]
    return nodes, inits, f"{prefix}_dq"


def _const_dq(prefix, codes, scale, axis=None):
    """A DequantizeLinear of constant codes (weights int8, bias int32; zero point 0)."""
    kw = {} if axis is None else {"axis": axis}
    scale = np.asarray(scale, np.float32)
    zp = np.zeros(scale.shape, codes.dtype)
    node = helper.make_node("DequantizeLinear", [f"{prefix}_c", f"{prefix}_s", f"{prefix}_z"], [f"{prefix}_dq"], **kw)
    return [node], [_init(f"{prefix}_c", codes), _init(f"{prefix}_s", scale), _init(f"{prefix}_z", zp)], f"{prefix}_dq"


def _run(nodes, inits, inputs: dict, out_shape, tmp_path):
    """Run the graph (inputs float32, one float32 output 'y') at default SessionOptions; returns (y, op types of
    the optimized graph)."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "m.opt.onnx")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    ops = {n.op_type for n in onnx.load(str(tmp_path / "m.opt.onnx")).graph.node}
    return torch.from_numpy(y), ops


def _on_grid(shape, scale, lo=-128, hi=127, seed=0):
    """Float inputs on the grid of ``scale`` and half-way between its steps (ties), and some beyond the range."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(lo * 2 - 8, hi * 2 + 8, shape, generator=g).to(torch.float32) / 2
    return (steps * scale).to(torch.float32)


def _u8(x, scale):
    """The runtime's codes of an int8 activation on x86 (code + 128, zero point 128)."""
    return K.quantize_linear(x, scale, 0, -128, 127) + SHIFT


def _out(codes_u8, scale, zero_point=0):
    return K.dequantize_linear(codes_u8, scale, zero_point + SHIFT)


def test_quantize_linear_divides_in_float32_and_rounds_ties_to_even(tmp_path):
    s = 0.0731
    x = torch.cat([_on_grid((4000,), s), torch.tensor([float("inf"), -float("inf"), 0.0])])
    nodes, inits, out = _qdq("x", "x", s, 0)
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    y, _ = _run(nodes, inits, {"x": x}, list(x.shape), tmp_path)
    ours = K.dequantize_linear(K.quantize_linear(x, s, 0, -128, 127), s, 0)
    assert torch.equal(y, ours)
    # the rule is a division: multiplying by the reciprocal rounds some ties the other way
    recip = torch.round((x * (1 / torch.tensor(s, dtype=torch.float32))).clamp(-128, 127))
    assert not torch.equal(recip, K.quantize_linear(x, s, 0, -128, 127).to(torch.float32))


@pytest.mark.parametrize("groups", [1, 4])
def test_qlinear_conv_with_per_channel_weights_is_exact(tmp_path, groups):
    g = torch.Generator().manual_seed(1)
    sx, sy = 0.05, 0.21
    cin, cout = 8, 16
    sw = (torch.rand(cout, generator=g) * 0.02 + 0.001).to(torch.float32)
    w = torch.randint(-W_MAX, W_MAX + 1, (cout, cin // groups, 3, 3), generator=g, dtype=torch.int8)
    sb = (torch.tensor(sx, dtype=torch.float32) * sw)
    b = torch.randint(-3000, 3000, (cout,), generator=g, dtype=torch.int32)
    x = _on_grid((2, cin, 7, 7), sx, seed=2)
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, wdq = _const_dq("w", w.numpy(), sw.numpy(), axis=0)
    n3, i3, bdq = _const_dq("b", b.numpy(), sb.numpy(), axis=0)
    conv = helper.make_node("Conv", [xdq, wdq, bdq], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], group=groups)
    n4, i4, _ = _qdq("o", "c", sy, 0)
    nodes = n1 + n2 + n3 + [conv] + n4 + [helper.make_node("Identity", ["o_dq"], ["y"])]
    y, ops = _run(nodes, i1 + i2 + i3 + i4, {"x": x}, None, tmp_path)
    assert "QLinearConv" in ops and "Conv" not in ops
    acc = K.conv_accumulate(_u8(x, sx), SHIFT, w, 0, b, 2, 1, 1, groups)
    m = R.gemm_multiplier(sx, sw, sy).reshape(1, -1, 1, 1)
    ours = _out(K.requantize(acc, m, SHIFT, 0, 255), sy)
    assert torch.equal(y, ours)


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul_is_exact(tmp_path, per_column):
    g = torch.Generator().manual_seed(3)
    sa, sy = 0.04, 0.9
    sw = (torch.rand(12, generator=g) * 0.02 + 0.002) if per_column else torch.tensor(0.011)
    w = torch.randint(-W_MAX, W_MAX + 1, (32, 12), generator=g, dtype=torch.int8)
    a = _on_grid((5, 32), sa, seed=4)
    n1, i1, adq = _qdq("a", "a", sa, 0)
    n2, i2, wdq = _const_dq("w", w.numpy(), sw.to(torch.float32).numpy(), axis=1 if per_column else None)
    mm = helper.make_node("MatMul", [adq, wdq], ["c"])
    n3, i3, _ = _qdq("o", "c", sy, 0)
    y, ops = _run(n1 + n2 + [mm] + n3 + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2 + i3, {"a": a},
                  None, tmp_path)
    assert "QLinearMatMul" in ops and "MatMul" not in ops
    acc = K.matmul_accumulate(_u8(a, sa), SHIFT, w, 0)
    ours = _out(K.requantize(acc, R.gemm_multiplier(sa, sw.to(torch.float32), sy), SHIFT, 0, 255), sy)
    assert torch.equal(y, ours)


def _binary(op, tmp_path, sa, sb, sc, shape_b=(64,)):
    a, b = _on_grid((3, 64), sa, seed=5), _on_grid(shape_b, sb, seed=6)
    n1, i1, adq = _qdq("a", "a", sa, 0)
    n2, i2, bdq = _qdq("b", "b", sb, 0)
    n3, i3, _ = _qdq("o", "c", sc, 0)
    nodes = n1 + n2 + [helper.make_node(op, [adq, bdq], ["c"])] + n3 + [helper.make_node("Identity", ["o_dq"], ["y"])]
    y, ops = _run(nodes, i1 + i2 + i3, {"a": a, "b": b}, None, tmp_path)
    return y, ops, _u8(a, sa), _u8(b, sb)


def test_qlinear_add_folds_the_zero_points_into_one_fused_multiply_add(tmp_path):
    sa, sb, sc = 0.031, 0.017, 0.043
    y, ops, a, b = _binary("Add", tmp_path, sa, sb, sc)
    assert "QLinearAdd" in ops
    r_a, r_b, f = R.add_constants(sa, SHIFT, sb, SHIFT, sc, SHIFT)
    assert torch.equal(y, _out(K.qlinear_add(a, b, r_a, r_b, f, 0, 255), sc))


def test_qlinear_mul_rounds_the_product_then_adds_the_zero_point(tmp_path):
    sa, sb, sc = 0.031, 0.017, 0.0043
    y, ops, a, b = _binary("Mul", tmp_path, sa, sb, sc)
    assert "QLinearMul" in ops
    r = R.mul_multiplier(sa, sb, sc)
    assert torch.equal(y, _out(K.qlinear_mul(a, SHIFT, b, SHIFT, r, SHIFT, 0, 255), sc))


def test_qlinear_global_average_pool_is_exact(tmp_path):
    sx, sy = 0.05, 0.013
    x = _on_grid((2, 8, 5, 5), sx, seed=7)
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, _ = _qdq("o", "c", sy, 0)
    nodes = n1 + [helper.make_node("GlobalAveragePool", [xdq], ["c"])] + n2 + [
        helper.make_node("Identity", ["o_dq"], ["y"])]
    y, ops = _run(nodes, i1 + i2, {"x": x}, None, tmp_path)
    assert "QLinearGlobalAveragePool" in ops
    acc = K.global_average_accumulate(_u8(x, sx), SHIFT)
    ours = _out(K.requantize(acc, R.global_average_multiplier(sx, sy, 25), SHIFT, 0, 255), sy)
    assert torch.equal(y, ours)


@pytest.mark.parametrize("op", ["Sigmoid", "LeakyRelu"])
def test_lookup_ops_sample_the_runtimes_own_function(tmp_path, op):
    # Sigmoid: scales where the exact logistic would fill one entry (code 91 = table entry 219) differently from the runtime's
    sx, sy, zy = _SIGMOID_CASE if op == "Sigmoid" else (0.05, 0.03, -20)
    fn = R.mlas_logistic if op == "Sigmoid" else R.leaky_relu(0.1)
    x = (torch.arange(-128, 128, dtype=torch.float32) * sx).reshape(4, 64)  # every code
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, _ = _qdq("o", "c", sy, zy)
    node = helper.make_node(op, [xdq], ["c"], **({"alpha": 0.1} if op == "LeakyRelu" else {}))
    y, ops = _run(n1 + [node] + n2 + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2, {"x": x}, None,
                  tmp_path)
    assert f"QLinear{op}" in ops
    table = R.lookup_table(fn, sx, SHIFT, sy, zy + SHIFT, 0, 255)
    assert torch.equal(y, _out(K.lookup(_u8(x, sx), table, 0), sy, zy).reshape(y.shape))


def test_the_logistic_is_mlas_polynomial_not_the_exact_function():
    """At :data:`_SIGMOID_CASE` the exact logistic fills one table entry differently: the runtime test above
    matches the polynomial there, so it tells the two rules apart."""
    sx, sy, zy = _SIGMOID_CASE
    poly = R.lookup_table(R.mlas_logistic, sx, SHIFT, sy, zy + SHIFT, 0, 255)
    exact = R.lookup_table(lambda v: torch.sigmoid(v.double()).float(), sx, SHIFT, sy, zy + SHIFT, 0, 255)
    assert torch.nonzero(poly != exact).flatten().tolist() == [219]


def test_fma32_rounds_once():
    g = np.random.default_rng(0)
    a = torch.from_numpy(g.standard_normal(2000).astype(np.float32))
    b = torch.from_numpy((g.standard_normal(2000) * 1e-7).astype(np.float32))
    c = torch.from_numpy(g.standard_normal(2000).astype(np.float32))
    got = R.fma32(a, b, c)
    for i in range(0, 2000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        # the float32 nearest to the exact value, ties to even
        lo = np.float32(float(exact))
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert float(got[i]) == float(best)


def test_avx2_variant_saturates_each_pair_of_products_to_int16():
    """The documented u8 x s8 rule of CPUs without VNNI, on hand-made operands (no such CPU here to run it)."""
    a = torch.tensor([[255, 255, 3]], dtype=torch.uint8)
    w = torch.tensor([[127], [127], [5]], dtype=torch.int8)
    exact = K.matmul_accumulate(a, 0, w, 0)
    avx2 = K.matmul_accumulate(a, 0, w, 0, R.KernelVariant.AVX2)
    assert int(exact) == 255 * 127 * 2 + 15 and int(avx2) == 32767 + 15
    # zero points are applied exactly, after the saturating dot product of the raw codes
    z = K.matmul_accumulate(a, 128, w, 0, R.KernelVariant.AVX2)
    assert int(z) == 32767 + 15 - 128 * (127 + 127 + 5)
    # with weights within +-64 no pair can saturate: both variants agree
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (6, 33), generator=g, dtype=torch.uint8)
    w = torch.randint(-64, 65, (33, 4), generator=g, dtype=torch.int8)
    assert torch.equal(K.matmul_accumulate(a, 128, w, 0), K.matmul_accumulate(a, 128, w, 0, R.KernelVariant.AVX2))


def test_the_variant_is_read_from_the_cpu_flags():
    assert R.detect_variant("flags\t: fpu sse2 avx2 avx512f avx512_vnni\n") is R.KernelVariant.VNNI
    assert R.detect_variant("flags\t: fpu sse2 avx2 avx_vnni\n") is R.KernelVariant.VNNI
    assert R.detect_variant("flags\t: fpu sse2 avx2 avx512f avx512bw\n") is R.KernelVariant.AVX2
    assert R.parse_variant("avx2") is R.KernelVariant.AVX2
    with pytest.raises(Exception, match="expected one of"):
        R.parse_variant("sse")


def test_the_runtime_kernels_of_each_op_site_are_read_from_its_optimized_graph(tmp_path):
    """tiny_resnet's QDQ file (QL1's symmetric int8): the conv before a residual add runs as QLinearConv, the
    classifier as QGemm, but a conv followed by a ReLU runs in float (FusedConv): the ReLU's output zero point is
    not the range's minimum, so the runtime cannot drop it (docs/march_ort.md)."""
    from quantlens.compiler import export, to_onnx
    from quantlens.compiler.onnx.runtime_kernels import kernels_by_site, runtime_kernels
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.pre_export import pre_export
    from quantlens.zoo import example_inputs, get_model, sample_batches

    torch.manual_seed(0)
    calib = prepare(get_model("tiny_resnet"), example_inputs("tiny_resnet"), check_result_dir=None)
    calibrate(calib, sample_batches("tiny_resnet", 2, 4))
    qat_ir = export(pre_export(calib), example_inputs("tiny_resnet"))
    sites = kernels_by_site(runtime_kernels(to_onnx(qat_ir, tmp_path / "r.onnx", standard_qdq=True)))
    assert sites["layer1.conv2"] == ["QLinearConv"]
    assert sites["fc"] == ["QGemm"]
    assert sites["stem_conv"] == ["FusedConv"]
    assert sites["avgpool"] == ["QLinearGlobalAveragePool"]


def test_qgemm_adds_the_int32_bias_before_the_requantize(tmp_path):
    g = torch.Generator().manual_seed(8)
    sa, sy = 0.04, 0.35
    sw = (torch.rand(10, generator=g) * 0.02 + 0.002).to(torch.float32)
    w = torch.randint(-W_MAX, W_MAX + 1, (10, 24), generator=g, dtype=torch.int8)  # [N, K]: transB
    b = torch.randint(-20000, 20000, (10,), generator=g, dtype=torch.int32)
    a = _on_grid((6, 24), sa, seed=9)
    n1, i1, adq = _qdq("a", "a", sa, 0)
    n2, i2, wdq = _const_dq("w", w.numpy(), sw.numpy(), axis=0)
    n3, i3, bdq = _const_dq("b", b.numpy(), (torch.tensor(sa, dtype=torch.float32) * sw).numpy(), axis=0)
    n4, i4, _ = _qdq("o", "c", sy, 0)
    gemm = helper.make_node("Gemm", [adq, wdq, bdq], ["c"], transB=1)
    y, ops = _run(n1 + n2 + n3 + [gemm] + n4 + [helper.make_node("Identity", ["o_dq"], ["y"])],
                  i1 + i2 + i3 + i4, {"a": a}, None, tmp_path)
    assert "QGemm" in ops and "Gemm" not in ops
    acc = K.matmul_accumulate(_u8(a, sa), SHIFT, w.T, 0) + b
    ours = _out(K.requantize(acc, R.gemm_multiplier(sa, sw, sy), SHIFT, 0, 255), sy)
    assert torch.equal(y, ours)


def test_qlinear_concat_requantizes_an_input_on_another_grid_through_a_table(tmp_path):
    sa, sb, sy = 0.02, 0.05, 0.03
    a, b = _on_grid((2, 3, 8), sa, seed=10), _on_grid((2, 5, 8), sb, seed=11)
    n1, i1, adq = _qdq("a", "a", sa, 0)
    n2, i2, bdq = _qdq("b", "b", sb, 0)
    n3, i3, _ = _qdq("o", "c", sy, 0)
    cat = helper.make_node("Concat", [adq, bdq], ["c"], axis=1)
    y, ops = _run(n1 + n2 + [cat] + n3 + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2 + i3,
                  {"a": a, "b": b}, None, tmp_path)
    assert "QLinearConcat" in ops
    parts = [K.lookup(_u8(x, s), R.lookup_table(lambda v: v, s, SHIFT, sy, SHIFT, 0, 255), 0) for x, s in ((a, sa), (b, sb))]
    assert torch.equal(y, _out(torch.cat(parts, 1), sy))


@pytest.mark.parametrize("length, sx, sy", [(64, 0.083, 1 / 256), (200, 0.083, 1 / 256), (64, 0.083, 0.0041),
                                            (4, 9.78e-5, 0.00099038), (3, 2.548e-4, 0.0020477)])
def test_qlinear_softmax_reads_one_table_shifted_to_the_row_maximum(tmp_path, length, sx, sy):
    """(``s_y = 0.0041``: the runtime scales by ``floor(1 / s_y) = 243``, not by ``1 / s_y = 243.9``. Rows of 3 and 4
    with a fine input scale: the table's values come near FLT_MAX, where ``e * floor(1 / s_y)`` overflows float32;
    the runtime gives the softmax's codes, as ``e * (floor(1 / s_y) / sum)`` does, not 255.)"""
    x = _on_grid((6, length), sx, seed=12)
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, _ = _qdq("o", "c", sy, -128)
    nodes = n1 + [helper.make_node("Softmax", [xdq], ["c"], axis=-1)] + n2 + [
        helper.make_node("Identity", ["o_dq"], ["y"])]
    y, ops = _run(nodes, i1 + i2, {"x": x}, None, tmp_path)
    assert "QLinearSoftmax" in ops
    codes = K.qlinear_softmax(_u8(x, sx), R.softmax_table(sx, length), R.softmax_output_scale(sy), 0)
    assert torch.equal(y, _out(codes, sy, -128))


@pytest.mark.parametrize("include_pad", [0, 1])
def test_qlinear_average_pool_averages_in_float_and_adds_the_zero_point_before_rounding(tmp_path, include_pad):
    sx, sy = 0.05, 0.0173
    x = _on_grid((2, 4, 9, 9), sx, seed=13)
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, _ = _qdq("o", "c", sy, 0)
    pool = helper.make_node("AveragePool", [xdq], ["c"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                            count_include_pad=include_pad)
    y, ops = _run(n1 + [pool] + n2 + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2, {"x": x}, None,
                  tmp_path)
    assert "QLinearAveragePool" in ops
    codes = K.qlinear_average_pool(_u8(x, sx), sx, SHIFT, sy, SHIFT, (3, 3), (2, 2), (1, 1), bool(include_pad), 0, 255)
    assert torch.equal(y, _out(codes, sy))


def test_qlinear_average_pool_rounds_after_adding_an_odd_zero_point(tmp_path):
    """2x2 windows with s_y = s_x put a quarter of the averages on .5 ties; with an odd output zero point (uint8 1)
    rounding before adding it would move each of those ties by one step."""
    sx = 0.05
    x = _on_grid((1, 3, 8, 8), sx, seed=14)
    n1, i1, xdq = _qdq("x", "x", sx, 0)
    n2, i2, _ = _qdq("o", "c", sx, -127)
    pool = helper.make_node("AveragePool", [xdq], ["c"], kernel_shape=[2, 2], strides=[2, 2])
    y, ops = _run(n1 + [pool] + n2 + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2, {"x": x}, None,
                  tmp_path)
    assert "QLinearAveragePool" in ops
    codes = K.qlinear_average_pool(_u8(x, sx), sx, SHIFT, sx, 1, (2, 2), (2, 2), (0, 0), False, 0, 255)
    assert torch.equal(y, _out(codes, sx, -127))
    xf = K.dequantize_linear(_u8(x, sx), sx, SHIFT)
    mean = torch.nn.functional.avg_pool2d(xf, 2)
    round_first = (K.quantize_linear(mean, sx, 0, -128, 127) + 1).clamp(0, 255)
    assert not torch.equal(round_first, codes)


def test_a_matmul_whose_output_stays_float_runs_as_matmul_integer_to_float(tmp_path):
    g = torch.Generator().manual_seed(15)
    sa = 0.04
    sw = (torch.rand(12, generator=g) * 0.02 + 0.002).to(torch.float32)
    w = torch.randint(-W_MAX, W_MAX + 1, (32, 12), generator=g, dtype=torch.int8)
    a = _on_grid((5, 32), sa, seed=16)
    n1, i1, adq = _qdq("a", "a", sa, 0)
    n2, i2, wdq = _const_dq("w", w.numpy(), sw.numpy(), axis=1)
    y, ops = _run(n1 + n2 + [helper.make_node("MatMul", [adq, wdq], ["y"])], i1 + i2, {"a": a}, None, tmp_path)
    assert "MatMulIntegerToFloat" in ops
    acc = K.matmul_accumulate(_u8(a, sa), SHIFT, w, 0)
    assert torch.equal(y, K.integer_to_float(acc, sa, sw))


def test_the_avx2_conv_is_the_exact_conv_where_no_pair_saturates_and_differs_where_pairs_do():
    """The AVX2 rule of a conv (no such CPU here): with weights within +-64 no pair of products passes int16, so it
    equals the exact accumulator; full-range codes saturate and it differs; a depthwise conv has no pairs."""
    g = torch.Generator().manual_seed(17)
    x = torch.randint(0, 256, (1, 8, 6, 6), generator=g, dtype=torch.uint8)
    small = torch.randint(-64, 65, (4, 8, 3, 3), generator=g, dtype=torch.int8)
    args = (2, 1, 1, 1)  # stride, padding, dilation, groups
    exact = K.conv_accumulate(x, 128, small, 0, None, *args)
    assert torch.equal(K.conv_accumulate(x, 128, small, 0, None, *args, R.KernelVariant.AVX2), exact)
    full = torch.full((4, 8, 3, 3), 127, dtype=torch.int8)
    hot = torch.full((1, 8, 6, 6), 255, dtype=torch.uint8)
    sat = K.conv_accumulate(hot, 128, full, 0, None, *args, R.KernelVariant.AVX2)
    assert (sat < K.conv_accumulate(hot, 128, full, 0, None, *args)).all()
    # by hand, an output away from the padding: 36 pairs of 255 * 127 each saturate to 32767, then the zero point
    # term 128 * (72 * 127) is subtracted exactly (the exact sum is 72 * 127 * 127)
    assert int(sat[0, 0, 1, 1]) == 36 * 32767 - 128 * 72 * 127 == 9180
    dw = torch.full((8, 1, 3, 3), 127, dtype=torch.int8)
    assert torch.equal(K.conv_accumulate(hot, 128, dw, 0, None, 1, 1, 1, 8, R.KernelVariant.AVX2),
                       K.conv_accumulate(hot, 128, dw, 0, None, 1, 1, 1, 8))


def test_a_relu_after_a_conv_fuses_when_its_output_is_uint8_with_zero_point_zero(tmp_path):
    """The quantization scheme ORT_CPU needs: QL1's symmetric int8 ReLU output (zero point 0, uint8 128 on x86)
    keeps the ReLU in float (FusedConv); a uint8 output with zero point 0 makes the ReLU redundant, the conv runs
    as QLinearConv and the requantize's clamp at 0 is the ReLU, bit for bit."""
    g = torch.Generator().manual_seed(18)
    sx, sy = 0.05, 0.04
    sw = (torch.rand(16, generator=g) * 0.02 + 0.001).to(torch.float32)
    w = torch.randint(-W_MAX, W_MAX + 1, (16, 8, 3, 3), generator=g, dtype=torch.int8)
    b = torch.randint(-3000, 3000, (16,), generator=g, dtype=torch.int32)
    x = _on_grid((1, 8, 6, 6), sx, seed=19)

    def graph(out_dtype):
        n1, i1, xdq = _qdq("x", "x", sx, 0)
        n2, i2, wdq = _const_dq("w", w.numpy(), sw.numpy(), axis=0)
        n3, i3, bdq = _const_dq("b", b.numpy(), (torch.tensor(sx, dtype=torch.float32) * sw).numpy(), axis=0)
        n4, i4, _ = _qdq("o", "r", sy, 0, dtype=out_dtype)
        nodes = n1 + n2 + n3 + [helper.make_node("Conv", [xdq, wdq, bdq], ["c"], pads=[1, 1, 1, 1]),
                                helper.make_node("Relu", ["c"], ["r"])] + n4
        return nodes + [helper.make_node("Identity", ["o_dq"], ["y"])], i1 + i2 + i3 + i4

    _, ops = _run(*graph(np.int8), {"x": x}, None, tmp_path)
    assert "FusedConv" in ops and "QLinearConv" not in ops
    y, ops = _run(*graph(np.uint8), {"x": x}, None, tmp_path)
    assert "QLinearConv" in ops and "Relu" not in ops and "FusedConv" not in ops
    acc = K.conv_accumulate(_u8(x, sx), SHIFT, w, 0, b, 1, 1, 1, 1)
    codes = K.requantize(acc, R.gemm_multiplier(sx, sw, sy).reshape(1, -1, 1, 1), 0, 0, 255)
    assert torch.equal(y, K.dequantize_linear(codes, sy, 0))
