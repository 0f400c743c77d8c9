"""Issue #23's acceptance suite, the faults planted in the real pretrained sentence transformer (see
tests/test_fault_suite.py)."""

import pytest

from quantlens.zoo.faults import FAULTS
from tests._faults import check_culprit_is_found_first


@pytest.mark.parametrize("name", sorted(n for n, f in FAULTS.items() if "MiniLM" in f.model))
def test_culprit_is_found_first_in_minilm(name, tmp_path):
    check_culprit_is_found_first(name, tmp_path)
