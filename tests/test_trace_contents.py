"""What a trace keeps: tensor statistics against float64 references, and a fused member's statistics without its values."""

import pytest
import torch

from quantlens.profiler.trace.stats import tensor_stat


@pytest.mark.parametrize("n", [7, 8191, 4096 * 64, 4096 * 64 + 123])
def test_float32_statistics_match_float64_references(n):
    g = torch.Generator().manual_seed(n)
    # a large offset makes a float32 running sum lose the mean's digits; the tail past the last full row counts
    x = torch.randn(n, generator=g) * 3 + 1000.0
    x[-1] = 5000.0
    st = tensor_stat(x.reshape(-1, 1) if n % 2 else x)
    ref = x.double()
    assert st.min == float(ref.min()) and st.max == float(ref.max())
    assert st.mean == pytest.approx(float(ref.mean()), rel=1e-7)  # float32 precision
    assert st.var == pytest.approx(float(ref.var(correction=0)), rel=1e-5)
    assert st.shape == ((n, 1) if n % 2 else (n,))


@pytest.mark.parametrize("moments", [True, False])
def test_the_numpy_statistics_of_small_tensors_agree_with_the_torch_passes_at_their_limit(moments):
    """At most NUMPY_MOMENTS elements (NUMPY_EXTREMES for the extremes alone) the statistics are numpy's, in
    float64; one element more takes torch's chunked passes. Both sides of the limit give the float64 figures,
    the numpy side to float64 rounding."""
    from quantlens.profiler.trace import stats

    limit = stats.NUMPY_MOMENTS if moments else stats.NUMPY_EXTREMES
    g = torch.Generator().manual_seed(11)
    x = torch.randn(limit + 1, generator=g) * 3 + 1000.0
    calls = []
    real = stats._numpy_stat
    try:
        stats._numpy_stat = lambda *a: calls.append(a[0].numel()) or real(*a)
        small, large = stats.tensor_stat(x[:limit], moments=moments), stats.tensor_stat(x, moments=moments)
    finally:
        stats._numpy_stat = real
    assert calls == [limit]  # the numpy path up to the limit, torch's beyond it
    for st, ref in ((small, x[:limit].double()), (large, x.double())):
        assert (st.min, st.max) == (float(ref.min()), float(ref.max()))
        if moments:
            exact = st is small
            assert st.mean == pytest.approx(float(ref.mean()), rel=1e-15 if exact else 1e-7)
            assert st.var == pytest.approx(float(ref.var(correction=0)), rel=1e-12 if exact else 1e-5)
        else:
            assert st.mean is None and st.var is None


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int64, torch.float16, torch.float64, torch.bool])
def test_small_tensors_of_other_dtypes_take_the_numpy_path_with_float64_moments(dtype):
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(4097, generator=g) * 40).to(dtype)
    st = tensor_stat(t.reshape(17, 241))
    d = t.double()
    assert (st.min, st.max) == (float(d.min()), float(d.max()))
    assert st.shape == (17, 241) and st.dtype == str(dtype).replace("torch.", "")
    assert st.mean == pytest.approx(float(d.mean()), rel=1e-13, abs=1e-13)
    assert st.var == pytest.approx(float(d.var(unbiased=False)), rel=1e-12)


def test_a_small_tensor_with_nan_or_inf_is_counted_like_a_large_one():
    x = torch.arange(100, dtype=torch.float32)
    x[3], x[7] = float("nan"), -float("inf")
    st = tensor_stat(x)
    assert (st.nan, st.inf) == (1, 1) and (st.min, st.max) == (0.0, 99.0)
    assert tensor_stat(torch.full((5,), float("nan"))).min is None


def test_nonfinite_values_are_counted_and_left_out():
    x = torch.arange(10000, dtype=torch.float32)
    x[3], x[5], x[9000] = float("nan"), float("inf"), -float("inf")
    st = tensor_stat(x)
    finite = torch.cat([x[:3], x[4:5], x[6:9000], x[9001:]]).double()
    assert (st.nan, st.inf) == (1, 2)
    assert st.min == 0.0 and st.max == 9999.0
    assert st.mean == pytest.approx(float(finite.mean()), rel=1e-12)


def test_integer_codes_are_summed_exactly():
    x = torch.full((3 * 4096 + 1,), 127, dtype=torch.int8)
    x[0] = -128
    st = tensor_stat(x)
    assert st.dtype == "int8" and (st.min, st.max) == (-128.0, 127.0)
    assert st.mean == (127 * (x.numel() - 1) - 128) / x.numel()


def test_an_analysis_trace_keeps_a_fused_members_statistics_not_its_values(small_conv_analysis, tmp_path):
    from safetensors import safe_open
    from torch import nn

    from quantlens.errors import QuantLensError
    from quantlens.profiler.trace.reader import TraceReader
    from quantlens.quantization import DeQuantStub, QuantStub

    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 1), DeQuantStub()).eval()
    _, x, qa = small_conv_analysis(model)
    rows = {r.op_name: r for r in qa.compare_per_layer()}
    analysis, baseline = TraceReader(tmp_path / "analysis_model"), TraceReader(tmp_path / "baseline_model")
    conv = analysis.by_name["1"]
    assert conv.fused_into and conv.stats_only == ["out0", "weight"]  # (a weight is never copied: the model's)
    with safe_open(str(analysis.dir / conv.file), framework="pt") as f:
        assert "out0" not in f.keys() and "weight" not in f.keys()
    assert conv.stats["weight"].shape == (8, 3, 3, 3)
    with pytest.raises(QuantLensError, match="only the statistics of the weight.*state_dict"):
        analysis.tensors("1")["weight"]
    # the statistics are the fused conv's (BN folded in): its range is the BN output's, not the bare conv's
    with torch.no_grad():
        bn_out = model[2](model[1](model[0](x)))
    assert conv.stats["out0"].min == pytest.approx(float(bn_out.min()), abs=0.05)
    assert rows["1"].note.startswith("fused into") and rows["1"].analy_min == conv.stats["out0"].min
    with pytest.raises(QuantLensError, match="fused into '3'.*Read that site's tensors"):
        analysis.tensors("1")["out0"]
    # the group's last op keeps its values in both traces
    assert analysis.tensors("3")["out0"].shape == baseline.tensors("3")["out0"].shape == (2, 8, 8, 8)
    assert rows["3"].same_input_sqnr > 20
    # traced for this comparison, the baseline keeps the conv's and BN's statistics only: nothing reads them
    # (the analysis fuses them; its same-input run of the BN and ReLU takes the group's own values)
    assert [baseline.by_name[k].stats_only for k in ("1", "2", "3", "4")] == [["out0", "weight"], ["out0", "weight"],
                                                                               [], ["weight"]]
    assert baseline.by_name["1"].stats["out0"].shape == (2, 8, 8, 8)
    with pytest.raises(QuantLensError, match="fuses this op site.*Trace this model again"):
        baseline.tensors("2")["out0"]
    # a baseline traced on its own keeps every value (it may serve other comparisons)
    qa.run(run_analysis_model=False)
    baseline = TraceReader(tmp_path / "baseline_model")
    assert all(set(s.stats_only) <= {"weight"} for s in baseline.sites)
    assert baseline.tensors("1")["out0"].shape == (2, 8, 8, 8)
    qa.run(run_baseline_model=False)
    assert [(r.op_name, r.same_input_sqnr) for r in qa.compare_per_layer()] == \
        [(op, r.same_input_sqnr) for op, r in rows.items()]


def test_integer_codes_are_checked_in_every_chunk():
    from quantlens.profiler._sums import CHUNK
    from quantlens.profiler.trace.writer import _encode

    scale = 0.03125
    g = torch.Generator().manual_seed(1)
    n = 5 * (2 * CHUNK // 5 + 3)  # a short last chunk
    codes = torch.randint(-128, 128, (n,), generator=g)
    x = (codes.float() * scale).reshape(-1, 5)
    bufs: dict[str, torch.Tensor] = {}

    def buf(name):
        return lambda nbytes: bufs.setdefault((name, nbytes), torch.empty(nbytes, dtype=torch.uint8))

    got = _encode(x, scale, -128, 127, torch.int8, buf("scratch"), buf("codes"))
    assert got is not None and got.shape == x.shape and torch.equal(got.reshape(-1).long(), codes)
    for where, value in ((n - 1, 0.5 * scale), (CHUNK + 7, 200 * scale), (CHUNK - 1, float("nan"))):
        bad = x.clone().reshape(-1)
        bad[where] = value  # off the grid in the last chunk, out of range in the second, NaN at a chunk's end
        assert _encode(bad.reshape(x.shape), scale, -128, 127, torch.int8, buf("scratch"), buf("codes")) is None


def test_output_quantization_split_over_chunks_matches_a_float64_reference():
    from quantlens.march import QuantDType
    from quantlens.profiler._sums import CHUNK
    from quantlens.profiler.torch_probe import _quant_error_stats

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * CHUNK + 333, generator=g) * 3
    scale = torch.tensor(0.02)
    st = _quant_error_stats(x, scale, QuantDType.qint8)
    xd, s = x.double(), 0.02
    q = torch.clamp(torch.round(xd / float(scale)), -128, 127) * float(scale)
    err = (q - xd) ** 2
    clipped = (xd > 127.5 * s) | (xd < -128.5 * s)
    assert st.clipped == int(clipped.sum()) > 0 and st.numel == x.numel()
    assert st.clip_sq_err == pytest.approx(float(err[clipped].sum()), rel=1e-5)
    # (the rounding part is a hundred-thousandth of the clipping part here: summed apart, not as the difference)
    assert st.round_sq_err == pytest.approx(float(err[~clipped].sum()), rel=1e-5)
    assert (st.raw_min, st.raw_max) == (float(x.min()), float(x.max()))


def test_output_quantization_split_without_saturation_is_all_rounding():
    """The split skips the saturation masks when the extremes show none saturates: the same figures as the
    masked path, and an element exactly at the last level's half step still counts as rounding."""
    from quantlens.march import QuantDType
    from quantlens.profiler._sums import CHUNK
    from quantlens.profiler.torch_probe import _quant_error_stats

    g = torch.Generator().manual_seed(3)
    scale = torch.tensor(0.02)
    x = (torch.rand(CHUNK + 91, generator=g) * 2 - 1) * 2.5  # inside [-128.5, 127.5] steps
    x[5] = torch.tensor(127.5 * 0.02, dtype=torch.float32)  # the edge itself: not beyond it
    st = _quant_error_stats(x, scale, QuantDType.qint8)
    xd = x.double()
    q = torch.clamp(torch.round(xd / 0.02), -128, 127) * 0.02
    assert st.clipped == 0 and st.clip_sq_err == 0.0
    assert st.round_sq_err == pytest.approx(float(((q - xd) ** 2).sum()), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.bool])
def test_statistics_of_other_dtypes_go_to_float64_chunk_by_chunk(dtype):
    """An IR's integer weights and half-precision tensors: the statistics of their values, over several chunks
    (no float64 copy of the whole tensor is made), as the float64 formulas give them."""
    from quantlens.profiler._sums import CHUNK
    from quantlens.profiler.trace.stats import tensor_stat

    g = torch.Generator().manual_seed(4)
    t = (torch.randn(2 * CHUNK + 17, generator=g) * 40).to(dtype)
    st = tensor_stat(t)
    d = t.double()
    assert (st.min, st.max) == (float(d.min()), float(d.max())) and st.dtype == str(dtype).replace("torch.", "")
    assert st.mean == pytest.approx(float(d.mean()), rel=1e-12, abs=1e-12)
    assert st.var == pytest.approx(float(d.var(unbiased=False)), rel=1e-9)
