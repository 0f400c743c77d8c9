"""The command line speaks CONFIG, the library speaks Python (issue #42, point 7): advice names the setting as the
reader changes it where they are, and a library's warning is printed as that library's, not as quantlens' own."""

import warnings
from pathlib import Path

import pytest
import torch

from quantlens._advice import SETTINGS, setting, speaking_to
from quantlens.cli import warning_origin
from quantlens.errors import QuantLensError, QuantLensWarning

NEWCOMERS = Path(__file__).parent / "newcomers"

_NO_STUBS = """
import torch
from torch import nn

def float_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()

def example_inputs():
    return torch.randn(2, 4)

def calibration_data():
    return [torch.randn(2, 4)]
"""


def _static_ir():
    from quantlens.compiler import export
    from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    model = torch.nn.Sequential(QuantStub(), torch.nn.Linear(4, 4), DeQuantStub()).eval()
    x = torch.randn(2, 4)
    prepared = calibrate(prepare(model, x, default_calibration_qconfig_setter, check_result_dir=None), [x])
    return export(prepared, x)


def test_the_same_error_advises_python_or_config_by_its_reader():
    ir = _static_ir()
    wrong = torch.randn(3, 4)
    with pytest.raises(QuantLensError) as python:
        ir(wrong)
    with speaking_to("config"), pytest.raises(QuantLensError) as config:
        ir(wrong)
    assert "`export(..., dynamic_batch=True)`" in str(python.value)
    assert "`dynamic_batch = True` in the CONFIG file" in str(config.value)
    assert "export(" not in str(config.value)


def test_every_setting_has_both_forms_of_its_value():
    for name in SETTINGS:
        assert f"{name}=True" in setting(name, True)
        with speaking_to("config"):
            words = setting(name, True)
        assert "(..." not in words, (name, words)
    with pytest.raises(ValueError, match="expected one of"):
        with speaking_to("yaml"):
            pass


def test_analyze_advises_the_config_setting_for_a_model_without_stubs(tmp_path):
    from test_cli import ql

    config = tmp_path / "nostubs.py"
    config.write_text(_NO_STUBS)
    res = ql("analyze", config, "--stage", "fake_quant", "--out", tmp_path / "out", "--no-sensitivity")
    assert res.returncode == 2, res.stdout[-1000:] + res.stderr
    assert "`allow_no_stubs = True` in the CONFIG file" in res.stderr
    assert "prepare(..., allow_no_stubs=True)" not in res.stderr


def test_a_library_warning_is_printed_as_that_librarys():
    torch_file = torch.__file__.replace("__init__.py", "export/_trace.py")
    assert warning_origin(UserWarning, torch_file, 12) == "warning from torch (_trace.py:12):"
    assert warning_origin(QuantLensWarning, "/home/user/config.py", 3) == "warning:"


def test_quantlens_warnings_have_their_own_category():
    from quantlens.quantization import prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    class HostOp(torch.nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=-1)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), HostOp()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(model, torch.randn(2, 4), default_calibration_qconfig_setter, check_result_dir=None,
                allow_no_stubs=True)
    ours = [w for w in caught if "run on the host" in str(w.message)]
    assert ours and all(issubclass(w.category, QuantLensWarning) for w in ours)
