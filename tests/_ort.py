"""onnxruntime sessions for the ONNX tests, at the two levels every ONNX test checks with one bound.

* ``"disable_all"``: ``ORT_DISABLE_ALL``, the graph as written.
* ``"default"``: a session with onnxruntime's default options (``ORT_ENABLE_ALL``): what a user gets.

Whether onnxruntime's default level is exact depends on the CPU when it fuses Q/DQ groups into its int8 GEMM
kernels (their u8s8 path saturates 16-bit intermediate sums on x86 CPUs without VNNI), so a test that only compared
outputs would pass on one machine and fail on another. :func:`saturating_kernels` reads the optimized graph
onnxruntime writes and names every such kernel left in it: that check gives the same answer on every CPU.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

LEVELS = ("disable_all", "default")

#: onnxruntime kernels with an integer GEMM inside (the u8s8 / s8s8 paths of MLAS); on x86 without VNNI their
#: u8s8 path sums pairs of products in 16 bits and saturates.
INTEGER_GEMM_KERNELS = frozenset({
    "QLinearConv", "QLinearConvTranspose", "QGemm", "QLinearMatMul", "MatMulInteger", "ConvInteger",
    "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention", "DynamicQuantizeLSTM", "QEmbedLayerNormalization",
    "QOrderedMatMul", "QOrderedAttention", "MatMulNBits", "NhwcQLinearConv",
})


def session(path, level: str, **config) -> ort.InferenceSession:
    """A CPU session at ``level`` (one of :data:`LEVELS`); ``config`` adds session config entries."""
    options = ort.SessionOptions()
    if level == "disable_all":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    elif level != "default":
        raise ValueError(f"level {level!r} is not one of {LEVELS}")
    options.log_severity_level = 3
    options.intra_op_num_threads = 1  # the tests' thread count (tests/conftest.py): no pool to wait for
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def optimized_ops(path, folder) -> list[str]:
    """The op types of the graph onnxruntime runs at its default level (its ``optimized_model_filepath``)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.optimized_model_filepath = str(Path(folder) / f"{Path(path).stem}.optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def saturating_kernels(path, folder) -> set[str]:
    """The integer GEMM kernels onnxruntime's default level leaves in the graph of the model at ``path``."""
    return set(optimized_ops(path, folder)) & INTEGER_GEMM_KERNELS
