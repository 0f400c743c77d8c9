"""Which kernel onnxruntime runs for each op site of an ONNX file written by ``to_onnx``: read from the runtime's own
optimized graph (default ``SessionOptions``), not predicted (``docs/march_ort.md``).

``to_onnx`` names every node ``<op site>/<op>/<index>``, and the runtime's graph optimizations keep that name (with
a suffix) on the node that replaces a fused group, so each kernel of the optimized graph is traced back to the op
site it computes. A kernel is *integer* when it is one of the runtime's fused int8 kernels; everything else (a
float ``Conv``, ``FusedConv``, ``Add`` between a DequantizeLinear and a QuantizeLinear) runs in float.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RuntimeKernel", "INTEGER_KERNELS", "runtime_kernels", "kernels_by_site", "site_of"]

#: the runtime's fused int8 kernels (op types of its optimized graph); the movement ops it runs on the codes
#: (Reshape, Transpose, MaxPool ... with equal input and output parameters) keep their own op type
INTEGER_KERNELS = frozenset({
    "QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "QLinearAdd", "QLinearMul", "QLinearConcat",
    "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax",
    "QLinearWhere",
})
#: the runtime's own plumbing: a boundary, or a layout change it adds around a kernel
_PLUMBING = frozenset({"QuantizeLinear", "DequantizeLinear", "ReorderInput", "ReorderOutput"})


@dataclass(frozen=True)
class RuntimeKernel:
    """One node of the runtime's optimized graph: its op type, the op site it computes (``""`` for a node the
    runtime added, such as a layout Transpose), and whether it is a fused integer kernel."""

    op_type: str
    site: str
    name: str

    @property
    def integer(self) -> bool:
        return self.op_type in INTEGER_KERNELS


def site_of(name: str) -> str:
    """``"layer1.conv2/Conv/38_token_26"`` -> ``"layer1.conv2"``; a name without ``/`` is the runtime's own."""
    return name.split("/", 1)[0] if "/" in name else ""


def runtime_kernels(path: str | os.PathLike) -> list[RuntimeKernel]:
    """The kernels onnxruntime's CPU execution provider runs for the ONNX file at ``path`` at its default options
    (its graph optimizations included), in graph order, Q/DQ boundaries left out."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(optimized)
        options.log_severity_level = 3  # (the runtime warns that a fully optimized file is hardware specific)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(str(optimized)).graph
    return [RuntimeKernel(n.op_type, site_of(n.name), n.name) for n in graph.node if n.op_type not in _PLUMBING]


def kernels_by_site(kernels: list[RuntimeKernel]) -> dict[str, list[str]]:
    """``op site -> op types of the runtime's kernels that compute it`` (sites in first-seen order; the runtime's
    own nodes, such as layout Transposes around an NHWC kernel, left out)."""
    found: dict[str, list[str]] = {}
    for k in kernels:
        if k.site and k.op_type not in found.setdefault(k.site, []):
            found[k.site].append(k.op_type)
    return found
