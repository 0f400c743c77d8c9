"""A CONFIG value of the wrong type is refused, naming the name and the expected type (issue #43): the string
"False" where a bool belongs was read as True."""

import pytest

from quantlens.cli import UsageError
from quantlens.cli.config import load_config

_BASE = """
import torch
def float_model():
    return torch.nn.Linear(2, 2)
def example_inputs():
    return torch.randn(1, 2)
def calibration_data():
    return [torch.randn(1, 2)]
"""


@pytest.mark.parametrize("line, expected", [
    ('higher_is_better = "False"', r"higher_is_better = 'False' \(str\); expected True or False"),
    ("dynamic_batch = 0", r"dynamic_batch = 0 \(int\); expected True or False"),
    ('allow_no_stubs = "yes"', r"allow_no_stubs = 'yes' \(str\); expected True or False"),
    ("num_steps = 2.5", r"num_steps = 2.5 \(float\); expected None or a whole number >= 1"),
    ("num_steps = True", r"num_steps = True \(bool\)"),
])
def test_a_setting_of_the_wrong_type_is_refused_by_name(tmp_path, line, expected):
    path = tmp_path / "config.py"
    path.write_text(_BASE + line + "\n")
    with pytest.raises(UsageError, match=expected):
        load_config(path)


def test_settings_of_the_right_type_are_read_as_written(tmp_path):
    path = tmp_path / "config.py"
    path.write_text(_BASE + "higher_is_better = False\nnum_steps = 3\nallow_no_stubs = True\n")
    cfg = load_config(path)
    assert cfg.higher_is_better is False and cfg.num_steps == 3 and cfg.allow_no_stubs is True
    assert cfg.dynamic_batch is True  # the default
