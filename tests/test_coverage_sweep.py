"""A fast subset of the coverage sweep (``benchmarks/bench_coverage.py``, ``docs/coverage_zoo.md``): architectures from
transformers' own module code, each through every stage at the sweep's thresholds. Each exercises mechanisms the
bundled zoo does not: rotary tables folded at export, grouped-query attention and RMSNorm (llama); baddbmm, ALiBi and
a finfo.min causal mask (bloom); shifted windows with an additive relative-position bias (swin); group norm and a
weight-normed positional conv (wav2vec2)."""

import pytest

pytest.importorskip("transformers")

from quantlens.zoo.architectures import build  # noqa: E402
from quantlens.zoo.coverage import THRESHOLDS, run_stages  # noqa: E402


@pytest.mark.parametrize("name", ["llama", "bloom", "swin", "wav2vec2"])
def test_architecture_goes_through_every_stage(name):
    model, example, batches, held_out = build(name)
    result = run_stages(name, model, example, batches, held_out)
    assert result.failed_stage is None, result.error
    assert set(result.agreements) == set(THRESHOLDS)
    assert not result.below(), {k: result.agreements[k] for k in result.below()}


def test_the_convert_criterion_for_random_weight_nets():
    """mobilenet_v1 with random weights amplifies rounding block after block: its quantized IR ends further from the
    qat IR than the cosine threshold, yet every op on the NPU is within one output step of it on the same input,
    which is the criterion (docs/coverage.md)."""
    model, example, batches, held_out = build("mobilenet_v1")
    result = run_stages("mobilenet_v1", model, example, batches, held_out)
    assert result.failed_stage is None, result.error
    assert result.agreements["quantized IR vs qat IR"] < THRESHOLDS["quantized IR vs qat IR"]
    assert result.convert_worst_step is not None and result.convert_worst_step <= 1.001
    assert result.passed and not result.below()


def test_an_op_more_than_one_step_off_fails_the_convert_criterion():
    from quantlens.zoo.coverage import CoverageResult

    agreements = {name: 1.0 for name in THRESHOLDS}
    agreements["quantized IR vs qat IR"] = 0.9
    far = CoverageResult("x", "int8", agreements=agreements, convert_worst_step=3.0)
    near = CoverageResult("x", "int8", agreements=agreements, convert_worst_step=1.0)
    unknown = CoverageResult("x", "int8", agreements=agreements)
    assert far.below() == ["quantized IR vs qat IR"] and not far.passed
    assert near.passed and not unknown.passed
