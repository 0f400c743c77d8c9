"""``quantlens.march.rules``: each op family's integer parameters, pinned to hand-computed values, and the proof
that convert and the fake quant's emulation both take them from there (``docs/march.md`` §6-§11).

Multipliers: the default profile's ``M`` lies in ``[2**15, 2**16)`` and the high-precision one's in
``[2**30, 2**31)``, with ``real = M · 2**-shift``.
"""

import math

import pytest
import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.kernels.integer import INT_KERNELS
from quantlens.march import Qpp, QuantDType, rules

DEF, HP = Qpp.DEFAULT, Qpp.HIGH_PRECISION
I8, I16 = QuantDType.qint8, QuantDType.qint16


def s(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def test_multiplier_and_requantize():
    assert rules.multiplier(0.75, DEF) == (49152, 16)  # 0.75 · 2**16
    assert rules.multiplier(1 / 3, DEF) == (43691, 17)  # rhe(2**17 / 3)
    assert rules.multiplier(2.0, HP) == (2**30, 29)
    # a multiplier past the default range takes the 31-bit one (the wide multiplier)
    assert rules.multiplier(3.0 * 2**20, DEF) == (3 * 2**29, 9)
    assert rules.requantize(torch.tensor([0.5, 0.25], dtype=torch.float64), I16, DEF) == {
        "multiplier": [2**15, 2**15], "shift": [16, 17], "out_dtype": "qint16"}
    assert rules.move(s(0.5), s(0.25), I8, DEF) == {"multiplier": [2**15], "shift": [14], "out_dtype": "qint8"}


def test_gemm_requantizes_the_accumulator_per_channel_and_folds_a_factor():
    w = torch.tensor([0.25, 0.125])
    # s_x · s_w / s_out = [0.5, 0.25]
    assert rules.gemm(s(0.5), w, s(0.25), I8, DEF) == {"multiplier": [2**15, 2**15], "shift": [16, 17],
                                                        "out_dtype": "qint8"}
    assert rules.gemm(s(0.5), w, s(0.25), I8, DEF, factor=0.5)["shift"] == [17, 18]
    assert rules.accumulator_scale(s(0.5), w).dtype == torch.float64


def test_add_cat_and_constants():
    scales = [s(2.0**-4), s(2.0**-5)]
    assert rules.add(scales, s(2.0**-3), I8, DEF) == {
        "multipliers": [2**15, 2**15], "shifts": [16, 17], "frac_bits": 0, "out_dtype": "qint8"}
    assert rules.add(scales, s(2.0**-3), I8, HP) == {
        "multipliers": [2**30, 2**30], "shifts": [31, 32], "frac_bits": 8, "out_dtype": "qint8"}
    # cat requantizes each input alone: no sum, so no fractional bits
    assert rules.cat(scales, s(2.0**-3), I16, DEF, dim=1) == {
        "multipliers": [2**15, 2**15], "shifts": [16, 17], "out_dtype": "qint16", "dim": 1}
    # k - x with k = 0.75 at s_out = 0.25 and F = 8: the addend is rhe(0.75 · 256 / 0.25) = 768
    assert rules.add_constant(s(0.5), 0.75, s(0.25), I8, HP, negate=True) == {
        "multipliers": [2**30], "shifts": [29], "frac_bits": 8, "out_dtype": "qint8", "addend": 768, "negate": True}
    assert rules.add_constant(s(0.5), 0.75, s(0.25), I8, DEF, negate=False)["addend"] == 3  # F = 0


def test_products_and_averages():
    # x · (-1.5): |k| · s_x / s_out = 3 = 49152 · 2**-14, the sign apart
    assert rules.scale_by_constant(-1.5, s(0.5), s(0.25), I8, DEF) == {
        "multiplier": [49152], "shift": [14], "out_dtype": "qint8", "negative": True}
    with pytest.raises(QuantLensError, match="multiplication by 0"):
        rules.scale_by_constant(0.0, s(0.5), s(0.25), I8, DEF)
    assert rules.mul(s(0.5), s(0.25), s(0.5), I8, DEF)["shift"] == [17]  # 0.25
    assert rules.average(s(0.5), 4, s(0.25), I8, DEF)["multiplier"] == [2**15]  # 0.5
    assert rules.average(s(0.5), 3, s(0.25), I8, DEF) == {"multiplier": [43691], "shift": [16],
                                                          "out_dtype": "qint8"}  # 2/3: rhe(2**17 / 3)


def test_clamp_sign_bilinear_and_fill():
    assert rules.clamp(0.0, 6.0, s(0.5), s(0.25), I8, DEF) == {
        "lo": 0, "hi": 12, "out_lo": 0, "out_hi": 24, "multiplier": [2**15], "shift": [14], "out_dtype": "qint8"}
    # a bound off the input grid: clamp(max=1.0) with s_in = 3.46, s_out = 1/127 (Inkling2's L2 clip); the fake
    # quant gives fq(min(x, 1.0)) = 127 for every x >= 1; rhe(1.0 / 3.46) = 0 as the input bound gave 0 instead
    attrs = rules.clamp(None, 1.0, s(3.46), s(1 / 127), I8, DEF)
    assert (attrs["hi"], attrs["out_lo"], attrs["out_hi"]) == (1, -128, 127)
    q = torch.tensor([31, 109, 0, -3], dtype=torch.int8)
    assert INT_KERNELS["clamp"]([q], attrs).tolist() == [127, 127, 0, -128]  # 0 -> 0; -3 -> -10.38 / s_out: sat
    assert rules.clamp(None, 1.0, s(0.5), s(0.5), I8, DEF)["lo"] == -(2**31)
    assert rules.sign_op(s(0.5), s(0.5), I8, DEF)["shift"] == [15]  # 1.0
    # weights in 2**-8 fixed point per axis: s_x · 2**-16 / s_out = 2
    assert rules.bilinear(s(1.0), s(2.0**-17), I8, DEF) == {"multiplier": [2**15], "shift": [14],
                                                            "out_dtype": "qint8"}
    assert rules.fill_code(0.75, s(0.25), I8) == 3
    assert rules.fill_code(1e9, s(0.25), I8) == 127 and rules.fill_code(-math.inf, s(0.25), I8) == -128


def test_channel_affine_and_prelu():
    a = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.25, 0.0, 1.0], dtype=torch.float64)
    w, bias, attrs = rules.channel_affine(a, b, s(0.5), s(0.25), I8, DEF)
    # s_w = |a| / 127 (1 where a = 0): weights ±127; bias = rhe(b / (s_x · s_w)) = [127, 0, 2]
    assert w.tolist() == [127, -127, 0] and bias.tolist() == [127, 0, 2]
    # s_x · s_w / s_out = [1/127, 2/127, 2]: rhe(2**22 / 127) = 33026
    assert attrs == {"channel_dim": 1, "multiplier": [33026, 33026, 2**15], "shift": [22, 21, 14],
                     "out_dtype": "qint8"}
    alpha = torch.tensor([0.25, -0.5, 0.0], dtype=torch.float64)
    assert rules.prelu(alpha, s(0.5), s(0.25), I8, DEF) == {
        "multiplier": [2**15], "shift": [14], "out_dtype": "qint8",  # q >= 0: s_x / s_out = 2
        "neg_multiplier": [2**15, 2**15, 2**15], "neg_shift": [16, 15, 15],  # |α| · 2 = 0.5, 1.0; α = 0: any
        "neg_sign": [1, -1, 0], "channel_dim": 1}


class _Add(nn.Module):
    def __init__(self):
        super().__init__()
        from quantlens.quantization import DeQuantStub, QuantStub

        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        x = self.quant(x)
        return self.dequant(self.conv(x) + x[:, :1] * 0.5)


def test_convert_and_the_emulation_take_the_add_rule_from_rules(monkeypatch):
    """Changing the add rule is one function: a spy in its place is called by convert (the IR's scales) and by
    the consistency-level forward (the fake quants' scales) with the same scales, and both results follow it."""
    from quantlens.compiler import convert, export
    from quantlens.quantization import ConsistencyStrategy, calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    ConsistencyStrategy.set_consistency_level(2)
    try:
        model = calibrate(prepare(_Add(), (x,), default_calibration_qconfig_setter, check_result_dir=None),
                          [(torch.randn(2, 3, 6, 6),) for _ in range(3)])
    finally:
        ConsistencyStrategy.disable()
    qat_ir = export(model, (x,))
    calls = {"convert": [], "emulation": []}
    real_add = rules.add

    def spy(in_scales, out_scale, qdtype, qpp, out_axis=None):
        import inspect

        caller = inspect.stack()[1].filename
        calls["emulation" if "emulation" in caller else "convert"].append(
            ([float(t.reshape(-1)[0]) for t in in_scales], float(torch.as_tensor(out_scale).reshape(-1)[0])))
        return real_add(in_scales, out_scale, qdtype, qpp, out_axis)

    monkeypatch.setattr(rules, "add", spy)
    quantized = convert(qat_ir)
    with torch.no_grad():
        expected = model(x)
    assert calls["convert"] and calls["emulation"]
    assert calls["convert"][0] == calls["emulation"][0]
    assert torch.equal(quantized(x), expected)  # the integer model and the level-2 forward agree bit for bit
