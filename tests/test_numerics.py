"""The numeric rules of docs/march.md, pinned to hand-computed values.

Every expected number below was worked out by hand from the spec (scales are powers of two where possible, so
the float32 arithmetic is exact and the only rounding is the one under test).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import March, Qpp, QuantDType, RoundingMode, get_march
from quantlens.march.numerics import (
    dequantize,
    fake_quant,
    quantize,
    quantize_multiplier,
    requantize,
    rshift_round_half_to_even,
    saturate,
)

I8, I16, I32 = QuantDType.qint8, QuantDType.qint16, QuantDType.qint32


def t(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def f32(value: float) -> float:
    """A hand-computed value rounded to float32, the way scales are stored."""
    return torch.tensor(value, dtype=torch.float32).item()


#: the worked examples of §8 and §10 below are those of the high-precision profile (31-bit M, F = 8);
#: tests/test_qpp.py has the default profile's.
HP = Qpp.HIGH_PRECISION


@pytest.fixture(autouse=True)
def _default_march():
    # quantize_multiplier and scale_from_range read the selected march; the rules below are those of QL1.
    assert get_march() is March.QL1
    yield


# --- the march constants --------------------------------------------------------------------------------------


def test_ql1_constants():
    spec = March.QL1.spec
    assert spec.name == "ql1"
    assert spec.rounding is RoundingMode.HALF_TO_EVEN
    assert spec.min_scale == 2.0**-24
    assert spec.requant_multiplier_bits == 31 and spec.max_requant_shift == 62
    assert (spec.qpp(Qpp.HIGH_PRECISION).multiplier_bits, spec.qpp(Qpp.HIGH_PRECISION).elementwise_frac_bits) == (31, 8)
    assert (spec.qpp(Qpp.DEFAULT).multiplier_bits, spec.qpp(Qpp.DEFAULT).elementwise_frac_bits) == (16, 0)
    assert spec.allow_int16_x_int16_gemm is False
    assert spec.accumulator_dtype is I32 and spec.high_precision_output_dtype is I32
    assert (I8.qmin, I8.qmax) == (-128, 127)
    assert (I16.qmin, I16.qmax) == (-32768, 32767)
    assert (I32.qmin, I32.qmax) == (-(2**31), 2**31 - 1)
    assert (QuantDType.quint8.qmin, QuantDType.quint8.qmax, QuantDType.quint8.bits) == (0, 255, 8)
    assert QuantDType.of_range(0, 255) is QuantDType.quint8 and QuantDType.of_range(-128, 127) is I8
    with pytest.raises(QuantLensError, match=r"No quantized dtype has the range \[0, 127\]"):
        QuantDType.of_range(0, 127)


# --- QuantDType.parse -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [("int8", I8), ("qint8", I8), ("int16", I16), ("qint16", I16), ("int32", I32), (I16, I16), (torch.qint8, I8),
     ("uint8", QuantDType.quint8), (torch.quint8, QuantDType.quint8)],
)
def test_quant_dtype_parse_accepts(value, expected):
    assert QuantDType.parse(value) is expected


@pytest.mark.parametrize("value", ["int4", "qint4", "float32", "uint16", ""])
def test_quant_dtype_parse_rejects(value):
    with pytest.raises(QuantLensError, match="Unknown quantized dtype"):
        QuantDType.parse(value)


# --- scale from range -----------------------------------------------------------------------------------------


def test_scale_from_range_int8_hand_values():
    spec = get_march().spec
    s = spec.scale_from_range(-1.0, 2.54, I8)
    assert s == f32(2.54 / 127) == f32(0.02)
    assert s != 2.54 / 127  # stored as float32, not float64
    # The larger magnitude decides, whichever side it is on.
    assert spec.scale_from_range(-5.08, 1.0, I8) == f32(0.04)
    assert spec.scale_from_range(-12.7, 12.7, I8) == f32(0.1)
    assert spec.scale_from_range(0.0, 127.0, I8) == 1.0


def test_scale_from_range_int16_hand_values():
    spec = get_march().spec
    assert spec.scale_from_range(-3.0, 1.0, I16) == f32(3.0 / 32767)
    assert spec.scale_from_range(-1.0, 32767.0, I16) == 1.0
    assert spec.scale_from_range(0.0, 32767 * 2.0**-8, I16) == 2.0**-8


def test_scale_from_range_min_scale_floor():
    spec = get_march().spec
    assert spec.scale_from_range(0.0, 0.0, I8) == 2.0**-24
    assert spec.scale_from_range(-1e-9, 1e-9, I16) == 2.0**-24
    # Just above the floor the rule applies again.
    assert spec.scale_from_range(0.0, 127 * 2.0**-20, I8) == 2.0**-20


@pytest.mark.parametrize("lo, hi", [(math.nan, 1.0), (-1.0, math.nan), (-math.inf, 1.0), (0.0, math.inf)])
def test_scale_from_range_rejects_non_finite(lo, hi):
    with pytest.raises(QuantLensError, match="non-finite range"):
        get_march().spec.scale_from_range(lo, hi, I8)


def test_observed_absmax_maps_to_qmax_and_qmin_only_by_clamping():
    spec = get_march().spec
    s = t(spec.scale_from_range(-0.8, 2.54, I8))
    q = quantize(t([2.54, -2.54, -2.6, -0.8]), s, I8)
    assert q.tolist() == [127, -127, -128, -40]


# --- fake quant: rounding and clamping ------------------------------------------------------------------------


def test_fake_quant_int8_ties_to_even():
    x = t([1.25, 1.75, -1.25, -1.75, 0.75, -0.75])
    # x / 0.5 = 2.5, 3.5, -2.5, -3.5, 1.5, -1.5 -> 2, 4, -2, -4, 2, -2
    out = fake_quant(x, t(0.5), I8)
    assert out.tolist() == [1.0, 2.0, -1.0, -2.0, 1.0, -1.0]
    assert quantize(x, t(0.5), I8).tolist() == [2, 4, -2, -4, 2, -2]


def test_fake_quant_int8_non_ties_round_to_nearest():
    x = t([1.3, 1.2, -1.3, -1.2, 0.2, -0.2])
    # x / 0.5 = 2.6, 2.4, -2.6, -2.4, 0.4, -0.4 -> 3, 2, -3, -2, 0, 0
    assert quantize(x, t(0.5), I8).tolist() == [3, 2, -3, -2, 0, 0]


def test_fake_quant_int8_clamps():
    out = fake_quant(t([100.0, -100.0, 63.5, -64.0, 63.75, -64.25]), t(0.5), I8)
    assert out.tolist() == [63.5, -64.0, 63.5, -64.0, 63.5, -64.0]


def test_fake_quant_int16_ties_and_clamp():
    s = 2.0**-8
    x = t([2.5 * s, 3.5 * s, -2.5 * s, -3.5 * s, 1000.0, -1000.0, 0.5 * s])
    out = fake_quant(x, t(s), I16)
    assert out.tolist() == [2 * s, 4 * s, -2 * s, -4 * s, 32767 * s, -32768 * s, 0.0]
    assert quantize(x, t(s), I16).tolist() == [2, 4, -2, -4, 32767, -32768, 0]


def test_fake_quant_int16_does_not_clamp_at_the_int8_range():
    out = fake_quant(t([200.0, -300.0]), t(1.0), I16)
    assert out.tolist() == [200.0, -300.0]


def test_fake_quant_per_channel_axis0_int8():
    x = t([[1.25, -0.75, 100.0], [1.25, -0.375, -100.0]])
    scale = t([0.5, 0.25])
    # row 0 (s=0.5): 2.5->2, -1.5->-2, 200->127;   row 1 (s=0.25): 5, -1.5->-2, -400->-128
    assert quantize(x, scale, I8, axis=0).tolist() == [[2, -2, 127], [5, -2, -128]]
    assert fake_quant(x, scale, I8, axis=0).tolist() == [[1.0, -1.0, 63.5], [1.25, -0.5, -32.0]]


def test_fake_quant_per_channel_axis1_int8():
    x = t([[1.25, 1.25], [0.75, 0.625], [100.0, -100.0]])
    scale = t([0.5, 0.25])
    # column 0 (s=0.5): 2.5->2, 1.5->2, 200->127;   column 1 (s=0.25): 5, 2.5->2, -400->-128
    assert quantize(x, scale, I8, axis=1).tolist() == [[2, 5], [2, 2], [127, -128]]
    assert fake_quant(x, scale, I8, axis=1).tolist() == [[1.0, 1.25], [1.0, 0.5], [63.5, -32.0]]


def test_fake_quant_per_channel_axis0_int16():
    a, b = 2.0**-8, 2.0**-4
    x = t([[2.5 * a, 3.5 * a, 1000.0], [2.5 * b, -3.5 * b, -5000.0]])
    scale = t([a, b])
    assert quantize(x, scale, I16, axis=0).tolist() == [[2, 4, 32767], [2, -4, -32768]]
    assert fake_quant(x, scale, I16, axis=0).tolist() == [[2 * a, 4 * a, 32767 * a], [0.125, -0.25, -2048.0]]


def test_fake_quant_per_channel_axis1_int16():
    x = t([[[2.5, 2.5]], [[-300.0, 70000.0]]]).permute(0, 2, 1)  # shape [2, 2, 1], channels on axis 1
    scale = t([1.0, 0.5])
    # channel 0 (s=1): 2.5->2, -300;   channel 1 (s=0.5): 5, 140000->32767
    assert quantize(x, scale, I16, axis=1).reshape(-1).tolist() == [2, 5, -300, 32767]
    assert fake_quant(x, scale, I16, axis=1).reshape(-1).tolist() == [2.0, 2.5, -300.0, 16383.5]


def test_per_channel_scales_are_not_swapped_between_axes():
    x = t([[1.0, 1.0], [1.0, 1.0]])
    scale = t([1.0, 0.75])
    assert fake_quant(x, scale, I8, axis=0).tolist() == [[1.0, 1.0], [0.75, 0.75]]
    assert fake_quant(x, scale, I8, axis=1).tolist() == [[1.0, 0.75], [1.0, 0.75]]


def test_quantize_returns_integers_and_dequantize_matches_fake_quant():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 3, generator=gen) * 3
    per_tensor = t(0.037)
    per_channel = t([0.01, 0.02, 0.05, 0.1, 0.2, 0.013])
    for dtype in (I8, I16):
        q = quantize(x, per_tensor, dtype)
        assert q.dtype == torch.int64
        assert int(q.min()) >= dtype.qmin and int(q.max()) <= dtype.qmax
        assert torch.equal(dequantize(q, per_tensor), fake_quant(x, per_tensor, dtype))
        qc = quantize(x, per_channel, dtype, axis=1)
        assert qc.dtype == torch.int64
        assert torch.equal(dequantize(qc, per_channel, axis=1), fake_quant(x, per_channel, dtype, axis=1))
    assert int(quantize(x, per_channel, I8, axis=1).min()) == -128  # the small scales do clamp


def test_quantize_divides_in_float32():
    # With s = float32(0.1) = 0.10000000149..., x = 2.75 and x = float32(0.35) = 0.34999999...: the exact quotients
    # are 27.4999996 and 3.4999999 (round down), but the IEEE float32 quotients are exactly 27.5 and 3.5, which
    # tie to even: 28 and 4. The spec computes x / s in float32, so 28 and 4 are the normative values.
    x, s = t([2.75, 0.35, -2.75]), t(0.1)
    assert (x / s).tolist() == [27.5, 3.5, -27.5]
    assert quantize(x, s, I8).tolist() == [28, 4, -28]
    assert fake_quant(x, s, I8).tolist() == [f32(28 * f32(0.1)), f32(4 * f32(0.1)), -f32(28 * f32(0.1))]


def test_fake_quant_keeps_input_dtype():
    x = torch.tensor([1.25, 100.0], dtype=torch.float64)
    out = fake_quant(x, t(0.5), I8)
    assert out.dtype == torch.float64 and out.tolist() == [1.0, 63.5]


def test_saturate_never_wraps():
    assert saturate(i64([128, -129, 40000, -40000, 5]), I8).tolist() == [127, -128, 127, -128, 5]
    assert saturate(i64([40000, -40000, 5]), I16).tolist() == [32767, -32768, 5]
    assert saturate(i64([2**40, -(2**40)]), I32).tolist() == [2**31 - 1, -(2**31)]


# --- straight-through gradient --------------------------------------------------------------------------------


def test_ste_gradient_is_one_inside_and_zero_when_clamped():
    # int8 at s=0.5 represents [-64, 63.5]; the boundaries themselves are inside.
    x = t([-100.0, -64.25, -64.0, -63.9, 0.3, 63.5, 63.6, 100.0]).requires_grad_()
    fake_quant(x, t(0.5), I8).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_ste_gradient_per_channel_and_upstream_grad():
    x = t([[63.5, 64.0], [63.5, 64.0]]).requires_grad_()
    scale = t([0.5, 1.0])  # row 0 range [-64, 63.5]; row 1 range [-128, 127]
    (fake_quant(x, scale, I8, axis=0) * t([[2.0, 3.0], [4.0, 5.0]])).sum().backward()
    assert x.grad.tolist() == [[2.0, 0.0], [4.0, 5.0]]


# --- custom op registration -----------------------------------------------------------------------------------


def test_fake_quant_is_one_custom_op_under_export():
    assert hasattr(torch.ops.quantlens, "fake_quant")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", t(0.5))

        def forward(self, x):
            return fake_quant(x, self.scale, I8)

    x = t([1.25, 1.75, -100.0])
    ep = torch.export.export(Tiny(), (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.quantlens.fake_quant.default]
    assert ep.module()(x).tolist() == [1.0, 2.0, -64.0]
    assert torch.ops.quantlens.fake_quant(x, t(0.5), -128, 127, -1).tolist() == [1.0, 2.0, -64.0]


# --- requantize multiplier ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "real, expected",
    [
        (0.5, (2**30, 31)),
        (1.0, (2**30, 30)),
        (0.25, (2**30, 32)),
        (0.75, (3 * 2**29, 31)),
        (3.0, (3 * 2**29, 29)),
        (2.0**-32, (2**30, 62)),  # the largest shift allowed
        (2.0**30, (2**30, 0)),  # the smallest shift allowed
        (1 - 2.0**-40, (2**30, 30)),  # rounds up to 2**31: halve M, one less shift
        (0.0123, (1690499128, 37)),  # 0.0123 * 2**37 = 1690499127.7056 -> 1690499128
    ],
)
def test_quantize_multiplier_hand_values(real, expected):
    # the high-precision profile (31-bit M), the worked table of docs/march.md §8.1
    assert quantize_multiplier(real, HP) == expected


def test_quantize_multiplier_0_0123_is_within_2_pow_minus_31():
    mult, shift = quantize_multiplier(0.0123, HP)
    approx = Fraction(mult, 2**shift)
    assert abs(approx - Fraction(0.0123)) / Fraction(0.0123) <= Fraction(1, 2**31)


def test_quantize_multiplier_range_and_error_bound_on_many_values():
    gen = torch.Generator().manual_seed(1)
    for e in torch.empty(200).uniform_(-30.0, 30.0, generator=gen).tolist():
        real = 2.0**e
        mult, shift = quantize_multiplier(real, HP)
        assert 2**30 <= mult < 2**31 and 0 <= shift <= 62
        assert abs(Fraction(mult, 2**shift) - Fraction(real)) <= Fraction(real) / 2**31


@pytest.mark.parametrize("real", [0.0, -0.5, math.nan, math.inf, -math.inf])
def test_quantize_multiplier_rejects_non_positive_and_non_finite(real):
    with pytest.raises(QuantLensError, match="positive and finite"):
        quantize_multiplier(real, HP)


@pytest.mark.parametrize("real", [2.0**-33, 1e-12, 2.0**31, 1e10])
def test_quantize_multiplier_rejects_shift_outside_0_62(real):
    with pytest.raises(QuantLensError, match=r"outside \[0, 62\]"):
        quantize_multiplier(real, HP)


# --- rounding right shift -------------------------------------------------------------------------------------


def test_rshift_by_one_ties_to_even_both_signs():
    out = rshift_round_half_to_even(i64([5, 6, 7, -5, -6, -7, 3, 1, -1, 0]), 1)
    assert out.tolist() == [2, 3, 4, -2, -3, -4, 2, 0, 0, 0]


def test_rshift_by_two_ties_and_non_ties():
    x = i64([-6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 5, 6, 10, 14])
    # x / 4 = -1.5 -1.25 -1 -0.75 -0.5 -0.25 0 0.25 0.5 0.75 1.25 1.5 2.5 3.5
    assert rshift_round_half_to_even(x, 2).tolist() == [-2, -1, -1, -1, 0, 0, 0, 0, 0, 1, 1, 2, 2, 4]


def test_rshift_by_zero_is_identity():
    x = i64([-7, 0, 7, 2**40])
    assert rshift_round_half_to_even(x, 0).tolist() == [-7, 0, 7, 2**40]


def test_rshift_large_shifts():
    h = 2**61
    x = i64([h, 3 * h, -h, -3 * h, h + 1, -h - 1, h - 1, 2**62 - 1])
    # x / 2**62 = 0.5, 1.5, -0.5, -1.5, >0.5, <-0.5, <0.5, <1
    assert rshift_round_half_to_even(x, 62).tolist() == [0, 2, 0, -2, 1, -1, 0, 1]
    assert rshift_round_half_to_even(i64([2**39, 3 * 2**39, 1, -1]), 40).tolist() == [0, 2, 0, 0]


# --- requantize -----------------------------------------------------------------------------------------------


def test_requantize_quarter_saturates_int8_not_int16():
    mult, shift = quantize_multiplier(0.25, HP)
    acc = torch.tensor([1000, -1000, 300, 301, 302, 303, 298, -298, -302], dtype=torch.int32)
    # acc / 4 = 250, -250, 75, 75.25, 75.5, 75.75, 74.5, -74.5, -75.5
    assert requantize(acc, mult, shift, I8).tolist() == [127, -128, 75, 75, 76, 76, 74, -74, -76]
    assert requantize(acc, mult, shift, I16).tolist() == [250, -250, 75, 75, 76, 76, 74, -74, -76]
    assert requantize(acc, mult, shift, I8).dtype == torch.int64


def test_requantize_saturates_int16():
    mult, shift = quantize_multiplier(0.25, HP)
    assert requantize(i64([200000, -200000, 131068]), mult, shift, I16).tolist() == [32767, -32768, 32767]


def test_requantize_non_power_of_two_multiplier():
    mult, shift = quantize_multiplier(0.0123, HP)
    # acc * 0.0123 = 12.3, -12.3, 0.615, -0.615, 0.492, 0.5043
    assert requantize(i64([1000, -1000, 50, -50, 40, 41]), mult, shift, I8).tolist() == [12, -12, 1, -1, 0, 1]


def test_requantize_multiplier_above_one():
    mult, shift = quantize_multiplier(3.0, HP)
    assert requantize(i64([42, 43, -42, -43, 10]), mult, shift, I8).tolist() == [126, 127, -126, -128, 30]


def test_requantize_extreme_int32_accumulator_does_not_overflow():
    # |acc * M| < 2**31 * 2**31 = 2**62 fits in int64.
    mult, shift = 2**31 - 1, 62  # m just below 2**-31
    acc = i64([2**31 - 1, -(2**31), 2**30, -(2**30)])
    # (2**31 - 1)**2 / 2**62 = 1 - 2**-30 -> 1;  -2**31 * (2**31 - 1) / 2**62 = -(1 - 2**-31) -> -1;  +-0.5 -> 0
    assert requantize(acc, mult, shift, I8).tolist() == [1, -1, 0, 0]
    assert requantize(acc[:2], 2**31 - 1, 0, I32).tolist() == [2**31 - 1, -(2**31)]


def test_conv_worked_example_of_the_spec():
    # docs/march.md, "Requantize": s_in = 2**-4, s_w = 2**-6, s_out = 2**-3, bias 0.3.
    s_in, s_w, s_out = 2.0**-4, 2.0**-6, 2.0**-3
    qx = quantize(t([1.0, 0.5, -0.75, 2.0]), t(s_in), I8)
    qw = quantize(t([0.5, 0.25, -0.5, 0.75]), t(s_w), I8)
    assert qx.tolist() == [16, 8, -12, 32] and qw.tolist() == [32, 16, -32, 48]
    qb = quantize(t([0.3]), t(s_in * s_w), I32)
    assert qb.tolist() == [307]  # 0.3 * 1024 = 307.2
    acc = int((qx * qw).sum()) + int(qb)
    assert acc == 2867
    mult, shift = quantize_multiplier(s_in * s_w / s_out, HP)
    assert (mult, shift) == (2**30, 37)
    # 2867 / 128 = 22.398 -> 22; ties: 2880 / 128 = 22.5 -> 22, 2752 / 128 = 21.5 -> 22
    assert requantize(i64([acc, 2880, 2752, -2880]), mult, shift, I8).tolist() == [22, 22, 22, -22]


def test_elementwise_add_worked_example_of_the_spec():
    # docs/march.md §10: q_a = 5 at 2**-4, q_b = 2 at 2**-5, output at 2**-3, F = 8 extra fractional bits.
    from quantlens.march.numerics import rescaled_sum

    ma, sa = quantize_multiplier(0.5, HP)  # (2**30, 31)
    mb, sb = quantize_multiplier(0.25, HP)  # (2**30, 32)
    # t_a = rhe(5 * 0.5 * 256) = 640, t_b = rhe(2 * 0.25 * 256) = 128, y = rhe(768 / 256) = 3
    assert rescaled_sum([(i64([5]), ma, sa, 1), (i64([2]), mb, sb, 1)], 0, I8, 8).tolist() == [3]
    # ... which is what the fake-quant model gives: (0.3125 + 0.0625) / 0.125 = 3 (rounding each term first
    # would give rhe(2.5) + rhe(0.5) = 2).
    assert quantize(t([5 * 2.0**-4 + 2 * 2.0**-5]), t(2.0**-3), I8).tolist() == [3]
    # sub, a tie: 5*0.5 - 1*0.25 = 2.25 -> 2;  3*0.5 - 0 = 1.5 -> 2 (ties to even); saturation to int8
    assert rescaled_sum([(i64([5, 3]), ma, sa, 1), (i64([1, 0]), mb, sb, -1)], 0, I8, 8).tolist() == [2, 2]
    two = quantize_multiplier(2.0, HP)
    assert rescaled_sum([(i64([127]), *two, 1), (i64([127]), *two, 1)], 0, I8, 8).tolist() == [127]
    # An addend in units of 2**-F output steps: 1.5 steps + 1 -> 2.5 -> 2
    assert rescaled_sum([(i64([3]), ma, sa, 1)], 256, I8, 8).tolist() == [2]
    # An equal scale rescales exactly (identity).
    assert requantize(i64([-128, 77, 127]), *quantize_multiplier(1.0, HP), I8).tolist() == [-128, 77, 127]


# --- bias and BatchNorm folding -------------------------------------------------------------------------------


def _fq(spec_dtype, scale, ch_axis=None):
    from quantlens.quantization.fake_quantize import FakeQuantize
    from quantlens.quantization.qconfig import QuantSpec

    fq = FakeQuantize(QuantSpec(spec_dtype, ch_axis=ch_axis))
    fq.scale = t(scale)
    fq.fake_quant_enabled = True
    return fq


def test_bias_is_int32_at_input_times_weight_scale():
    from quantlens.quantization.qat_modules import QATLinear
    from quantlens.quantization.qconfig import QuantSpec

    lin = QATLinear.from_float(nn.Linear(2, 2), QuantSpec(I8, ch_axis=0))
    lin.weight_fake_quant = _fq(I8, [0.25, 0.125], ch_axis=0)
    lin.__dict__["_ql_input_fq"] = _fq(I8, 0.5)
    # bias scales 0.5 * [0.25, 0.125] = [0.125, 0.0625]; 0.3 / 0.125 = 2.4 -> 2; -0.09375 / 0.0625 = -1.5 -> -2
    qb = lin._quant_bias(t([0.3, -0.09375]))
    assert qb.tolist() == [0.25, -0.125]
    # No input fake quant: the bias stays float.
    lin.__dict__["_ql_input_fq"] = None
    assert lin._quant_bias(t([0.3, -0.09375])).tolist() == [f32(0.3), -0.09375]


def test_batchnorm_is_folded_before_the_weight_is_quantized():
    from quantlens.quantization.qat_modules import QATLinearBn1d
    from quantlens.quantization.qconfig import QuantSpec

    linear = nn.Linear(1, 1)
    bn = nn.BatchNorm1d(1, eps=1.0)
    with torch.no_grad():
        linear.weight.fill_(2.2)
        linear.bias.fill_(1.2)
        bn.weight.fill_(3.0)
        bn.bias.fill_(0.5)
        bn.running_mean.fill_(1.0)
        bn.running_var.fill_(3.0)
    fused = QATLinearBn1d.from_modules(linear, bn, QuantSpec(I8, ch_axis=0)).eval()
    fused.weight_fake_quant = _fq(I8, [0.5], ch_axis=0)
    x = t([[1.0]])
    # gamma / sqrt(var + eps) = 3 / 2 = 1.5; w' = 3.3 -> 6.6 -> 7 -> 3.5 (quantizing w = 2.2 first would give 3.0);
    # b' = 0.5 + (1.2 - 1) * 1.5 = 0.8, float without an input fake quant.
    assert fused(x).item() == pytest.approx(4.3, abs=1e-6)
    # With an input scale of 0.5 the bias is int32 at 0.5 * 0.5 = 0.25: 0.8 / 0.25 = 3.2 -> 3 -> 0.75.
    fused.__dict__["_ql_input_fq"] = _fq(I8, 0.5)
    assert fused(x).item() == 4.25
