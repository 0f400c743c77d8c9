"""The two requantize precision profiles ("qpp", docs/march.md §8, §10) and the cost model (§15).

The default profile: 16-bit multipliers ``M`` in ``[2**15, 2**16)`` and ``F = 0`` (each add/sub term rounded to
whole output steps). The high-precision one: today's 31-bit ``M`` and ``F = 8`` (tests/test_numerics.py pins its
worked examples). Values below are computed by hand; comments show the arithmetic.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import pytest
import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.compiler.cost import LatencyEstimate, estimate_latency, requant_class
from quantlens.compiler.ir import Graph, Module, Node, ValueInfo
from quantlens.compiler.kernels_int import INT_KERNELS
from quantlens.errors import QuantLensError
from quantlens.march import SPEC_VERSION, March, Qpp, QppSpec, QuantDType, get_march
from quantlens.march.numerics import constant_addend, quantize_multiplier, requantize, rescaled_sum
from quantlens.march.rules import add as rescale_attrs
from quantlens.march.rules import requantize as requant_attrs
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

I8, I16, I32 = QuantDType.qint8, QuantDType.qint16, QuantDType.qint32
HP, DEF = Qpp.HIGH_PRECISION, Qpp.DEFAULT


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


def _rhe(f: Fraction) -> int:
    floor = f.numerator // f.denominator
    rest = f - floor
    return floor + (1 if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2) else 0)


# -- the march data ---------------------------------------------------------------------------------------------
def test_spec_v6_declares_both_profiles():
    spec = March.QL1.spec
    assert SPEC_VERSION == 6  # (version 5 added the profiles)
    assert spec.qpp(DEF) == QppSpec(multiplier_bits=16, elementwise_frac_bits=0)
    assert spec.qpp(HP) == QppSpec(multiplier_bits=31, elementwise_frac_bits=8)
    assert spec.qpp("high_precision") is spec.qpp(HP) and spec.qpp("default") is spec.qpp(DEF)
    with pytest.raises(QuantLensError, match="Unknown qpp"):
        spec.qpp("fast")
    cost = spec.cost
    assert 0 < cost.requant_passes_shift < cost.requant_passes_default < cost.requant_passes_high_precision
    assert cost.macs_per_cycle_int8 > cost.macs_per_cycle_int16 > 0 and cost.clock_mhz > 0


# -- §8.1: the 16-bit multiplier at its edges -------------------------------------------------------------------
@pytest.mark.parametrize(
    "real, expected",
    [
        (0.5, (2**15, 16)),
        (1.0, (2**15, 15)),  # exactly 1: M = 2**shift
        (0.25, (2**15, 17)),
        (0.75, (3 * 2**14, 16)),  # 0.75 · 2**16 = 49152
        (3.0, (3 * 2**14, 14)),
        (0.0123, (51590, 22)),  # floor(log2) = -7: 0.0123 · 2**22 = 51589.9392 -> 51590
        (1 / 3, (43691, 17)),  # 2**17 / 3 = 43690.67 -> 43691
        (1 / 254, (33026, 23)),  # 2**23 / 254 = 33026.016 -> 33026
        # rounding reaches 2**16: M halves, the shift drops by one
        (1 - 2.0**-18, (2**15, 15)),  # · 2**16 = 65535.75 -> 65536
        (1 - 2.0**-17, (2**15, 15)),  # · 2**16 = 65535.5, a tie -> 65536 (even)
        (1 - 3 * 2.0**-18, (65535, 16)),  # · 2**16 = 65535.25 -> 65535: no drop
        # the smallest m: shift 62 = 15 + 47
        (2.0**-47, (2**15, 62)),
        (2.0**-47 * (1 - 2.0**-20), (2**15, 62)),  # floor(log2) = -48 (shift 63), but rounds up to 2**16: 62
        # the largest m: shift 0, M < 2**16
        (65535.49, (65535, 0)),
        (65534.5, (65534, 0)),  # a tie -> even
    ],
)
def test_default_multiplier_hand_values(real, expected):
    assert quantize_multiplier(real) == expected
    assert quantize_multiplier(real, DEF) == expected


@pytest.mark.parametrize("real", [2.0**-48, 2.0**-47 * (1 - 2.0**-16), 65535.5, 2.0**16])
def test_default_multiplier_rejects_shifts_outside_0_62(real):
    # 2**-48: shift 63; 2**-47 · (1 - 2**-16): · 2**63 = 65535 (no round-up), shift 63; 65535.5: a tie rounds to
    # 2**16 at shift 0, which would need shift -1; 2**16: shift -1
    with pytest.raises(QuantLensError, match=r"outside \[0, 62\]"):
        quantize_multiplier(real)


def test_default_multiplier_error_is_at_most_2_pow_minus_16():
    gen = torch.Generator().manual_seed(5)
    for e in torch.empty(300).uniform_(-40.0, 15.0, generator=gen).tolist():
        real = 2.0**e
        mult, shift = quantize_multiplier(real)
        assert 2**15 <= mult < 2**16 and 0 <= shift <= 62
        assert abs(Fraction(mult, 2**shift) - Fraction(real)) <= Fraction(real) / 2**16


def test_table_kernels_keep_the_31_bit_multiplier():
    # §13 units keep their own (high-precision) arithmetic whatever the qpp: softmax's output multiplier of
    # 2**-31 / s_out with s_out = 2**-7 is 2**-24 = (2**30, 54), not the 16-bit (2**15, 39)
    from quantlens.kernels.int_ops import softmax_multiplier

    assert softmax_multiplier(2.0**-7) == (2**30, 54)
    assert quantize_multiplier(2.0**-24) == (2**15, 39)


# -- §8.3: requantize with a 16-bit multiplier ------------------------------------------------------------------
def test_default_requantize_ties_and_where_the_profiles_differ():
    m, s = quantize_multiplier(0.25)  # (2**15, 17)
    acc = i64([302, 298, -302, -298, 301, 2**31 - 1, -(2**31)])
    # /4: 75.5 -> 76, 74.5 -> 74, -75.5 -> -76, -74.5 -> -74, 75.25 -> 75, 536870911.75 -> 2**29, -2**29
    assert requantize(acc, m, s, I32).tolist() == [76, 74, -76, -74, 75, 2**29, -(2**29)]
    assert requantize(acc, m, s, I8).tolist() == [76, 74, -76, -74, 75, 127, -128]
    # m = 0.0123: acc = 15813 is 194.4999 (real); 15813 · 51590 / 2**22 = 194.50013 -> 195 with the 16-bit M,
    # 15813 · 1690499128 / 2**37 = 194.4999 -> 194 with the 31-bit one: one step apart
    assert requantize(i64([15813]), *quantize_multiplier(0.0123), I16).tolist() == [195]
    assert requantize(i64([15813]), *quantize_multiplier(0.0123, HP), I16).tolist() == [194]
    # §10.3 example with the default profile: 1397 · 33026 / 2**23 = 46137322 / 8388608 = 5.4999974 -> 5, as
    # with the 31-bit M (5.49999999984); 5.5 exactly would be 46137344
    assert requantize(i64([1397]), *quantize_multiplier(1 / 254), I8).tolist() == [5]
    assert requantize(i64([1397]), *quantize_multiplier(1 / 254, HP), I8).tolist() == [5]


#: M = 65535, shift = 30: products near 2**53. Found by solving acc · M = 2**29 + d (mod 2**30).
_M, _S = 65535, 30
#: below the fast-path bound 2**37 (= 2**(53 - 16)): just above a tie, just below one, a tie
_BELOW = [136902017023, 136902148097, 136902082560]
#: above it: acc · M > 2**53 is just above a tie (exact 8486779), which a float64 product rounds onto the tie (even
#: 8486778): the integer path must be taken
_ABOVE = 139049500671


def test_requantize_fast_path_at_its_16_bit_bound_equals_the_integer_rule():
    edge = _BELOW + [-v for v in _BELOW] + [2**37 - 1, -(2**37 - 1), 3, -3, 0]
    want = [_rhe(Fraction(a * _M, 2**_S)) for a in edge]
    assert want[:3] == [8355709, 8355716, 8355712]  # the tie 8355711.5 -> 8355712 (even)
    fast = requantize(i64(edge), _M, _S, I32)  # every |acc| < 2**37: the float64 path
    slow = requantize(i64(edge + [2**37]), _M, _S, I32)[:-1]  # one at the bound: the integer path
    assert fast.tolist() == want and slow.tolist() == want
    # float64 accumulators (the simulator's exact GEMM results) take the same path
    assert requantize(i64(edge).to(torch.float64), _M, _S, I32).tolist() == want
    # beyond the bound the float64 product is not exact; the integer path gives the exact result
    assert _rhe(Fraction(_ABOVE * _M, 2**_S)) == 8486779
    assert int(torch.round(torch.tensor(float(_ABOVE), dtype=torch.float64) * (_M * 2.0**-_S))) == 8486778
    assert requantize(i64([_ABOVE]), _M, _S, I32).tolist() == [8486779]
    # per-channel multipliers: the bound follows the largest one (here 16 bits)
    mult = i64([[_M], [2**15]])
    got = requantize(i64([_BELOW, _BELOW]), mult, _S, I32)
    assert got.tolist() == [want[:3], [_rhe(Fraction(a * 2**15, 2**_S)) for a in _BELOW]]


def test_rescaled_sum_fast_path_at_its_16_bit_bound_equals_the_integer_path():
    qa = _BELOW + [-(2**37 - 1), 17, 1]
    qb = [0, _BELOW[2], -_BELOW[0], 3, -1, 0]

    def ref(a, b, addend=100):  # F = 0: each term rounded to whole steps, then summed (no second rounding)
        t = [max(min(_rhe(Fraction(q * _M, 2**_S)), 2**31 - 1), -(2**31)) for q in (a, b)]
        return max(min(t[0] - t[1] + addend, 2**31 - 1), -(2**31))

    terms = lambda a, b: [(i64(a), _M, _S, 1), (i64(b), _M, _S, -1)]  # noqa: E731
    want = [ref(a, b) for a, b in zip(qa, qb)]
    fast = rescaled_sum(terms(qa, qb), 100, I32, 0)
    slow = rescaled_sum(terms(qa + [2**37], qb + [0]), 100, I32, 0)[:-1]  # forces the integer path
    assert fast.tolist() == want and slow.tolist() == want
    assert rescaled_sum([(i64([_ABOVE]), _M, _S, 1)], 0, I32, 0).tolist() == [8486779]


# -- §10: the add rule with F = 0 ------------------------------------------------------------------------------
def test_add_with_f0_rounds_each_term_and_differs_from_f8_by_one_step():
    # q_a = 5 at 2**-4, q_b = 2 at 2**-5, output 2**-3 (the §10 example)
    ma, sa = quantize_multiplier(0.5)  # (2**15, 16)
    mb, sb = quantize_multiplier(0.25)  # (2**15, 17)
    # F = 0: rhe(2.5) + rhe(0.5) = 2 + 0 = 2; F = 8 (high precision): rhe((640 + 128) / 256) = 3
    assert rescaled_sum([(i64([5]), ma, sa, 1), (i64([2]), mb, sb, 1)], 0, I8, 0).tolist() == [2]
    hp_a, hp_b = quantize_multiplier(0.5, HP), quantize_multiplier(0.25, HP)
    assert rescaled_sum([(i64([5]), *hp_a, 1), (i64([2]), *hp_b, 1)], 0, I8, 8).tolist() == [3]
    # sub: 3·0.5 - 1·0.25 = 1.25: F = 0 gives rhe(1.5) - rhe(0.25) = 2 - 0 = 2, F = 8 gives rhe(1.25) = 1
    assert rescaled_sum([(i64([3]), ma, sa, 1), (i64([1]), mb, sb, -1)], 0, I8, 0).tolist() == [2]
    assert rescaled_sum([(i64([3]), *hp_a, 1), (i64([1]), *hp_b, -1)], 0, I8, 8).tolist() == [1]
    # saturation after the sum: 127·2 + 127·2 -> 127
    two = quantize_multiplier(2.0)
    assert rescaled_sum([(i64([127]), *two, 1), (i64([127]), *two, 1)], 0, I8, 0).tolist() == [127]


def test_constant_addend_with_f0_is_whole_output_steps():
    assert constant_addend(0.75, 0.5, 0) == 2  # 1.5 -> 2
    assert constant_addend(1.25, 0.5, 0) == 2  # 2.5 -> 2 (even)
    assert constant_addend(5 / 1024, 0.5, 0) == 0  # 0.0098 -> 0; with F = 8: 2.5 -> 2
    assert constant_addend(5 / 1024, 0.5, 8) == 2
    with pytest.raises(QuantLensError, match="outside the int32 range"):
        constant_addend(1e7, 1e-3, 0)


def test_add_kernel_reads_frac_bits_and_a_v4_node_means_8():
    hp_a, hp_b = quantize_multiplier(0.5, HP), quantize_multiplier(0.25, HP)
    attrs = {"multipliers": [hp_a[0], hp_b[0]], "shifts": [hp_a[1], hp_b[1]], "out_dtype": "qint8"}
    x = [torch.tensor([5], dtype=torch.int8), torch.tensor([2], dtype=torch.int8)]
    assert INT_KERNELS["add"](Node("add", [], [], attrs), x).tolist() == [3]  # no frac_bits (spec v4): F = 8
    assert INT_KERNELS["add"](Node("add", [], [], {**attrs, "frac_bits": 8}), x).tolist() == [3]
    assert INT_KERNELS["add"](Node("add", [], [], {**attrs, "frac_bits": 0}), x).tolist() == [2]
    # x + k: 3 · 0.5 + 0.75 / 0.5 = 1.5 + 1.5: F = 0 gives rhe(1.5) + 2 = 4; F = 8: rhe((384 + 384) / 256) = 3
    const = {"multipliers": [2**15], "shifts": [16], "addend": constant_addend(0.75, 0.5, 0), "negate": False,
             "out_dtype": "qint8", "frac_bits": 0}
    three = [torch.tensor([3], dtype=torch.int8)]
    assert INT_KERNELS["add_const"](Node("add_const", [], [], const), three).tolist() == [4]
    hp_const = {**const, "multipliers": [hp_a[0]], "shifts": [hp_a[1]], "addend": constant_addend(0.75, 0.5, 8),
                "frac_bits": 8}
    assert INT_KERNELS["add_const"](Node("add_const", [], [], hp_const), three).tolist() == [3]


# -- the parameter helpers of convert ------------------------------------------------------------------------------
def test_requant_and_rescale_attrs_follow_the_qpp():
    real = torch.tensor([0.5, 1 / 3], dtype=torch.float64)
    assert requant_attrs(real, I8, DEF) == {"multiplier": [2**15, 43691], "shift": [16, 17], "out_dtype": "qint8"}
    assert requant_attrs(real, I16, HP) == {"multiplier": [2**30, 1431655765], "shift": [31, 32],
                                            "out_dtype": "qint16"}
    # outside the 16-bit range (m >= 2**16 - 1/2): that requantize takes the 31-bit multiplier
    assert requant_attrs(torch.tensor(3.0 * 2**20), I8, DEF)["multiplier"] == [3 * 2**29]
    assert requant_attrs(torch.tensor(3.0 * 2**20), I8, DEF)["shift"] == [9]
    with pytest.raises(QuantLensError, match="outside"):
        quantize_multiplier(3.0 * 2**20)
    scales = [torch.tensor(2.0**-4), torch.tensor(2.0**-5)]
    assert rescale_attrs(scales, torch.tensor(2.0**-3), I8, DEF) == {
        "multipliers": [2**15, 2**15], "shifts": [16, 17], "frac_bits": 0, "out_dtype": "qint8"}
    assert rescale_attrs(scales, torch.tensor(2.0**-3), I8, HP) == {
        "multipliers": [2**30, 2**30], "shifts": [31, 32], "frac_bits": 8, "out_dtype": "qint8"}


# -- convert: the qpp comes from the qat IR's meta -------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        x = self.quant(x)
        y = torch.relu(self.conv(x)) + self.conv2(x) * 0.7
        y = y + 0.5
        y = y.mean(dim=(2, 3))
        return self.dequant(self.fc(y))


@pytest.fixture(scope="module")
def qat_ir():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(_Net().eval(), (x,), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate(prepared, [(torch.randn(2, 3, 6, 6),) for _ in range(3)])
    return export(pre_export(prepared), (x,), dynamic_batch=True)


def _multipliers(ir):
    for node in ir.graph.nodes:
        for key in ("multiplier", "multipliers", "neg_multiplier"):
            yield from ((node.op, m) for m in node.attrs.get(key) or [])


def _with_qpp(qat, high: bool):
    return Module(qat.kind, qat.graph, qat.input_leaves, qat.input_spec, qat.output_spec,
                  meta={**qat.meta, "high_precision_qpp": high})


def test_convert_uses_the_high_precision_qpp_when_the_meta_says_so(qat_ir):
    assert qat_ir.meta.get("high_precision_qpp") is False  # export wrote the key (consistency strategy off)
    default, high = convert(_with_qpp(qat_ir, False)), convert(_with_qpp(qat_ir, True))
    assert default.meta["qpp"] == "default" and high.meta["qpp"] == "high_precision"
    d, h = list(_multipliers(default)), list(_multipliers(high))
    assert {op for op, _ in d} >= {"conv2d", "add", "add_const", "sum_int"} and len(d) == len(h)
    assert all(2**15 <= m < 2**16 for _, m in d) and all(2**30 <= m < 2**31 for _, m in h)
    adds = lambda ir: [n.attrs["frac_bits"] for n in ir.graph.nodes if n.op in ("add", "add_const")]  # noqa: E731
    assert adds(default) == [0, 0] and adds(high) == [8, 8]
    # a qat IR without the key (saved before the strategy existed) converts with the default qpp
    meta = {k: v for k, v in qat_ir.meta.items() if k != "high_precision_qpp"}
    old = convert(Module(qat_ir.kind, qat_ir.graph, qat_ir.input_leaves, qat_ir.input_spec, qat_ir.output_spec,
                         meta=meta))
    assert old.meta["qpp"] == "default" and list(_multipliers(old)) == d


def test_both_profiles_stay_within_one_output_step_of_each_other(qat_ir):
    default, high = convert(_with_qpp(qat_ir, False)), convert(_with_qpp(qat_ir, True))
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(9))
    a, b = default(x), high(x)
    assert not torch.equal(a, b)  # the profiles are different arithmetic
    # the final linear keeps int32 (its output steps are tiny): compare relative to the output range
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


def test_saved_quantized_ir_keeps_frac_bits_and_qpp(qat_ir, tmp_path):
    from quantlens.compiler.serialize import load, save

    high = convert(_with_qpp(qat_ir, True))
    save(high, tmp_path / "m.qlir")
    back = load(tmp_path / "m.qlir")
    assert back.meta["qpp"] == "high_precision"
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    assert torch.equal(back(x), high(x))
    assert [n.attrs.get("frac_bits") for n in back.graph.nodes if n.op == "add"] == [8]


# -- §15: the cost model --------------------------------------------------------------------------------------
def test_high_precision_costs_more_than_default_on_the_same_model(qat_ir):
    default, high = convert(_with_qpp(qat_ir, False)), convert(_with_qpp(qat_ir, True))
    d, h = default.latency_estimate(), high.latency_estimate()
    assert isinstance(d, LatencyEstimate) and d == estimate_latency(default, 1)
    assert h.cycles > d.cycles > 0
    assert h.microseconds == pytest.approx(h.cycles / get_march().spec.cost.clock_mhz)
    # a multiplier within 2**-17 of 1 is exactly 1 with 16 bits (free) but not with 31
    assert 0 < d.requantize_ops <= h.requantize_ops and sum(d.by_op.values()) == d.cycles
    assert h.by_op["conv2d"] > d.by_op["conv2d"] and h.by_op["add"] > d.by_op["add"]
    # the batch multiplies the work of every dynamic-batch value
    assert default.latency_estimate(batch=8).cycles > d.cycles
    stats = default.statistics()
    assert stats["requantize_ops"] == d.requantize_ops and stats["estimated_cycles"] == d.cycles
    assert stats["conv2d"] == 2  # the op counts are unchanged
    assert "estimated_cycles" not in qat_ir.statistics()


def test_latency_estimate_of_a_qat_ir_says_convert_first(qat_ir):
    with pytest.raises(QuantLensError, match="convert first"):
        estimate_latency(qat_ir)
    with pytest.raises(QuantLensError, match="convert first"):
        qat_ir.latency_estimate()


def _requant_module(multiplier: int, shift: int, n: int = 4096) -> Module:
    values = {"x": ValueInfo((n,), "int8", "qint8"), "y": ValueInfo((n,), "int8", "qint8")}
    node = Node("requantize", ["x"], ["y"], {"multiplier": [multiplier], "shift": [shift], "out_dtype": "qint8"})
    return Module("quantized", Graph([node], ["x"], ["y"], {}, values), [], "", "")


def test_requantize_cost_identity_free_shift_cheaper_than_multiply():
    cost = get_march().spec.cost
    n = 4096
    identity, identity_hp = estimate_latency(_requant_module(2**15, 15)), estimate_latency(_requant_module(2**30, 30))
    assert identity.cycles == identity_hp.cycles == 0 and identity.requantize_ops == 0
    shift = estimate_latency(_requant_module(2**15, 17))  # 1/4: a rounding shift
    default = estimate_latency(_requant_module(43691, 17))  # 1/3, 16 bits
    high = estimate_latency(_requant_module(1431655765, 32))  # 1/3, 31 bits
    assert (shift.requantize_ops, shift.shift_only_ops) == (1, 1)
    assert (default.requantize_ops, default.shift_only_ops) == (1, 0) and high.requantize_ops == 1
    assert 0 < shift.cycles < default.cycles < high.cycles
    assert shift.cycles == n * cost.requant_passes_shift // cost.vector_lanes
    assert high.cycles == n * cost.requant_passes_high_precision // cost.vector_lanes
    assert [requant_class(*p) for p in [(2**15, 15), (2**30, 31), (3 * 2**14, 14), (2**30 + 1, 31)]] == [
        "identity", "shift", "default", "high_precision"]


def test_identity_add_terms_are_free_with_f0_and_cost_a_shift_with_f8():
    n = 640
    values = {v: ValueInfo((n,), "int8", "qint8") for v in ("a", "b", "y")}

    def add(mults, shifts, frac):
        attrs = {"multipliers": mults, "shifts": shifts, "frac_bits": frac, "out_dtype": "qint8"}
        return Module("quantized", Graph([Node("add", ["a", "b"], ["y"], attrs)], ["a", "b"], ["y"], {}, values),
                      [], "", "")

    cost = get_march().spec.cost
    lanes = cost.vector_lanes
    same = estimate_latency(add([2**15, 2**15], [15, 15], 0))  # both inputs on the output grid: one sum pass
    assert same.requantize_ops == 0 and same.cycles == n // lanes
    same_hp = estimate_latency(add([2**30, 2**30], [30, 30], 8))  # q · 2**8 for both, the sum, the final shift
    assert same_hp.requantize_ops == 0 and same_hp.cycles == n // lanes * (1 + 3 * cost.requant_passes_shift)
    mixed = estimate_latency(add([2**15, 43691], [15, 17], 0))
    assert (mixed.requantize_ops, mixed.shift_only_ops) == (1, 0)
    assert mixed.cycles == n // lanes * (1 + cost.requant_passes_default)
