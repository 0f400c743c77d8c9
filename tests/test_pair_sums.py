"""The chunked float64 sums of a row (profiler/pair_sums.py) against the whole-tensor float64 formulas, on tensors
that span many chunks, end in a partial one, and put one softmax across chunks; and the same sums bit for bit on
every call (no alignment-dependent reduction)."""

import math

import pytest
import torch

from quantlens.profiler.metrics import channel_signal, channel_sqnr, compute_all, get_metric
from quantlens.profiler.pair_sums import ROW_CHUNK, pair_kl, pair_sums, split_sums


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
