"""Observers: hand-computed scales, non-finite handling, state dicts and factories."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, get_march
from quantlens.quantization.observers import (
    FixedScaleObserver,
    MinMaxObserver,
    MSEObserver,
    Observer,
    PercentileObserver,
)

I8, I16 = QuantDType.qint8, QuantDType.qint16
MIN_SCALE = 2.0**-24


def f32(value: float) -> torch.Tensor:
    """A hand-computed value rounded to float32, the way scales are stored."""
    return torch.tensor(value, dtype=torch.float32)


# --- MinMax ------------------------------------------------------------------------------------------------------


def test_minmax_running_range_over_two_batches_int8():
    obs = MinMaxObserver(I8)
    obs(torch.tensor([-1.0, 0.5]))
    obs(torch.tensor([-0.25, 2.54]))
    lo, hi = obs.observed_range()
    assert lo.item() == -1.0 and hi.item() == pytest.approx(2.54)
    scale = obs.calculate_scale()
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(scale, f32(0.02))  # 2.54 / 127


def test_minmax_scale_int16_and_matches_march_rule():
    obs = MinMaxObserver(I16)
    obs(torch.tensor([-2.54, 1.0]))
    assert torch.equal(obs.calculate_scale(), f32(2.54 / 32767))
    # Same bits as the scalar rule in march/spec.py, fed the float32 range the observer saw.
    lo, hi = obs.observed_range()
    assert obs.calculate_scale().item() == get_march().spec.scale_from_range(lo.item(), hi.item(), I16)


def test_minmax_scale_matches_march_rule_on_random_data():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(50, generator=gen) * torch.rand(1, generator=gen) * 10
        obs = MinMaxObserver(I8)
        obs(x)
        expected = get_march().spec.scale_from_range(x.min().item(), x.max().item(), I8)
        assert obs.calculate_scale().item() == expected


def test_minmax_forward_returns_input_unchanged():
    obs = MinMaxObserver(I8)
    x = torch.tensor([1.0, -3.0], requires_grad=True)
    assert obs(x) is x


def test_minmax_ema_half_over_two_batches():
    obs = MinMaxObserver(I8, averaging_constant=0.5)
    obs(torch.tensor([-1.0, 2.0]))  # first batch sets the range directly
    lo, hi = obs.observed_range()
    assert (lo.item(), hi.item()) == (-1.0, 2.0)
    obs(torch.tensor([-3.0, 4.0]))  # min = -1 + 0.5 * (-3 + 1) = -2, max = 2 + 0.5 * (4 - 2) = 3
    lo, hi = obs.observed_range()
    assert (lo.item(), hi.item()) == (-2.0, 3.0)
    assert torch.equal(obs.calculate_scale(), f32(3.0 / 127))


def test_minmax_ema_ignores_an_all_nan_batch():
    obs = MinMaxObserver(I8, averaging_constant=0.5)
    obs(torch.tensor([float("nan")]))  # nothing finite yet: the next batch is the first
    obs(torch.tensor([-1.0, 2.0]))
    obs(torch.tensor([float("nan"), float("inf")]))  # leaves the range alone
    lo, hi = obs.observed_range()
    assert (lo.item(), hi.item()) == (-1.0, 2.0)
    assert bool(obs.saw_nonfinite)


def test_minmax_per_channel_axis0():
    w = torch.tensor(
        [
            [[1.0, -2.0], [0.5, 0.0]],  # absmax 2    -> 2 / 127
            [[0.0, 0.0], [0.0, 0.0]],  # all zero    -> min_scale
            [[-1.27, 0.0635], [0.1, 0.12]],  # absmax 1.27 -> 0.01
        ]
    )
    obs = MinMaxObserver(I8, ch_axis=0)
    obs(w)
    assert torch.equal(obs.calculate_scale(), torch.tensor([2 / 127, MIN_SCALE, 0.01], dtype=torch.float32))
    lo, hi = obs.observed_range()
    assert torch.equal(lo, torch.tensor([-2.0, 0.0, -1.27]))
    assert torch.equal(hi, torch.tensor([1.0, 0.0, 0.12]))


def test_minmax_per_channel_negative_axis_and_running():
    obs = MinMaxObserver(I8, ch_axis=-1)
    obs(torch.tensor([[1.0, -0.5, 0.0], [0.0, 0.25, 0.0]]))
    obs(torch.tensor([[-2.54, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(obs.calculate_scale(), torch.tensor([0.02, 0.5 / 127, MIN_SCALE], dtype=torch.float32))


def test_per_channel_shape_change_and_bad_axis_raise():
    obs = MinMaxObserver(I8, ch_axis=0)
    obs(torch.ones(3, 2))
    with pytest.raises(QuantLensError, match="3 channels"):
        obs(torch.ones(4, 2))
    with pytest.raises(QuantLensError, match="ch_axis=2"):
        MinMaxObserver(I8, ch_axis=2)(torch.ones(3, 2))


@pytest.mark.parametrize(
    "make", [lambda: MinMaxObserver(I8), lambda: PercentileObserver(I8), lambda: MSEObserver(I8)]
)
def test_all_zero_tensor_gives_min_scale(make):
    obs = make()
    obs(torch.zeros(4, 4))
    assert torch.equal(obs.calculate_scale(), f32(2.0**-24))


# --- Percentile ----------------------------------------------------------------------------------------------


def test_percentile_99_of_0_to_9999():
    obs = PercentileObserver(I8, percentile=99.0)
    obs(torch.arange(10000, dtype=torch.float32))
    bin_width = 9999 / 2048
    assert abs(obs.calculate_scale().item() - 9899 / 127) <= bin_width / 127


def test_percentile_rebinning_over_growing_batches_and_uses_abs():
    obs = PercentileObserver(I8, percentile=99.0)
    # Ascending chunks widen the range ten times, forcing a re-bin each time; negatives count by |x|.
    for i in range(10):
        chunk = torch.arange(i * 1000, (i + 1) * 1000, dtype=torch.float32)
        obs(-chunk if i % 2 else chunk)
    assert obs.histogram.sum().item() == 10000  # re-binning keeps every count
    assert abs(obs.calculate_scale().item() - 9899 / 127) <= (9999 / 2048) / 127


def test_percentile_100_covers_absmax():
    obs = PercentileObserver(I8, percentile=100.0, bins=16)
    obs(torch.tensor([0.1, -3.0, 2.0]))
    assert torch.equal(obs.calculate_scale(), f32(3.0 / 127))


def test_histogram_observers_are_per_tensor_only():
    for cls in (PercentileObserver, MSEObserver):
        with pytest.raises(QuantLensError, match=cls.__name__):
            cls(I8, ch_axis=0)
    with pytest.raises(QuantLensError, match="percentile"):
        PercentileObserver(I8, percentile=0.0)


# --- MSE -----------------------------------------------------------------------------------------------------


def test_mse_clips_a_single_huge_outlier():
    outlier = 100.0
    x = torch.cat([torch.linspace(-1.0, 1.0, 1_000_000), torch.tensor([outlier])])
    mse, minmax = MSEObserver(I8), MinMaxObserver(I8)
    mse(x)
    minmax(x)
    assert torch.equal(minmax.calculate_scale(), f32(outlier / 127))
    assert mse.calculate_scale().item() < outlier / 127 / 4


def test_mse_keeps_full_range_for_uniform_data():
    obs = MSEObserver(I8)
    obs(torch.linspace(-1.0, 1.0, 10001))
    # Clipping uniform data costs more than the finer step saves: the best candidate is the absmax itself.
    assert torch.equal(obs.calculate_scale(), f32(1.0 / 127))


def test_mse_ties_pick_the_largest_threshold():
    obs = MSEObserver(I8, num_candidates=8)
    obs(torch.tensor([0.5, -2.0]))
    obs.histogram.zero_()  # every candidate now has error 0: a tie across the board
    assert torch.equal(obs.calculate_scale(), f32(2.0 / 127))


# --- FixedScale ----------------------------------------------------------------------------------------------


def test_fixed_scale_returns_exact_scale_and_records_range():
    obs = FixedScaleObserver(I8, scale=1 / 128)
    assert obs.has_stats
    assert torch.equal(obs.calculate_scale(), f32(1 / 128))  # even before any data
    obs(torch.tensor([-5.0, 0.25]))
    lo, hi = obs.observed_range()
    assert (lo.item(), hi.item()) == (-5.0, 0.25)
    scale = obs.calculate_scale()
    assert scale.shape == () and scale.dtype == torch.float32 and scale.item() == 1 / 128
    with pytest.raises(QuantLensError, match="scale"):
        FixedScaleObserver(I8, scale=0.0)
    with pytest.raises(QuantLensError, match="per-tensor"):
        FixedScaleObserver(I8, 0, scale=0.5)


# --- NaN / Inf, missing data ---------------------------------------------------------------------------------


def test_nonfinite_values_are_ignored_but_flagged():
    obs = MinMaxObserver(I8)
    assert not bool(obs.saw_nonfinite)
    obs(torch.tensor([float("nan"), -1.0, float("inf"), 2.0, float("-inf")]))
    lo, hi = obs.observed_range()
    assert (lo.item(), hi.item()) == (-1.0, 2.0)
    assert bool(obs.saw_nonfinite)
    assert torch.equal(obs.calculate_scale(), f32(2.0 / 127))


def test_histogram_ignores_nonfinite_values():
    obs = PercentileObserver(I8, percentile=100.0)
    obs(torch.tensor([float("nan"), 1.0, float("inf"), -4.0]))
    assert obs.histogram.sum().item() == 2
    assert bool(obs.saw_nonfinite)
    assert torch.equal(obs.calculate_scale(), f32(4.0 / 127))


@pytest.mark.parametrize("cls", [MinMaxObserver, PercentileObserver, MSEObserver])
def test_all_nan_input_raises(cls):
    obs = cls(I8)
    obs(torch.full((3,), float("nan")))
    assert bool(obs.saw_nonfinite) and not obs.has_stats
    with pytest.raises(QuantLensError, match=f"{cls.__name__} saw only NaN/Inf"):
        obs.calculate_scale()


def test_per_channel_with_one_all_nan_channel_raises():
    obs = MinMaxObserver(I8, ch_axis=0)
    obs(torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]]))
    with pytest.raises(QuantLensError, match="only NaN/Inf values for some channels"):
        obs.calculate_scale()


def test_nonfinite_statistic_in_loaded_state_raises():
    obs = MinMaxObserver(I8)
    obs.load_state_dict(
        {"min_val": torch.tensor(-1.0), "max_val": torch.tensor(float("nan")), "saw_nonfinite": torch.tensor(False)}
    )
    with pytest.raises(QuantLensError, match="MinMaxObserver cannot derive a qint8 scale"):
        obs.calculate_scale()


@pytest.mark.parametrize("cls", [MinMaxObserver, PercentileObserver, MSEObserver])
def test_scale_before_any_data_raises_with_class_name(cls):
    obs = cls(I8)
    assert not obs.has_stats
    with pytest.raises(QuantLensError, match=f"{cls.__name__} has not observed any data"):
        obs.calculate_scale()
    per_channel = MinMaxObserver(I8, ch_axis=0)
    obs(torch.empty(0))  # an empty batch is not data
    assert not obs.has_stats and not per_channel.has_stats


# --- state, reset, factories ---------------------------------------------------------------------------------


def test_state_dict_round_trip_into_fresh_per_channel_observer():
    src = MinMaxObserver(I8, ch_axis=1)
    src(torch.tensor([[0.5, -2.54, 0.0], [-1.0, 1.0, 0.0]]))
    dst = MinMaxObserver(I8, ch_axis=1)
    assert dst.min_val.shape == (0,)
    dst.load_state_dict(src.state_dict())
    assert dst.has_stats
    assert torch.equal(dst.calculate_scale(), src.calculate_scale())
    assert torch.equal(dst.calculate_scale(), torch.tensor([1 / 127, 0.02, MIN_SCALE], dtype=torch.float32))
    # The loaded observer keeps observing with the loaded channel count.
    dst(torch.tensor([[3.81, 0.0, 0.0]]))
    assert dst.calculate_scale()[0].item() == pytest.approx(0.03)


def test_state_dict_round_trip_histogram_observer():
    src = PercentileObserver(I8, percentile=99.0)
    src(torch.arange(10000, dtype=torch.float32))
    dst = PercentileObserver(I8, percentile=99.0)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.calculate_scale(), src.calculate_scale())


def test_reset_forgets_everything():
    obs = MinMaxObserver(I8, ch_axis=0)
    obs(torch.tensor([[1.0, float("nan")]]))
    obs.reset()
    assert obs.min_val.shape == (0,) and not obs.has_stats and not bool(obs.saw_nonfinite)
    hist = PercentileObserver(I8)
    hist(torch.tensor([1.0, 2.0]))
    hist.reset()
    assert hist.histogram.sum().item() == 0 and not hist.has_stats
    hist(torch.tensor([0.5]))  # a fresh start, not a re-bin of stale counts
    assert hist.histogram.sum().item() == 1


def test_with_args_factory_configures_and_pickles():
    factory = MinMaxObserver.with_args(averaging_constant=0.25)
    obs = factory(I16, 1)
    assert isinstance(obs, MinMaxObserver) and isinstance(obs, Observer)
    assert (obs.dtype, obs.ch_axis, obs.averaging_constant) == (I16, 1, 0.25)
    clone = pickle.loads(pickle.dumps(factory))(I8, None)
    assert (clone.dtype, clone.ch_axis, clone.averaging_constant) == (I8, None, 0.25)
    pct = pickle.loads(pickle.dumps(PercentileObserver.with_args(percentile=99.9, bins=64)))(I8, None)
    assert (pct.percentile, pct.bins) == (99.9, 64)
    with pytest.raises(QuantLensError, match="with_args"):
        MinMaxObserver.with_args(percentile=99.0)


def test_extra_repr_and_option_validation():
    text = repr(MinMaxObserver(I8, ch_axis=0, averaging_constant=0.5))
    assert "dtype=qint8" in text and "ch_axis=0" in text and "averaging_constant=0.5" in text
    assert "num_candidates=128" in repr(MSEObserver(I16))
    with pytest.raises(QuantLensError, match="averaging_constant"):
        MinMaxObserver(I8, averaging_constant=0.0)
    assert not math.isfinite(MinMaxObserver(I8).min_val.item())  # per-tensor starts at (+inf, -inf)
