"""onnxruntime's CPU int8 kernels on integer codes: what each fused kernel computes, with the parameters of
:mod:`quantlens.march.ort_cpu` (``docs/march_ort.md``).

Codes are integer tensors holding the runtime's values (uint8 activations on x86, int8 weights, int32 biases);
zero points are Python ints (per tensor) or integer tensors (per channel). Every function returns the output
codes as int32. The accumulators are exact: a float64 sum of products of 8-bit codes is exact far beyond any
reduction these kernels see (2**53 / 2**16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantlens.march.ort_cpu import KernelVariant, fma32

__all__ = [
    "quantize_linear", "dequantize_linear", "requantize", "matmul_accumulate", "conv_accumulate",
    "qlinear_add", "qlinear_mul", "global_average_accumulate", "lookup", "qlinear_softmax", "qlinear_average_pool", "integer_to_float", "INT16_MIN", "INT16_MAX",
]

INT16_MIN, INT16_MAX = -(1 << 15), (1 << 15) - 1


def quantize_linear(x: torch.Tensor, scale, zero_point, qmin: int, qmax: int) -> torch.Tensor:
    """QuantizeLinear: ``sat(RNE(fl(x / s)) + z)`` (a true float32 division; ``x * (1 / s)`` rounds otherwise)."""
    v = x.to(torch.float32) / torch.as_tensor(scale, dtype=torch.float32)
    z = torch.as_tensor(zero_point, dtype=torch.float32)
    return (torch.round(torch.minimum(torch.maximum(v, qmin - z), qmax - z)) + z).to(torch.int32)


def dequantize_linear(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    """DequantizeLinear: ``fl(float(q - z) * s)``."""
    diff = q.to(torch.int32) - torch.as_tensor(zero_point, dtype=torch.int32)
    return diff.to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32)


def requantize(acc: torch.Tensor, multiplier, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """The requantize every GEMM-like kernel ends in: ``sat(RNE(fl(float32(acc) * m)) + z)``, ``m`` float32 per
    tensor or broadcast per channel (``acc`` int32; its conversion to float32 rounds above 2**24)."""
    v = acc.to(torch.int32).to(torch.float32) * torch.as_tensor(multiplier, dtype=torch.float32)
    return (torch.round(v.clamp(qmin - zero_point, qmax - zero_point)) + zero_point).to(torch.int32)


def integer_to_float(acc: torch.Tensor, s_a, s_b) -> torch.Tensor:
    """MatMulIntegerToFloat (a MatMul whose output the runtime leaves in float): ``fl(float32(acc) * fl(s_a * s_b))``,
    ``s_b`` per tensor or per column."""
    scale = torch.as_tensor(s_a, dtype=torch.float32) * torch.as_tensor(s_b, dtype=torch.float32)
    return acc.to(torch.int32).to(torch.float32) * scale


def _pair_saturated_dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j sat16(a[2j] * w[2j] + a[2j+1] * w[2j+1])`` over the last axis of ``a`` [M, K] and first of
    ``w`` [K, N]: the u8 x s8 dot product of ``vpmaddubsw`` on the raw codes (an odd K pads with a zero)."""
    k = a.shape[-1]
    if k % 2:
        a, w = F.pad(a, (0, 1)), F.pad(w, (0, 0, 0, 1))
    a64, w64 = a.to(torch.int64), w.to(torch.int64)
    pairs = a64[:, 0::2, None] * w64[None, 0::2, :] + a64[:, 1::2, None] * w64[None, 1::2, :]
    return pairs.clamp(INT16_MIN, INT16_MAX).sum(1)


def matmul_accumulate(a: torch.Tensor, z_a: int, w: torch.Tensor, z_w, variant: KernelVariant = KernelVariant.VNNI,
                      ) -> torch.Tensor:
    """``sum_k (a[m,k] - z_a)(w[k,n] - z_w)`` in int32, ``a`` [M, K] uint8 codes, ``w`` [K, N] int8 codes,
    ``z_w`` per tensor or per column ``[N]``.

    ``VNNI`` sums exactly. ``AVX2`` computes the raw codes' dot product with each two adjacent products summed
    and saturated to int16 (``_pair_saturated_dot``), then subtracts the zero-point terms exactly from the row and
    column sums: ``dot - z_w * sum_k a - z_a * sum_k w + K * z_a * z_w``."""
    z_w = torch.as_tensor(z_w, dtype=torch.int64)
    a64, w64 = a.to(torch.int64), w.to(torch.int64)
    if variant is KernelVariant.AVX2:
        k = a.shape[-1]
        dot = _pair_saturated_dot(a64, w64)
        acc = dot - z_w * a64.sum(-1, keepdim=True) - z_a * w64.sum(0) + k * z_a * z_w
    else:
        acc = ((a64 - z_a).to(torch.float64) @ (w64 - z_w).to(torch.float64)).round().to(torch.int64)
    return acc.to(torch.int32)


def conv_accumulate(x: torch.Tensor, z_x: int, w: torch.Tensor, z_w, bias: torch.Tensor | None, stride, padding,
                    dilation, groups: int, variant: KernelVariant = KernelVariant.VNNI) -> torch.Tensor:
    """QLinearConv's int32 accumulator (NCHW): ``sum (x - z_x)(w - z_w) + bias``, padding contributing zero (the
    runtime pads with ``z_x``). ``z_w`` per tensor or per output channel (onnxruntime requires them equal).

    ``AVX2``: the 2-D convolution as the runtime's im2col GEMM, its reduction axis in (kh, kw, cin) order with the
    input channel fastest, each two adjacent raw-code products saturated to int16 (:func:`matmul_accumulate`); a
    depthwise convolution (one input channel per group) has no pairs and stays exact."""
    if variant is KernelVariant.AVX2 and w.dim() == 4 and w.shape[1] > 1:
        acc = _conv_avx2(x, z_x, w, z_w, stride, padding, dilation, groups)
        if bias is not None:
            acc = acc + bias.to(torch.int64).reshape(1, -1, 1, 1)
        return acc.to(torch.int32)
    z_w = torch.as_tensor(z_w, dtype=torch.float64)
    wf = w.to(torch.float64) - (z_w.reshape(-1, *([1] * (w.dim() - 1))) if z_w.dim() else z_w)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[w.dim() - 2]
    acc = conv((x.to(torch.float64) - z_x), wf, None, stride, padding, dilation, groups).round().to(torch.int64)
    if bias is not None:
        acc = acc + bias.to(torch.int64).reshape(1, -1, *([1] * (acc.dim() - 2)))
    return acc.to(torch.int32)


def _conv_avx2(x, z_x, w, z_w, stride, padding, dilation, groups) -> torch.Tensor:
    n, _, h, wd = x.shape
    cout, cin_g, kh, kw = w.shape
    pad = (padding, padding) if isinstance(padding, int) else tuple(padding)
    xp = F.pad(x.to(torch.float64), (pad[1], pad[1], pad[0], pad[0]), value=float(z_x))  # padded with the zero point
    cols = F.unfold(xp, (kh, kw), dilation=dilation, stride=stride)  # [N, C*kh*kw, L], (cin, kh, kw) order
    length = cols.shape[-1]
    out = []
    cout_g = cout // groups
    z_w = torch.as_tensor(z_w, dtype=torch.int64)
    for g in range(groups):
        part = cols[:, g * cin_g * kh * kw:(g + 1) * cin_g * kh * kw].reshape(n, cin_g, kh * kw, length)
        a = part.permute(0, 3, 2, 1).reshape(n * length, kh * kw * cin_g).round().to(torch.int64)  # (kh, kw, cin)
        wg = w[g * cout_g:(g + 1) * cout_g].permute(2, 3, 1, 0).reshape(kh * kw * cin_g, cout_g)
        zg = z_w[g * cout_g:(g + 1) * cout_g] if z_w.dim() else z_w
        out.append(matmul_accumulate(a, z_x, wg, zg, KernelVariant.AVX2).to(torch.int64).reshape(n, length, cout_g))
    oh = (h + 2 * pad[0] - (kh - 1) * _pair(dilation)[0] - 1) // _pair(stride)[0] + 1
    ow = (wd + 2 * pad[1] - (kw - 1) * _pair(dilation)[1] - 1) // _pair(stride)[1] + 1
    return torch.cat(out, -1).permute(0, 2, 1).reshape(n, cout, oh, ow)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def qlinear_add(a: torch.Tensor, b: torch.Tensor, r_a, r_b, f, qmin: int, qmax: int) -> torch.Tensor:
    """QLinearAdd on codes: ``sat(RNE(fma(a, r_a, fma(b, r_b, f))))`` (constants from
    :func:`quantlens.march.ort_cpu.add_constants`; broadcast as ONNX does)."""
    a, b = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32))
    t = fma32(b, torch.as_tensor(r_b, dtype=torch.float32).expand_as(b), torch.as_tensor(f).expand_as(b))
    t = fma32(a, torch.as_tensor(r_a, dtype=torch.float32).expand_as(a), t)
    return torch.round(t.clamp(qmin, qmax)).to(torch.int32)


def qlinear_mul(a: torch.Tensor, z_a: int, b: torch.Tensor, z_b: int, r, z_c: int, qmin: int, qmax: int) -> torch.Tensor:
    """QLinearMul on codes: ``sat(RNE(fl(fl(p * r) + z_c)))``, ``p = (a - z_a)(b - z_b)`` exact."""
    p = (a.to(torch.int32) - z_a) * (b.to(torch.int32) - z_b)
    v = p.to(torch.float32) * torch.as_tensor(r, dtype=torch.float32) + float(z_c)
    return torch.round(v.clamp(qmin, qmax)).to(torch.int32)


def global_average_accumulate(x: torch.Tensor, z_x: int) -> torch.Tensor:
    """QLinearGlobalAveragePool's int32 sum over the spatial dims (NCHW), ``sum(x) - z_x * N``; the requantize
    (:func:`requantize`, multiplier :func:`quantlens.march.ort_cpu.global_average_multiplier`) follows."""
    dims = tuple(range(2, x.dim()))
    n = 1
    for d in dims:
        n *= x.shape[d]
    return (x.to(torch.int64).sum(dims, keepdim=True) - z_x * n).to(torch.int32)


def lookup(x: torch.Tensor, table: torch.Tensor, qmin: int) -> torch.Tensor:
    """A QLinear lookup op (Sigmoid, LeakyRelu): ``table[x - qmin]``."""
    return table[(x.to(torch.int64) - qmin)]


def qlinear_softmax(x: torch.Tensor, table: torch.Tensor, y_scale, z_y: int) -> torch.Tensor:
    """QLinearSoftmax over the last axis of uint8 codes ``x`` (table :func:`quantlens.march.ort_cpu.softmax_table`,
    ``y_scale`` its ``softmax_output_scale``): each row reads ``e = table[255 - max(row) + x]``, sums ``e`` in float32
    one element after the other (the runtime's loop, in index order), and gives ``min(255, RNE(fl(e * fl(y_scale /
    sum))) + z_y)``."""
    import numpy as np

    rows = x.reshape(-1, x.shape[-1]).to(torch.int64)
    e = table[(255 - rows.max(-1, keepdim=True).values + rows)]
    total = torch.from_numpy(np.add.accumulate(e.numpy(), axis=-1, dtype=np.float32)[:, -1:])
    # e * (y_scale / sum), not (e * y_scale) / sum as the source reads: the runtime's build computes it without the
    # float32 overflow of e * y_scale (a short row's table values come within a factor of 2**8 of FLT_MAX), and this
    # order matches it bit for bit where the literal one overflows (tests/test_ort_cpu_rules.py)
    v = e * (torch.as_tensor(y_scale, dtype=torch.float32) / total)
    return (torch.round(v) + z_y).clamp(max=255).to(torch.int32).reshape(x.shape)


def qlinear_average_pool(x: torch.Tensor, s_x, z_x: int, s_y, z_y: int, kernel: tuple[int, int],
                         stride: tuple[int, int], pads: tuple[int, int], count_include_pad: bool,
                         qmin: int, qmax: int) -> torch.Tensor:
    """QLinearAveragePool (2-D, NCHW codes, symmetric pads ``(top, left)``): the codes dequantized to float32
    (``fl(s_x * (x - z_x))``), each window summed in float32 row by row (padding left out), divided by its count in
    float32 (the window's size with ``count_include_pad``, else its valid elements), and quantized as
    ``sat(RNE(fl(fl(v / s_y) + z_y)))``: the zero point is added before the rounding, unlike QuantizeLinear."""
    xf = torch.as_tensor(s_x, dtype=torch.float32) * (x.to(torch.int32) - z_x).to(torch.float32)
    n, c, h, w = xf.shape
    cols = F.unfold(xf, kernel, padding=pads, stride=stride)  # [N, C*kh*kw, L], zeros in the padding
    cols = cols.reshape(n, c, kernel[0] * kernel[1], -1)
    total = cols[:, :, 0]
    for k in range(1, cols.shape[2]):  # one element after the other, as the runtime's loop (+0.0 at the padding)
        total = total + cols[:, :, k]
    oh = (h + 2 * pads[0] - kernel[0]) // stride[0] + 1
    ow = (w + 2 * pads[1] - kernel[1]) // stride[1] + 1
    if count_include_pad:
        count = torch.full((oh * ow,), float(kernel[0] * kernel[1]))
    else:
        ones = F.unfold(torch.ones(1, 1, h, w), kernel, padding=pads, stride=stride)
        count = ones.sum(1).reshape(-1)
    v = total / count.to(torch.float32)
    q = torch.round(v / torch.as_tensor(s_y, dtype=torch.float32) + float(z_y)).clamp(qmin, qmax)
    return q.to(torch.int32).reshape(n, c, oh, ow)
