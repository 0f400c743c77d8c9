"""``convert``: qat IR -> quantized IR (integer-only; quantize/dequantize only at the model boundary).

Every value of the qat IR that lies on an integer grid (the output of a ``fake_quant``, or data moved by a
passthrough op) becomes an integer value with a known ``(dtype, scale)``. Each compute op is matched with the
fake quant that ends its output chain (through passthrough ops such as the fused ReLU), and becomes one integer
kernel that accumulates exactly and requantizes straight to that fake quant's scale (``docs/march.md`` §6-§10).
A conv/linear whose output reaches a model output without a fake quant keeps the int32 high-precision output.

Converters live in one registry, ``CONVERTERS``, keyed by qat IR op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from quantlens.compiler.ir import Graph, Module, Node, ValueInfo
from quantlens.compiler.kernels_int import storage_dtype
from quantlens.errors import QuantLensError
from quantlens.march import Qpp, QuantDType, get_march
from quantlens.kernels import TABLE_OP_IO, table_torch_op
from quantlens.march.numerics import (
    channel_affine_params,
    clamp_codes,
    constant_addend,
    constant_code,
    interpolation_weights,
    quantize,
    quantize_multiplier,
)
from quantlens.march.opset import Category, ops_in

__all__ = ["convert", "CONVERTERS", "PASSTHROUGH_OPS", "requant_attrs", "rescale_attrs", "qpp_of"]

#: ops that move integer values without changing them (or their scale): the op set's movement ops.
PASSTHROUGH_OPS = set(ops_in(Category.MOVEMENT, level="qat"))
#: passthrough ops that keep every dimension in place (a per-channel int32 value may pass them).
_DIM_PRESERVING = set(ops_in(Category.MOVEMENT, keeps_dims=True))
#: ops whose outputs after the first are indices (topk, sort, max_dim).
_INDEX_OUTPUTS = set(ops_in(index_outputs=True))


@dataclass
class QInfo:
    """An integer value: storage type and scale (per tensor, or per channel along ``axis``)."""

    name: str  # value name in the quantized IR
    qdtype: QuantDType
    scale: torch.Tensor  # float32, [] or [C]
    axis: int | None = None

    def same_grid(self, qdtype: QuantDType, scale: torch.Tensor) -> bool:
        return self.qdtype is qdtype and self.scale.numel() == scale.numel() and bool(
            torch.equal(self.scale.reshape(-1), scale.reshape(-1).to(self.scale.dtype))
        )


def qpp_of(module: Module) -> Qpp:
    """The requantize precision profile convert uses for ``module`` (a qat IR): high precision where its meta says
    ``high_precision_qpp`` (consistency level 0), else the default one (``docs/march.md`` §8)."""
    return Qpp.HIGH_PRECISION if module.meta.get("high_precision_qpp", False) else Qpp.DEFAULT


def _multiplier(real: float, qpp: Qpp) -> tuple[int, int]:
    """``quantize_multiplier(real, qpp)``; a multiplier outside the default profile's range (``2**-47 <= m <
    2**16 - 1/2``, docs/march.md §8.1) takes the 31-bit one for that requantize (the wide multiplier; the cost
    model charges it as high precision)."""
    if qpp is Qpp.DEFAULT:
        try:
            return quantize_multiplier(real, qpp)
        except QuantLensError:
            pass
    return quantize_multiplier(real, Qpp.HIGH_PRECISION)


def requant_attrs(real: torch.Tensor, qdtype: QuantDType, qpp: Qpp) -> dict:
    """Requantize attrs of one real multiplier per tensor (``[]``/``[1]``) or per channel (``[C]``), §8:
    ``{"multiplier": [M...], "shift": [shift...], "out_dtype": qdtype}`` with ``M`` of profile ``qpp``."""
    reals = real.reshape(-1).tolist() if isinstance(real, torch.Tensor) else [float(real)]
    pairs = [_multiplier(float(m), qpp) for m in reals]
    return {"multiplier": [p[0] for p in pairs], "shift": [p[1] for p in pairs], "out_dtype": qdtype.value}


def rescale_attrs(in_scales: list[torch.Tensor], out_scale: torch.Tensor, qdtype: QuantDType, qpp: Qpp) -> dict:
    """Rescale attrs of add/sub/cat (§10): one ``(M_i, shift_i)`` of ``s_i / s_out`` per input (per-tensor scales,
    float64 division of the float32 scales) and the add rule's ``frac_bits`` F of profile ``qpp``:
    ``{"multipliers", "shifts", "frac_bits", "out_dtype"}`` (cat ignores ``frac_bits``)."""
    s_out = float(torch.as_tensor(out_scale).to(torch.float64).reshape(-1)[0])
    pairs = [_multiplier(float(torch.as_tensor(s).to(torch.float64).reshape(-1)[0]) / s_out, qpp)
             for s in in_scales]
    return {"multipliers": [p[0] for p in pairs], "shifts": [p[1] for p in pairs],
            "frac_bits": get_march().spec.qpp(qpp).elementwise_frac_bits, "out_dtype": qdtype.value}


def _fq_dtype(qmin: int) -> QuantDType:
    return {-128: QuantDType.qint8, -32768: QuantDType.qint16, -(2**31): QuantDType.qint32}[qmin]


class _Converter:
    def __init__(self, qat: Module):
        self.src = qat.graph
        #: the requantize precision profile of every multiplier this conversion derives (§8)
        self.qpp = qpp_of(qat)
        self.out = Graph(nodes=[], inputs=list(qat.graph.inputs), outputs=[], constants={}, values={})
        self.producers = self.src.producers()
        self.consumers = self.src.consumers()
        self.q: dict[str, QInfo] = {}  # qat value -> integer value
        self.float_values: dict[str, str] = {}  # qat value -> float value of the quantized IR (inputs, outputs)
        #: scalar mul/div nodes folded into the preceding GEMM's requantize multiplier
        self.folded: set[str] = set()
        #: qat value -> the op site of the fake quant whose grid the integer op requantizes to (a BatchNorm or
        #: ReLU fused into a conv): the profiler attributes the integer value to that site ("output_site")
        self.grid_sites: dict[str, str] = {}
        self.counter = 0
        for name in qat.graph.inputs:
            self.float_values[name] = name
            self.out.values[name] = qat.graph.values[name]

    # -- helpers ----------------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}_q{self.counter}"

    def const(self, tensor: torch.Tensor, base: str) -> str:
        name = self.fresh(base)
        self.out.constants[name] = tensor
        self.out.values[name] = ValueInfo(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
        return name

    def is_const(self, name: str) -> bool:
        return name in self.src.constants

    def emit(self, node: Node, op: str, inputs: list[str], attrs: dict, qdtype: QuantDType | None,
             scale: torch.Tensor | None, axis: int | None = None, src_out: str | None = None) -> str:
        src_out = src_out or node.outputs[0]
        name = self.fresh(src_out)
        grid_site = self.grid_sites.get(src_out)
        if qdtype is not None and grid_site and grid_site != node.site:
            attrs = {**attrs, "output_site": grid_site}
        self.out.nodes.append(Node(op, inputs, [name], attrs, node.site))
        info = self.src.values.get(src_out, ValueInfo((), "unknown"))
        if qdtype is not None:
            scale_name = self.const(scale.to(torch.float32), f"{src_out}_scale")
            self.out.values[name] = ValueInfo(info.shape, storage_dtype(qdtype.value).__repr__().replace(
                "torch.", ""), qdtype.value, scale_name, axis)
            self.q[src_out] = QInfo(name, qdtype, scale.to(torch.float32), axis)
        else:
            self.out.values[name] = info
            self.float_values[src_out] = name
        return name

    def int_input(self, node: Node, value: str) -> QInfo:
        info = self.q.get(value)
        if info is None:
            raise QuantLensError(
                f"convert: op '{node.op}' at op site '{node.site}' takes '{value}', which is not quantized. Every "
                "input of a compute op must come from a fake quant in the qat IR; check that this op site has a "
                "qconfig (model_check_result.txt lists sites left float)."
            )
        return info

    def requant_attrs(self, real: torch.Tensor, qdtype: QuantDType) -> dict:
        return requant_attrs(real, qdtype, self.qpp)

    def output_grid(self, node: Node, fold_scalars: bool = False):
        """The fake quant that ends this compute op's output chain (through passthrough ops), if any.

        With ``fold_scalars`` (GEMMs), multiplications by positive scalar constants on the way are folded into
        the requantize multiplier; the result is then ``(dtype, scale, factor)``.
        """
        value = node.outputs[0]
        factor, folded = 1.0, []
        seen = 0
        while seen < 64:
            seen += 1
            users = self.consumers.get(value, [])
            if len(users) != 1 or value in self.src.outputs:
                return None
            user = users[0]
            if user.op == "fake_quant" and user.inputs[0] == value:
                grid = _fq_dtype(user.attrs["qmin"]), self.src.constants[user.inputs[1]].to(torch.float32)
                self.grid_sites[node.outputs[0]] = user.site
                if not fold_scalars:
                    return grid
                self.folded.update(folded)
                return (*grid, factor)
            k = _scalar(self, user.inputs[1]) if user.op in ("mul", "div") and len(user.inputs) == 2 else None
            if fold_scalars and k is not None and k > 0 and user.inputs[0] == value:
                factor *= k if user.op == "mul" else 1.0 / k
                folded.append(user.outputs[0])
                value = user.outputs[0]
                continue
            if user.op in PASSTHROUGH_OPS and user.inputs[0] == value and user.op not in _INDEX_OUTPUTS:
                value = user.outputs[0]
                continue
            return None
        return None

    # -- driver -----------------------------------------------------------------------------------------------
    def run(self) -> Graph:
        for node in self.src.nodes:
            if self.is_host_op(node):
                self.host_op(node)
                continue
            converter = CONVERTERS.get(node.op)
            if converter is None:
                raise QuantLensError(
                    f"convert: no integer lowering for op '{node.op}' (op site '{node.site}'). Supported ops are "
                    "listed in docs/ir.md."
                )
            converter(self, node)
        for value in self.src.outputs:
            self.out.outputs.append(self.boundary_output(value))
        self._name_scales()
        return self.out

    def _name_scales(self) -> None:
        """Every integer value names its scale constant (passthrough results share their input's), so a reader
        of the quantized IR (the profiler, a runtime) can dequantize any value."""
        by_scale: dict[int, str] = {}
        for info in self.q.values():
            value = self.out.values.get(info.name)
            if value is None or not value.qdtype:
                continue
            if value.scale is not None:
                by_scale.setdefault(id(info.scale), value.scale)
        for info in self.q.values():
            value = self.out.values.get(info.name)
            if value is None or not value.qdtype or value.scale is not None:
                continue
            if id(info.scale) not in by_scale:
                by_scale[id(info.scale)] = self.const(info.scale, f"{info.name}_scale")
            value.scale = by_scale[id(info.scale)]
            value.axis = info.axis

    def is_host_op(self, node: Node) -> bool:
        """Float post-processing after the boundary (all inputs are float values that left the NPU)."""
        data = [v for v in node.inputs if v and not self.is_const(v)]
        if node.attrs.get("host"):
            return True
        return (
            node.op != "fake_quant"
            and bool(data)
            and all(v in self.float_values and v not in self.src.inputs for v in data)
            and any(self.src.values[v].dtype.startswith("float") for v in data)
        )

    def host_op(self, node: Node) -> None:
        """Kept as a float op with the qat IR's semantics (``attrs["host"]``): it runs on the host, not the NPU."""
        ins = [_index_input(self, node, v) for v in node.inputs]
        outs = [self.fresh(o) for o in node.outputs]
        self.out.nodes.append(Node(node.op, ins, outs, {**node.attrs, "host": True}, node.site))
        for src_out, name in zip(node.outputs, outs):
            self.out.values[name] = self.src.values.get(src_out, ValueInfo((), "unknown"))
            self.float_values[src_out] = name

    def boundary_output(self, value: str) -> str:
        if value in self.q:
            info = self.q[value]
            scale = self.const(info.scale, f"{value}_out_scale")
            name = self.fresh(f"{value}_float")
            self.out.nodes.append(Node("dequantize", [info.name, scale], [name], {"axis": info.axis}, "output"))
            self.out.values[name] = ValueInfo(self.src.values[value].shape, "float32")
            return name
        if value in self.float_values:
            return self.float_values[value]
        if value in self.src.constants:
            return self.const(self.src.constants[value], value)
        raise QuantLensError(f"convert: model output '{value}' was not produced by the converted graph.")


CONVERTERS: dict[str, Callable[[_Converter, Node], None]] = {}


def converter(*ops: str):
    def register(fn):
        for op in ops:
            CONVERTERS[op] = fn
        return fn

    return register


@converter("fake_quant")
def _fake_quant(c: _Converter, node: Node) -> None:
    x, scale_name = node.inputs
    qdtype = _fq_dtype(node.attrs["qmin"])
    scale = c.src.constants[scale_name].to(torch.float32)
    axis = node.attrs["axis"] if node.attrs["axis"] >= 0 else None
    out = node.outputs[0]
    if c.is_const(x):  # weights and biases become integer constants
        q = quantize(c.src.constants[x], scale, qdtype, axis, storage_dtype(qdtype.value))
        name = c.const(q, out)
        c.out.values[name].qdtype = qdtype.value
        c.q[out] = QInfo(name, qdtype, scale, axis)
        return
    if x in c.q:
        info = c.q[x]
        if info.same_grid(qdtype, scale):
            c.q[out] = info
            return
        real = info.scale.to(torch.float64) / scale.to(torch.float64)
        attrs = c.requant_attrs(real, qdtype)
        attrs["axis"] = info.axis
        c.emit(node, "requantize", [info.name], attrs, qdtype, scale)
        return
    if x in c.float_values:  # a model input: the boundary quantize
        scale_const = c.const(scale, f"{out}_in_scale")
        c.emit(node, "quantize", [c.float_values[x], scale_const], {"out_dtype": qdtype.value, "axis": axis},
               qdtype, scale, axis)
        return
    raise QuantLensError(
        f"convert: fake quant at op site '{node.site}' quantizes '{x}', a float value computed inside the model. "
        "Only model inputs may be quantized from float; the op producing it has no integer form."
    )


def _gemm(c: _Converter, node: Node, channel_axis: int | None) -> None:
    x = c.int_input(node, node.inputs[0])
    w = c.int_input(node, node.inputs[1])
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    acc_scale = x.scale.to(torch.float64) * w.scale.to(torch.float64)  # exact product of float32 scales
    inputs = [x.name, w.name]
    if bias:
        b = c.int_input(node, bias)
        if b.qdtype is not QuantDType.qint32:
            raise QuantLensError(f"convert: the bias of op site '{node.site}' is not int32-quantized.")
        inputs.append(b.name)
    elif node.op != "matmul":
        inputs.append("")
    grid = c.output_grid(node, fold_scalars=True)
    if grid is None:
        if node.op == "matmul":
            raise QuantLensError(f"convert: matmul at op site '{node.site}' has no output fake quant.")
        scale = acc_scale.to(torch.float32)
        axis = None if scale.numel() == 1 else channel_axis
        c.emit(node, node.op, inputs, {**node.attrs, "out_dtype": "qint32"}, QuantDType.qint32, scale, axis)
        return
    qdtype, out_scale, factor = grid
    attrs = {**node.attrs, **c.requant_attrs(acc_scale * factor / out_scale.to(torch.float64), qdtype)}
    c.emit(node, node.op, inputs, attrs, qdtype, out_scale)


@converter("conv2d", "conv1d")
def _conv(c, node):
    _gemm(c, node, 1)


@converter("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(c, node):
    """A transposed conv accumulates like a conv (§6): its weight ``[in, out, k...]`` is per channel along axis 1
    (the output channels), so the bias and the requantize are per output channel (dim 1 of the output)."""
    w = c.int_input(node, node.inputs[1])
    if w.scale.numel() > 1 and (w.axis != 1 or node.attrs.get("groups", 1) != 1):
        raise QuantLensError(
            f"convert: {node.op} at op site '{node.site}' has a weight quantized per channel along axis "
            f"{w.axis} with groups={node.attrs.get('groups', 1)}; a transposed conv needs axis 1 (its output "
            "channels) and groups = 1, or a per-tensor weight."
        )
    _gemm(c, node, 1)


@converter("linear")
def _linear(c, node):
    _gemm(c, node, len(c.src.values[node.outputs[0]].shape) - 1)


@converter("matmul")
def _matmul(c, node):
    _gemm(c, node, None)


def _required_grid(c: _Converter, node: Node) -> tuple[QuantDType, torch.Tensor]:
    grid = c.output_grid(node)
    if grid is None:
        raise QuantLensError(
            f"convert: op '{node.op}' at op site '{node.site}' has no output fake quant; its integer result needs "
            "an output scale. Give the op site a qconfig with an int8/int16 output."
        )
    return grid


@converter("add", "sub", "cat")
def _rescaled(c, node):
    if node.op in ("add", "sub") and any(_scalar(c, v) is not None for v in node.inputs):
        return _add_constant(c, node)
    # an empty constant (torch.zeros(1, 0) padding a cat to a multiple) adds nothing and has no grid
    values = [v for v in node.inputs if not (c.is_const(v) and c.src.constants[v].numel() == 0)]
    infos = [c.int_input(node, v) for v in values]
    qdtype, out_scale = _required_grid(c, node)
    attrs = rescale_attrs([i.scale for i in infos], out_scale, qdtype, c.qpp)
    if node.op == "cat":  # each input is requantized alone (§10): no sum, no F
        del attrs["frac_bits"]
        attrs["dim"] = node.attrs["dim"]
    c.emit(node, node.op, [i.name for i in infos], attrs, qdtype, out_scale)


def _add_constant(c: _Converter, node: Node) -> None:
    """``x ± k`` for a scalar constant ``k``: x is rescaled as in §10 and ``k`` enters as ``rhe(k · 2**F / s_out)``
    (in the F extra fractional bits), so the result is rounded once."""
    a, b = node.inputs
    qdtype, out_scale = _required_grid(c, node)
    if _scalar(c, a) is not None:  # k - x  or  k + x
        k, x, sign_x = _scalar(c, a), c.int_input(node, b), -1 if node.op == "sub" else 1
    else:
        k, x, sign_x = _scalar(c, b) * (-1 if node.op == "sub" else 1), c.int_input(node, a), 1
    attrs = rescale_attrs([x.scale], out_scale, qdtype, c.qpp)
    attrs.update(addend=constant_addend(k, float(out_scale), attrs["frac_bits"]), negate=sign_x < 0)
    c.emit(node, "add_const", [x.name], attrs, qdtype, out_scale)


def _scalar(c: _Converter, name: str) -> float | None:
    if name in c.src.constants and c.src.constants[name].numel() == 1:
        return float(c.src.constants[name])
    return None


@converter("mul", "div")
def _mul(c, node):
    a, b = node.inputs
    if node.outputs[0] in c.folded:  # already part of the GEMM's multiplier
        c.q[node.outputs[0]] = c.q[a]
        return
    qdtype, out_scale = _required_grid(c, node)
    k = _scalar(c, b)
    if k is not None:
        real = 1.0 / k if node.op == "div" else k
        if real == 0:
            raise QuantLensError(f"convert: multiplication by 0 at op site '{node.site}'.")
        x = c.int_input(node, a)
        m = abs(real) * float(x.scale) / float(out_scale)
        attrs = {**c.requant_attrs(torch.tensor(m, dtype=torch.float64), qdtype), "negative": real < 0}
        c.emit(node, "scale", [x.name], attrs, qdtype, out_scale)
        return
    if node.op == "div":
        raise QuantLensError(
            f"convert: division by a tensor at op site '{node.site}' needs the reciprocal lookup table; run "
            "export on the QAT model (it applies pre_export) instead of exporting without tables."
        )
    x, y = c.int_input(node, a), c.int_input(node, b)
    real = x.scale.to(torch.float64) * y.scale.to(torch.float64) / out_scale.to(torch.float64)
    c.emit(node, "mul", [x.name, y.name], c.requant_attrs(real, qdtype), qdtype, out_scale)


@converter("mean", "sum")
def _reduce(c, node):
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    shape = c.src.values[node.inputs[0]].shape
    dims = node.attrs["dim"] if node.attrs.get("dim") is not None else list(range(len(shape)))
    count = 1
    for d in dims:
        count *= shape[d]
    divisor = count if node.op == "mean" else 1
    real = x.scale.to(torch.float64) / (divisor * out_scale.to(torch.float64))
    attrs = {"dim": dims, "keepdim": node.attrs.get("keepdim", False), **c.requant_attrs(real, qdtype)}
    c.emit(node, "sum_int", [x.name], attrs, qdtype, out_scale)


def _pool_attrs(c, node) -> tuple[dict, int]:
    if node.op == "avg_pool2d":
        a = node.attrs
        if a.get("divisor_override") is not None or (a["padding"] != [0, 0] and a["count_include_pad"] is False):
            raise QuantLensError(
                f"convert: avg_pool2d at op site '{node.site}' with divisor_override or excluded padding has "
                "varying window sizes; the march averages fixed windows."
            )
        kernel = a["kernel_size"]
        stride = a["stride"] or kernel
        # ceil_mode adds a last window that overhangs the padded input where the floor formula has none; torch
        # divides that window by the elements it covers, the march by the kernel area
        in_hw = c.src.values[node.inputs[0]].shape[-2:]
        out_hw = c.src.values[node.outputs[0]].shape[-2:]
        floor_hw = [(int(n) + 2 * int(p) - int(k)) // int(st) + 1
                    for n, p, k, st in zip(in_hw, a["padding"], kernel, stride)]
        if [int(o) for o in out_hw] != floor_hw:
            raise QuantLensError(
                f"convert: avg_pool2d at op site '{node.site}' with ceil_mode=True has windows that overhang the "
                f"input ({tuple(int(n) for n in in_hw)} -> {tuple(int(o) for o in out_hw)}, {tuple(floor_hw)} "
                "without ceil_mode): they average fewer elements than the kernel, and the march averages fixed "
                "windows. Use ceil_mode=False, or pad the input so that the windows tile it."
            )
        return {"kernel_size": kernel, "stride": stride, "padding": a["padding"], "ceil_mode": a["ceil_mode"],
                "count_include_pad": True}, kernel[0] * kernel[1]
    in_h, in_w = c.src.values[node.inputs[0]].shape[-2:]
    out_h, out_w = node.attrs["output_size"]
    if in_h % out_h or in_w % out_w:
        raise QuantLensError(
            f"convert: adaptive_avg_pool2d at op site '{node.site}' from {in_h}x{in_w} to {out_h}x{out_w} has "
            "uneven windows; the march averages fixed windows (make the input size a multiple of the output)."
        )
    kernel = [in_h // out_h, in_w // out_w]
    return {"kernel_size": kernel, "stride": kernel, "padding": [0, 0], "ceil_mode": False,
            "count_include_pad": True}, kernel[0] * kernel[1]


@converter("avg_pool2d", "adaptive_avg_pool2d")
def _avg_pool(c, node):
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    attrs, count = _pool_attrs(c, node)
    real = x.scale.to(torch.float64) / (count * out_scale.to(torch.float64))
    c.emit(node, "avg_pool2d_int", [x.name], {**attrs, **c.requant_attrs(real, qdtype)}, qdtype, out_scale)


def _pool1d_attrs(c, node) -> dict:
    """Fixed windows of a 1-d average: (kernel, stride, padding); refused where torch divides windows by varying
    counts (excluded padding, ceil_mode windows that overhang) or an adaptive pool has uneven windows."""
    length = c.src.values[node.inputs[0]].shape[-1]
    out_len = c.src.values[node.outputs[0]].shape[-1]
    if node.op == "adaptive_avg_pool1d":
        (out_size,) = [int(o) for o in node.attrs["output_size"]]
        if length <= 0 or length % out_size:
            raise QuantLensError(
                f"convert: adaptive_avg_pool1d at op site '{node.site}' from {length} to {out_size} has uneven "
                "windows; the march averages fixed windows (make the input length a multiple of the output)."
            )
        k = length // out_size
        return {"kernel_size": [k], "stride": [k], "padding": [0]}
    a = node.attrs
    k = int(a["kernel_size"][0])
    s = int(a["stride"][0]) if a.get("stride") else k
    p = int(a["padding"][0]) if a.get("padding") else 0
    if (p and a.get("count_include_pad") is False) or out_len != (length + 2 * p - k) // s + 1:
        raise QuantLensError(
            f"convert: avg_pool1d at op site '{node.site}' with excluded padding or overhanging ceil_mode windows "
            "has varying window sizes; the march averages fixed windows."
        )
    return {"kernel_size": [k], "stride": [s], "padding": [p]}


@converter("avg_pool1d", "adaptive_avg_pool1d")
def _avg_pool1d(c, node):
    """§10: the exact integer sum of each window, then one requantize by ``s_in / (k · s_out)``."""
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    attrs = _pool1d_attrs(c, node)
    real = x.scale.to(torch.float64) / (attrs["kernel_size"][0] * out_scale.to(torch.float64))
    c.emit(node, "avg_pool1d_int", [x.name], {**attrs, **c.requant_attrs(real, qdtype)}, qdtype, out_scale)


@converter("clamp", "hardtanh")
def _clamp(c, node):
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    lo_val = node.attrs.get("min", node.attrs.get("min_val"))
    hi_val = node.attrs.get("max", node.attrs.get("max_val"))
    lo, hi = clamp_codes(lo_val, hi_val, float(x.scale))
    real = x.scale.to(torch.float64) / out_scale.to(torch.float64)
    c.emit(node, "clamp", [x.name], {"lo": lo, "hi": hi, **c.requant_attrs(real, qdtype)}, qdtype, out_scale)


@converter("abs", "neg")
def _sign_op(c, node):
    """|q| and -q are exact on integers; the result is rescaled to the op's output grid."""
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    real = x.scale.to(torch.float64) / out_scale.to(torch.float64)
    c.emit(node, f"{node.op}_int", [x.name], c.requant_attrs(real, qdtype), qdtype, out_scale)


@converter("upsample_bilinear2d")
def _bilinear(c, node):
    """Bilinear resize as two integer interpolation matrices (weights in 2**-8 fixed point, ``docs/march.md``
    §11): ``acc = A_h · q · A_wᵀ`` exactly, then one requantize by ``s_in · 2**-16 / s_out``."""
    x = c.int_input(node, node.inputs[0])
    qdtype, out_scale = _required_grid(c, node)
    in_h, in_w = c.src.values[node.inputs[0]].shape[-2:]
    out_h, out_w = c.src.values[node.outputs[0]].shape[-2:]
    align = bool(node.attrs.get("align_corners"))
    a_h = c.const(interpolation_weights(in_h, out_h, align), f"{node.outputs[0]}_rows")
    a_w = c.const(interpolation_weights(in_w, out_w, align), f"{node.outputs[0]}_cols")
    real = x.scale.to(torch.float64) * 2.0**-16 / out_scale.to(torch.float64)
    c.emit(node, "bilinear_int", [x.name, a_h, a_w], c.requant_attrs(real, qdtype), qdtype, out_scale)


@converter(*sorted(PASSTHROUGH_OPS))
def _passthrough(c, node):
    x = c.q.get(node.inputs[0])
    if x is None:
        if node.inputs[0] in c.float_values or c.is_const(node.inputs[0]):
            return _float_movement(c, node)
        x = c.int_input(node, node.inputs[0])
    axis = x.axis if x.axis is None or node.op in _DIM_PRESERVING else _moved_axis(c, node, x.axis)
    extra = [c.q[v].name if v in c.q else _index_input(c, node, v) for v in node.inputs[1:]]
    outs = [c.fresh(o) for o in node.outputs]
    c.out.nodes.append(Node(node.op, [x.name] + extra, outs, dict(node.attrs), node.site))
    value_outputs = node.outputs if node.op not in _INDEX_OUTPUTS else node.outputs[:1]
    for src_out, name in zip(node.outputs, outs):
        info = c.src.values.get(src_out, ValueInfo((), "unknown"))
        if src_out in value_outputs:
            c.out.values[name] = ValueInfo(info.shape, str(storage_dtype(x.qdtype.value)).replace("torch.", ""),
                                           x.qdtype.value, None, axis)
            c.q[src_out] = QInfo(name, x.qdtype, x.scale, axis)
        else:  # indices
            c.out.values[name] = info
            c.float_values[src_out] = name


def _moved_axis(c: _Converter, node: Node, axis: int) -> int:
    """Where the channel axis of a per-channel (int32 high-precision) value lands after a movement op."""
    in_shape = list(c.src.values[node.inputs[0]].shape)
    axis %= len(in_shape)
    if node.op == "permute":
        return node.attrs["dims"].index(axis)
    if node.op == "reshape":
        # The channel dim must survive whole: same size, same number of elements before it.
        out_shape = list(c.src.values[node.outputs[0]].shape)
        dyn = 7919  # stands for the dynamic batch (-1) on both sides
        prefix = 1
        for d in in_shape[:axis]:
            prefix *= dyn if d == -1 else d
        running = 1
        for j, d in enumerate(out_shape):
            if running == prefix and d == in_shape[axis]:
                return j
            running *= dyn if d == -1 else d
    raise QuantLensError(
        f"convert: op '{node.op}' at op site '{node.site}' splits or merges the channel dim of a per-channel int32 "
        "high-precision output; dequantize it first (put the DeQuantStub right after the final conv/linear)."
    )


@converter("masked_fill")
def _masked_fill(c, node):
    x = c.int_input(node, node.inputs[0])
    mask = _index_input(c, node, node.inputs[1])
    value = node.attrs.get("value")
    if value is None:
        value = float(c.src.constants[node.inputs[2]])
    fill = constant_code(value, float(x.scale), x.qdtype)
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node("masked_fill_int", [x.name, mask], [name], {"value": fill}, node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, x.name and c.out.values[x.name].dtype,
                                   x.qdtype.value)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis)


def _index_input(c: _Converter, node: Node, value: str) -> str:
    if not value:
        return ""
    if value in c.q:  # an integer value leaves the NPU here: the boundary dequantize
        return c.boundary_output(value)
    if value in c.float_values:
        return c.float_values[value]
    if c.is_const(value):
        return c.const(c.src.constants[value], value)
    raise QuantLensError(f"convert: index input '{value}' of op site '{node.site}' is not available.")


def _float_movement(c: _Converter, node: Node) -> None:
    """Integer/bool tensors (token ids, masks, indices) move with the same kernels as in the qat IR."""
    ins = [_index_input(c, node, v) for v in node.inputs]
    outs = [c.fresh(o) for o in node.outputs]
    c.out.nodes.append(Node(node.op, ins, outs, dict(node.attrs), node.site))
    for src_out, name in zip(node.outputs, outs):
        c.out.values[name] = c.src.values.get(src_out, ValueInfo((), "unknown"))
        c.float_values[src_out] = name


@converter("embedding")
def _embedding(c, node):
    table = c.int_input(node, node.inputs[0])
    ids = _index_input(c, node, node.inputs[1])
    c.emit(node, "embedding", [table.name, ids], {}, table.qdtype, table.scale)


@converter(*sorted(ops_in(Category.INDEX, level="qat")))
def _non_numeric(c, node):
    """Ops whose result is an index or a mask: computed on the integer values (order is preserved)."""
    if any(v in c.q for v in node.inputs) and node.op not in ("argmax",):
        raise QuantLensError(
            f"convert: op '{node.op}' at op site '{node.site}' compares quantized values with float ones; "
            "keep comparisons on integer/bool tensors or in post-processing."
        )
    ins = [c.q[v].name if v in c.q else _index_input(c, node, v) for v in node.inputs]
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(node.op, ins, [name], dict(node.attrs), node.site))
    c.out.values[name] = c.src.values.get(node.outputs[0], ValueInfo((), "unknown"))
    c.float_values[node.outputs[0]] = name


#: table ops of pre_export (``torch.ops.quantlens.*``): their data inputs and scale inputs (one declaration,
#: ``quantlens.kernels.TABLE_OP_IO``)
TABLE_OPS = {name: (io.data, io.scales) for name, io in TABLE_OP_IO.items()}


@converter(*TABLE_OPS)
def _table_op(c, node):
    """A table op takes integers at its input scales and yields integers at ``scale_out``; its integer kernel
    is the same function pre_export runs (``quantlens.kernels``), so both are bit-identical."""
    import torch as _torch

    schema = table_torch_op(node.op)._schema
    tensor_args = [a.name for a in schema.arguments if str(a.type).startswith("Tensor")]
    by_name = dict(zip(tensor_args, node.inputs))
    data_args, scale_args = TABLE_OPS[node.op]
    inputs = []
    for arg, scale_arg in zip(data_args, scale_args):
        info = c.int_input(node, by_name[arg])
        expected = c.src.constants[by_name[scale_arg]].to(_torch.float32)
        if not info.same_grid(info.qdtype, expected):
            raise QuantLensError(
                f"convert: table op '{node.op}' at op site '{node.site}' was built for input scale "
                f"{float(expected.reshape(-1)[0]):.6g} but its input has scale {float(info.scale.reshape(-1)[0]):.6g}; "
                "re-run pre_export after calibration."
            )
        inputs.append(info.name)
    others = [
        c.const(c.src.constants[by_name[a]], f"{node.outputs[0]}_{a}") if by_name[a] else ""
        for a in tensor_args if a not in data_args
    ]
    qdtype = _fq_dtype(node.attrs["out_qmin"])
    out_scale = c.src.constants[by_name["scale_out"]].to(_torch.float32)
    c.emit(node, node.op, inputs + others, {**node.attrs, "table_inputs": list(data_args)}, qdtype, out_scale)


def convert(qat_ir: Module) -> Module:
    """Convert a qat IR (from ``export``) to the integer-only quantized IR; the input module is not modified."""
    if not isinstance(qat_ir, Module) or qat_ir.kind != "qat":
        raise QuantLensError(
            "convert expects the qat IR returned by quantlens.compiler.export (kind 'qat'), got "
            f"{getattr(qat_ir, 'kind', type(qat_ir).__name__)!r}."
        )
    converter = _Converter(qat_ir)
    graph = converter.run()
    return Module("quantized", graph, list(qat_ir.input_leaves), qat_ir.input_spec, qat_ir.output_spec,
                  meta={**qat_ir.meta, "qpp": converter.qpp.value})


# -- pad, standalone batch norm, prelu / leaky_relu, constant writes (docs/march.md §10.2, §10.3, §11) ----------
def _on_grid(value: float, info: QInfo) -> int:
    """A constant written into an integer tensor: ``sat(rhe(v / s))`` on that tensor's grid (§11)."""
    return constant_code(value, float(info.scale.reshape(-1)[0]), info.qdtype)


def _per_tensor(c: _Converter, node: Node, info: QInfo, what: str) -> None:
    if info.scale.numel() != 1:
        raise QuantLensError(
            f"convert: {what} at op site '{node.site}' takes a per-channel int32 high-precision value; "
            "dequantize it first (put the DeQuantStub right after the final conv/linear) or give the producer an "
            "int8/int16 output."
        )


@converter("pad", "fill")
def _pad(c, node):
    """Padding and filling keep the grid; the constant is written as its integer on that grid."""
    x = c.int_input(node, node.inputs[0])
    attrs = dict(node.attrs)
    if node.op == "fill" or attrs.get("mode") == "constant":
        _per_tensor(c, node, x, node.op)
        attrs["value"] = _on_grid(attrs["value"], x)
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(f"{node.op}_int", [x.name], [name], attrs, node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, c.out.values[x.name].dtype, x.qdtype.value)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis)


@converter("select_scatter", "slice_scatter")
def _scatter(c, node):
    """``x[...] = src`` (functionalized): src must already lie on x's grid (the fake-quant model writes it
    unchanged), so the integers are written as they are."""
    x, src = c.int_input(node, node.inputs[0]), c.int_input(node, node.inputs[1])
    if not src.same_grid(x.qdtype, x.scale):
        raise QuantLensError(
            f"convert: op site '{node.site}' writes a value with scale {float(src.scale.reshape(-1)[0]):.6g} "
            f"({src.qdtype.value}) into a tensor with scale {float(x.scale.reshape(-1)[0]):.6g} ({x.qdtype.value}); "
            "the integer write needs one grid. Write a constant, or a value computed from the same tensor."
        )
    name = c.fresh(node.outputs[0])
    c.out.nodes.append(Node(node.op, [x.name, src.name], [name], dict(node.attrs), node.site))
    c.out.values[name] = ValueInfo(c.src.values[node.outputs[0]].shape, c.out.values[x.name].dtype, x.qdtype.value)
    c.q[node.outputs[0]] = QInfo(name, x.qdtype, x.scale, x.axis)


@converter("batch_norm")
def _batch_norm(c, node):
    """BatchNorm on its own (after an activation): a per-channel affine ``a·x + b`` computed as a depthwise 1x1
    GEMM (§10.2): int8 weights ``±127`` at ``s_w = |a|/127``, an int32 bias at ``s_x·s_w``, exact accumulation,
    one per-channel requantize to the output grid."""
    x = c.int_input(node, node.inputs[0])
    _per_tensor(c, node, x, "batch_norm")
    qdtype, out_scale = _required_grid(c, node)
    consts = []
    for name in node.inputs[1:]:
        if name and not c.is_const(name):
            raise QuantLensError(f"convert: batch_norm at op site '{node.site}' has a computed weight or statistic.")
        consts.append(c.src.constants[name].to(torch.float64) if name else None)
    weight, bias, mean, var = consts
    channels = mean.numel()
    weight = torch.ones(channels, dtype=torch.float64) if weight is None else weight
    bias = torch.zeros(channels, dtype=torch.float64) if bias is None else bias
    a = weight / torch.sqrt(var + node.attrs["eps"])
    b = bias - mean * a
    s_x = x.scale.to(torch.float64).reshape(-1)[0]
    w_q, bias_q, s_w = channel_affine_params(a, b, float(s_x))
    acc_scale = s_x * s_w
    inputs = [x.name, c.const(w_q, f"{node.outputs[0]}_a"), c.const(bias_q, f"{node.outputs[0]}_b")]
    attrs = {"channel_dim": 1, **c.requant_attrs(acc_scale / out_scale.to(torch.float64), qdtype)}
    c.emit(node, "channel_affine", inputs, attrs, qdtype, out_scale)


@converter("prelu", "leaky_relu")
def _prelu(c, node):
    """``x >= 0 ? x : α·x`` (§10.3): the same integers, requantized by ``s_x/s_out`` where ``q >= 0`` and by
    ``|α|·s_x/s_out`` (sign folded into the integers) where ``q < 0``; ``α`` per channel for prelu."""
    x = c.int_input(node, node.inputs[0])
    _per_tensor(c, node, x, node.op)
    qdtype, out_scale = _required_grid(c, node)
    if node.op == "leaky_relu":
        alpha = torch.tensor([float(node.attrs["negative_slope"])], dtype=torch.float64)
    elif node.inputs[1] in c.q:  # a fake-quantized weight: the integer model uses exactly its grid value
        w = c.q[node.inputs[1]]
        alpha = (c.out.constants[w.name].to(torch.float64) * w.scale.to(torch.float64)).reshape(-1)
    else:
        alpha = c.src.constants[node.inputs[1]].to(torch.float64).reshape(-1)
    attrs = prelu_attrs(alpha, x.scale, out_scale, qdtype, c.qpp)
    c.emit(node, "prelu_int", [x.name], attrs, qdtype, out_scale)


def prelu_attrs(alpha: torch.Tensor, s_x: torch.Tensor, out_scale: torch.Tensor, qdtype: QuantDType,
                qpp: Qpp) -> dict:
    """§10.4 ``prelu_int`` attrs for slopes ``alpha`` (float64, one or per channel): the ``q >= 0`` requantize
    ``s_x / s_out``, and per slope the multiplier of ``|α|·s_x/s_out`` with the sign folded into the integers."""
    s_x = s_x.to(torch.float64).reshape(-1)[0]
    s_out = out_scale.to(torch.float64)
    # α = 0: the sign 0 zeroes the integers; any valid multiplier will do
    neg = [_multiplier(float(abs(v) * s_x / s_out), qpp) if v != 0 else _multiplier(1.0, qpp)
           for v in alpha.tolist()]
    pos = requant_attrs(s_x / s_out, qdtype, qpp)
    return {**pos, "neg_multiplier": [m for m, _ in neg], "neg_shift": [s for _, s in neg],
            "neg_sign": [1 if v > 0 else -1 if v < 0 else 0 for v in alpha.tolist()], "channel_dim": 1}
