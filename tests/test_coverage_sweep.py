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


def test_the_tables_have_the_convert_pairs_per_op_criterion():
    """pre_export vs fake quant below 0.99 passes when every table is within one step on its own input (levit,
    mobilevit: random weights amplify a table's one step); a table further off fails, and so does a NaN cosine."""
    from quantlens.zoo.coverage import CoverageResult

    agreements = {name: 1.0 for name in THRESHOLDS}
    agreements["pre_export vs fake quant"] = 0.78
    assert CoverageResult("x", "int8", agreements=agreements, pre_export_worst_step=1.000004).passed
    far = CoverageResult("x", "int8", agreements=agreements, pre_export_worst_step=2.5)
    assert far.below() == ["pre_export vs fake quant"] and not far.passed
    assert not CoverageResult("x", "int8", agreements=agreements).passed
    assert not CoverageResult("x", "int8", agreements={**agreements, "pre_export vs fake quant": float("nan")}).passed


def _drawn_sample(count: int = 10, seconds: float = 5.0) -> tuple[int, list[str]]:
    """``count`` model types drawn from those the last sweep (docs/coverage.json, ``bench_coverage.py --auto``)
    passed in at most ``seconds`` (177 of its 329 passing types: the suite's time stays within its budget, the whole
    sweep is the benchmark), by a seed that changes with every test run (``QUANTLENS_SWEEP_SEED`` overrides it; a
    failing test names it). 10 a run (was 20, a fifth of the suite's time): the draw changes with every run, so
    the runs together still go through the whole list."""
    import datetime
    import json
    import os
    import random
    from pathlib import Path

    from quantlens.zoo.coverage import CoverageResult

    rows = json.loads((Path(__file__).resolve().parents[1] / "docs" / "coverage.json").read_text())
    passed = sorted(r["name"] for r in rows if CoverageResult(
        r["name"], r["qconfig"], r["failed"], r["error"], r["agreements"],
        convert_worst_step=r.get("convert_worst_step"), random_draws=r.get("random_draws", False),
        pre_export_worst_step=r.get("pre_export_worst_step"), onnxruntime_worst_step=r.get("onnxruntime_worst_step")
    ).passed and sum(r["seconds"].values()) <= seconds)
    # one seed per test run, the same in every pytest-xdist worker (their collections must agree): the run's id
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    default = int(run[:8], 16) if run else datetime.date.today().toordinal()
    seed = int(os.environ.get("QUANTLENS_SWEEP_SEED", default))
    return seed, sorted(random.Random(seed).sample(passed, min(count, len(passed))))


_SEED, _SAMPLE = _drawn_sample()


@pytest.mark.parametrize("name", _SAMPLE)
def test_a_drawn_transformers_architecture_goes_through_every_stage(name):
    """A sample of the sweep by construction, drawn anew at every run from the model classes the last sweep passed:
    each still goes through every stage within the criteria (its QUANTLENS_SWEEP_SEED reproduces the draw)."""
    from quantlens.zoo.auto_architectures import build_auto

    model, example, batches, held_out = build_auto(name)
    result = run_stages(name, model, example, batches, held_out)
    assert result.failed_stage is None, (f"QUANTLENS_SWEEP_SEED={_SEED}", result.error)
    assert result.passed, (f"QUANTLENS_SWEEP_SEED={_SEED}", result.agreements, result.convert_worst_step)
