"""Integer helpers shared by the table kernels (``docs/march.md`` §13). All tensors are int64."""

from __future__ import annotations

import torch

from quantlens.march.numerics import rshift_round_half_to_even

__all__ = ["rshift_rhe_var", "div_round_half_even", "bit_length", "round_half_even_float"]

#: the largest shift ``rshift_rhe_var`` performs; larger shifts give 0 (callers keep |operand| <= 2**61).
MAX_SHIFT = 62


def rshift_rhe_var(x: torch.Tensor, shift: torch.Tensor | int, *, bound: float | None = None) -> torch.Tensor:
    """``x / 2**shift`` rounded half to even, with a per-element ``shift >= 0`` (``numerics`` takes one int).

    A shift above 62 gives 0: every caller keeps ``|x| <= 2**61``, so such a quotient is below one half.
    ``bound`` (speed only): a known bound on ``|x|`` (see ``rshift_round_half_to_even``).
    """
    x = x.to(torch.int64)
    if isinstance(shift, int):
        if shift > MAX_SHIFT:
            return torch.zeros_like(x)
        return rshift_round_half_to_even(x, shift, bound=bound)
    shift = torch.as_tensor(shift, dtype=torch.int64, device=x.device)
    lo, hi = (int(v) for v in torch.aminmax(shift)) if shift.numel() else (0, 0)
    if lo < 0:
        raise ValueError("rshift_rhe_var: negative shift")
    if hi <= MAX_SHIFT:
        return rshift_round_half_to_even(x, shift, bound=bound)
    too_far = shift > MAX_SHIFT
    out = rshift_round_half_to_even(x, shift.clamp(max=MAX_SHIFT), bound=bound)
    return torch.where(too_far, torch.zeros_like(out), out) if bool(too_far.any()) else out


def div_round_half_even(num: torch.Tensor, den: int) -> torch.Tensor:
    """``num / den`` rounded half to even, exactly, for int64 ``num`` and a positive int ``den``."""
    num = num.to(torch.int64)
    q = torch.div(num, den, rounding_mode="floor")
    rem = num - q * den  # 0 <= rem < den
    twice = 2 * rem
    round_up = (twice > den) | ((twice == den) & (torch.bitwise_and(q, 1) == 1))
    return q + round_up.to(torch.int64)


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Number of bits of each non-negative int64 value (0 for 0), like Python's ``int.bit_length``."""
    x = x.to(torch.int64)
    lo, hi = (int(v) for v in torch.aminmax(x)) if x.numel() else (0, 0)
    if x.numel() and lo >= 0 and hi < 2**53:
        # Same result: x converts to float64 exactly, and frexp's exponent e (x = m·2**e, m in [0.5, 1)) is the
        # bit length; frexp(0) has e = 0.
        return torch.frexp(x.to(torch.float64)).exponent.to(torch.int64)
    n = torch.zeros_like(x)
    v = x.clone()
    for step in (32, 16, 8, 4, 2, 1):
        big = v >= (1 << step)
        n = n + big.to(torch.int64) * step
        v = torch.where(big, torch.bitwise_right_shift(v, step), v)
    return n + (v > 0).to(torch.int64)


def round_half_even_float(v: torch.Tensor) -> torch.Tensor:
    """``rhe`` of float64 values (``torch.round`` is half to even)."""
    return torch.round(v.to(torch.float64))
