"""Quantization stage: prepare a float model, calibrate it, train it with fake quant (QAT).

Typical flow::

    from quantlens.quantization import prepare, set_fake_quantize, FakeQuantState
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    calib = prepare(float_model, example_inputs, default_calibration_qconfig_setter)
    calib.eval(); set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    for batch in data: calib(batch)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)   # evaluate what the NPU computes

Searches over qconfigs (the mixed-precision search) measure configurations through the compiler and the
profiler, so they live a layer above both, in ``quantlens.search``.
"""

from quantlens.quantization.check import ModelCheckResult, check_qat_model
from quantlens.quantization.consistency import ConsistencyConfig, ConsistencyStrategy
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, uncalibrated_sites
from quantlens.quantization.observers import (
    FixedRangeObserver,
    FixedScaleObserver,
    KLObserver,
    MinMaxObserver,
    MSEObserver,
    Observer,
    PercentileObserver,
)
from quantlens.quantization.prepare import prepare
from quantlens.quantization.qconfig import QConfig, QuantSpec, get_qconfig
from quantlens.quantization.queries import get_op_sites, without_integer_rules
from quantlens.quantization.stages import calibrate, set_fake_quantize
from quantlens.quantization.state import is_prepared, use_runtime
from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = [
    "ConsistencyStrategy",
    "ConsistencyConfig",
    "prepare",
    "is_prepared",
    "use_runtime",
    "set_fake_quantize",
    "uncalibrated_sites",
    "calibrate",
    "FakeQuantState",
    "FakeQuantize",
    "QuantStub",
    "DeQuantStub",
    "QConfig",
    "QuantSpec",
    "get_qconfig",
    "get_op_sites",
    "without_integer_rules",
    "check_qat_model",
    "ModelCheckResult",
    "Observer",
    "MinMaxObserver",
    "PercentileObserver",
    "MSEObserver",
    "KLObserver",
    "FixedScaleObserver",
    "FixedRangeObserver",
    "pre_export",
    "pre_export_report",
    "set_lut_enabled",
    "lut_sites",
    "lut_errors",
    "LutSiteInfo",
]
from quantlens.quantization.nonfinite import NonFiniteError, NonFiniteSite, detect_nonfinite, find_nonfinite  # noqa: E402,F401,E501
from quantlens.quantization.pre_export import (  # noqa: E402,F401,E501
    LutSiteInfo,
    lut_errors,
    lut_sites,
    pre_export,
    pre_export_report,
    set_lut_enabled,
)

__all__ += ["find_nonfinite", "detect_nonfinite", "NonFiniteSite", "NonFiniteError"]
