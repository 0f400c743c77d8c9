"""sensitivity() from the ablation cache (only what a quantizer changes is recomputed) gives the very tables of
the old path (one full forward per quantizer): tiny_resnet and tiny_transformer for fake_quant, the
transformer's lookup tables for pre_export, and the deployed stages (export, convert with an IR reference)."""

import pytest
import torch

from quantlens.compiler import convert, export
from quantlens.profiler import QuantAnalysis
from quantlens.profiler import sensitivity as sensitivity_module
from quantlens.profiler.ablation import ir_cache, torch_cache
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization import prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.quantization.queries import last_sites
from quantlens.zoo import example_inputs, get_model, sample_batches


def _calibrated(name, setter=default_calibration_qconfig_setter):
    model = get_model(name)
    calib = prepare(model, example_inputs(name), setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 3, 8))
    return model, calib


def _tables(result):
    return [(t.key, [(r.op_name, r.sensitive_type, r.op_type, r.metric, r.value, r.quant_dtype) for r in t])
            for t in result]


def _both(monkeypatch, tmp_path, baseline, analysis, kind, example, metric="L1", shard_true=False):
    """(cached tables, full-forward tables, number of cached runs)."""
    calls = []
    original = torch_cache.TorchAblationCache.run, ir_cache.IRAblationCache.run

    def counting(index):
        def run(self, *a, **k):
            calls.append(index)
            return original[index](self, *a, **k)
        return run

    monkeypatch.setattr(torch_cache.TorchAblationCache, "run", counting(0))
    monkeypatch.setattr(ir_cache.IRAblationCache, "run", counting(1))
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=tmp_path / "cached", progress=False)
    qa.set_bad_case(example)
    cached = _tables(qa.sensitivity(metric=metric, shard=shard_true))
    used = len(calls)
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", False)
    qa = QuantAnalysis(baseline, analysis, kind, out_dir=tmp_path / "full", progress=False)
    qa.set_bad_case(example)
    full = _tables(qa.sensitivity(metric=metric, shard=False))
    monkeypatch.setattr(sensitivity_module, "_USE_CACHE", True)
    return cached, full, used


@pytest.mark.parametrize("name", ["tiny_resnet", "tiny_transformer"])
@pytest.mark.parametrize("metric", ["L1", "Cosine"])
def test_fake_quant_tables_identical(name, metric, monkeypatch, tmp_path):
    model, calib = _calibrated(name)
    cached, full, used = _both(monkeypatch, tmp_path, model, calib, "fake_quant", example_inputs(name, 4), metric)
    assert used == sum(len(t[1]) for t in full[:1])  # every ablation came from the cache
    assert cached == full


def test_pre_export_lut_tables_identical(monkeypatch, tmp_path):
    _, qat = _calibrated("tiny_transformer", calibration_8bit_weight_16bit_act_qconfig_setter)
    pre = pre_export(qat)
    cached, full, used = _both(monkeypatch, tmp_path, qat, pre, "pre_export", example_inputs("tiny_transformer", 4))
    assert used > 0 and cached == full


@pytest.fixture(scope="module")
def resnet_stages():
    name = "tiny_resnet"
    example = example_inputs(name)
    calib = prepare(get_model(name), example, default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches(name, 8, 16))
    pe = pre_export(calib)
    qat_ir = export(pe, example)
    return example, pe, qat_ir, convert(qat_ir)


@pytest.mark.parametrize("pair", ["export", "convert_ir", "convert_torch"])
def test_deployed_tables_identical(pair, resnet_stages, monkeypatch, tmp_path):
    example, pe, qat_ir, quantized_ir = resnet_stages
    baseline, analysis, kind = {"export": (pe, qat_ir, "export"), "convert_ir": (qat_ir, quantized_ir, "convert"),
                                "convert_torch": (pe, quantized_ir, "convert")}[pair]
    cached, full, used = _both(monkeypatch, tmp_path, baseline, analysis, kind, example)
    assert used > 0 and cached == full
    if pair == "convert_ir":
        assert any(r[4] != 0 for r in full[0][1])  # the comparison means something


def test_small_budget_and_in_place_fallback(monkeypatch, tmp_path):
    """A cache too small for most outputs still gives the same tables (sites past the budget compute)."""
    model, calib = _calibrated("tiny_resnet")
    monkeypatch.setenv("QUANTLENS_SENSITIVITY_CACHE_MB", "0.05")
    cached, full, _ = _both(monkeypatch, tmp_path, model, calib, "fake_quant", example_inputs("tiny_resnet", 4))
    assert cached == full


def test_cache_skips_upstream_work(monkeypatch):
    """The forward of the last quantizer computes only the sites from it on."""
    from quantlens.profiler.model_access import AnalysisType
    from quantlens.profiler.sensitivity import IndexRecorder, ablation_runner
    from quantlens.profiler.torch_access import TorchModelAccess

    _, calib = _calibrated("tiny_resnet")
    access = TorchModelAccess(calib, "analysis")
    example = example_inputs("tiny_resnet", 2)
    computed = []
    original = torch_cache._CachingRuntime._done

    def done(self, key, *a, **k):
        if not self.recording:
            computed.append(key[0])
        return original(self, key, *a, **k)

    monkeypatch.setattr(torch_cache._CachingRuntime, "_done", done)
    quantizers = access.quantizers(AnalysisType.FAKE_QUANT)
    with access.ablation(AnalysisType.FAKE_QUANT) as enable:
        runner = ablation_runner(access, AnalysisType.FAKE_QUANT, example, IndexRecorder())
        last = quantizers[-1]
        enable(last, True)
        runner.run(last, lambda: pytest.fail("fell back to the full forward"))
        enable(last, False)
    sites = last_sites(calib._quantlens_state, example)
    assert last.op_name in computed and len(computed) < len(sites) / 2
    # upstream, only the sites that hand their input on unchanged (a folded BatchNorm, QuantStub) run
    plans = calib._quantlens_state.plans
    assert not [s for s in computed if plans[s].op_type in ("conv2d", "add", "relu")]
    assert torch.is_tensor(access.run(example))


def test_sharded_single_process_uses_the_cache(monkeypatch, tmp_path):
    """shard=True (one resumable process) takes the cached path too and gives the single-process tables."""
    model, calib = _calibrated("tiny_resnet")
    cached, full, used = _both(monkeypatch, tmp_path, model, calib, "fake_quant", example_inputs("tiny_resnet", 4),
                               shard_true=True)
    assert used > 0 and cached == full


def test_frozen_folds_give_the_per_forward_fold_and_end_with_the_block():
    """qat_modules.frozen_folds (the ablation forwards): a conv + BN folded once gives the forward's outputs bit
    for bit; after the block, a changed BN statistic is folded afresh."""
    import warnings

    from torch import nn

    from quantlens.quantization import QuantStub, calibrate, prepare
    from quantlens.quantization.qat_modules import QATConvBn2d, frozen_folds
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    model = nn.Sequential(QuantStub(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[2].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None),
                             [(torch.randn(2, 3, 8, 8),)])
    fused = [m for m in prepared.modules() if isinstance(m, QATConvBn2d)]
    assert len(fused) == 1
    with torch.no_grad():
        plain = prepared(x)
        with frozen_folds(prepared.modules()):
            assert torch.equal(prepared(x), plain)
            fused[0].bn.running_mean.add_(0.5)  # (nobody does this inside the block: the fold stays frozen)
            assert torch.equal(prepared(x), plain)
        assert not torch.equal(prepared(x), plain)  # outside it, folded from the current statistics
