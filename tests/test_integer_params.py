"""The integer parameters convert derives from constants, pinned to hand-computed values at their edges (ties,
saturation, missing bounds), the div multiplier's tie rule, and the float fast paths of the integer kernels
against exact integer references right at their limits (docs/march.md §8, §10, §10.1, §10.3, §11, §13.5)."""

from fractions import Fraction

import pytest
import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.kernels_int import INT_KERNELS
from quantlens.errors import QuantLensError
from quantlens.kernels import div_multiplier
from quantlens.march import QuantDType
from quantlens.march.numerics import (
    channel_affine_params,
    clamp_codes,
    constant_addend,
    constant_code,
    interpolation_weights,
    requantize,
    rescaled_sum,
    rshift_round_half_to_even,
)


def _rhe(fraction: Fraction) -> int:
    """Round half to even on an exact fraction (the reference for every integer rule)."""
    floor = fraction.numerator // fraction.denominator
    rest = fraction - floor
    return floor + (1 if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2) else 0)


# -- §10: x ± k -------------------------------------------------------------------------------------------------
def test_constant_addend_rounds_half_to_even_in_2_to_minus_8_steps():
    assert constant_addend(0.3, 0.25, 8) == 307  # 0.3 · 256 / 0.25 = 307.2
    assert constant_addend(5 / 1024, 0.5, 8) == 2  # 2.5 -> 2 (even)
    assert constant_addend(7 / 1024, 0.5, 8) == 4  # 3.5 -> 4 (even)
    assert constant_addend(-5 / 1024, 0.5, 8) == -2
    with pytest.raises(QuantLensError, match="outside the int32 range"):
        constant_addend(1e6, 1e-3, 8)


# -- §10: clamp bounds on the input grid ------------------------------------------------------------------------
def test_clamp_bounds_are_rounded_half_to_even_and_missing_bounds_are_int32_extremes():
    # rounded outward (they only bound the integers; the bounds' output codes clamp the result, rules.clamp)
    assert clamp_codes(-0.5, 0.75, 0.5) == (-1, 2)  # -1 exactly; 0.75 / 0.5 = 1.5 -> 2
    assert clamp_codes(0.25, 1.25, 0.5) == (0, 3)  # floor(0.5) = 0, ceil(2.5) = 3
    assert clamp_codes(None, 1.0, 3.46) == (-(2**31), 1)  # ceil(0.289): rhe gave 0, clamping every code to 0
    assert clamp_codes(0.0, float("inf"), 0.5) == (0, 2**31 - 1)  # clamp(min=0, max=inf): no upper bound
    assert clamp_codes(float("-inf"), 1.0, 0.5) == (-(2**31), 2)
    assert clamp_codes(None, 6.0, 0.05) == (-(2**31), 120)
    assert clamp_codes(-1e12, None, 1e-3) == (-(2**31), 2**31 - 1)


# -- §11: constants written into integer tensors ----------------------------------------------------------------
def test_constant_code_rounds_saturates_and_maps_infinities():
    q8 = QuantDType.qint8
    assert constant_code(0.3, 0.25, q8) == 1  # 1.2
    assert constant_code(0.375, 0.25, q8) == 2  # 1.5 -> 2
    assert constant_code(0.625, 0.25, q8) == 2  # 2.5 -> 2
    assert constant_code(-0.625, 0.25, q8) == -2
    assert constant_code(100.0, 0.25, q8) == 127 and constant_code(-100.0, 0.25, q8) == -128
    assert constant_code(float("-inf"), 0.25, q8) == -128 and constant_code(float("inf"), 0.25, q8) == 127
    assert constant_code(float("nan"), 0.25, q8) == 0
    assert constant_code(1000.0, 0.25, QuantDType.qint16) == 4000


# -- §10.1: bilinear weights --------------------------------------------------------------------------------------
def test_interpolation_weights_are_torch_weights_in_256ths():
    # 2 -> 4, align_corners=False: source positions -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1)
    assert interpolation_weights(2, 4, False).tolist() == [[256, 0], [192, 64], [64, 192], [0, 256]]
    assert interpolation_weights(2, 3, True).tolist() == [[256, 0], [128, 128], [0, 256]]
    # 3 -> 5: source 0.4 -> (0.6, 0.4) = (153.6, 102.4) -> (154, 102); 1.6 -> (102, 154)
    w = interpolation_weights(3, 5, False)
    assert w.tolist() == [[256, 0, 0], [154, 102, 0], [0, 256, 0], [0, 102, 154], [0, 0, 256]]
    assert w.dtype == torch.int16 and bool((w.sum(dim=1) == 256).all())


# -- §10.3: BatchNorm on its own ------------------------------------------------------------------------------------
def test_channel_affine_params_hand_values():
    w, bias, s_w = channel_affine_params(torch.tensor([0.5, -2.0, 0.0]), torch.tensor([0.25, 1.0, 3.0]), 2**-4)
    assert w.tolist() == [127, -127, 0] and w.dtype == torch.int8
    # 0.25 / (2**-4 · 0.5/127) = 1016; 1 / (2**-4 · 2/127) = 1016; a = 0 -> s_w = 1: 3 / 2**-4 = 48
    assert bias.tolist() == [1016, 1016, 48] and bias.dtype == torch.int32
    assert s_w.tolist() == [0.5 / 127, 2 / 127, 1.0]


# -- §13.5: the div multiplier's tie rule ---------------------------------------------------------------------------
def test_div_multiplier_drops_8_bits_with_ties_to_even():
    # s_x / (s_y · s_out) · 2**-23 = (2**30 + 128) · 2**-40: M31 = 2**30 + 128, so M31 / 256 = 2**22 + 0.5 -> 2**22
    assert div_multiplier(8192 + 2**-10, 1.0, 1.0) == (2**22, 32)
    # (2**30 + 384) / 256 = 2**22 + 1.5 -> 2**22 + 2 (the odd floor rounds up)
    assert div_multiplier(8192 + 3 * 2**-10, 1.0, 1.0) == (2**22 + 2, 32)
    # just above the tie rounds up, just below rounds down
    assert div_multiplier(8192 + 129 * 2**-17, 1.0, 1.0) == (2**22 + 1, 32)
    assert div_multiplier(8192 + 127 * 2**-17, 1.0, 1.0) == (2**22, 32)


# -- fast paths at their limits ---------------------------------------------------------------------------------------
def _ref_requantize(acc: int, m: int, shift: int, dtype: QuantDType) -> int:
    return min(max(_rhe(Fraction(acc * m, 2**shift)), dtype.qmin), dtype.qmax)


def test_requantize_float64_fast_path_equals_the_integer_rule_at_its_limit():
    m, shift = 2**30 + 1, 31  # acc · m / 2**31 = acc/2 + acc · 2**-31: ties appear only through the rounding
    edge = [2**22 - 1, -(2**22 - 1), 2**22 - 2, 3, -3, 1, -1, 0]
    fast = requantize(torch.tensor(edge), m, shift, QuantDType.qint32)  # every |acc| < 2**22: the float64 path
    slow = requantize(torch.tensor(edge + [2**22]), m, shift, QuantDType.qint32)[:-1]  # one larger: integer path
    want = [_ref_requantize(a, m, shift, QuantDType.qint32) for a in edge]
    assert fast.tolist() == want and slow.tolist() == want
    # Beyond the bound float64 is not exact: acc · m = (2n + 1) · 2**30 + 1 is just above a tie, which a float64
    # product (54 bits) rounds onto the tie (-> even). Found by solving acc · m = 2**30 + 1 (mod 2**31).
    assert requantize(torch.tensor([8388611]), 1311419051, 31, QuantDType.qint32).tolist() == [5122733]
    assert _ref_requantize(8388611, 1311419051, 31, QuantDType.qint32) == 5122733
    assert int(torch.round(torch.tensor(8388611.0, dtype=torch.float64) * (1311419051 * 2.0**-31))) == 5122732
    m, shift = 2**30, 31  # exact halves: odd accumulators are ties
    ties = [2**22 - 1, 2**22 - 3, -(2**22 - 1), 5, 7]
    assert requantize(torch.tensor(ties), m, shift, QuantDType.qint32).tolist() == \
        [_ref_requantize(a, m, shift, QuantDType.qint32) for a in ties] == [2**21, 2**21 - 2, -(2**21), 2, 4]


def test_rounding_shift_float64_path_equals_the_integer_path_near_2_to_53():
    base = [2**53 - 1, 2**53 - 3, -(2**53 - 1), 2**52 + 1, 12345, -7, 6, 0]
    values = (base * 512)[:4096]  # >= 4096 elements and |x| < 2**53: the float64 path
    fast = rshift_round_half_to_even(torch.tensor(values), 1)
    slow = rshift_round_half_to_even(torch.tensor(values[:100]), 1)  # small tensor: the integer path
    want = [_rhe(Fraction(v, 2)) for v in values]
    assert fast.tolist() == want and slow.tolist() == want[:100]
    assert want[:3] == [2**52, 2**52 - 2, -(2**52)]


def test_rescaled_sum_float64_path_equals_the_integer_path_at_its_limit():
    frac = 8
    m, shift = 2**30 + 3, 31 + 2  # q · m / 2**(shift - 8): the terms round inside their 2**-8 units
    qa = [2**22 - 1, -(2**22 - 1), 2**22 - 5, 17, -17, 1]
    qb = [3, 2**22 - 1, -(2**22 - 7), -1, 1, 0]

    def ref(a, b, addend=100):
        t = [max(min(_rhe(Fraction(q * m, 2**(shift - frac))), 2**31 - 1), -(2**31)) for q in (a, b)]
        return min(max(_rhe(Fraction(t[0] - t[1] + addend, 2**frac)), -(2**31)), 2**31 - 1)

    terms = lambda a, b: [(torch.tensor(a), m, shift, 1), (torch.tensor(b), m, shift, -1)]  # noqa: E731
    # beyond the bound (q >= 2**22) float64 would round q · m onto a tie: t = 5122733 exactly (not 5122732), and
    # the addend -44 puts t + addend = 5122689 just above the final tie: 5122689 / 256 = 20010.50390625 -> 20011
    beyond = rescaled_sum([(torch.tensor([8388611]), 1311419051, 39, 1)], -44, QuantDType.qint32, frac)
    assert beyond.tolist() == [20011]
    fast = rescaled_sum(terms(qa, qb), 100, QuantDType.qint32, frac)
    slow = rescaled_sum(terms(qa + [2**22], qb + [0]), 100, QuantDType.qint32, frac)[:-1]  # forces the integer path
    want = [ref(a, b) for a, b in zip(qa, qb)]
    assert fast.tolist() == want and slow.tolist() == want


@pytest.mark.parametrize("terms", [1023, 1024, 1100])
def test_linear_kernel_float32_path_is_exact_up_to_its_bound(terms):
    # int8 bound: terms · 128 · 128 < 2**24 (float32) up to 1023 terms; above it float64. All-127 products are odd
    # (16129), so any float32 accumulation beyond 2**24 would lose the last bit of the exact sum.
    x = torch.full((2, terms), 127, dtype=torch.int8)
    x[1] = -128
    w = torch.full((3, terms), 127, dtype=torch.int8)
    w[2, ::2] = -128
    node = Node("linear", [], [], {"out_dtype": "qint32"})
    out = INT_KERNELS["linear"](node, [x, w, None])
    exact = x.to(torch.int64) @ w.to(torch.int64).t()
    assert torch.equal(out.to(torch.int64), exact)
