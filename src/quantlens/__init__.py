"""quantlens: PyTorch to integer NPU, with a layer-by-layer precision profiler."""

from quantlens.errors import DiskFullError, QuantLensError
from quantlens.march import March, MarchSpec, QuantDType, RoundingMode, get_march, set_march

__all__ = ["QuantLensError", "DiskFullError", "March", "MarchSpec", "QuantDType", "RoundingMode", "get_march", "set_march"]
__version__ = "0.1.0"
