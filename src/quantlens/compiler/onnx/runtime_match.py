"""Whether the fused int8 kernels ``convert`` assumed under ``March.ORT_CPU`` are the ones onnxruntime runs for the
file ``to_onnx`` writes: the quantized IR's kernels (nodes with ``runtime: "ort_cpu"``) against the runtime's own
optimized graph (:func:`.runtime_kernels.runtime_kernels`), op site by op site.

A difference means the quantized IR does not predict the runtime (a fusion rule of a newer onnxruntime, a pattern
the march's converters misjudge), so it is an error naming each op site, both kernels and the runtime's version.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quantlens.compiler.ir import Module, Node
from quantlens.compiler.onnx.runtime_kernels import INTEGER_KERNELS, runtime_kernels
from quantlens.errors import QuantLensError

__all__ = ["FusionDifference", "assumed_kernels", "fusion_differences", "check_fusion", "FusedOpComparison",
           "compare_fused_ops", "kernel_of", "ZERO_POINT_INPUT", "channels_last_values", "activation_inputs",
           "in_ir_layout", "in_runtime_layout", "reads_channels_last"]


def kernel_of(node: Node) -> str | None:
    """The runtime kernel a quantized IR node of ``March.ORT_CPU`` stands for (None: no kernel of its own)."""
    if node.attrs.get("runtime") is None or node.op == "requantize":  # a DequantizeLinear -> QuantizeLinear pair
        return None
    float_out = "out_dtype" not in node.attrs
    if node.op in ("conv1d", "conv2d"):
        return "QLinearConv"
    if node.op == "linear":
        return "QGemm"
    if node.op == "matmul":
        return "MatMulIntegerToFloat" if float_out else "QLinearMatMul"
    if node.op == "avg_pool2d_int":
        return "QLinearGlobalAveragePool" if node.attrs.get("global") else "QLinearAveragePool"
    if node.op in ("sigmoid", "leaky_relu"):
        return node.attrs.get("runtime_kernel")
    return {"add": "QLinearAdd", "mul": "QLinearMul", "cat": "QLinearConcat", "softmax": "QLinearSoftmax"}.get(node.op)


def assumed_kernels(quantized: Module) -> dict[str, list[str]]:
    """``op site -> the fused int8 kernels convert assumed the runtime runs for it`` (an attention's two matmuls
    share one site), sorted."""
    found: dict[str, list[str]] = {}
    for node in quantized.graph.nodes:
        kernel = kernel_of(node)
        if kernel:
            found.setdefault(node.site, []).append(kernel)
    return {site: sorted(kernels) for site, kernels in found.items()}


@dataclass(frozen=True)
class FusionDifference:
    """One op site whose kernels differ: the fused kernels convert assumed (``""``: float) and what the runtime
    runs there."""

    site: str
    assumed: str
    runtime: str

    def describe(self) -> str:
        return f"op site '{self.site}': convert assumed {self.assumed or 'float'}, onnxruntime runs {self.runtime}"


def fusion_differences(quantized: Module, onnx_path: str | os.PathLike) -> list[FusionDifference]:
    """The op sites where the quantized IR's assumed kernel and the runtime's kernels for ``onnx_path`` differ."""
    assumed = assumed_kernels(quantized)
    ran: dict[str, list[str]] = {}
    for kernel in runtime_kernels(onnx_path):
        if kernel.site:
            ran.setdefault(kernel.site, []).append(kernel.op_type)
    differences = []
    for site in dict.fromkeys([*assumed, *ran]):
        fused = sorted(k for k in ran.get(site, ()) if k in INTEGER_KERNELS)
        want = assumed.get(site, [])
        if fused != want:
            runs = ", ".join(sorted(ran.get(site, ()))) or "nothing of its own"
            differences.append(FusionDifference(site, " + ".join(want), runs))
    return differences


def check_fusion(qat_ir: Module, quantized: Module) -> None:
    """Write ``qat_ir`` as ``to_onnx`` does, read the kernels onnxruntime runs for it (default options) and refuse a
    quantized IR whose assumed kernels differ, naming each op site, both kernels and the runtime's version."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise QuantLensError("convert: March.ORT_CPU checks its kernels against onnxruntime; install it with "
                             "pip install 'quantlens[onnx]'.") from exc
    from quantlens.compiler.onnx.driver import to_onnx

    with tempfile.TemporaryDirectory() as folder:
        path = to_onnx(qat_ir, Path(folder) / "model.onnx", standard_qdq=True)
        differences = fusion_differences(quantized, path)
    if differences:
        shown = "; ".join(d.describe() for d in differences[:8])
        more = f" (and {len(differences) - 8} more)" if len(differences) > 8 else ""
        raise QuantLensError(
            f"convert: the quantized IR of March.ORT_CPU does not match what onnxruntime {onnxruntime.__version__} "
            f"runs for this model: {shown}{more}. The march's fusion rules (docs/march_ort.md) were checked against "
            "onnxruntime 1.32; run with that version, or report the model and the version.")


#: fused kernel -> the index of its output zero point among its inputs (none: a float output)
ZERO_POINT_INPUT = {"QLinearConv": 7, "QLinearMatMul": 7, "QGemm": 8, "QLinearAdd": 7, "QLinearMul": 7,
                      "QLinearConcat": 1, "QLinearGlobalAveragePool": 4, "QLinearAveragePool": 4,
                      "QLinearSoftmax": 4, "QLinearSigmoid": 4, "QLinearLeakyRelu": 4}


@dataclass(frozen=True)
class FusedOpComparison:
    """One fused kernel of the runtime against the quantized IR's node that stands for it, on the same model input:
    how many of its ``elements`` output elements differ when each computes from its own run (``differ``, largest
    difference ``max_abs``; an upstream float op's last bit can move a code), and when the IR's node computes from
    the runtime's own inputs to the kernel (``same_input_differ``: the kernel rule itself)."""

    site: str
    op_type: str
    elements: int
    differ: int
    max_abs: float
    same_input_differ: int


#: kernels that keep their input's layout (the runtime's NHWC rewrite leaves them between its Transposes)
_LAYOUT_KEEPING = frozenset({"QLinearAdd", "QLinearMul", "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu",
                             "QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "MaxPool"})


def channels_last_values(nodes: list) -> set[str]:
    """The values of the runtime's optimized graph that hold a channels-last tensor: written by a kernel with
    ``channels_last=1`` or by a Transpose to NHWC the runtime added (a Transpose of the model's own is named after its
    op site), passed on by the kernels that keep their input's layout. (What such a kernel reads is channels last
    to it whatever made it: the runtime moves the layout change up through a Pad, a QuantizeLinear, or folds it into
    the model's own Transpose; :func:`reads_channels_last`.)"""
    from quantlens.compiler.onnx.runtime_kernels import site_of

    found: set[str] = set()
    for node in nodes:
        attrs = {a.name: a for a in node.attribute}
        if "channels_last" in attrs and attrs["channels_last"].i:  # writes NHWC (what it reads: reads_channels_last)
            found.update(node.output)
        elif node.op_type == "Transpose" and not site_of(node.name) and list(attrs["perm"].ints) == [0, 2, 3, 1]:
            found.update(node.output)
        elif node.op_type in _LAYOUT_KEEPING and any(name in found for name in node.input):
            found.update(node.output)
    return found


#: fused kernel -> the indices of its activation inputs (the others are its constants and quantization parameters)
_ACTIVATIONS = {"QLinearConv": (0,), "QGemm": (0,), "QLinearMatMul": (0, 3), "MatMulIntegerToFloat": (0, 1),
                "QLinearAdd": (0, 3), "QLinearMul": (0, 3), "QLinearGlobalAveragePool": (0,),
                "QLinearAveragePool": (0,), "QLinearSoftmax": (0,), "QLinearSigmoid": (0,), "QLinearLeakyRelu": (0,)}


def activation_inputs(node) -> tuple[int, ...]:
    if node.op_type == "QLinearConcat":
        return tuple(range(2, len(node.input), 3))
    return _ACTIVATIONS.get(node.op_type, ())


def _permutation(have: tuple, want: tuple) -> list[int] | None:
    """The order of ``have``'s dims that gives ``want`` (None: not the same dims); equal sizes keep their order
    (a layout change moves the channels, it does not swap two equal spatial dims)."""
    if have == want or len(have) != len(want) or sorted(have) != sorted(want):
        return None
    order, used = [], set()
    for size in want:
        index = next(i for i, d in enumerate(have) if d == size and i not in used)
        used.add(index)
        order.append(index)
    return order


def in_ir_layout(t, shape: tuple, channels_last: bool):
    """The runtime's tensor ``t`` in the IR's layout of ``shape``: back from channels last (the runtime's NHWC
    rewrite) where that gives the IR's shape, or from another order of the same dims (its transpose optimizer runs
    an elementwise kernel on the transposed tensor and moves the Transpose after it), else reshaped (a 2-D Gemm's
    rows). A flag whose permutation does not give ``shape`` while ``t`` already has it is not followed (an add of a
    channels-last and a channels-first input, which the runtime computed channels first)."""
    shape = tuple(shape)
    if channels_last and t.dim() > 2:
        nchw = t.permute(0, t.dim() - 1, *range(1, t.dim() - 1))
        if tuple(nchw.shape) == shape:
            return nchw
    if tuple(t.shape) == shape:
        return t
    order = _permutation(tuple(t.shape), shape)
    return (t.permute(*order) if order is not None else t).reshape(shape)


def in_runtime_layout(t, shape: tuple, channels_last: bool):
    """The IR's tensor ``t`` in the runtime's layout of ``shape`` (the inverse of :func:`in_ir_layout`)."""
    if channels_last and t.dim() > 2:
        t = t.permute(0, *range(2, t.dim()), 1)
    else:
        order = _permutation(tuple(t.shape), tuple(shape))
        if order is not None:
            t = t.permute(*order)
    return t.reshape(shape)


def reads_channels_last(node) -> bool:
    """Whether the runtime's kernel ``node`` reads its activation input channels last (``channels_last=1``)."""
    return any(a.name == "channels_last" and a.i for a in node.attribute)


def compare_fused_ops(quantized: Module, onnx_path: str | os.PathLike, feeds: dict) -> list[FusedOpComparison]:
    """Run the quantized IR and onnxruntime (default options) on ``feeds`` and compare each fused kernel's output with
    the IR's node that stands for it (same op site and kernel, in graph order): from the two runs, and with the IR's
    node run again on the very inputs the runtime gave its kernel. The runtime's codes less its zero point are the
    IR's codes; a value the runtime holds channels last (its NHWC rewrite) is moved back to channels first."""
    import numpy as np
    import torch

    from quantlens.compiler.kernels_int import int_dispatch
    from quantlens.compiler.onnx.runtime_check import exposed_run
    from quantlens.compiler.onnx.runtime_kernels import site_of

    ours: dict[tuple[str, str], list] = {}

    def keep(node, inputs, outputs):
        kernel = kernel_of(node)
        if kernel:
            out = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
            ours.setdefault((node.site, kernel), []).append((node, list(inputs), out))

    quantized.run({k: torch.as_tensor(v) for k, v in feeds.items()}, observer=keep)
    fused, values, nodes = exposed_run(onnx_path, {k: np.asarray(v) for k, v in feeds.items()})
    channels_last = channels_last_values(nodes)

    def ir_codes(name: str, zero_point: int, like: torch.Tensor, nhwc: bool | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.array(values[name]))
        if not t.is_floating_point():
            t = (t.to(torch.int32) - zero_point).to(like.dtype)
        return in_ir_layout(t, tuple(like.shape), name in channels_last if nhwc is None else nhwc)

    found = []
    for node in fused:
        queue = ours.get((site_of(node.name), node.op_type))
        if not queue:
            continue
        ir_node, ir_inputs, mine = queue.pop(0)
        zp_index = ZERO_POINT_INPUT.get(node.op_type)
        z_out = int(np.asarray(values[node.input[zp_index]]).reshape(-1)[0]) if zp_index is not None and \
            zp_index < len(node.input) and node.input[zp_index] else 0
        got = ir_codes(node.output[0], z_out, mine)
        diff = (mine.to(torch.float64) - got.to(torch.float64)).abs()
        same = list(ir_inputs)
        activations = [i for i, v in enumerate(ir_node.inputs) if v and v not in quantized.graph.constants]
        zero_points = ir_node.attrs["zero_points"]  # the inputs', then the output's (a float output has none)
        in_zero_points = zero_points if "out_dtype" not in ir_node.attrs else zero_points[:-1]
        positions = activation_inputs(node)  # the IR node's inputs are the kernel's operands, in order
        for slot, index in ((slot, positions[slot]) for slot in activations if slot < len(positions)):
            if np.asarray(values[node.input[index]]).size != ir_inputs[slot].numel():
                raise QuantLensError(f"compare_fused_ops: the runtime's {node.op_type} at op site '{ir_node.site}' reads "
                                     f"{node.input[index]!r} of {np.asarray(values[node.input[index]]).shape} where the "
                                     f"IR's node reads {tuple(ir_inputs[slot].shape)}; report the model.")
            same[slot] = ir_codes(node.input[index], int(in_zero_points[slot]), ir_inputs[slot],
                                  True if reads_channels_last(node) else None)
        again = int_dispatch(ir_node, same)
        again = again[0] if isinstance(again, (list, tuple)) else again
        found.append(FusedOpComparison(ir_node.site, node.op_type, got.numel(), int((diff != 0).sum()),
                                       float(diff.max()) if diff.numel() else 0.0,
                                       int((again.to(torch.float64) != got.to(torch.float64)).sum())))
    return found
