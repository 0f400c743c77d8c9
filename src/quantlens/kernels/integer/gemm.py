"""GEMM kernels (``docs/march.md`` §6): conv1d/2d, conv_transpose1d/2d, linear and matmul on integers.

GEMMs are computed in float32 or float64 on integer operands, which is exact whenever every partial sum stays
below ``2**24`` (float32) or ``2**53`` (float64), and therefore independent of summation order and thread count;
the exact accumulator is then requantized (:func:`~.core.requant`).

A GEMM's constant operands (weight, bias) are prepared once for the GEMM (:class:`GemmWeights`) and kept in a
cache weakly keyed on the weight tensor (with the bias and the kind of GEMM), while both tensors are unmodified.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from quantlens.kernels.integer.core import int_kernel, magnitude, requant
from quantlens.kernels.integer.param_cache import TensorCache

__all__ = ["GemmWeights", "gemm_weights", "conv_kernel", "conv_transpose_kernel", "linear_kernel", "matmul_kernel",
           "exact_accumulator"]


def _float32_gemm_is_exact(t: torch.Tensor) -> bool:
    """Whether a float32 GEMM on ``t``'s device is IEEE float32 summation (exact for integers below 2**24): on
    the CPU, yes. A GPU's libraries may run float32 convolutions and matmuls in TF32 (cuDNN's default for
    convolutions) or with FFT / Winograd algorithms, none exact on integers, so GEMMs there take float64 (exact
    below 2**53 for any summation order; neither TF32 nor those algorithms apply to it)."""
    return t.device.type == "cpu"


def _gemm_dtype(a: torch.Tensor, b: torch.Tensor, terms: int) -> torch.dtype:
    """float32 when every partial sum of the integer products is below 2**24 (exact in float32 whatever the
    summation order) and the device sums float32 exactly, else float64 (exact below 2**53). Both give the exact
    integer result."""
    bound = terms * magnitude(a) * magnitude(b)
    return torch.float32 if bound < 2**24 and _float32_gemm_is_exact(a) else torch.float64


class GemmWeights:
    """A GEMM's constant operands, prepared for one weight/bias pair (kept while they are the same tensors,
    unmodified): the GEMM dtype, the weight (and bias, when it can enter the GEMM) in that dtype, and a bound on
    ``|acc|``.

    The bound: every partial sum of ``x · w`` for an output is at most ``max|x| · Σ|w|`` over that output's
    weights (``max|x|`` from the input's storage type), plus ``|bias|``. Below ``2**24`` the whole GEMM with its
    bias is exact in float32 whatever the summation order (the ``_gemm_dtype`` rule, with the weights' actual
    magnitudes); else the bias is added in float64 after a float32 GEMM whose products alone stay below
    ``2**24``; else float64 (exact below ``2**53``)."""

    __slots__ = ("w_version", "b", "b_version", "x_dtype", "dtype", "weight", "gemm_bias", "late_bias", "bound")

    def __init__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_sums: Callable):
        self.w_version, self.b, self.x_dtype = w._version, b, x.dtype
        self.b_version = None if b is None else b._version
        w_abs = w.to(torch.int64).abs()
        products = magnitude(x) * (int(out_sums(w_abs).max()) if w.numel() else 0)
        b_max = int(b.to(torch.int64).abs().max()) if b is not None and b.numel() else 0
        self.bound = float(products + b_max)
        if not _float32_gemm_is_exact(x):
            self.dtype, self.gemm_bias, self.late_bias = torch.float64, None, b
        elif products + b_max < 2**24:
            self.dtype, self.gemm_bias, self.late_bias = torch.float32, b, None
        elif products < 2**24:
            self.dtype, self.gemm_bias, self.late_bias = torch.float32, None, b
        else:
            self.dtype, self.gemm_bias, self.late_bias = torch.float64, None, b
        self.weight = w.to(self.dtype)
        if self.gemm_bias is not None:
            self.gemm_bias = self.gemm_bias.to(self.dtype)
        if self.late_bias is not None:
            self.late_bias = self.late_bias.to(torch.float64)

    def fits(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        """Whether this preparation holds for these operands (``w``: the tensor it was made from)."""
        return (w._version == self.w_version and b is self.b and x.dtype == self.x_dtype
                and (b is None or b._version == self.b_version))


#: weight -> GemmWeights, per (id(bias), out_sums): the entry holds its bias, so that id stays its own
_WEIGHTS = TensorCache()


def gemm_weights(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_sums: Callable) -> GemmWeights:
    extra = (id(b), out_sums)
    entry = _WEIGHTS.get(w, extra)
    if entry is None or not entry.fits(x, w, b):
        entry = _WEIGHTS.put(w, extra, GemmWeights(x, w, b, out_sums))
    return entry


def _gemm_out(attrs: dict, acc: torch.Tensor, g: GemmWeights, channel_dim: int) -> torch.Tensor:
    """Add a late bias (float64, exact) and requantize with the GEMM's bound."""
    consume = False
    if g.late_bias is not None:
        acc = acc.to(torch.float64)  # the GEMM's fresh result: changed in place
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        acc.add_(g.late_bias.reshape(shape))
        consume = True
    return requant(attrs, acc, channel_dim, bound=g.bound, consume=consume or acc.dtype == torch.float64)


def exact_accumulator(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attrs: dict) -> torch.Tensor:
    """The exact accumulator ``sum x w + b`` of a conv1d/conv2d (``attrs``: its stride, padding, dilation, groups;
    channels on dim 1) or, without ``stride`` in ``attrs``, a linear (channels last), as integers held in float32 or
    float64 (the GEMM dtype rule above): for a runtime march's kernels, which requantize it their own way."""
    if "stride" not in attrs:
        g = gemm_weights(x, w, b, _linear_sums)
        acc, channel_dim = F.linear(x.to(g.dtype), g.weight, g.gemm_bias), -1
    else:
        g = gemm_weights(x, w, b, _conv_sums)
        conv = F.conv1d if w.dim() == 3 else F.conv2d
        acc = conv(x.to(g.dtype), g.weight, g.gemm_bias, attrs["stride"], attrs["padding"], attrs["dilation"],
                   attrs["groups"])
        channel_dim = 1
    if g.late_bias is not None:
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        acc = acc.to(torch.float64).add_(g.late_bias.reshape(shape))
    return acc


def _conv_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [out, in / groups, k...]
    return w_abs.reshape(w_abs.shape[0], -1).sum(1)


def _conv_transpose_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [in, out / groups, k...]
    return w_abs.transpose(0, 1).reshape(w_abs.shape[1], -1).sum(1)


def _linear_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [out, in]
    return w_abs.reshape(-1, w_abs.shape[-1]).sum(1)


def conv_kernel(conv: Callable) -> Callable:
    """The kernel of a conv (``conv``: ``F.conv1d`` or ``F.conv2d``)."""

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        x, w, b = inputs
        a = attrs
        g = gemm_weights(x, w, b, _conv_sums)
        acc = conv(x.to(g.dtype), g.weight, g.gemm_bias, a["stride"], a["padding"], a["dilation"], a["groups"])
        return _gemm_out(attrs, acc, g, 1)

    return kernel


def conv_transpose_kernel(conv_transpose: Callable) -> Callable:
    """§6 like a conv: the exact sum over every (input channel, kernel tap) that reaches an output, bias, one
    requantize per output channel (dim 1). A weight ``[in, out / groups, k...]`` gives each output at most
    ``in · prod(k)`` terms."""

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        x, w, b = inputs
        a = attrs
        g = gemm_weights(x, w, b, _conv_transpose_sums)
        acc = conv_transpose(x.to(g.dtype), g.weight, g.gemm_bias, a["stride"], a["padding"], a["output_padding"],
                             a["groups"], a["dilation"])
        return _gemm_out(attrs, acc, g, 1)

    return kernel


int_kernel("conv2d")(conv_kernel(F.conv2d))
int_kernel("conv1d")(conv_kernel(F.conv1d))
int_kernel("conv_transpose2d")(conv_transpose_kernel(F.conv_transpose2d))
int_kernel("conv_transpose1d")(conv_transpose_kernel(F.conv_transpose1d))


@int_kernel("linear")
def linear_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    x, w, b = inputs
    g = gemm_weights(x, w, b, _linear_sums)
    acc = F.linear(x.to(g.dtype), g.weight, g.gemm_bias)
    return _gemm_out(attrs, acc, g, acc.dim() - 1)


@int_kernel("matmul")
def matmul_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    a, b = inputs
    dtype = _gemm_dtype(a, b, a.shape[-1])
    acc = torch.matmul(a.to(dtype), b.to(dtype))
    return requant(attrs, acc, bound=float(a.shape[-1] * magnitude(a) * magnitude(b)),
                   consume=acc.dtype == torch.float64)
