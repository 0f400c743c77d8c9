"""A fast subset of the coverage sweep (``benchmarks/bench_coverage.py``, ``docs/coverage.md``): architectures from
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
