"""Elementwise kernels (``docs/march.md`` §10): add, sub, ``x ± k``, cat, mul, scale, clamp, abs, neg,
masked_fill, the per-channel affine of a lone BatchNorm and PReLU."""

from __future__ import annotations

import torch

from quantlens.kernels.integer.core import (
    INT32_MAX,
    bound_of,
    channel_shape,
    int_kernel,
    qdtype,
    requant,
    storage_dtype,
    store,
)
from quantlens.kernels.integer.param_cache import prepared
from quantlens.march import QuantDType
from quantlens.march.numerics import (
    apply_requantize,
    requantize,
    requantize_params,
    rescaled_sum,
    rshift_round_half_to_even,
)

__all__ = ["add_kernel", "sub_kernel", "channel_shift_kernel", "add_const_kernel", "cat_kernel", "mul_kernel", "scale_kernel",
           "clamp_kernel", "masked_fill_kernel", "abs_kernel", "neg_kernel", "channel_affine_kernel",
           "prelu_kernel"]

_INT32 = QuantDType.qint32


def _rescale(q: torch.Tensor, mult: int, shift: int) -> torch.Tensor:
    """``docs/march.md`` §10: one input rescaled to the output scale, saturated to int32."""
    t = rshift_round_half_to_even(q.to(torch.int64) * int(mult), int(shift))
    return torch.clamp(t, _INT32.qmin, _INT32.qmax)


#: F of an add/sub/add_const call without ``frac_bits`` (written by spec v4, whose one add rule kept 8 bits)
_V4_FRAC_BITS = 8


def _frac_bits(attrs: dict) -> int:
    """The add rule's extra fractional bits F (§10): ``attrs["frac_bits"]`` (0: default qpp, 8: high precision)."""
    return int(attrs.get("frac_bits", _V4_FRAC_BITS))


def _add(inputs: list, attrs: dict, sign_b: int) -> torch.Tensor:
    (ma, mb), (sa, sb) = attrs["multipliers"], attrs["shifts"]
    out = qdtype(attrs)
    if attrs.get("out_exponents") is not None:  # §3.1: channel c rescales with shift_i - k_c
        shape = channel_shape({"channel_dim": attrs["out_axis"]}, inputs[0])
        k = torch.tensor(attrs["out_exponents"], dtype=torch.int64).reshape(shape)
        sa, sb = sa - k, sb - k
    return rescaled_sum([(inputs[0], ma, sa, 1), (inputs[1], mb, sb, sign_b)], 0, out, _frac_bits(attrs),
                        storage=storage_dtype(out.value))


@int_kernel("add")
def add_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    return _add(inputs, attrs, 1)


@int_kernel("sub")
def sub_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    return _add(inputs, attrs, -1)


@int_kernel("channel_shift")
def channel_shift_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """§3.1: exponent-form codes onto the common grid, ``q · 2**(K - k_c)`` per channel (exact, int16)."""
    q = inputs[0]
    shape = channel_shape({"channel_dim": attrs["axis"]}, q)
    factor = torch.tensor([1 << s for s in attrs["left_shifts"]], dtype=torch.int16).reshape(shape)
    return q.to(torch.int16) * factor


@int_kernel("add_const")
def add_const_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    sign = -1 if attrs["negate"] else 1
    term = (inputs[0], attrs["multipliers"][0], attrs["shifts"][0], sign)
    out = qdtype(attrs)
    return rescaled_sum([term], attrs["addend"], out, _frac_bits(attrs), storage=storage_dtype(out.value))


class _CatParams:
    def __init__(self, attrs: dict):
        out = qdtype(attrs)
        self.storage = storage_dtype(out.value)
        self.parts = [requantize_params(int(m), int(s), out) for m, s in zip(attrs["multipliers"], attrs["shifts"])]


@int_kernel("cat")
def cat_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """§10: each input rescaled to the output scale (``rshift_rhe(q · M, shift)``, saturated to int32, then to
    the output type: the requantize rule, whose saturation to the output type covers both), concatenated."""
    c = prepared(attrs, _CatParams)
    if len(c.parts) != len(inputs) or any(bound_of(q) is None or bound_of(q) > INT32_MAX for q in inputs):
        parts = [_rescale(q, m, s) for q, m, s in zip(inputs, attrs["multipliers"], attrs["shifts"])]
        return store(attrs, torch.cat(parts, dim=attrs["dim"]))
    parts = [apply_requantize(q, p, bound=bound_of(q), storage=c.storage) for q, p in zip(inputs, c.parts)]
    return torch.cat(parts, dim=attrs["dim"])


@int_kernel("mul")
def mul_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    a, b = inputs
    ba, bb = bound_of(a), bound_of(b)
    return requant(attrs, a.to(torch.int64) * b.to(torch.int64), bound=None if ba is None or bb is None else ba * bb)


@int_kernel("scale")
def scale_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """Multiply by a constant real number: its sign flips the integers, its magnitude joins the multiplier."""
    bound = bound_of(inputs[0])
    q = inputs[0].to(torch.int64)
    if attrs["negative"]:
        q = -q
    return requant(attrs, q, bound=bound)


@int_kernel("clamp")
def clamp_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    bound = bound_of(inputs[0])
    q = inputs[0].to(torch.int64)
    lo, hi = attrs["lo"], attrs["hi"]
    q = torch.clamp(q, min=lo, max=hi)
    y = requant(attrs, q, bound=None if bound is None else min(bound, float(max(abs(lo), abs(hi)))))
    if "out_lo" in attrs:  # (a file of spec v4 and earlier has none: its bounds were rounded onto the input grid)
        y = torch.clamp(y, min=attrs["out_lo"], max=attrs["out_hi"])
    return y


@int_kernel("masked_fill_int")
def masked_fill_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    q, mask = inputs
    return q.masked_fill(mask, attrs["value"])


@int_kernel("abs_int")
def abs_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    bound = bound_of(inputs[0])
    return requant(attrs, inputs[0].to(torch.int64).abs(), bound=bound)


@int_kernel("neg_int")
def neg_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    bound = bound_of(inputs[0])
    return requant(attrs, -inputs[0].to(torch.int64), bound=bound)


@int_kernel("channel_affine")
def channel_affine_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """BatchNorm alone: ``acc = q·w[c] + b[c]`` exactly, then the per-channel requantize (§10.2)."""
    q, w, b = inputs
    shape = channel_shape(attrs, q)
    acc = q.to(torch.int64) * w.to(torch.int64).reshape(shape) + b.to(torch.int64).reshape(shape)
    return requant(attrs, acc, attrs["channel_dim"])


@int_kernel("prelu_int")
def prelu_kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
    """``q >= 0``: requantize(q, M, shift); ``q < 0``: requantize(sign(α)·q, M_neg[c], shift_neg[c]) (§10.3)."""
    q = inputs[0].to(torch.int64)
    a = attrs
    out = qdtype(attrs)
    pos = requantize(q, int(a["multiplier"][0]), int(a["shift"][0]), out)
    shape = channel_shape(attrs, q) if len(a["neg_multiplier"]) > 1 else [1] * q.dim()
    sign = torch.tensor(a["neg_sign"], dtype=torch.int64, device=q.device).reshape(shape)
    mult = torch.tensor(a["neg_multiplier"], dtype=torch.int64, device=q.device).reshape(shape)
    shift = torch.tensor(a["neg_shift"], dtype=torch.int64, device=q.device).reshape(shape)
    neg = requantize(q * sign, mult, shift, out)
    return torch.where(q >= 0, pos, neg).to(storage_dtype(out.value))
