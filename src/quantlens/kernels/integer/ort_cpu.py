"""The quantized IR's kernels under ``March.ORT_CPU``: each node that ``convert`` lowered to one of onnxruntime's
fused int8 kernels (attrs ``runtime: "ort_cpu"``) runs that kernel's arithmetic (:mod:`quantlens.kernels.ort_cpu`,
parameters from :mod:`quantlens.march.ort_cpu`; ``docs/march_ort.md``).

Values of the IR hold the model's codes: ``qint8`` codes in int8 storage, ``quint8`` codes in uint8, both with zero
point 0. The runtime holds an int8 activation as uint8 with zero point 128 on x86 (its S8->U8 pass), so each kernel
reads its inputs as ``code + z`` with the runtime's zero point ``z`` (attrs ``zero_points``: one per integer
input, then the output's) and gives back ``runtime code - z_out``: the same number, in the model's storage.
"""

from __future__ import annotations

import torch

from quantlens._registry import make_registry
from quantlens.kernels.integer.core import storage_dtype
from quantlens.kernels.integer.gemm import exact_accumulator
from quantlens.kernels.ort_cpu import (
    conv_accumulate,
    dequantize_linear,
    global_average_accumulate,
    integer_to_float,
    lookup,
    matmul_accumulate,
    qlinear_add,
    qlinear_average_pool,
    qlinear_mul,
    qlinear_softmax,
    quantize_linear,
    requantize,
)
from quantlens.march import QuantDType
from quantlens.march.ort_cpu import KernelVariant, parse_variant

__all__ = ["ORT_CPU_KERNELS", "ort_cpu_kernel", "RUNTIME"]

#: the ``runtime`` attr of the nodes these kernels run
RUNTIME = "ort_cpu"

#: IR op -> its kernel under ``March.ORT_CPU``, ``kernel(inputs, attrs, site="")``
ORT_CPU_KERNELS, ort_cpu_kernel = make_registry("onnxruntime CPU kernel for op")


def _runtime_codes(q: torch.Tensor, zero_point: int) -> torch.Tensor:
    return q.to(torch.int32) + zero_point


def _variant(attrs: dict) -> KernelVariant:
    return parse_variant(attrs.get("variant", KernelVariant.VNNI.value))


def _out(attrs: dict) -> tuple[QuantDType, int]:
    return QuantDType.parse(attrs["out_dtype"]), int(attrs["zero_points"][-1])


def _to_model(y: torch.Tensor, attrs: dict) -> torch.Tensor:
    """Runtime output codes (zero point ``z_out``) as the model's codes in its storage type."""
    out, z = _out(attrs)
    return (y - z).to(storage_dtype(out.value))


def _requantized(acc: torch.Tensor, attrs: dict, channel_dim: int) -> torch.Tensor:
    """The GEMMs' requantize: ``sat(RNE(fl(float32(acc) * m)) + z)`` with the float32 multiplier(s) ``multiplier_f32``
    (per tensor, or per output channel along ``channel_dim``); without one (``out_dtype`` absent), the float output
    ``fl(float32(acc) * fl(s_x * s_w))`` of MatMulIntegerToFloat / QGemm."""
    if "out_dtype" not in attrs:
        scale = torch.tensor(attrs["accumulator_scale"], dtype=torch.float32)
        return integer_to_float(acc, 1.0, _per_channel(scale, acc.dim(), channel_dim))
    out, z = _out(attrs)
    m = _per_channel(torch.tensor(attrs["multiplier_f32"], dtype=torch.float32), acc.dim(), channel_dim)
    return _to_model(requantize(acc, m, z, out.qmin + z, out.qmax + z), attrs)


def _per_channel(t: torch.Tensor, ndim: int, channel_dim: int) -> torch.Tensor:
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * ndim
    shape[channel_dim % ndim] = -1
    return t.reshape(shape)


def _exact(acc: torch.Tensor) -> torch.Tensor:
    return acc.round().to(torch.int32) if acc.is_floating_point() else acc.to(torch.int32)


@ort_cpu_kernel("conv1d", "conv2d")
def conv_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearConv: ``sum (x - z_x) w + bias`` (the kernel variant's sum), then the float32 requantize. VNNI sums
    exactly: ``x - z_x`` is the model's code, so the sum is QL1's exact accumulator (float32 where that is exact)."""
    x, w, b = inputs
    z_x = int(attrs["zero_points"][0])
    if _variant(attrs) is KernelVariant.VNNI:
        acc = _exact(exact_accumulator(x, w, b, attrs))
    else:
        acc = conv_accumulate(_runtime_codes(x, z_x), z_x, w, 0, b, attrs["stride"], attrs["padding"],
                              attrs["dilation"], attrs["groups"], KernelVariant.AVX2)
    return _requantized(acc, attrs, 1)


@ort_cpu_kernel("linear")
def linear_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QGemm (``transB``): ``sum (a - z_a) w + bias``, requantized (or its float output)."""
    x, w, b = inputs
    z_x = int(attrs["zero_points"][0])
    if _variant(attrs) is KernelVariant.VNNI:
        return _requantized(_exact(exact_accumulator(x, w, b, {})), attrs, -1)
    rows = _runtime_codes(x, z_x).reshape(-1, x.shape[-1])
    acc = matmul_accumulate(rows, z_x, w.t(), 0, KernelVariant.AVX2)
    if b is not None:
        acc = acc + b.to(torch.int32)
    return _requantized(acc.reshape(*x.shape[:-1], w.shape[0]), attrs, -1)


@ort_cpu_kernel("matmul")
def matmul_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearMatMul (or MatMulIntegerToFloat): ``sum (a - z_a)(b - z_b)``, exact for two activations."""
    a, b = inputs
    z_a, z_b = int(attrs["zero_points"][0]), int(attrs["zero_points"][1])
    # (products of 8-bit codes sum exactly in float64: the order of the sum does not matter)
    acc = torch.matmul((_runtime_codes(a, z_a) - z_a).to(torch.float64),
                       (_runtime_codes(b, z_b) - z_b).to(torch.float64)).round().to(torch.int32)
    return _requantized(acc, attrs, -1)


@ort_cpu_kernel("add")
def add_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearAdd: ``sat(RNE(fma(a, r_a, fma(b, r_b, f))))`` on the runtime's codes."""
    a, b = inputs
    z = attrs["zero_points"]
    out, z_out = _out(attrs)
    y = qlinear_add(_runtime_codes(a, z[0]), _runtime_codes(b, z[1]), attrs["r_a"], attrs["r_b"],
                    torch.tensor(attrs["f"], dtype=torch.float32), out.qmin + z_out, out.qmax + z_out)
    return _to_model(y, attrs)


@ort_cpu_kernel("mul")
def mul_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearMul: ``sat(RNE(fl(fl(p * r) + z_c)))``, ``p = (a - z_a)(b - z_b)``."""
    a, b = inputs
    z = attrs["zero_points"]
    out, z_out = _out(attrs)
    y = qlinear_mul(_runtime_codes(a, z[0]), z[0], _runtime_codes(b, z[1]), z[1], attrs["multiplier_f32"][0],
                    z_out, out.qmin + z_out, out.qmax + z_out)
    return _to_model(y, attrs)


def _dq_q(q: torch.Tensor, s_in: float, s_out: float, out: QuantDType) -> torch.Tensor:
    """A value moved to another grid through float: DequantizeLinear then QuantizeLinear (the zero points cancel:
    both sides are the model's codes)."""
    return quantize_linear(dequantize_linear(q, s_in, 0), s_out, 0, out.qmin, out.qmax)


@ort_cpu_kernel("requantize")
def requantize_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """A DequantizeLinear -> QuantizeLinear pair on two grids: the runtime moves the value in float32."""
    out = QuantDType.parse(attrs["out_dtype"])
    return _dq_q(inputs[0], attrs["in_scale"], attrs["out_scale"], out).to(storage_dtype(out.value))


@ort_cpu_kernel("cat")
def cat_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearConcat: an input on the output's grid is copied, any other moved through its lookup table, which is
    DequantizeLinear -> QuantizeLinear of each code."""
    out = QuantDType.parse(attrs["out_dtype"])
    parts = [q.to(torch.int32) if s == attrs["out_scale"] else _dq_q(q, s, attrs["out_scale"], out)
             for q, s in zip(inputs, attrs["in_scales"])]
    return torch.cat(parts, attrs["dim"]).to(storage_dtype(out.value))


@ort_cpu_kernel("avg_pool2d_int")
def average_pool_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearGlobalAveragePool (``global``: ``sum(x) - z_x N``, the float32 multiplier) or QLinearAveragePool (the
    window's float32 mean, then ``RNE(fl(v / s_y) + z_y)``)."""
    x = inputs[0]
    z_x = int(attrs["zero_points"][0])
    out, z_out = _out(attrs)
    if attrs.get("global"):
        acc = global_average_accumulate(_runtime_codes(x, z_x), z_x)
        return _to_model(requantize(acc, attrs["multiplier_f32"][0], z_out, out.qmin + z_out, out.qmax + z_out),
                         attrs)
    y = qlinear_average_pool(_runtime_codes(x, z_x), attrs["in_scale"], z_x, attrs["out_scale"], z_out,
                             tuple(attrs["kernel_size"]), tuple(attrs["stride"]), tuple(attrs["padding"]),
                             bool(attrs["count_include_pad"]), out.qmin + z_out, out.qmax + z_out)
    return _to_model(y, attrs)


@ort_cpu_kernel("softmax")
def softmax_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearSoftmax over axis ``dim`` (its exp table ``table`` and output factor ``y_scale``), the runtime's
    transpose of that axis to the last and back."""
    z_x = int(attrs["zero_points"][0])
    dim = int(attrs.get("dim", -1))
    x = _runtime_codes(inputs[0], z_x).movedim(dim, -1)
    y = qlinear_softmax(x.contiguous(), torch.tensor(attrs["table"], dtype=torch.float32), attrs["y_scale"],
                        _out(attrs)[1])
    return _to_model(y.movedim(-1, dim), attrs)


@ort_cpu_kernel("sigmoid", "leaky_relu")
def lookup_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """QLinearSigmoid / QLinearLeakyRelu: ``table[x]`` over the runtime's 256 codes."""
    z_x = int(attrs["zero_points"][0])
    return _to_model(lookup(_runtime_codes(inputs[0], z_x), torch.tensor(attrs["table"], dtype=torch.int32), 0),
                     attrs)
