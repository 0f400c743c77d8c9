"""Issue #23's acceptance suite: every planted fault of ``quantlens.zoo.faults`` (two or more per stage pair,
four or more in a real pretrained transformer) has its culprit ranked first by at least one of the profiler's
methods, first by sensitivity (one quantizer, one op or a pair) whenever the fault changes the output (the
``onnxruntime`` pair, which has no sensitivity, by where the accumulated error jumps), and named by the
advisor. ``benchmarks/bench_fault_suite.py`` prints the rank table of ``docs/fault_suite.md``."""

from collections import Counter

import pytest

from quantlens.zoo.faults import FAULTS
from tests._faults import check_culprit_is_found_first

STAGES = ("fake_quant", "pre_export", "export", "convert", "onnxruntime")


def test_suite_covers_every_stage_pair_and_a_real_model():
    per_stage = Counter(f.stage for f in FAULTS.values())
    assert all(per_stage[s] >= 2 for s in STAGES), per_stage
    assert sum("MiniLM" in f.model for f in FAULTS.values()) >= 4


@pytest.mark.parametrize("name", sorted(n for n, f in FAULTS.items() if "MiniLM" not in f.model))
def test_culprit_is_found_first(name, tmp_path):
    """The faults planted in small models (the MiniLM ones: tests/test_fault_suite_minilm.py, a file of its own
    so that the two halves run on different workers)."""
    check_culprit_is_found_first(name, tmp_path)
