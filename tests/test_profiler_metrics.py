"""The profiler's metric registry: hand-computed values, worst-first ordering, errors."""

import math

import pytest
import torch

from quantlens import QuantLensError
from quantlens.profiler.metrics import METRICS, custom_metric, get_metric, in_scale_units

X = torch.tensor([1.0, 2.0, -2.0, 0.0])
Y = torch.tensor([1.0, 1.0, -2.0, 1.0])  # differences 0, 1, 0, -1


def test_registry_has_the_six_metrics():
    assert list(METRICS) == ["Cosine", "MSE", "L1", "KL", "SQNR", "Atol"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("MSE", 0.5),  # (0 + 1 + 0 + 1) / 4
        ("L1", 0.5),
        ("Atol", 1.0),
        ("Cosine", 7.0 / (3.0 * math.sqrt(7.0))),  # <x,y> = 1+2+4+0 = 7; |x| = 3; |y| = sqrt(7)
        ("SQNR", 20 * math.log10(3.0 / math.sqrt(2.0))),  # |x| = 3, |x-y| = sqrt(2)
    ],
)
def test_metric_values_by_hand(name, expected):
    assert get_metric(name)(X, Y) == pytest.approx(expected, rel=1e-12)


def test_kl_matches_the_definition_over_dim1_for_4d():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    p, q = torch.softmax(x.double(), 1), torch.softmax(y.double(), 1)
    expected = float((p * (p.log() - q.log())).sum(1).mean())
    assert get_metric("KL")(x, y) == pytest.approx(expected, rel=1e-10)
    assert get_metric("KL")(x, x) == pytest.approx(0.0, abs=1e-12)


def test_identical_and_zero_tensors():
    assert get_metric("SQNR")(X, X) == math.inf
    assert get_metric("Cosine")(torch.zeros(3), torch.zeros(3)) == 1.0
    assert get_metric("Cosine")(torch.zeros(3), torch.ones(3)) == 0.0


def test_nonfinite_gives_nan_and_nan_is_worst():
    y = Y.clone()
    y[0] = float("nan")
    l1 = get_metric("L1")
    assert math.isnan(l1(X, y))
    assert l1.worse(math.nan, 100.0) and not l1.worse(100.0, math.nan)
    cos = get_metric("cosine")  # case-insensitive
    assert cos.worse(0.5, 0.9) and not cos.worse(0.9, 0.5)
    assert sorted([0.9, 0.1, math.nan], key=cos.sort_key)[1:] == [0.1, 0.9]


def test_unknown_metric_and_shape_mismatch_are_clear_errors():
    with pytest.raises(QuantLensError, match=r"Unknown metric 'L3'.*Cosine"):
        get_metric("L3")
    with pytest.raises(QuantLensError, match="shapes differ"):
        get_metric("L1")(torch.zeros(3), torch.zeros(4))


def test_custom_metric_order():
    m = custom_metric(lambda a, b: (a - b).abs().sum(), "descending")
    assert m(X, Y) == 2.0 and m.higher_is_worse
    assert not custom_metric(lambda a, b: 0.0, "ascending").higher_is_worse
    with pytest.raises(QuantLensError, match="'descending'.*'ascending'"):
        custom_metric(lambda a, b: 0.0, "up")


def test_in_scale_units():
    assert in_scale_units(0.5, 0.25) == 2.0
    assert in_scale_units(0.5, None) is None
