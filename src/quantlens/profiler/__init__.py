"""The profiler: where, layer by layer, a quantized model loses precision (``QuantAnalysis``).

See ``docs/profiler.md``. Public API::

    from quantlens.profiler import QuantAnalysis
"""

from quantlens.profiler.advisor import Finding
from quantlens.profiler.bad_case import BadCaseResult
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.metrics import METRICS, Metric, get_metric, register_metric
from quantlens.profiler.model_access import AnalysisType, ModelAccess, Quantizer
from quantlens.profiler.onnx_access import OnnxModelAccess
from quantlens.profiler.quant_analysis import QuantAnalysis, RunResult
from quantlens.profiler.sensitivity import SensitivityResult, SensitivityRow, SensitivityTable

__all__ = [
    "QuantAnalysis",
    "RunResult",
    "AnalysisType",
    "BadCaseResult",
    "LayerComparison",
    "LayerRow",
    "SensitivityResult",
    "SensitivityTable",
    "SensitivityRow",
    "Finding",
    "Metric",
    "METRICS",
    "get_metric",
    "register_metric",
    "ModelAccess",
    "Quantizer",
    "OnnxModelAccess",
]
