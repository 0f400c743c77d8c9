"""The integer kernels' registry and what several kernel families share: storage types, bounds of integer
tensors, and the requantize of an exact accumulator with a call's ``multiplier``/``shift`` attrs."""

from __future__ import annotations

from typing import Any

import torch

from quantlens._registry import make_registry
from quantlens.kernels.integer.param_cache import prepared
from quantlens.march import QuantDType
from quantlens.march.numerics import apply_requantize, requantize_params

__all__ = ["INT_KERNELS", "int_kernel", "storage_dtype"]

#: IR op -> its integer kernel, ``kernel(inputs, attrs, site="") -> Tensor | list[Tensor]`` (``site``: the op
#: site, for messages only); ``@int_kernel(op, ...)`` registers one
INT_KERNELS, int_kernel = make_registry("integer kernel for op")

_INT32 = QuantDType.qint32
INT32_MAX = _INT32.qmax


def storage_dtype(qdtype: str) -> torch.dtype:
    return {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32, "quint8": torch.uint8}[qdtype]


def qdtype(attrs: dict) -> QuantDType:
    return QuantDType.parse(attrs["out_dtype"])


class Requant:
    """A call's requantize attrs, prepared: the output type and the :func:`requantize_params` (per channel: one
    per accumulator rank and channel dim)."""

    def __init__(self, attrs: dict):
        self.out = qdtype(attrs)
        self.storage = storage_dtype(self.out.value)
        self.mult = attrs.get("multiplier")
        self.shifts = attrs.get("shift")
        self.scalar = None
        if self.mult is not None and len(self.mult) == 1:
            self.scalar = requantize_params(int(self.mult[0]), int(self.shifts[0]), self.out)
        self.by_shape: dict[tuple[int, int], Any] = {}

    def params(self, ndim: int, channel_dim: int | None, device: torch.device):
        if self.scalar is not None:
            return self.scalar
        key = (ndim, channel_dim % ndim, device)  # per-channel tensors live where the accumulator does
        p = self.by_shape.get(key)
        if p is None:
            shape = [1] * ndim
            shape[key[1]] = -1
            m = torch.tensor(self.mult, dtype=torch.int64, device=device).reshape(shape)
            sh = (self.shifts[0] if len(set(self.shifts)) == 1
                  else torch.tensor(self.shifts, dtype=torch.int64, device=device).reshape(shape))
            p = self.by_shape[key] = requantize_params(m, sh, self.out)
        return p


def clamp_int32(acc: torch.Tensor) -> torch.Tensor:
    if acc.is_floating_point():  # float bounds: exact in float64 (and a faster kernel than int bounds)
        return torch.clamp(acc.to(torch.float64), float(_INT32.qmin), float(_INT32.qmax))
    return torch.clamp(acc, _INT32.qmin, _INT32.qmax)


def requant(attrs: dict, acc: torch.Tensor, channel_dim: int | None = None, bound: float | None = None,
            consume: bool = False) -> torch.Tensor:
    """Apply the call's requantize attrs to an exact integer accumulator (int64, or integer values in
    float32/64); store in the output's integer type. ``bound``: a known bound on ``|acc|`` (no saturation pass
    below int32's range, and the requantize fast path's test without a pass over the data); ``consume``: ``acc``
    is a float64 temporary that may be overwritten."""
    rq = prepared(attrs, Requant)
    if bound is None or bound > INT32_MAX:
        acc = clamp_int32(acc)
        consume = acc.dtype == torch.float64
        bound = None if bound is None else float(2**31)
    if rq.mult is None:  # int32 high-precision output: saturate only
        return acc.to(rq.storage)
    if bound is None:
        bound = float(2**31)  # saturated above
    return apply_requantize(acc, rq.params(acc.dim(), channel_dim, acc.device), bound=bound, storage=rq.storage,
                            consume=consume)


def store(attrs: dict, y: torch.Tensor) -> torch.Tensor:
    """Saturate to the output type and store in its integer type."""
    out = qdtype(attrs)
    return torch.clamp(y, out.qmin, out.qmax).to(storage_dtype(out.value))


def exact(t: torch.Tensor) -> torch.Tensor:
    """Integers as float64 (exact: every int8/int16/int32 value, and sums below 2**53)."""
    return t.to(torch.float64)


def acc64(t: torch.Tensor) -> torch.Tensor:
    """An exact integer-valued GEMM/pool result, kept in float64 (exact below 2**53; requantize reads it)."""
    return t.to(torch.float64)


def magnitude(t: torch.Tensor) -> int:
    """``max |t|`` of the storage type, as an int (int32 and wider: ``2**31``)."""
    return {torch.int8: 128, torch.int16: 32768, torch.uint8: 255}.get(t.dtype, 2**31)


def bound_of(t: torch.Tensor) -> float | None:
    """``max |t|`` from its storage type (int8/int16/int32), or ``None`` (unknown: the data decide)."""
    return {torch.int8: 128.0, torch.int16: 32768.0, torch.int32: float(2**31), torch.bool: 1.0,
            torch.uint8: 255.0}.get(t.dtype)


def channel_shape(attrs: dict, x: torch.Tensor) -> list[int]:
    """The broadcast shape of a per-channel vector along ``attrs["channel_dim"]``."""
    shape = [1] * x.dim()
    shape[attrs["channel_dim"] % x.dim()] = -1
    return shape
