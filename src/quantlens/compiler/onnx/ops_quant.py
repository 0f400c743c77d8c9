"""ONNX converters: fake quant.

A fake quant of an activation becomes ``QuantizeLinear`` followed by its dequantization (``Builder.dequantize``:
``Cast -> Mul`` by default, ``DequantizeLinear`` in the standard QDQ form), or its own float arithmetic where no
``QuantizeLinear`` type holds its range (int32). A fake quant of a constant is folded into an integer initializer
and the same dequantization when that reproduces it bit for bit (checked at export), else a float initializer.
"""

from __future__ import annotations

import torch

from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.registry import onnx_converter
from quantlens.march.ort_cpu import X86_ACTIVATION_SHIFT

#: (qmin, qmax) -> the QuantizeLinear output type that holds exactly that range.
_QDQ_TYPES = {(-128, 127): "int8", (-32768, 32767): "int16", (0, 255): "uint8", (0, 65535): "uint16"}


def _container(qmin: int, qmax: int) -> str | None:
    """The integer dtype that stores codes in [qmin, qmax] for a folded constant (None: none fits)."""
    for dtype in ("int8", "uint8", "int16", "uint16", "int32"):
        info = torch.iinfo(getattr(torch, dtype))
        if info.min <= qmin and qmax <= info.max:
            return dtype
    return None


def _scale_tensor(b: Builder, node: Node) -> torch.Tensor:
    name = node.inputs[1]
    if name not in b.graph.constants:
        raise b.error(node, f"its scale '{name}' is not a constant",
                      "Export from a calibrated or trained model in VALIDATION state (frozen scales).")
    return b.graph.constants[name].detach().to(torch.float32)


def _broadcast_scale(scale: torch.Tensor, rank: int, axis: int) -> torch.Tensor:
    if scale.dim() > 1 and scale.dim() == rank:  # a folded weight's [out, in] scale (rules.fold_exponents)
        return scale
    if axis < 0 or scale.numel() == 1:
        return scale.reshape(())
    shape = [1] * rank
    shape[axis] = -1
    return scale.reshape(shape)


@onnx_converter("fake_quant")
def _fake_quant(b: Builder, node: Node) -> None:
    x, _ = node.inputs
    out = node.outputs[0]
    qmin, qmax, axis = int(node.attrs["qmin"]), int(node.attrs["qmax"]), int(node.attrs.get("axis", -1))
    scale = _scale_tensor(b, node)
    per_axis = axis >= 0 and scale.numel() > 1
    if x in b.graph.constants:
        _folded_fake_quant(b, node, b.graph.constants[x], scale, qmin, qmax, axis, per_axis)
        return
    rank = b.rank(x)
    if per_axis and rank is None:
        raise b.error(node, "the rank of its input is unknown", "Export again; every value should carry a shape.")
    qtype = _QDQ_TYPES.get((qmin, qmax))
    xf = b.cast(x, "float32")  # the fake quant computes in float32, like quantlens::fake_quant
    if qtype is None:  # e.g. int32: QuantizeLinear has no such output type; write the fake quant's arithmetic
        s = b.init(_broadcast_scale(scale, rank or 0, axis).to(torch.float32), f"{out}/scale")
        q = b.add("Div", [xf, s], f"{out}/div", dtype="float32", rank=rank)
        q = b.add("Round", [q], f"{out}/round", dtype="float32", rank=rank)
        lo, hi = b.scalar(float(qmin), "float32", f"{out}/qmin"), b.scalar(float(qmax), "float32", f"{out}/qmax")
        q = b.add("Clip", [q, lo, hi], f"{out}/clip", dtype="float32", rank=rank)
        y = b.add("Mul", [q, s], out if b.dtype(x) in (None, "float32") else f"{out}/mul", dtype="float32", rank=rank)
        if y != out:
            b.add("Cast", [y], out, dtype=b.dtype(x), rank=rank, to=onnx_dtype(b.dtype(x)))
        return
    scale_name = node.inputs[1]
    scale_dim = b.graph.constants[scale_name].dim()
    if per_axis:
        s = b.value(scale_name) if scale_dim == 1 else b.init(scale.reshape(-1), f"{out}/scale")
        zp = b.init(torch.zeros((scale.numel(),), dtype=getattr(torch, qtype)), f"{out}/zero_point")
        attrs = {"axis": axis}
    elif qtype == "int8" and b.uint8_activations:  # code + 128 with zero point 128: the runtime's form on x86
        s = b.value(scale_name) if scale_dim == 0 else b.init(scale.reshape(()), f"{out}/scale")
        qtype = "uint8"
        zp = b.init(torch.full((), X86_ACTIVATION_SHIFT, dtype=torch.uint8), f"{out}/zero_point")
        attrs = {}
    else:
        s = b.value(scale_name) if scale_dim == 0 else b.init(scale.reshape(()), f"{out}/scale")
        zp = b.init(torch.zeros((), dtype=getattr(torch, qtype)), f"{out}/zero_point")
        attrs = {}
    if b.dtype(s) != "float32":
        s = b.cast(s, "float32")
    q = b.add("QuantizeLinear", [xf, s, zp], f"{out}/q", dtype=qtype, rank=rank, **attrs)
    y = b.dequantize(q, scale, zp, axis if per_axis else -1, rank,
                     out if b.dtype(x) in (None, "float32") else f"{out}/dq", scale_name=s)
    if y != out:
        b.add("Cast", [y], out, dtype=b.dtype(x), rank=rank, to=onnx_dtype(b.dtype(x)))


def _folded_fake_quant(b: Builder, node: Node, x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int,
                       axis: int, per_axis: bool) -> None:
    out = node.outputs[0]
    expected = torch.ops.quantlens.fake_quant(x, scale, qmin, qmax, axis)
    container = _container(qmin, qmax)
    # (a weight folded with channel exponents has an [out, in] scale, which no DequantizeLinear takes: a float
    # initializer holding the fake quant's values)
    if container is not None and x.dtype == torch.float32 and scale.dim() <= 1:
        s = _broadcast_scale(scale, x.dim(), axis)
        q = torch.div(x.to(torch.float32), s).round().clamp(qmin, qmax)
        info = torch.iinfo(getattr(torch, container))
        q_int = q.to(torch.float64).clamp(info.min, info.max).to(getattr(torch, container))
        if torch.equal(q_int.to(torch.float32) * s, expected):  # the dequantization reproduces the fake quant
            qname = b.init(q_int, f"{out}/quantized")
            zp = None
            if container != "int32" and b.standard_qdq:
                zp_shape = (scale.numel(),) if per_axis else ()
                zp = b.init(torch.zeros(zp_shape, dtype=getattr(torch, container)), f"{out}/zero_point")
            b.dequantize(qname, scale, zp, axis if per_axis else -1, x.dim(), out)
            return
    b.add("Identity", [b.init(expected, f"{out}/folded")], out, dtype=str(expected.dtype).replace("torch.", ""),
          rank=expected.dim())
