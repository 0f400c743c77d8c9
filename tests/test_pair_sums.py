"""The chunked float64 sums of a row (profiler/pair_sums.py) against the whole-tensor float64 formulas, on tensors
that span many chunks, end in a partial one, and put one softmax across chunks; and the same sums bit for bit on
every call (no alignment-dependent reduction)."""

import math

import pytest
import torch

from quantlens.profiler.metrics import channel_signal, channel_sqnr, compute_all, get_metric
from quantlens.profiler.pair_sums import ROW_CHUNK, pair_kl, pair_sums, row_sums, split_sums


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x, x + 0.05 * torch.randn(shape, generator=g)


def _kl_reference(x: torch.Tensor, y: torch.Tensor) -> float:
    dim = 1 if x.dim() > 2 else -1
    lp, lq = torch.log_softmax(x.double(), dim), torch.log_softmax(y.double(), dim)
    return float((lp.exp() * (lp - lq)).sum(dim).mean())


@pytest.mark.parametrize("shape", [(3, 5, 67, 71), (2 * ROW_CHUNK + 17,), (5, ROW_CHUNK + 3), (2, 7, ROW_CHUNK // 3)])
def test_chunked_sums_are_the_whole_tensor_formulas(shape):
    x, y = _pair(shape)
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    s = pair_sums(x, y)
    assert s.count == x.numel()
    for got, want in ((s.xx, xd @ xd), (s.yy, yd @ yd), (s.xy, xd @ yd), (s.dd, ((xd - yd) ** 2).sum()),
                      (s.ad, (xd - yd).abs().sum())):
        assert got == pytest.approx(float(want), rel=1e-12)
    assert s.amax == float((xd - yd).abs().max())  # a maximum is exact
    assert pair_kl(x, y) == pytest.approx(_kl_reference(x, y), rel=1e-10)
    values = compute_all(x, y)
    assert values["SQNR"] == pytest.approx(float(20 * torch.log10(xd.norm() / (xd - yd).norm())), rel=1e-12)
    assert values["Cosine"] == pytest.approx(float(xd @ yd / (xd.norm() * yd.norm())), rel=1e-12)
    assert values["MSE"] == pytest.approx(float(((xd - yd) ** 2).mean()), rel=1e-12)
    assert get_metric("KL")(x, y) == values["KL"]
    # the same sums on every call, whatever memory the buffers and the tensors lie in
    assert pair_sums(x.clone(), y.clone()) == s


@pytest.mark.parametrize("shape", [(300, 384), (64, 10), (1, 7), (ROW_CHUNK // 8 + 3, 8)])
def test_the_kl_of_a_2d_tensor_is_taken_over_its_last_dim(shape):
    """A 2-D tensor's softmax runs over its last dim, taken as a 2-D view (a 3-D block with a last dim of 1 took
    7x as long); several rows per block, one, and a row count past a chunk."""
    x, y = _pair(shape, seed=3)
    assert pair_kl(x, y) == pytest.approx(_kl_reference(x, y), rel=1e-10)


def test_a_softmax_larger_than_a_chunk():
    x, y = _pair((2, ROW_CHUNK + 9, 3))  # 2 outer rows, the softmax over ROW_CHUNK + 9 channels
    assert pair_kl(x, y) == pytest.approx(_kl_reference(x, y), rel=1e-10)


def test_split_sums_put_saturated_elements_in_the_clipping_part_only():
    x, p = _pair((4, ROW_CHUNK // 2 + 5))
    scale = 0.02
    high, low = 127.5 * scale, -128.5 * scale
    y = torch.clamp(torch.round(p / scale), -128, 127) * scale
    s = split_sums(x, p, y, low, high)
    xd, pd, yd = x.double(), p.double(), y.double()
    clip = (pd > high) | (pd < low)
    assert clip.any() and not clip.all()
    assert s.inner == pytest.approx(float(((xd - pd) ** 2).sum()), rel=1e-12)
    assert s.clipped == pytest.approx(float(((pd - yd) ** 2)[clip].sum()), rel=1e-12)
    assert s.rounded == pytest.approx(float(((pd - yd) ** 2)[~clip].sum()), rel=1e-12)
    unbounded = split_sums(x, p, y)
    assert unbounded.clipped == 0.0 and unbounded.rounded == pytest.approx(s.clipped + s.rounded, rel=1e-12)


@pytest.mark.parametrize("shape, axis", [((3, 8, 70, 90), 1), ((ROW_CHUNK // 4 + 7, 12), 1), ((2, 3, ROW_CHUNK + 1), 1)])
def test_channel_sqnr_is_the_per_channel_formula(shape, axis):
    x, y = _pair(shape, seed=1)
    xd, yd = x.double().movedim(axis, 0).reshape(shape[axis], -1), y.double().movedim(axis, 0).reshape(shape[axis], -1)
    want = 10 * torch.log10((xd ** 2).sum(1) / ((xd - yd) ** 2).sum(1))
    assert torch.allclose(channel_sqnr(x, y, axis), want, rtol=1e-12, atol=0)
    assert torch.allclose(channel_signal(x, axis), (xd ** 2).sum(1), rtol=1e-12, atol=0)


def test_identical_and_empty_pairs():
    x, _ = _pair((4, 9))
    values = compute_all(x, x.clone())
    assert values["SQNR"] == math.inf and values["MSE"] == 0.0 and values["Atol"] == 0.0 and values["KL"] == 0.0
    assert values["Cosine"] == pytest.approx(1.0, rel=1e-15)
    empty = compute_all(torch.empty(0, 3), torch.empty(0, 3))
    assert empty["MSE"] == 0.0 and empty["Atol"] == 0.0 and empty["Cosine"] == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_are_converted_chunk_by_chunk(dtype):
    x, y = _pair((3, 4, ROW_CHUNK // 5))
    x, y = x.to(dtype), y.to(dtype)
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    s = pair_sums(x, y)
    assert s.dd == pytest.approx(float(((xd - yd) ** 2).sum()), rel=1e-12)
    assert s.amax == float((xd - yd).abs().max())
    assert compute_all(x, y)["KL"] == pytest.approx(_kl_reference(x, y), rel=1e-10)
    assert torch.allclose(channel_sqnr(x, y, 1), channel_sqnr(x.double(), y.double(), 1), rtol=1e-12, atol=0)


def test_empty_channel_blocks():
    from quantlens.profiler.pair_sums import blocks

    assert list(blocks((2, 8, 0))) == [] and list(blocks((0, 8, 5))) == []
    assert channel_signal(torch.empty(2, 8, 0), 1).tolist() == [0.0] * 8
    assert compute_all(torch.empty(2, 8, 0), torch.empty(2, 8, 0))["KL"] == 0.0


def _fq(p: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.clamp(torch.round(p / scale), -128, 127) * scale


# (shape, channel axis): channels in the middle, channels last (a linear's output), one position's channels larger
# than a chunk, no axis, a partial last block
@pytest.mark.parametrize("shape,axis", [((3, 5, 67, 71), 1), ((9, 11, 3001), 2), ((2, ROW_CHUNK + 9, 3), 1),
                                        ((2 * ROW_CHUNK + 17,), None), ((4, 7, 1), 1)])
@pytest.mark.parametrize("saturation", ["none", "some blocks", "most elements"])
def test_one_pass_row_sums_equal_the_separate_functions(shape, axis, saturation):
    """The fused pass (compare's fast path) against each figure's own function (its exact path), on every block
    layout: pairs, channel energies and the error split, to 1e-12; the same bits on every call."""
    x, y = _pair(shape, seed=1)
    g = torch.Generator().manual_seed(2)
    p = x + 0.01 * torch.randn(shape, generator=g)
    scale = {"none": 1.0, "some blocks": 0.02, "most elements": 0.001}[saturation]
    if saturation == "some blocks":  # only the first block reaches past the grid
        p = p.clone()
        p.reshape(-1)[:50] *= 100
    s = _fq(p, scale)
    low, high = -128.5 * scale, 127.5 * scale
    r = row_sums(x, [y, s, p], axis, frozenset({2}), (2, 1, low, high))
    for got, want in ((r.pairs[0], pair_sums(x, y)), (r.pairs[1], pair_sums(x, s))):
        for field in ("xx", "yy", "xy", "dd", "ad"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-12), field
        assert got.amax == want.amax and got.count == want.count
    assert r.pairs[2].dd == pytest.approx(pair_sums(x, p).dd, rel=1e-12)
    assert math.isnan(r.pairs[2].xy)  # (not computed: a pair that only needs its squared difference)
    split = split_sums(x, p, s, low, high)
    assert (r.split.clipped > 0) == (saturation != "none")
    for field in ("inner", "clipped", "rounded"):
        assert getattr(r.split, field) == pytest.approx(getattr(split, field), rel=1e-12, abs=1e-300), field
    if axis is None:
        assert r.signal is None and r.noise is None
    else:
        assert torch.allclose(r.signal, channel_signal(x, axis), rtol=1e-12, atol=0)
        for i, t in enumerate((y, s, p)):
            assert torch.allclose(10 * torch.log10(r.signal / r.noise[i]), channel_sqnr(x, t, axis, finite=True),
                                  rtol=1e-12, atol=0)
    again = row_sums(x.clone(), [y.clone(), s.clone(), p.clone()], axis, frozenset({2}), (2, 1, low, high))
    assert again.pairs == r.pairs and again.split == r.split


def test_the_split_keeps_a_small_rounding_part_next_to_a_large_clipping_one():
    """Where clipping dominates, the rounding part is summed on its own, not as total - clipping."""
    x = torch.zeros(3 * ROW_CHUNK)
    p = torch.full((3 * ROW_CHUNK,), 0.0011)
    p[::7] = 50.0  # far past the grid: clipping errors of ~2500 each
    s = _fq(p, 0.001)
    r = row_sums(x, [s, p], None, frozenset({1}), (1, 0, -128.5e-3, 127.5e-3))
    want = split_sums(x, p, s, -128.5e-3, 127.5e-3)
    assert r.split.clipped > 1e6 * r.split.rounded > 0
    assert r.split.rounded == pytest.approx(want.rounded, rel=1e-12)
