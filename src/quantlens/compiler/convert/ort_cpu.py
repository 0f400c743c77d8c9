"""``convert`` under ``March.ORT_CPU``: each op group onnxruntime's CPU execution provider fuses into an int8 kernel
becomes that kernel; every other op runs on the host in float between a dequantize and a quantize, as the runtime
runs it (``docs/march_ort.md``).

The groups are the ones the runtime's QDQ fusion takes (its default graph optimizations, read in its source and held
by ``tests/test_ort_cpu_rules.py``): a Conv, Gemm or MatMul with DequantizeLinear inputs (8-bit activations, int8
weights, an int32 bias) and one QuantizeLinear after it, through a ReLU only where the QuantizeLinear makes it
redundant (a ``quint8`` output: its clamp at 0 is the ReLU); Add and Mul of two 8-bit tensors; Concat; average
pools. A node of such a group carries ``runtime: "ort_cpu"``, the runtime's zero point of each integer operand
and of the output (``zero_points``: 128 for an int8 activation, which the runtime holds as uint8 on x86), and the
kernel's float32 parameters from :mod:`quantlens.march.ort_cpu`; its kernel is
:mod:`quantlens.kernels.integer.ort_cpu`. An op without a converter here, or one a converter refuses, becomes a
host op (:meth:`Converter.host_op`).
"""

from __future__ import annotations

import torch

from quantlens._registry import make_registry
from quantlens.compiler.convert.gemm import fake_quant_converter
from quantlens.compiler.convert.pools import pool_attrs
from quantlens.compiler.convert.state import PASSTHROUGH_OPS, Converter, QInfo, fq_dtype
from quantlens.compiler.ir import Node
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, get_variant
from quantlens.march.ort_cpu import (
    X86_ACTIVATION_SHIFT,
    KernelVariant,
    add_constants,
    gemm_multiplier,
    global_average_multiplier,
    leaky_relu,
    lookup_table,
    mlas_logistic,
    mul_multiplier,
    softmax_output_scale,
    softmax_table,
)

__all__ = ["ORT_CPU_CONVERTERS", "RUNTIME"]

#: the ``runtime`` attr of the nodes converted here (the kernels' registry key)
RUNTIME = "ort_cpu"

#: qat IR op -> its converter under ``March.ORT_CPU``
ORT_CPU_CONVERTERS, ort_cpu_converter = make_registry("ORT_CPU convert converter for op")

_EIGHT_BIT = (QuantDType.qint8, QuantDType.quint8)


def zero_point(qdtype: QuantDType) -> int:
    """The runtime's zero point of a model value of type ``qdtype`` (its codes + this are the runtime's codes)."""
    return X86_ACTIVATION_SHIFT if qdtype is QuantDType.qint8 else 0


def _attrs(**params) -> dict:
    variant = get_variant() or KernelVariant.VNNI
    return {"runtime": RUNTIME, "variant": variant.value, **params}


def _scales(scale: torch.Tensor) -> list[float]:
    return [float(v) for v in scale.to(torch.float32).reshape(-1)]


def _eight_bit(node: Node, *infos: QInfo) -> None:
    for info in infos:
        if info.qdtype not in _EIGHT_BIT or info.scale.numel() != 1:
            raise QuantLensError(f"op site '{node.site}' reads a {info.qdtype.value} value with "
                                 f"{info.scale.numel()} scale(s); onnxruntime fuses 8-bit per-tensor activations only")


_CLIPS = ("relu", "hardtanh", "clamp")


def _clip_bounds(node: Node) -> tuple[float | None, float | None]:
    if node.op == "relu":
        return 0.0, None
    if node.op == "hardtanh":
        return node.attrs.get("min_val", -1.0), node.attrs.get("max_val", 1.0)
    return node.attrs.get("min"), node.attrs.get("max")


def clip_is_redundant(clip: Node, qdtype: QuantDType, scale: torch.Tensor) -> bool:
    """Whether the runtime drops the ReLU / Clip ``clip`` before a QuantizeLinear of ``(qdtype, scale)``: a ReLU when
    the zero point is the type's minimum (``quint8``: an int8 activation's zero point is 128 on x86); a Clip when
    ``rint(lo / s) + z <= qmin`` and ``rint(hi / s) + z >= qmax``, in float32 (then the QuantizeLinear's clamp does
    what the Clip did, and the two give the same codes)."""
    if clip.op not in _CLIPS or scale.numel() != 1 or qdtype not in _EIGHT_BIT:
        return False
    lo, hi = _clip_bounds(clip)
    z = zero_point(qdtype)
    qmin, qmax = qdtype.qmin + z, qdtype.qmax + z  # the runtime's uint8 range
    s = scale.to(torch.float32).reshape(())
    if clip.op == "relu":
        return z == 0 and qmin == 0
    low_ok = lo is not None and int(torch.round(torch.tensor(float(lo), dtype=torch.float32) / s)) + z <= qmin
    high_ok = hi is not None and int(torch.round(torch.tensor(float(hi), dtype=torch.float32) / s)) + z >= qmax
    return low_ok and high_ok


def identity_scale(c: Converter, node: Node) -> bool:
    """A multiply or divide by the constant 1 (attention's scale when the query was scaled before): the runtime
    removes it (its no-op elimination), so the kernel before it fuses with the quantize after it."""
    if node.op not in ("mul", "div") or len(node.inputs) != 2:
        return False
    k = node.inputs[1]
    return c.is_const(k) and c.src.constants[k].numel() == 1 and float(c.src.constants[k]) == 1.0


def identity_cast(c: Converter, node: Node) -> bool:
    """A cast to the type its input already has (``softmax(x, dtype=torch.float32)``): the runtime removes it."""
    if node.op != "cast" or not node.inputs:
        return False
    info = c.src.values.get(node.inputs[0])
    return info is not None and str(node.attrs.get("dtype", "")).replace("torch.", "") == info.dtype


@ort_cpu_converter("cast")
def _cast(c: Converter, node: Node) -> None:
    """A cast to its input's own type passes the codes on (the runtime removes it); any other runs on the host."""
    if not (identity_cast(c, node) and node.inputs[0] in c.q):
        raise QuantLensError(f"op site '{node.site}' casts to another type")
    c.q[node.outputs[0]] = c.q[node.inputs[0]]


def _only_user(c: Converter, value: str) -> Node | None:
    users = c.consumers.get(value, [])
    return users[0] if len(users) == 1 and value not in c.src.outputs else None


def fused_output(c: Converter, node: Node) -> tuple[QuantDType, torch.Tensor] | None:
    """The grid of the QuantizeLinear the runtime fuses into ``node``'s kernel: its one user's fake quant, or that of
    a ReLU / Clip in between which the QuantizeLinear makes redundant (:func:`clip_is_redundant`; the runtime drops
    it). None: the output stays float (or the runtime would not fuse it)."""
    value = node.outputs[0]
    user = _only_user(c, value)
    while user is not None and (identity_scale(c, user) or identity_cast(c, user)) and user.inputs[0] == value:
        value, user = user.outputs[0], _only_user(c, user.outputs[0])  # the runtime drops it
    clip = None
    if user is not None and user.op in _CLIPS and user.inputs[0] == value:
        clip, value, user = user, user.outputs[0], _only_user(c, user.outputs[0])
    if user is None or user.op != "fake_quant" or user.inputs[0] != value:
        return None
    qdtype = fq_dtype(user.attrs)
    scale = c.src.constants[user.inputs[1]].to(torch.float32)
    if qdtype not in _EIGHT_BIT or (clip is not None and not clip_is_redundant(clip, qdtype, scale)):
        return None
    c.grid_sites[node.outputs[0]] = user.site
    return qdtype, scale


@ort_cpu_converter("hardtanh", "clamp")
def _clip(c: Converter, node: Node) -> None:
    """A Clip the next QuantizeLinear makes redundant: the runtime drops it, the codes pass unchanged (a fused
    kernel's clamp, or the QuantizeLinear's, does the clipping). Any other Clip runs in float."""
    x = c.int_input(node, node.inputs[0])
    user = _only_user(c, node.outputs[0])
    if user is None or user.op != "fake_quant" or x.scale.numel() != 1 or not clip_is_redundant(
            node, fq_dtype(user.attrs), c.src.constants[user.inputs[1]]):
        raise QuantLensError(f"the clip at op site '{node.site}' is not made redundant by its output quantize")
    c.q[node.outputs[0]] = x


@ort_cpu_converter("fake_quant")
def _fake_quant(c: Converter, node: Node) -> None:
    """A constant, a model input or a host result: QL1's converter (the runtime's QuantizeLinear is QL1's quantize:
    a float32 division rounded half to even, then the clamp). An integer value moved to another grid: the runtime's
    DequantizeLinear -> QuantizeLinear, in float32."""
    x = node.inputs[0]
    info = c.q.get(x)
    if info is None or c.is_const(x):
        fake_quant_converter(c, node)
        return
    qdtype = fq_dtype(node.attrs)
    scale = c.src.constants[node.inputs[1]].to(torch.float32)
    if info.same_grid(qdtype, scale):
        c.q[node.outputs[0]] = info
        return
    if info.scale.numel() != 1 or scale.numel() != 1:
        raise QuantLensError(f"op site '{node.site}' moves a per-channel value to another grid")
    c.emit(node, "requantize", [info.name], _attrs(in_scale=float(info.scale), out_scale=float(scale),
                                                   zero_points=[zero_point(info.qdtype), zero_point(qdtype)],
                                                   out_dtype=qdtype.value, axis=None), qdtype, scale)


@ort_cpu_converter("conv1d", "conv2d", "linear", "matmul")
def _gemm(c: Converter, node: Node) -> None:
    """QLinearConv, QGemm, QLinearMatMul: the exact accumulator (plus the int32 bias) requantized by
    ``fl(fl(s_x s_w) / s_y)``; a Gemm or MatMul without a QuantizeLinear gives the float output
    ``fl(acc * fl(s_x s_w))`` (QGemm, MatMulIntegerToFloat); a Conv without one runs in float."""
    x = c.int_input(node, node.inputs[0])
    w = c.int_input(node, node.inputs[1])
    _eight_bit(node, x)
    if node.op == "matmul" and not c.is_const(node.inputs[1]):
        _eight_bit(node, w)
    elif w.qdtype is not QuantDType.qint8:
        raise QuantLensError(f"op site '{node.site}' has a {w.qdtype.value} weight; onnxruntime fuses int8 weights")
    inputs = [x.name, w.name]
    if node.op != "matmul":
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        inputs.append(c.int_input(node, bias).name if bias else "")
        if bias and c.q[bias].qdtype is not QuantDType.qint32:
            raise QuantLensError(f"the bias of op site '{node.site}' is not int32-quantized")
    w_zero = zero_point(w.qdtype) if node.op == "matmul" and not c.is_const(node.inputs[1]) else 0
    grid = fused_output(c, node)
    if grid is None:
        if node.op.startswith("conv"):
            raise QuantLensError(f"conv at op site '{node.site}' has no 8-bit output quantize; onnxruntime runs it "
                                 "in float")
        acc_scale = (x.scale.to(torch.float32) * w.scale.to(torch.float32)).reshape(-1)
        c.emit(node, node.op, inputs, {**node.attrs, **_attrs(zero_points=[zero_point(x.qdtype), w_zero],
                                                                accumulator_scale=_scales(acc_scale))}, None, None)
        return
    qdtype, out_scale = grid
    attrs = _attrs(zero_points=[zero_point(x.qdtype), w_zero, zero_point(qdtype)], out_dtype=qdtype.value,
                   multiplier_f32=_scales(gemm_multiplier(x.scale, w.scale.reshape(-1), out_scale)))
    c.emit(node, node.op, inputs, {**node.attrs, **attrs}, qdtype, out_scale)


def _constant_source(c: Converter, value: str) -> str | None:
    """The fake quant of a constant that ``value`` is, directly or moved by data movement (a class token expanded to
    the batch, an ALiBi bias repeated per head), else None."""
    for _ in range(64):
        node = c.producers.get(value)
        if node is None or not node.inputs:
            return None
        if node.op == "fake_quant":
            return node.outputs[0] if c.is_const(node.inputs[0]) else None
        if node.op not in PASSTHROUGH_OPS:
            return None
        value = node.inputs[0]
    return None


def _activations_only(c: Converter, node: Node, values: list[str]) -> None:
    """Add, Mul and Concat fuse on activations and on uint8 constants (non-negative ones: the activations' type),
    directly or after data movement (the runtime moves a constant's DequantizeLinear past it). An int8 constant stays
    int8 in onnxruntime 1.32 (its S8->U8 rewrite takes Q -> DQ pairs, not a lone DequantizeLinear of an
    initializer), and a kernel cannot mix int8 and uint8, so the runtime computes in float."""
    for v in values:
        source = _constant_source(c, v)
        info = c.q.get(source) if source is not None else None
        if source is not None and (info is None or info.qdtype is not QuantDType.quint8 or info.scale.numel() != 1):
            raise QuantLensError(f"op site '{node.site}' reads an int8 constant, which onnxruntime keeps int8; it "
                                 f"computes that {node.op} in float")


def _two_tensors(c: Converter, node: Node) -> tuple[QInfo, QInfo, QuantDType, torch.Tensor]:
    if len(node.inputs) != 2:
        raise QuantLensError(f"op site '{node.site}' has {len(node.inputs)} inputs")
    _activations_only(c, node, list(node.inputs))
    a, b = c.int_input(node, node.inputs[0]), c.int_input(node, node.inputs[1])
    _eight_bit(node, a, b)
    grid = fused_output(c, node)
    if grid is None:
        raise QuantLensError(f"op site '{node.site}' has no 8-bit output quantize")
    return a, b, grid[0], grid[1]


@ort_cpu_converter("add")
def _add(c: Converter, node: Node) -> None:
    """QLinearAdd: ``sat(RNE(fma(a, r_a, fma(b, r_b, f))))``, the zero points folded into ``f``."""
    a, b, qdtype, out_scale = _two_tensors(c, node)
    z = [zero_point(a.qdtype), zero_point(b.qdtype), zero_point(qdtype)]
    r_a, r_b, f = add_constants(a.scale, z[0], b.scale, z[1], out_scale, z[2])
    c.emit(node, "add", [a.name, b.name], _attrs(zero_points=z, r_a=float(r_a), r_b=float(r_b), f=float(f),
                                                 out_dtype=qdtype.value), qdtype, out_scale)


@ort_cpu_converter("mul", "div")
def _mul(c: Converter, node: Node) -> None:
    """QLinearMul: ``sat(RNE(fl(fl(p r) + z_c)))``, ``p = (a - z_a)(b - z_b)``, ``r = fl(fl(s_a s_b) / s_c)``; a
    multiply or divide by 1 passes the codes on (the runtime removes it). A divide is otherwise float."""
    if identity_scale(c, node) and node.inputs[0] in c.q:
        c.q[node.outputs[0]] = c.q[node.inputs[0]]
        return
    if node.op == "div":
        raise QuantLensError(f"op site '{node.site}' divides; onnxruntime fuses no division")
    a, b, qdtype, out_scale = _two_tensors(c, node)
    z = [zero_point(a.qdtype), zero_point(b.qdtype), zero_point(qdtype)]
    m = mul_multiplier(a.scale, b.scale, out_scale)
    c.emit(node, "mul", [a.name, b.name], _attrs(zero_points=z, multiplier_f32=_scales(m), out_dtype=qdtype.value),
           qdtype, out_scale)


@ort_cpu_converter("cat")
def _cat(c: Converter, node: Node) -> None:
    """QLinearConcat: each input copied, or moved to the output's grid through DequantizeLinear -> QuantizeLinear."""
    values = [v for v in node.inputs if not (c.is_const(v) and c.src.constants[v].numel() == 0)]
    _activations_only(c, node, values)
    infos = [c.int_input(node, v) for v in values]
    _eight_bit(node, *infos)
    grid = fused_output(c, node)
    if grid is None or any(i.qdtype is not grid[0] for i in infos):
        raise QuantLensError(f"op site '{node.site}' mixes integer types or has no 8-bit output quantize")
    qdtype, out_scale = grid
    c.emit(node, "cat", [i.name for i in infos], _attrs(in_scales=[float(i.scale) for i in infos],
                                                         zero_points=[zero_point(i.qdtype) for i in infos]
                                                         + [zero_point(qdtype)],
                                                         out_scale=float(out_scale), dim=node.attrs["dim"],
                                                         out_dtype=qdtype.value), qdtype, out_scale)


def _partial_windows(c: Converter, node: Node) -> bool:
    """Whether ``ceil_mode`` gives an avg_pool2d windows past the input (its output larger than without it)."""
    a = node.attrs
    k = [int(v) for v in (a["kernel_size"] if isinstance(a["kernel_size"], (list, tuple)) else [a["kernel_size"]] * 2)]
    st = a.get("stride") or k
    st = [int(v) for v in (st if isinstance(st, (list, tuple)) else [st] * 2)]
    p = a.get("padding", 0)
    p = [int(v) for v in (p if isinstance(p, (list, tuple)) else [p] * 2)]
    size_in = c.src.values[node.inputs[0]].shape[-2:]
    size_out = c.src.values[node.outputs[0]].shape[-2:]
    floor = [(n + 2 * pp - kk) // ss + 1 for n, pp, kk, ss in zip(size_in, p, k, st)]
    return list(size_out) != floor


def _pool_input(c: Converter, node: Node) -> tuple[QInfo, QuantDType, torch.Tensor]:
    """An average pool's 8-bit input and its fused output grid, of the same integer type (the QLinear pools' rule)."""
    x = c.int_input(node, node.inputs[0])
    _eight_bit(node, x)
    grid = fused_output(c, node)
    if grid is None or grid[0] is not x.qdtype:
        raise QuantLensError(f"average pool at op site '{node.site}' changes the integer type or has no 8-bit "
                             "output quantize; onnxruntime runs it in float")
    return x, grid[0], grid[1]


@ort_cpu_converter("adaptive_avg_pool1d")
def _global_pool1d(c: Converter, node: Node) -> None:
    """An adaptive average pool to one step is GlobalAveragePool in the file: QLinearGlobalAveragePool."""
    if [int(o) for o in node.attrs["output_size"]] != [1]:
        raise QuantLensError(f"average pool at op site '{node.site}' is not global; onnxruntime runs it in float")
    x, qdtype, out_scale = _pool_input(c, node)
    m = global_average_multiplier(x.scale, out_scale, int(c.src.values[node.inputs[0]].shape[-1]))
    attrs = {"kernel_size": [1, int(c.src.values[node.inputs[0]].shape[-1])], "stride": [1, 1], "padding": [0, 0],
             "ceil_mode": False, "count_include_pad": True,
             **_attrs(zero_points=[zero_point(x.qdtype), zero_point(qdtype)], multiplier_f32=_scales(m),
                      out_dtype=qdtype.value, **{"global": True})}
    c.emit(node, "avg_pool2d_int", [x.name], attrs, qdtype, out_scale)


@ort_cpu_converter("avg_pool2d", "adaptive_avg_pool2d")
def _avg_pool(c: Converter, node: Node) -> None:
    """QLinearGlobalAveragePool for an adaptive pool to 1x1, QLinearAveragePool otherwise (both need one integer
    type in and out)."""
    x, qdtype, out_scale = _pool_input(c, node)
    attrs = pool_attrs(c, node)[0]  # (the window shape; the runtime's pools count their windows themselves)
    z = [zero_point(x.qdtype), zero_point(qdtype)]
    if node.op == "adaptive_avg_pool2d" and list(node.attrs["output_size"]) == [1, 1]:
        shape = c.src.values[node.inputs[0]].shape
        m = global_average_multiplier(x.scale, out_scale, int(shape[-1] * shape[-2]))
        attrs.update(_attrs(zero_points=z, multiplier_f32=_scales(m), out_dtype=qdtype.value, **{"global": True}))
    else:
        a = node.attrs
        if a.get("ceil_mode") and _partial_windows(c, node):
            size_in, size_out = c.src.values[node.inputs[0]].shape[-2:], c.src.values[node.outputs[0]].shape[-2:]
            if list(size_out) != [1, 1] or any(int(v) for v in (a.get("padding") or [0])):
                raise QuantLensError(f"average pool at op site '{node.site}' has ceil_mode windows past the input")
            # one window past the whole input (EfficientNet's pooler): the runtime averages the elements it covers
            attrs.update(kernel_size=[int(v) for v in size_in], stride=[int(v) for v in size_in], padding=[0, 0])
        if a.get("divisor_override"):
            raise QuantLensError(f"average pool at op site '{node.site}' has a divisor override")
        attrs.update(_attrs(zero_points=z, in_scale=float(x.scale), out_scale=float(out_scale),
                            out_dtype=qdtype.value, count_include_pad=bool(a.get("count_include_pad", True))))
    c.emit(node, "avg_pool2d_int", [x.name], attrs, qdtype, out_scale)


def _same_type_grid(c: Converter, node: Node) -> tuple[QInfo, QuantDType, torch.Tensor]:
    x = c.int_input(node, node.inputs[0])
    _eight_bit(node, x)
    grid = fused_output(c, node)
    if grid is None:
        raise QuantLensError(f"op site '{node.site}' has no 8-bit output quantize")
    return x, grid[0], grid[1]


@ort_cpu_converter("softmax")
def _softmax(c: Converter, node: Node) -> None:
    """QLinearSoftmax over axis ``dim`` (the runtime moves it last and back): each row reads ``table[255 - max + x]``
    (the runtime's exp table of the input scale), sums in float32 in index order and scales by ``floor(1 / s_y)``."""
    x, qdtype, out_scale = _same_type_grid(c, node)
    shape = c.src.values[node.inputs[0]].shape
    dim = int(node.attrs.get("dim", -1)) % len(shape)
    attrs = _attrs(zero_points=[zero_point(x.qdtype), zero_point(qdtype)], out_dtype=qdtype.value,
                   table=_scales(softmax_table(x.scale, int(shape[dim]))),
                   y_scale=float(softmax_output_scale(out_scale)))
    c.emit(node, "softmax", [x.name], {**node.attrs, **attrs}, qdtype, out_scale)


def _lookup(c: Converter, node: Node, fn, kernel: str) -> None:
    x, qdtype, out_scale = _same_type_grid(c, node)
    z_x, z_y = zero_point(x.qdtype), zero_point(qdtype)
    table = lookup_table(fn, x.scale, z_x, out_scale, z_y, qdtype.qmin + z_y, qdtype.qmax + z_y)
    attrs = _attrs(zero_points=[z_x, z_y], out_dtype=qdtype.value, table=[int(v) for v in table.reshape(-1)],
                   runtime_kernel=kernel)
    c.emit(node, node.op, [x.name], {**node.attrs, **attrs}, qdtype, out_scale)


@ort_cpu_converter("sigmoid")
def _sigmoid(c: Converter, node: Node) -> None:
    """QLinearSigmoid: a 256-entry table of MLAS's logistic polynomial at each input code."""
    _lookup(c, node, mlas_logistic, "QLinearSigmoid")


@ort_cpu_converter("leaky_relu")
def _leaky_relu(c: Converter, node: Node) -> None:
    """QLinearLeakyRelu: a 256-entry table."""
    _lookup(c, node, leaky_relu(float(node.attrs.get("negative_slope", 0.01))), "QLinearLeakyRelu")
