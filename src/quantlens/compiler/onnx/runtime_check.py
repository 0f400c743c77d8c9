"""Each fused int8 kernel onnxruntime runs for an ONNX file, recomputed by quantlens' kernels of the runtime
(:mod:`quantlens.kernels.ort_cpu`) on the very inputs the runtime gave it: the same-input check of the ORT_CPU
target on a real model (``docs/march_ort.md``).

The runtime's optimized graph (default ``SessionOptions``) is run again with every fused kernel's activation
inputs and outputs exposed; each kernel's output is then recomputed from those inputs and the graph's constants and
compared code by code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from quantlens.kernels import ort_cpu as K
from quantlens.march import ort_cpu as R

__all__ = ["KernelCheck", "check_runtime_kernels", "exposed_run"]


@dataclass(frozen=True)
class KernelCheck:
    """One fused kernel of the runtime: its op type, the op site it computes, and how many output elements the
    recomputation gives differently (``None``: no rule for this kernel yet)."""

    op_type: str
    site: str
    elements: int
    differ: int | None


class _Node:
    """A node's inputs as tensors (constants from the graph, activations from the run) and its attributes."""

    def __init__(self, node, values: dict[str, np.ndarray]):
        import onnx

        self.inputs = [torch.from_numpy(np.array(values[n])) if n else None for n in node.input]
        self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def arg(self, i: int) -> Any:
        return self.inputs[i] if i < len(self.inputs) else None


def _int(t) -> int:
    return int(t.reshape(-1)[0]) if t is not None else 0


def _range(t) -> tuple[int, int]:
    return (0, 255) if t is None or t.dtype == torch.uint8 else (-128, 127)


def _exact_matmul(a, za, b, zb) -> torch.Tensor:
    return ((a.to(torch.float64) - za) @ (b.to(torch.float64) - zb)).round().to(torch.int32)


def _conv(n: _Node, variant) -> torch.Tensor:
    x, xs, xz, w, ws, wz, ys, yz = n.inputs[:8]
    bias = n.arg(8)
    nhwc = bool(n.attrs.get("channels_last", 0))
    if nhwc:
        x = x.permute(0, 3, 1, 2)
    pads = n.attrs.get("pads", [0] * 4)
    acc = K.conv_accumulate(x, _int(xz), w, wz.to(torch.int64), bias, n.attrs.get("strides", 1), tuple(pads[:2]),
                            n.attrs.get("dilations", 1), n.attrs.get("group", 1), variant)
    m = R.gemm_multiplier(xs, ws, ys).reshape(1, -1, 1, 1)
    y = K.requantize(acc, m, _int(yz), *_range(yz))
    return y.permute(0, 2, 3, 1) if nhwc else y


def _matmul(n: _Node, variant) -> torch.Tensor:
    a, sa, za, b, sb, zb, sy, zy = n.inputs[:8]
    acc = _exact_matmul(a, _int(za), b, zb.to(torch.float64))
    return K.requantize(acc, R.gemm_multiplier(sa, sb, sy), _int(zy), *_range(zy))


def _matmul_to_float(n: _Node, variant) -> torch.Tensor:
    a, b, sa, sb = n.inputs[:4]
    za, zb, bias = n.arg(4), n.arg(5), n.arg(6)
    acc = _exact_matmul(a, _int(za), b, zb.to(torch.float64) if zb is not None else 0.0)
    y = K.integer_to_float(acc, sa, sb)
    return y + bias if bias is not None else y


def _gemm(n: _Node, variant) -> torch.Tensor:
    a, sa, za, b, sb, zb = n.inputs[:6]
    c, sy, zy = n.arg(6), n.arg(7), n.arg(8)
    if n.attrs.get("transA", 0):
        a = a.T
    if n.attrs.get("transB", 0):
        b = b.T
    acc = _exact_matmul(a, _int(za), b, zb.to(torch.float64))
    if c is not None:
        acc = acc + c.to(torch.int32)
    if sy is None:
        return K.integer_to_float(acc, sa, sb)
    return K.requantize(acc, R.gemm_multiplier(sa, sb, sy), _int(zy), *_range(zy))


def _add(n: _Node, variant) -> torch.Tensor:
    a, sa, za, b, sb, zb, sc, zc = n.inputs[:8]
    r_a, r_b, f = R.add_constants(sa, _int(za), sb, _int(zb), sc, _int(zc))
    return K.qlinear_add(a, b, r_a, r_b, f, *_range(zc))


def _mul(n: _Node, variant) -> torch.Tensor:
    a, sa, za, b, sb, zb, sc, zc = n.inputs[:8]
    return K.qlinear_mul(a, _int(za), b, _int(zb), R.mul_multiplier(sa, sb, sc), _int(zc), *_range(zc))


def _concat(n: _Node, variant) -> torch.Tensor:
    sy, zy = n.inputs[:2]
    lo, hi = _range(zy)
    parts = []
    for i in range(2, len(n.inputs), 3):
        x, sx, zx = n.inputs[i:i + 3]
        table = R.lookup_table(lambda v: v, sx, _int(zx), sy, _int(zy), lo, hi)
        parts.append(K.lookup(x, table, lo))
    return torch.cat(parts, int(n.attrs.get("axis", 0)))


def _global_average(n: _Node, variant) -> torch.Tensor:
    x, sx, zx, sy, zy = n.inputs[:5]
    nhwc = bool(n.attrs.get("channels_last", 0))
    xc = x.permute(0, 3, 1, 2) if nhwc else x
    acc = K.global_average_accumulate(xc, _int(zx))
    y = K.requantize(acc, R.global_average_multiplier(sx, sy, int(np.prod(xc.shape[2:]))), _int(zy), *_range(zy))
    return y.permute(0, 2, 3, 1) if nhwc else y


def _lookup(fn_of: Callable[[_Node], Callable]) -> Callable:
    def kernel(n: _Node, variant) -> torch.Tensor:
        x, sx, zx, sy, zy = n.inputs[:5]
        lo, hi = _range(zy)
        return K.lookup(x, R.lookup_table(fn_of(n), sx, _int(zx), sy, _int(zy), lo, hi), lo)
    return kernel


def _softmax(n: _Node, variant) -> torch.Tensor | None:
    x, sx, _, sy, zy = n.inputs[:5]
    axis = int(n.attrs.get("axis", -1))
    if x.dtype != torch.uint8 or axis not in (-1, x.dim() - 1):
        return None
    return K.qlinear_softmax(x, R.softmax_table(sx, x.shape[-1]), R.softmax_output_scale(sy), _int(zy))


#: op type -> the recomputation of that fused kernel (``None`` from it: a form without a rule yet)
_KERNELS: dict[str, Callable[[_Node, R.KernelVariant], torch.Tensor | None]] = {
    "QLinearConv": _conv, "QLinearMatMul": _matmul, "MatMulIntegerToFloat": _matmul_to_float, "QGemm": _gemm,
    "QLinearAdd": _add, "QLinearMul": _mul, "QLinearConcat": _concat, "QLinearGlobalAveragePool": _global_average,
    "QLinearSigmoid": _lookup(lambda n: R.mlas_logistic),
    "QLinearLeakyRelu": _lookup(lambda n: R.leaky_relu(float(n.attrs.get("alpha", 0.01)))),
    "QLinearSoftmax": _softmax,
}


def exposed_run(path: str | os.PathLike, feeds: dict[str, np.ndarray]):
    """The runtime's fused kernels (its optimized graph's nodes), every value of one run of it (its constants, and
    the activations its fused kernels read and write), and all the optimized graph's nodes in order."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from quantlens.compiler.onnx.runtime_kernels import INTEGER_KERNELS

    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(optimized)
        options.log_severity_level = 3
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        model = onnx.load(str(optimized))
        constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        fused = [n for n in model.graph.node if n.op_type in INTEGER_KERNELS]
        wanted = {v for n in fused for v in (*n.input, *n.output) if v and v not in constants}
        present = {o.name for o in model.graph.output}
        for name in sorted(wanted - present):
            model.graph.output.append(onnx.ValueInfoProto(name=name))
        exposed = Path(tmp) / "exposed.onnx"
        onnx.save(model, str(exposed))
        plain = ort.SessionOptions()
        plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        plain.log_severity_level = 3
        session = ort.InferenceSession(str(exposed), plain, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(names, feeds)))
    return fused, {**constants, **feeds, **values}, list(model.graph.node)


def check_runtime_kernels(path: str | os.PathLike, feeds: dict[str, np.ndarray],
                          variant: R.KernelVariant | None = None) -> list[KernelCheck]:
    """Every fused int8 kernel onnxruntime runs for the ONNX file at ``path`` on ``feeds``, recomputed on its own
    inputs by :mod:`quantlens.kernels.ort_cpu` (``variant``: this CPU's by default), in graph order."""
    from quantlens.compiler.onnx.runtime_kernels import site_of

    variant = variant or R.detect_variant()
    fused, values, _ = exposed_run(path, feeds)
    checks = []
    for node in fused:
        got = torch.from_numpy(np.array(values[node.output[0]]))
        rule = _KERNELS.get(node.op_type)
        ours = rule(_Node(node, values), variant) if rule is not None else None
        differ = None if ours is None else int((ours.reshape(got.shape).to(got.dtype) != got).sum())
        checks.append(KernelCheck(node.op_type, site_of(node.name), got.numel(), differ))
    return checks
