"""The integer simulator's speed paths (issue #11 item 4) against exact integer references, on values just inside
and just outside each bound where a fast path is taken; and the quantized IR of every zoo model against the
level-4 consistency model (bit-equal)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import quantlens.zoo as zoo
from quantlens.compiler import convert, export
from quantlens.compiler.ir import Node
from quantlens.compiler.kernels_int import INT_KERNELS, _table_kernel, int_dispatch
from quantlens.errors import QuantLensError
from quantlens.kernels import TABLE_OP_IO, bit_length, lut256_lookup, rshift_rhe_var
from quantlens.march import QuantDType
from quantlens.march.numerics import (
    apply_requantize,
    requantize,
    requantize_params,
    rescaled_sum,
    rshift_round_half_to_even,
)
from quantlens.quantization import ConsistencyStrategy, calibrate, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)


# -- exact references (Python integers) ----------------------------------------------------------------------
def _rhe(x: int, k: int) -> int:
    if k == 0:
        return x
    f, r = x >> k, x & ((1 << k) - 1)
    h = 1 << (k - 1)
    return f + (1 if r > h or (r == h and f & 1) else 0)


def _sat(v: int, dtype: QuantDType) -> int:
    return min(max(v, dtype.qmin), dtype.qmax)


def _near(limit: int) -> list[int]:
    """Values around ``limit``: just inside and just outside, both signs, plus ties of small shifts."""
    out = []
    for base in (limit - 1, limit, limit + 1, limit - 2**10 - 2**9, limit // 2 + 2**20 + 1):
        out += [base, -base]
    return out


# -- rshift: float path and short formula --------------------------------------------------------------------
@pytest.mark.parametrize("shift", [1, 2, 7, 15, 31, 45, 61, 62])
def test_rshift_with_a_bound_matches_integer_rounding(shift):
    values = _near(2**53) + _near(2**62 - 2**40) + [(2 * j + 1) << (shift - 1) for j in range(-4, 4)] + [0, 1, -1]
    values = [v for v in values if abs(v) <= 2**62]
    x = torch.tensor(values, dtype=torch.int64)
    want = [_rhe(v, shift) for v in values]
    assert rshift_round_half_to_even(x, shift).tolist() == want  # no bound: the reference path
    assert rshift_round_half_to_even(x, shift, bound=2**62).tolist() == want  # short formula
    small = [v for v in values if abs(v) < 2**53]
    xs = torch.tensor(small, dtype=torch.int64)
    assert rshift_round_half_to_even(xs, shift, bound=2**53 - 1).tolist() == [_rhe(v, shift) for v in small]
    per_elem = torch.full_like(xs, shift)
    assert rshift_rhe_var(xs, per_elem, bound=2**53 - 1).tolist() == [_rhe(v, shift) for v in small]


# -- requantize: static bound, data bound, saturation --------------------------------------------------------
@pytest.mark.parametrize("mult,shift", [(46341, 16), (65535, 30), (2**30 + 12345, 31), (2**31 - 1, 53)])
@pytest.mark.parametrize("dtype", [QuantDType.qint8, QuantDType.qint16])
def test_requantize_fast_path_at_its_bound(mult, shift, dtype):
    limit = 2 ** (53 - mult.bit_length())  # the fast path needs |acc| < limit
    values = [v for v in _near(limit) + _near(2**31) if abs(v) <= 2**31] + list(range(-5, 6))
    values += [(2 * j + 1) * (1 << (shift - 1)) // mult for j in range(-3, 3)]  # near ties
    acc = torch.tensor(values, dtype=torch.int64)
    want = [_sat(_rhe(v * mult, shift), dtype) for v in values]
    assert requantize(acc, mult, shift, dtype).tolist() == want
    assert requantize(acc.to(torch.float64), mult, shift, dtype).tolist() == want
    p = requantize_params(mult, shift, dtype)
    assert apply_requantize(acc, p, bound=float(2**31), storage=dtype_storage(dtype)).tolist() == want
    inside = torch.tensor([v for v in values if abs(v) < limit], dtype=torch.int64)
    want_in = [_sat(_rhe(v * mult, shift), dtype) for v in inside.tolist()]
    assert apply_requantize(inside.to(torch.float64), p, bound=float(limit - 1), consume=True).tolist() == want_in


@pytest.mark.parametrize("mult,shift", [(46341, 16), (65535, 30), (2**23 - 1, 31), (2**30 + 12345, 31)])
@pytest.mark.parametrize("dtype", [QuantDType.qint8, QuantDType.qint16])
def test_requantize_float32_path_at_its_bound(mult, shift, dtype):
    """Below 2**(24 - bitlen(M)) the product acc · M·2**-shift is exact in float32: at the bound, at ties and at
    saturation the integer rule's bits, per tensor and per channel (one channel's multiplier past 2**24 / |acc|
    sends the whole call to float64)."""
    limit = 2 ** max(0, 24 - mult.bit_length())
    values = [v for v in _near(limit) if abs(v) < limit] + list(range(-3, 4))
    values += [(2 * j + 1) * (1 << (shift - 1)) // mult for j in range(-3, 3)]  # near ties
    values = [v for v in values if abs(v) < limit]
    acc = torch.tensor(values, dtype=torch.float32)
    p = requantize_params(mult, shift, dtype)
    assert p.exact_bound32 == limit and (p.real32 is not None) == (mult < 2**24)  # (else float64)
    # trailing zeros do not count: M = mult * 2**6 (shift + 6) has the same bound and the same results
    p6 = requantize_params(mult << 6, shift + 6, dtype)
    assert p6.exact_bound32 == limit
    assert apply_requantize(acc, p6, bound=float(limit - 1), storage=dtype_storage(dtype)).tolist() == \
        [_sat(_rhe(v * mult, shift), dtype) for v in values]
    want = [_sat(_rhe(v * mult, shift), dtype) for v in values]
    assert apply_requantize(acc, p, bound=float(limit - 1), storage=dtype_storage(dtype)).tolist() == want
    # per channel: two channels, the second's multiplier 4x the first's (its bound a quarter)
    mults = torch.tensor([mult, min(4 * mult, 2**31 - 1)]).reshape(1, 2)
    pc = requantize_params(mults, torch.tensor([shift, shift + 2]).reshape(1, 2), dtype)
    acc2 = torch.stack([acc, acc], dim=1)
    want2 = [[_sat(_rhe(v * int(m), sh), dtype) for m, sh in zip(mults[0].tolist(), (shift, shift + 2))]
             for v in values]
    assert apply_requantize(acc2, pc, bound=float(limit - 1), storage=dtype_storage(dtype)).tolist() == want2


def test_requantize_of_a_large_accumulator_reuses_its_scratch_but_not_its_results():
    """A float32 GEMM output of 2 MB and more is requantized in a reused float64 buffer: each result is its own
    tensor (the buffer is written again by the next call) and equals the integer path near the fast path's
    bound and at ties."""
    mult, shift, dtype = 2**30 + 12345, 31, QuantDType.qint8
    limit = 2 ** (53 - mult.bit_length())
    p = requantize_params(mult, shift, dtype)
    g = torch.Generator().manual_seed(0)
    accs = [torch.randint(-(limit - 1), limit, (4, 64, 32, 32), generator=g).to(torch.float32) for _ in range(2)]
    accs[0].view(-1)[:8] = torch.tensor([limit - 1, -(limit - 1), 0, 1, -1, 2**20, 2**21 - 3, -(2**21)],
                                        dtype=torch.float32)
    accs[0].view(-1)[8:14] = torch.tensor([(2 * j + 1) * (1 << (shift - 1)) // mult for j in range(-3, 3)],
                                          dtype=torch.float32)  # near ties
    outs = [apply_requantize(a, p, bound=float(limit - 1), storage=torch.int8) for a in accs]
    for a, out in zip(accs, outs):  # against Python integers (the int64 library path takes the same fast path)
        want = [_sat(_rhe(v * mult, shift), dtype) for v in a.to(torch.int64).view(-1).tolist()]
        assert out.dtype == torch.int8 and out.view(-1).tolist() == want
    assert outs[0].data_ptr() != outs[1].data_ptr()


def dtype_storage(dtype: QuantDType) -> torch.dtype:
    return {QuantDType.qint8: torch.int8, QuantDType.qint16: torch.int16}[dtype]


def test_per_channel_requantize_matches_integer_rounding():
    mult = torch.tensor([46341, 2**30 + 7, 33000]).reshape(1, 3, 1)
    shift = torch.tensor([17, 37, 16]).reshape(1, 3, 1)
    rng = random.Random(0)
    vals = [[[rng.choice([-1, 1]) * rng.randrange(2**31) for _ in range(5)] for _ in range(3)] for _ in range(2)]
    acc = torch.tensor(vals, dtype=torch.int64)
    got = requantize(acc, mult, shift, QuantDType.qint16)
    want = [[[_sat(_rhe(v * int(mult[0, c, 0]), int(shift[0, c, 0])), QuantDType.qint16) for v in row]
              for c, row in enumerate(b)] for b in vals]
    assert got.tolist() == want


# -- rescaled_sum: the storage-type bound ---------------------------------------------------------------------
@pytest.mark.parametrize("frac", [0, 8])
@pytest.mark.parametrize("storage", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_rescaled_sum_fast_path_matches_integer_rule(frac, storage):
    info = {torch.int8: (-128, 127), torch.int16: (-32768, 32767), torch.int32: (-(2**31), 2**31 - 1),
            torch.int64: (-(2**31), 2**31 - 1)}[storage]
    values = [info[0], info[0] + 1, -1, 0, 1, info[1] - 1, info[1]]
    if storage == torch.int64:
        values += [2**22 - 1, 2**22, -(2**22), 2**22 + 1]  # around _exact_bound of a 31-bit multiplier
    for mult in (45989, 2**30 + 3):
        for shift in (frac + 1, 20, 36):
            qa = torch.tensor(values, dtype=storage)
            qb = torch.tensor(list(reversed(values)), dtype=storage)
            got = rescaled_sum([(qa, mult, shift, 1), (qb, 34730, 16, -1)], 5 << frac, QuantDType.qint16, frac)
            want = []
            for a, b in zip(values, reversed(values)):
                ta = max(min(_rhe(a * mult, shift - frac), 2**31 - 1), -(2**31))
                tb = max(min(_rhe(b * 34730, 16 - frac), 2**31 - 1), -(2**31))
                want.append(_sat(_rhe(ta - tb + (5 << frac), frac), QuantDType.qint16))
            assert got.tolist() == want, (mult, shift)


@pytest.mark.parametrize("frac", [0, 8])
def test_rescaled_sum_float32_path_at_its_bounds(frac):
    """float32 where every storage-type bound |q|·M' (M' = M without its trailing zeros) and the sum of the
    rounded terms stay below 2**24: around both limits (M = 511 and 513 on int16: 32768·M just below and above
    2**24; M = 2**15, an unchanged scale, one significant bit; the sum of two terms just below and above 2**24), at
    the extremes and at ties, the integer rule's bits, and the dtype each side computes in."""
    from quantlens.march.numerics import _rescale_dtype

    q16 = [-32768, -32767, -2, -1, 0, 1, 2, 3, 5, 32766, 32767]
    cases = [(511, frac + 1, torch.float32), (513, frac + 1, torch.float64),  # one term's |q·M|
             (2**15, frac + 15, torch.float32),  # (M's trailing zeros: a power-of-two scaling)
             (511, frac, torch.float64),  # the sum of two terms (2 · 32768 · 511) passes 2**24
             (255, frac, torch.float32)]  # and here stays below it
    for mult, shift, work in cases:
        qa = torch.tensor(q16, dtype=torch.int16)
        qb = torch.tensor(list(reversed(q16)), dtype=torch.int16)
        terms = [(qa, mult, shift, 1), (qb, mult, shift, -1 if mult == 255 else 1)]
        assert _rescale_dtype(terms, 3, frac) == work, (mult, shift)
        got = rescaled_sum(terms, 3, QuantDType.qint16, frac, storage=torch.int16)
        want = []
        for a, b in zip(q16, reversed(q16)):
            ta = max(min(_rhe(a * mult, shift - frac), 2**31 - 1), -(2**31))
            tb = max(min(_rhe(b * mult, shift - frac), 2**31 - 1), -(2**31))
            want.append(_sat(_rhe(ta + (-tb if mult == 255 else tb) + 3, frac), QuantDType.qint16))
        assert got.dtype == torch.int16 and got.tolist() == want, (mult, shift)
    # int8 inputs with 16-bit multipliers, the simulator's usual add: float32
    q8 = torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8)
    assert _rescale_dtype([(q8, 65535, 16, 1), (q8, 65535, 16, -1)], 0, 0) == torch.float32


def test_rescaled_sum_broadcasts_like_before():
    a = torch.randint(-128, 128, (4, 3), dtype=torch.int8)
    b = torch.randint(-128, 128, (3,), dtype=torch.int8)
    y1 = rescaled_sum([(a, 40000, 16, 1), (b, 50000, 16, 1)], 0, QuantDType.qint8, 0)
    y2 = rescaled_sum([(b, 50000, 16, 1), (a, 40000, 16, 1)], 0, QuantDType.qint8, 0)
    assert y1.shape == (4, 3) and torch.equal(y1, y2)


# -- bit_length: frexp below 2**53 ----------------------------------------------------------------------------
def test_bit_length_around_two_to_the_53():
    values = [0, 1, 2, 3, 2**23 - 1, 2**23, 2**52, 2**53 - 1, 2**53, 2**53 + 1, 2**62 - 1, 2**62]
    assert bit_length(torch.tensor(values)).tolist() == [v.bit_length() for v in values]
    below = [v for v in values if v < 2**53]
    assert bit_length(torch.tensor(below)).tolist() == [v.bit_length() for v in below]


# -- GEMMs: float32 only while every partial sum stays below 2**24 --------------------------------------------
def _linear_node(mult, shift, qdtype="qint8"):
    return Node("linear", ["x", "w", "b"], ["y"], {"multiplier": mult, "shift": shift, "out_dtype": qdtype})


@pytest.mark.parametrize("bias_value", [2**24 - 16 * 127 * 128 - 1, 2**24 - 16 * 127 * 128, 2**24 + 3, 2**30])
def test_linear_float32_choice_at_the_two_to_the_24_bound(bias_value):
    w = torch.full((2, 16), 127, dtype=torch.int8)
    w[1] = -128
    x = torch.tensor([[127] * 16, [-128] * 16, [-128, 127] * 8], dtype=torch.int8)
    b = torch.tensor([bias_value, -bias_value + 1], dtype=torch.int32)
    node = _linear_node([40000, 50001], [31, 30], "qint16")
    y = int_dispatch(node, [x, w, b])
    acc = x.to(torch.int64) @ w.to(torch.int64).t() + b.to(torch.int64)
    want = [[_sat(_rhe(max(min(int(a), 2**31 - 1), -(2**31)) * m, s), QuantDType.qint16)
             for a, m, s in zip(row, (40000, 50001), (31, 30))] for row in acc.tolist()]
    assert y.tolist() == want and y.dtype == torch.int16
    # the cache follows the node's attrs and its weight tensors
    node.attrs["multiplier"] = [40000, 40000]
    want2 = [[_sat(_rhe(max(min(int(a), 2**31 - 1), -(2**31)) * 40000, s), QuantDType.qint16)
              for a, s in zip(row, (31, 30))] for row in acc.tolist()]
    assert int_dispatch(node, [x, w, b]).tolist() == want2
    w.mul_(0)
    assert int_dispatch(node, [x, w, b]).tolist() == [
        [_sat(_rhe(int(v) * 40000, s), QuantDType.qint16) for v, s in zip(b.tolist(), (31, 30))]] * 3


# -- lut: the storage-type range check ------------------------------------------------------------------------
def test_lut_range_check_is_kept_for_wider_codes():
    entries = torch.arange(256) * 3
    q = torch.tensor([-128, -1, 0, 127], dtype=torch.int8)
    assert lut256_lookup(q, entries).tolist() == [0, 381, 384, 765]
    assert lut256_lookup(q.to(torch.int64), entries).tolist() == [0, 381, 384, 765]
    with pytest.raises(QuantLensError):
        lut256_lookup(torch.tensor([128]), entries)
    with pytest.raises(QuantLensError):
        lut256_lookup(torch.tensor([-1]), entries, offset=0)


# -- zoo models -------------------------------------------------------------------------------------------------
SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}


def _build(name, setter, level):
    batches = zoo.sample_batches(name, 5, 16)
    ConsistencyStrategy.set_consistency_level(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = calibrate(prepare(zoo.get_model(name), batches[0], SETTERS[setter], check_result_dir=None),
                              batches[:3])
            qir = convert(export(model, batches[0]))
    finally:
        ConsistencyStrategy.disable()
    return model, qir, batches[3:]


@pytest.mark.parametrize("setter", ["int8", "w8a16"])
@pytest.mark.parametrize("name", zoo.list_models())
def test_zoo_quantized_ir_equals_the_level_4_model_and_the_reference_table_path(name, setter):
    model, qir, held_out = _build(name, setter, 4)
    for args in held_out:
        with torch.no_grad():
            ref = pytree.tree_leaves(model(*args))
        out = pytree.tree_leaves(qir(*args))
        assert all(torch.equal(r, o) for r, o in zip(ref, out) if isinstance(r, torch.Tensor))
        out_again = pytree.tree_leaves(qir(*args))  # the prepared caches give the same result on a second run
        assert all(torch.equal(a, b) for a, b in zip(out, out_again) if isinstance(a, torch.Tensor))
    # every table node: the direct integer kernel equals the custom-op path (quantize, kernel, dequantize)
    seen = []
    qir.run(qir.feeds(*held_out[0]), lambda node, inputs, outs: seen.append((node, list(inputs), outs)))
    for node, inputs, outs in seen:
        if node.op in TABLE_OP_IO:
            assert INT_KERNELS[node.op] is not _table_kernel
            reference = _table_kernel(node, inputs)
            assert torch.equal(reference, outs[0]) and reference.dtype == outs[0].dtype, node.op


# -- int_softmax / int_layer_norm float64 paths (issue #11 item 4) -------------------------------------------
def test_mantissa_lookup_matches_the_segmented_lookup():
    from quantlens.kernels.int_ops import mantissa_lookup
    from quantlens.kernels.tables import recip_mantissa_table, rsqrt_mantissa_table

    for table in (recip_mantissa_table(), rsqrt_mantissa_table()):
        lo, hi = table.domain
        edges = [int(b) for b in table.bounds] + [lo + (j << 13) for j in range(0, 2048, 7)]
        m = torch.tensor(sorted({min(max(e + d, lo), hi) for e in edges for d in range(-3, 4)}
                                | {lo + (j << 12) for j in range(0, (hi - lo) >> 12)}), dtype=torch.int64)
        m = torch.cat([m, torch.randint(lo, hi + 1, (20000,), generator=torch.Generator().manual_seed(3))])
        assert torch.equal(mantissa_lookup(table, m), table.lookup(m))


@pytest.mark.parametrize("shift", [1, 31, 53, 62])
def test_softmax_requantize_at_its_bound(shift):
    from quantlens.kernels.int_ops import _SOFTMAX_T_BOUND, _softmax_requantize

    values = [v for v in _near(_SOFTMAX_T_BOUND - 1) + _near(2**31) + list(range(0, 6)) if 0 <= v < _SOFTMAX_T_BOUND]
    for mult in (2**31 - 1, 2**30, 1141488430):
        ties = [((2 * j + 1) << (shift - 1)) // mult for j in range(0, 4)]  # near ties
        values_ties = values + [v + d for v in ties for d in (0, 1) if v + d < _SOFTMAX_T_BOUND]
        t = torch.tensor(values_ties, dtype=torch.int64)
        for dtype in (QuantDType.qint8, QuantDType.qint16):
            want = [_sat(_rhe(v * mult, shift), dtype) for v in values_ties]
            assert _softmax_requantize(t.clone(), mult, shift, dtype).tolist() == want


@pytest.mark.parametrize("in_dtype", [QuantDType.qint8, QuantDType.qint16])
def test_int_softmax_float_path_matches_int64_codes(in_dtype):
    from quantlens.kernels.int_ops import int_softmax, softmax_exp_table, softmax_multiplier

    g = torch.Generator().manual_seed(5)
    lo, hi = in_dtype.qmin, in_dtype.qmax
    q = torch.randint(lo, hi + 1, (6, 3, 40), generator=g)
    q[0, 0] = lo
    q[0, 0, 7] = hi  # one dominant element: t close to 2**31
    q[0, 1] = hi  # uniform row
    q[0, 2, :20] = hi  # half and half
    storage = torch.int8 if in_dtype is QuantDType.qint8 else torch.int16
    for out_dtype in (QuantDType.qint8, QuantDType.qint16):
        table = softmax_exp_table(0.05 if in_dtype is QuantDType.qint8 else 0.0005, in_dtype, out_dtype)
        for s_out in (1 / 255, 1 / 32767, 2.0**-7):
            mult, shift = softmax_multiplier(s_out)
            fast = int_softmax(q.to(storage), -1, table, mult, shift, out_dtype)
            ref = int_softmax(q.to(torch.int64), -1, table, mult, shift, out_dtype)
            assert torch.equal(fast, ref)


@pytest.mark.parametrize("in_dtype,n", [(QuantDType.qint8, 32), (QuantDType.qint8, 1 << 10),
                                        (QuantDType.qint16, 16), (QuantDType.qint16, 32), (QuantDType.qint16, 64)])
def test_int_layer_norm_float_path_at_its_bound(in_dtype, n):
    """int8/int16 codes take the float64 path when n * 2**(2 * (bits + P)) + eps_term < 2**53; int64 codes always
    take the int64 path: both agree on both sides of the bound (eps_term chosen just inside and just outside)."""
    from quantlens.kernels.int_ops import int_layer_norm, layer_norm_constants

    g = torch.Generator().manual_seed(n)
    lo, hi = in_dtype.qmin, in_dtype.qmax
    q = torch.randint(lo, hi + 1, (5, n), generator=g)
    q[0] = lo
    q[1, ::2], q[1, 1::2] = lo, hi  # the largest |c| and sum(c**2)
    q[2] = hi
    q[3, 0] = hi
    q[3, 1:] = lo
    storage = torch.int8 if in_dtype is QuantDType.qint8 else torch.int16
    gamma = torch.randn(n, generator=g)
    beta = torch.randn(n, generator=g)
    for out_dtype in (QuantDType.qint8, QuantDType.qint16):
        c = layer_norm_constants(0.02, 0.05, in_dtype, n, gamma, beta, 1e-5)
        limit = (1 << 53) - n * (1 << (2 * (in_dtype.bits + c.frac_bits)))
        for eps_term in (c.eps_term, 0, 1, limit - 1, limit, limit + 1, 2**61):
            if eps_term < 0:
                continue
            args = (1, c.gain, c.bias, eps_term, c.frac_bits, c.shift, out_dtype)
            fast = int_layer_norm(q.to(storage), *args)
            ref = int_layer_norm(q.to(torch.int64), *args)
            assert torch.equal(fast, ref), eps_term


def test_broadcast_shape_helper_matches_torch():
    """numerics' shape helper (the requantize and add fast paths choose in-place updates by it) agrees with
    torch.broadcast_shapes, and refuses what torch refuses."""
    from quantlens.march.numerics import _broadcast_shape

    pairs = [((2, 3), (2, 3)), ((2, 1, 4), (3, 1)), ((1,), (5, 4)), ((), (2, 2)), ((4, 1), ()),
             ((1, 32, 1, 1), (8, 32, 5, 5)), ((8, 32, 5, 5), (32, 1, 1))]
    for a, b in pairs:
        assert _broadcast_shape(torch.Size(a), torch.Size(b)) == tuple(torch.broadcast_shapes(a, b)), (a, b)
    with pytest.raises(RuntimeError):
        _broadcast_shape(torch.Size((2, 3)), torch.Size((4, 3)))


@pytest.mark.parametrize("shape", [(), (1,), (7,), (2, 3, 4)])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.int64, torch.float64])
def test_requantize_fast_path_keeps_shape_and_dtype_rules(shape, acc_dtype):
    """The float64 fast path (float32 / int64 / float64 accumulators, small and through the reused buffer) gives the
    shape and values of the integer rule, 0-dim accumulators included."""
    mult, shift, dtype = 46341, 16, QuantDType.qint8
    g = torch.Generator().manual_seed(len(shape))
    acc = torch.randint(-3000, 3000, shape, generator=g).to(acc_dtype)
    p = requantize_params(mult, shift, dtype)
    out = apply_requantize(acc, p, bound=3000.0, storage=torch.int8)
    want = [_sat(_rhe(int(v) * mult, shift), dtype) for v in acc.reshape(-1).tolist()]
    assert out.shape == acc.shape and out.dtype == torch.int8 and out.reshape(-1).tolist() == want
