"""Integer kernels of the quantized IR: the bit-exact simulator of ``docs/march.md``.

Values are integer tensors (int8/int16/int32 storage; int64 for indices). GEMMs and pooling sums are computed in
float64 on integer operands, which is exact (every partial sum of int8/int16 products stays far below 2**53) and
therefore independent of summation order and thread count; results are then rounded/saturated with the
functions of :mod:`quantlens.march.numerics`, which implement the spec's rules once.

Requantize parameters live in node attrs: ``multiplier``/``shift`` (lists: one entry per tensor, or per channel
along ``axis``) and the output type's ``qmin``/``qmax``.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F

from quantlens.compiler.interpreter import QAT_KERNELS, call_torch_op
from quantlens.compiler.ir import Node
from quantlens.compiler.lowering import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.kernels import TABLE_OP_IO, int_div, int_layer_norm, int_reciprocal, int_softmax, table_torch_op
from quantlens.kernels import SegmentedTable, Table256, dtype_from_range, lut256_lookup, segmented_lookup
from quantlens.march.opset import ops_in
from quantlens.march.numerics import (
    apply_requantize,
    dequantize,
    quantize,
    requantize,
    requantize_params,
    rescaled_sum,
    rshift_round_half_to_even,
)

__all__ = ["INT_KERNELS", "int_kernel", "int_dispatch", "storage_dtype"]

INT_KERNELS: dict[str, Callable[[Node, list], Any]] = {}

_INT32 = QuantDType.qint32


def int_kernel(*ops: str):
    def register(fn):
        for op in ops:
            INT_KERNELS[op] = fn
        return fn

    return register


def storage_dtype(qdtype: str) -> torch.dtype:
    return {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}[qdtype]


def _qdtype(node: Node) -> QuantDType:
    return QuantDType.parse(node.attrs["out_dtype"])


# -- per-node prepared parameters ------------------------------------------------------------------------------
#: (id(node), builder) -> (weakref to the node, builder, snapshot of its attrs, prepared value)
_PREPARED: dict[tuple[int, Any], tuple] = {}


def _forget(key: tuple, ref: weakref.ref) -> None:
    entry = _PREPARED.get(key)
    if entry is not None and entry[0] is ref:
        del _PREPARED[key]


def _prepared(node: Node, build: Callable[[Node], Any]) -> Any:
    """``build(node)``, cached per node (by identity) while its attrs stay equal to those it was built from: the
    parameters a kernel derives from attrs (requantize multipliers as tensors, ...) are made once, not per call."""
    key = (id(node), build)
    entry = _PREPARED.get(key)
    if entry is not None and entry[0]() is node:
        try:
            if entry[2] == node.attrs:
                return entry[3]
        except Exception:  # attrs that do not compare (tensors): no caching
            pass
    value = build(node)
    try:
        snapshot = copy.deepcopy(node.attrs)
        ref = weakref.ref(node, lambda r, key=key: _forget(key, r))
    except Exception:
        return value
    _PREPARED[key] = (ref, build, snapshot, value)
    return value


class _Requant:
    """A node's requantize attrs, prepared: the output type and the :func:`requantize_params` (per channel: one
    per accumulator rank and channel dim)."""

    def __init__(self, node: Node):
        self.out = _qdtype(node)
        self.storage = storage_dtype(self.out.value)
        self.mult = node.attrs.get("multiplier")
        self.shifts = node.attrs.get("shift")
        self.scalar = None
        if self.mult is not None and len(self.mult) == 1:
            self.scalar = requantize_params(int(self.mult[0]), int(self.shifts[0]), self.out)
        self.by_shape: dict[tuple[int, int], Any] = {}

    def params(self, ndim: int, channel_dim: int | None, device: torch.device):
        if self.scalar is not None:
            return self.scalar
        key = (ndim, channel_dim % ndim, device)  # per-channel tensors live where the accumulator does
        p = self.by_shape.get(key)
        if p is None:
            shape = [1] * ndim
            shape[key[1]] = -1
            m = torch.tensor(self.mult, dtype=torch.int64, device=device).reshape(shape)
            sh = (self.shifts[0] if len(set(self.shifts)) == 1
                  else torch.tensor(self.shifts, dtype=torch.int64, device=device).reshape(shape))
            p = self.by_shape[key] = requantize_params(m, sh, self.out)
        return p


_INT32_MAX = _INT32.qmax


def _clamp_int32(acc: torch.Tensor) -> torch.Tensor:
    if acc.is_floating_point():  # float bounds: exact in float64 (and a faster kernel than int bounds)
        return torch.clamp(acc.to(torch.float64), float(_INT32.qmin), float(_INT32.qmax))
    return torch.clamp(acc, _INT32.qmin, _INT32.qmax)


def _requant(node: Node, acc: torch.Tensor, channel_dim: int | None = None, bound: float | None = None,
             consume: bool = False) -> torch.Tensor:
    """Apply the node's requantize attrs to an exact integer accumulator (int64, or integer values in float32/64);
    store in the output's integer type. ``bound``: a known bound on ``|acc|`` (no saturation pass below int32's
    range, and the requantize fast path's test without a pass over the data); ``consume``: ``acc`` is a float64
    temporary that may be overwritten."""
    rq = _prepared(node, _Requant)
    if bound is None or bound > _INT32_MAX:
        acc = _clamp_int32(acc)
        consume = acc.dtype == torch.float64
        bound = None if bound is None else float(2**31)
    if rq.mult is None:  # int32 high-precision output: saturate only
        return acc.to(rq.storage)
    if bound is None:
        bound = float(2**31)  # saturated above
    return apply_requantize(acc, rq.params(acc.dim(), channel_dim, acc.device), bound=bound, storage=rq.storage,
                            consume=consume)


def _exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _float32_gemm_is_exact(t: torch.Tensor) -> bool:
    """Whether a float32 GEMM on ``t``'s device is IEEE float32 summation (exact for integers below 2**24): on
    the CPU, yes. A GPU's libraries may run float32 convolutions and matmuls in TF32 (cuDNN's default for
    convolutions) or with FFT / Winograd algorithms, none exact on integers, so GEMMs there take float64 (exact
    below 2**53 for any summation order; neither TF32 nor those algorithms apply to it)."""
    return t.device.type == "cpu"


def _gemm_dtype(a: torch.Tensor, b: torch.Tensor, terms: int) -> torch.dtype:
    """float32 when every partial sum of the integer products is below 2**24 (exact in float32 whatever the
    summation order) and the device sums float32 exactly, else float64 (exact below 2**53). Both give the exact
    integer result."""
    bound = terms * _magnitude(a) * _magnitude(b)
    return torch.float32 if bound < 2**24 and _float32_gemm_is_exact(a) else torch.float64


def _magnitude(t: torch.Tensor) -> int:
    return {torch.int8: 128, torch.int16: 32768}.get(t.dtype, 2**31)


def _bound_of(t: torch.Tensor) -> float | None:
    """``max |t|`` from its storage type (int8/int16/int32), or ``None`` (unknown: the data decide)."""
    return {torch.int8: 128.0, torch.int16: 32768.0, torch.int32: float(2**31), torch.bool: 1.0,
            torch.uint8: 255.0}.get(t.dtype)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """An exact integer-valued GEMM/pool result, kept in float64 (exact below 2**53; requantize reads it)."""
    return t.to(torch.float64)


# -- boundary and requantize ----------------------------------------------------------------------------------
@int_kernel("quantize")
def _quantize(node, inputs):
    x, scale = inputs
    return quantize(x, scale, _qdtype(node), node.attrs.get("axis"), storage_dtype(node.attrs["out_dtype"]))


@int_kernel("dequantize")
def _dequantize(node, inputs):
    q, scale = inputs
    return dequantize(q, scale, node.attrs.get("axis"))


@int_kernel("requantize")
def _requantize(node, inputs):
    q = inputs[0]
    return _requant(node, q.to(torch.int64), node.attrs.get("axis"), bound=_bound_of(q))


# -- GEMM -----------------------------------------------------------------------------------------------------
def _bias(acc: torch.Tensor, bias: torch.Tensor | None, channel_dim: int) -> torch.Tensor:
    if bias is None:
        return acc
    shape = [1] * acc.dim()
    shape[channel_dim] = -1
    return acc + bias.to(acc.dtype).reshape(shape)


class _GemmWeights:
    """A GEMM node's constant operands, prepared for one weight/bias pair (kept while they are the same tensors,
    unmodified): the GEMM dtype, the weight (and bias, when it can enter the GEMM) in that dtype, and a bound on
    ``|acc|``.

    The bound: every partial sum of ``x · w`` for an output is at most ``max|x| · Σ|w|`` over that output's
    weights (``max|x|`` from the input's storage type), plus ``|bias|``. Below ``2**24`` the whole GEMM with its
    bias is exact in float32 whatever the summation order (the ``_gemm_dtype`` rule, with the weights' actual
    magnitudes); else the bias is added in float64 after a float32 GEMM whose products alone stay below
    ``2**24``; else float64 (exact below ``2**53``)."""

    __slots__ = ("w", "w_version", "b", "b_version", "x_dtype", "dtype", "weight", "gemm_bias", "late_bias",
                 "bound")

    def __init__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_sums: Callable):
        self.w, self.w_version, self.b, self.x_dtype = w, w._version, b, x.dtype
        self.b_version = None if b is None else b._version
        w_abs = w.to(torch.int64).abs()
        products = _magnitude(x) * (int(out_sums(w_abs).max()) if w.numel() else 0)
        b_max = int(b.to(torch.int64).abs().max()) if b is not None and b.numel() else 0
        self.bound = float(products + b_max)
        if not _float32_gemm_is_exact(x):
            self.dtype, self.gemm_bias, self.late_bias = torch.float64, None, b
        elif products + b_max < 2**24:
            self.dtype, self.gemm_bias, self.late_bias = torch.float32, b, None
        elif products < 2**24:
            self.dtype, self.gemm_bias, self.late_bias = torch.float32, None, b
        else:
            self.dtype, self.gemm_bias, self.late_bias = torch.float64, None, b
        self.weight = w.to(self.dtype)
        if self.gemm_bias is not None:
            self.gemm_bias = self.gemm_bias.to(self.dtype)
        if self.late_bias is not None:
            self.late_bias = self.late_bias.to(torch.float64)

    def fits(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        return (w is self.w and w._version == self.w_version and b is self.b and x.dtype == self.x_dtype
                and (b is None or b._version == self.b_version))


class _GemmCache:
    def __init__(self, node: Node):
        self.entry: _GemmWeights | None = None


def _gemm_weights(node: Node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  out_sums: Callable) -> _GemmWeights:
    cache = _prepared(node, _GemmCache)
    entry = cache.entry
    if entry is None or not entry.fits(x, w, b):
        entry = cache.entry = _GemmWeights(x, w, b, out_sums)
    return entry


def _gemm_out(node: Node, acc: torch.Tensor, g: _GemmWeights, channel_dim: int) -> torch.Tensor:
    """Add a late bias (float64, exact) and requantize with the GEMM's bound."""
    consume = False
    if g.late_bias is not None:
        acc = acc.to(torch.float64)  # the GEMM's fresh result: changed in place
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        acc.add_(g.late_bias.reshape(shape))
        consume = True
    return _requant(node, acc, channel_dim, bound=g.bound, consume=consume or acc.dtype == torch.float64)


def _conv_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [out, in / groups, k...]
    return w_abs.reshape(w_abs.shape[0], -1).sum(1)


def _conv_transpose_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [in, out / groups, k...]
    return w_abs.transpose(0, 1).reshape(w_abs.shape[1], -1).sum(1)


def _linear_sums(w_abs: torch.Tensor) -> torch.Tensor:  # weight [out, in]
    return w_abs.reshape(-1, w_abs.shape[-1]).sum(1)


@int_kernel("conv2d", "conv1d")
def _conv(node, inputs):
    x, w, b = inputs
    conv = F.conv2d if node.op == "conv2d" else F.conv1d
    a = node.attrs
    g = _gemm_weights(node, x, w, b, _conv_sums)
    acc = conv(x.to(g.dtype), g.weight, g.gemm_bias, a["stride"], a["padding"], a["dilation"], a["groups"])
    return _gemm_out(node, acc, g, 1)


@int_kernel("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(node, inputs):
    """§6 like a conv: the exact sum over every (input channel, kernel tap) that reaches an output, bias, one
    requantize per output channel (dim 1). A weight ``[in, out / groups, k...]`` gives each output at most
    ``in · prod(k)`` terms."""
    x, w, b = inputs
    fn = F.conv_transpose2d if node.op == "conv_transpose2d" else F.conv_transpose1d
    a = node.attrs
    g = _gemm_weights(node, x, w, b, _conv_transpose_sums)
    acc = fn(x.to(g.dtype), g.weight, g.gemm_bias, a["stride"], a["padding"], a["output_padding"], a["groups"],
             a["dilation"])
    return _gemm_out(node, acc, g, 1)


@int_kernel("linear")
def _linear(node, inputs):
    x, w, b = inputs
    g = _gemm_weights(node, x, w, b, _linear_sums)
    acc = F.linear(x.to(g.dtype), g.weight, g.gemm_bias)
    return _gemm_out(node, acc, g, acc.dim() - 1)


@int_kernel("matmul")
def _matmul(node, inputs):
    a, b = inputs
    dtype = _gemm_dtype(a, b, a.shape[-1])
    acc = torch.matmul(a.to(dtype), b.to(dtype))
    return _requant(node, acc, bound=float(a.shape[-1] * _magnitude(a) * _magnitude(b)),
                    consume=acc.dtype == torch.float64)


# -- elementwise --------------------------------------------------------------------------------------------
def _rescale(q: torch.Tensor, mult: int, shift: int) -> torch.Tensor:
    """``docs/march.md`` §10: one input rescaled to the output scale, saturated to int32."""
    t = rshift_round_half_to_even(q.to(torch.int64) * int(mult), int(shift))
    return torch.clamp(t, _INT32.qmin, _INT32.qmax)


def _store(node: Node, y: torch.Tensor) -> torch.Tensor:
    out = _qdtype(node)
    return torch.clamp(y, out.qmin, out.qmax).to(storage_dtype(out.value))


#: F of an add/sub/add_const node without ``frac_bits`` (written by spec v4, whose one add rule kept 8 bits)
_V4_FRAC_BITS = 8


def _frac_bits(node: Node) -> int:
    """The add rule's extra fractional bits F (§10): the node's ``frac_bits`` (0: default qpp, 8: high precision)."""
    return int(node.attrs.get("frac_bits", _V4_FRAC_BITS))


@int_kernel("add", "sub")
def _add(node, inputs):
    (ma, mb), (sa, sb) = node.attrs["multipliers"], node.attrs["shifts"]
    sign_b = 1 if node.op == "add" else -1
    out = _qdtype(node)
    return rescaled_sum([(inputs[0], ma, sa, 1), (inputs[1], mb, sb, sign_b)], 0, out, _frac_bits(node),
                        storage=storage_dtype(out.value))


@int_kernel("add_const")
def _add_const(node, inputs):
    sign = -1 if node.attrs["negate"] else 1
    term = (inputs[0], node.attrs["multipliers"][0], node.attrs["shifts"][0], sign)
    out = _qdtype(node)
    return rescaled_sum([term], node.attrs["addend"], out, _frac_bits(node), storage=storage_dtype(out.value))


class _CatParams:
    def __init__(self, node: Node):
        out = _qdtype(node)
        self.storage = storage_dtype(out.value)
        self.parts = [requantize_params(int(m), int(s), out)
                      for m, s in zip(node.attrs["multipliers"], node.attrs["shifts"])]


@int_kernel("cat")
def _cat(node, inputs):
    """§10: each input rescaled to the output scale (``rshift_rhe(q · M, shift)``, saturated to int32, then to
    the output type: the requantize rule, whose saturation to the output type covers both), concatenated."""
    c = _prepared(node, _CatParams)
    if len(c.parts) != len(inputs) or any(_bound_of(q) is None or _bound_of(q) > _INT32_MAX for q in inputs):
        parts = [_rescale(q, m, s) for q, m, s in zip(inputs, node.attrs["multipliers"], node.attrs["shifts"])]
        return _store(node, torch.cat(parts, dim=node.attrs["dim"]))
    parts = [apply_requantize(q, p, bound=_bound_of(q), storage=c.storage) for q, p in zip(inputs, c.parts)]
    return torch.cat(parts, dim=node.attrs["dim"])


@int_kernel("mul")
def _mul(node, inputs):
    a, b = inputs
    ba, bb = _bound_of(a), _bound_of(b)
    return _requant(node, a.to(torch.int64) * b.to(torch.int64),
                    bound=None if ba is None or bb is None else ba * bb)


@int_kernel("scale")
def _scale(node, inputs):
    """Multiply by a constant real number: its sign flips the integers, its magnitude joins the multiplier."""
    bound = _bound_of(inputs[0])
    q = inputs[0].to(torch.int64)
    if node.attrs["negative"]:
        q = -q
    return _requant(node, q, bound=bound)


@int_kernel("clamp")
def _clamp(node, inputs):
    bound = _bound_of(inputs[0])
    q = inputs[0].to(torch.int64)
    lo, hi = node.attrs["lo"], node.attrs["hi"]
    q = torch.clamp(q, min=lo, max=hi)
    return _requant(node, q, bound=None if bound is None else min(bound, float(max(abs(lo), abs(hi)))))


@int_kernel("masked_fill_int")
def _masked_fill(node, inputs):
    q, mask = inputs
    return q.masked_fill(mask, node.attrs["value"])


# -- reductions and pooling (exact integer sums, one requantize) ---------------------------------------------
def _sum_dtype(q: torch.Tensor, terms: int) -> tuple[torch.dtype, float]:
    """float32 when every partial sum of ``terms`` values of ``q`` stays below 2**24 (exact), else float64; and
    the bound on the sum."""
    bound = terms * _magnitude(q)
    return (torch.float32 if bound < 2**24 else torch.float64), float(bound)


@int_kernel("sum_int")
def _sum(node, inputs):
    q = inputs[0]
    dtype, bound = _sum_dtype(q, max(1, q.numel()))  # at most numel terms per sum
    acc = torch.sum(q.to(dtype), dim=node.attrs["dim"], keepdim=node.attrs["keepdim"])
    return _requant(node, acc, bound=bound, consume=acc.dtype == torch.float64)


@int_kernel("avg_pool2d_int")
def _avg_pool(node, inputs):
    a = node.attrs
    k = a["kernel_size"]
    dtype, bound = _sum_dtype(inputs[0], k[0] * k[-1] if isinstance(k, (list, tuple)) else k * k)
    acc = F.avg_pool2d(inputs[0].to(dtype), a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"],
                       a["count_include_pad"], divisor_override=1)
    return _requant(node, acc, bound=bound, consume=acc.dtype == torch.float64)


@int_kernel("avg_pool1d_int")
def _avg_pool1d(node, inputs):
    """The exact sum of each window (zero padding counts), then one requantize by ``s_in / (k · s_out)``."""
    a = node.attrs
    x = _exact(inputs[0]).unsqueeze(-2)  # [..., 1, L]: the 2-d sum pool with a 1-row window
    acc = _acc(F.avg_pool2d(x, [1, a["kernel_size"][0]], [1, a["stride"][0]], [0, a["padding"][0]],
                            divisor_override=1)).squeeze(-2)
    return _requant(node, acc)


@int_kernel("abs_int", "neg_int")
def _sign(node, inputs):
    bound = _bound_of(inputs[0])
    q = inputs[0].to(torch.int64)
    return _requant(node, q.abs() if node.op == "abs_int" else -q, bound=bound)


@int_kernel("bilinear_int")
def _bilinear(node, inputs):
    q, a_h, a_w = inputs
    acc = _acc(torch.matmul(torch.matmul(_exact(a_h), _exact(q)), _exact(a_w).t()))
    return _requant(node, acc)


# -- passthrough: integer values move, their scale stays -------------------------------------------------------
@int_kernel("relu")
def _relu(node, inputs):
    return torch.clamp(inputs[0], min=0)


@int_kernel("max_pool2d")
def _max_pool(node, inputs):
    a = node.attrs
    q = inputs[0]  # int8/int16 values are exact in float32
    y = F.max_pool2d(q.to(torch.float32), a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    return y.to(q.dtype)


@int_kernel("max_pool1d")
def _max_pool1d(node, inputs):
    a = node.attrs
    q = inputs[0]  # float64 holds every int8/int16/int32 value exactly
    y = F.max_pool1d(_exact(q), a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"])
    return y.to(q.dtype)


@int_kernel("upsample_nearest1d")
def _nearest1d(node, inputs):
    q = inputs[0]
    return call_torch_op(TORCH_OPS[node.op], node, [_exact(q)]).to(q.dtype)


@int_kernel(*sorted(ops_in(index_outputs=True)))
def _values_and_indices(node, inputs):
    q = inputs[0]
    values, indices = call_torch_op(TORCH_OPS[node.op], node, [_exact(q)])
    return [values.to(q.dtype), indices]


@int_kernel("upsample_nearest2d")
def _nearest(node, inputs):
    q = inputs[0]
    return call_torch_op(TORCH_OPS[node.op], node, [_exact(q)]).to(q.dtype)


def _table_kernel(node: Node, inputs: list) -> torch.Tensor:
    """Table ops run the very function pre_export runs: integers in, dequantized at the input scales (exact),
    the op's integer kernel, and the result re-quantized at the output scale (exact: it lies on that grid)."""
    op = table_torch_op(node.op)
    io = TABLE_OP_IO[node.op]
    n_data = len(node.attrs["table_inputs"])
    schema_tensors = [a.name for a in op._schema.arguments if str(a.type).startswith("Tensor")]
    data, rest = inputs[:n_data], inputs[n_data:]
    by_name = dict(zip([n for n in schema_tensors if n not in node.attrs["table_inputs"]], rest))
    scale_of = dict(zip(io.data, io.scales))
    for name, q in zip(node.attrs["table_inputs"], data):
        by_name[name] = dequantize(q, by_name[scale_of[name]])
    attrs = {k: v for k, v in node.attrs.items() if k != "table_inputs"}
    out = call_torch_op(op, Node(node.op, [], [], attrs, node.site), [by_name[n] for n in schema_tensors])
    out_dtype = _qdtype_from_range(node.attrs["out_qmin"])
    return quantize(out, by_name["scale_out"], out_dtype, storage=storage_dtype(out_dtype.value))


def _qdtype_from_range(qmin: int) -> QuantDType:
    return {-128: QuantDType.qint8, -32768: QuantDType.qint16}[qmin]


#: the integer kernel of each table op on its codes, as its custom op (``quantlens.kernels.ops``) calls it, minus
#: the custom op's quantize/dequantize: ``(codes, constants by schema name, attrs, derived) -> output codes``;
#: ``derived`` is a per-node dict for values made from the constants (kept while they are unchanged).
def _direct_lut(q, c, a, derived):
    entries = derived.get("entries")
    if entries is None:
        # the output range applied to the 256 entries once instead of to every output (same values), stored in
        # the output's storage type: the gather is the whole kernel
        out = _qdtype_from_range(a["out_qmin"])
        entries = derived["entries"] = c["table"].to(torch.int64).clamp(a["out_qmin"], a["out_qmax"]).clamp(
            out.qmin, out.qmax).to(storage_dtype(out.value))
    if q.dtype != torch.int8:
        return lut256_lookup(q, entries.to(torch.int64), 128)
    return torch.take(entries, q.to(torch.int64).add_(128))


def _direct_segment_lut(q, c, a, derived):
    return segmented_lookup(q[0], c["bounds"], c["shifts"], c["entries"], a["frac_bits"], a["out_qmin"],
                            a["out_qmax"], c["tails"])


def _params(c, name="params"):
    return [int(v) for v in c[name].tolist()]


def _direct_reciprocal(q, c, a, derived):
    multiplier, shift = _params(c)
    return int_reciprocal(q[0], multiplier, shift, dtype_from_range(a["out_qmin"], a["out_qmax"]))


def _direct_div(q, c, a, derived):
    multiplier, shift = _params(c)
    return int_div(q[0], q[1], multiplier, shift, dtype_from_range(a["out_qmin"], a["out_qmax"]))


def _direct_softmax(q, c, a, derived):
    prepared = derived.get("softmax")
    if prepared is None:
        multiplier, shift = _params(c)
        out_dtype = dtype_from_range(a["out_qmin"], a["out_qmax"])
        x_bits = 7 + out_dtype.bits
        if c["exp_bounds"].numel() == 0:
            table = Table256(c["exp_entries"].to(torch.int64), 255, 0, 1 << x_bits)
        else:
            table = SegmentedTable(c["exp_bounds"], c["exp_shifts"], c["exp_entries"], a["exp_frac_bits"], 0,
                                   1 << x_bits, c["exp_tails"])
        prepared = derived["softmax"] = (table, multiplier, shift, out_dtype)
    table, multiplier, shift, out_dtype = prepared
    return int_softmax(q[0], a["dim"], table, multiplier, shift, out_dtype)


def _direct_layer_norm(q, c, a, derived):
    params = derived.get("params")
    if params is None:
        params = derived["params"] = _params(c)
    eps_term, shift, frac_bits = params
    return int_layer_norm(q[0], a["normalized_ndim"], c["gain"], c["bias"], eps_term, frac_bits, shift,
                          dtype_from_range(a["out_qmin"], a["out_qmax"]))


_DIRECT_TABLE = {"lut": lambda q, c, a, d: _direct_lut(q[0], c, a, d), "segment_lut": _direct_segment_lut,
                 "int_reciprocal": _direct_reciprocal, "int_div": _direct_div, "int_softmax": _direct_softmax,
                 "int_layer_norm": _direct_layer_norm}


class _TableSite:
    """A table node's schema split, prepared: data inputs (with their quantize range), the constant inputs by
    schema name, and the output type."""

    def __init__(self, node: Node):
        op = table_torch_op(node.op)
        io = TABLE_OP_IO[node.op]
        self.n_data = len(node.attrs["table_inputs"])
        schema_tensors = [a.name for a in op._schema.arguments if str(a.type).startswith("Tensor")]
        self.const_names = [n for n in schema_tensors if n not in node.attrs["table_inputs"]]
        self.attrs = {k: v for k, v in node.attrs.items() if k != "table_inputs"}
        self.out = _qdtype_from_range(node.attrs["out_qmin"])
        self.storage = storage_dtype(self.out.value)
        ranges = {"x": ("in_qmin", "in_qmax")} if len(io.data) == 1 else {"x": ("x_qmin", "x_qmax"),
                                                                            "y": ("y_qmin", "y_qmax")}
        self.ranges = [(node.attrs.get(ranges.get(n, ("", ""))[0], -128), node.attrs.get(ranges.get(n, ("", ""))[1],
                        127)) for n in node.attrs["table_inputs"]]
        self.ok = list(node.attrs["table_inputs"]) == list(io.data)
        self.consts: tuple | None = None  # (inputs, versions, by name)
        self.derived: dict = {}  # what a kernel made from the constants (reset when they change)

    def constants(self, rest: list) -> dict:
        cached = self.consts
        if cached is not None and len(cached[0]) == len(rest) and all(
                a is b and a._version == v for a, b, v in zip(cached[0], rest, cached[1])):
            return cached[2]
        by_name = dict(zip(self.const_names, rest))
        self.consts = (list(rest), [t._version for t in rest], by_name)
        self.derived = {}
        return by_name


_STORAGE_RANGE = {torch.int8: (-128, 127), torch.int16: (-32768, 32767)}


def _table_direct(node: Node, inputs: list) -> torch.Tensor:
    """Table ops on their codes: the very integer kernel pre_export's custom op runs, on the codes it would
    quantize (its dequantize-quantize round trips are exact: the values lie on the grids)."""
    site = _prepared(node, _TableSite)
    if not site.ok or any(not isinstance(t, torch.Tensor) for t in inputs):
        return _table_kernel(node, inputs)
    data = []
    for q, (lo, hi) in zip(inputs[:site.n_data], site.ranges):
        if _STORAGE_RANGE.get(q.dtype) != (lo, hi):  # the custom op's quantize saturates to the input range
            q = torch.clamp(q.to(torch.int64), lo, hi)
        data.append(q)
    consts = site.constants(inputs[site.n_data:])
    out = _DIRECT_TABLE[node.op](data, consts, site.attrs, site.derived)
    if out.dtype == site.storage and node.op == "lut":  # (its entries carry the output range already)
        return out
    return torch.clamp(out, site.out.qmin, site.out.qmax).to(site.storage)


for _op in TABLE_OP_IO:
    INT_KERNELS[_op] = _table_direct if _op in _DIRECT_TABLE else _table_kernel


def int_dispatch(node: Node, inputs: list) -> Any:
    if node.attrs.get("host"):  # float post-processing after the boundary
        from quantlens.compiler.interpreter import qat_dispatch

        return qat_dispatch(node, inputs)
    kernel = INT_KERNELS.get(node.op)
    if kernel is not None:
        return kernel(node, inputs)
    # Pure data movement (reshape, permute, slice, gather, embedding ...) has the same kernel on integers.
    if node.op in _MOVEMENT:
        return QAT_KERNELS[node.op](node, inputs) if node.op in QAT_KERNELS else call_torch_op(
            TORCH_OPS[node.op], node, inputs
        )
    raise QuantLensError(f"quantized IR: no integer kernel for op '{node.op}' (op site '{node.site}').")


#: ops whose integer kernel is the qat kernel (data movement, indices and masks), from the op set.
_MOVEMENT = ops_in(shared_kernel=True)


@int_kernel("pad_int")
def _pad(node, inputs):
    """Pads integers (exact in float64 for reflect/replicate, which torch implements for floats only)."""
    q = inputs[0]
    a = node.attrs
    if a["mode"] == "constant":
        return F.pad(q, a["pad"], mode="constant", value=int(a["value"]))
    return F.pad(q.to(torch.float64), a["pad"], mode=a["mode"]).to(q.dtype)


@int_kernel("fill_int")
def _fill(node, inputs):
    return torch.full_like(inputs[0], int(node.attrs["value"]))


@int_kernel("select_scatter", "slice_scatter")
def _scatter(node, inputs):
    return call_torch_op(TORCH_OPS[node.op], node, inputs)


def _channel_shape(node: Node, x: torch.Tensor) -> list[int]:
    shape = [1] * x.dim()
    shape[node.attrs["channel_dim"] % x.dim()] = -1
    return shape


@int_kernel("channel_affine")
def _channel_affine(node, inputs):
    """BatchNorm alone: ``acc = q·w[c] + b[c]`` exactly, then the per-channel requantize (§10.2)."""
    q, w, b = inputs
    shape = _channel_shape(node, q)
    acc = q.to(torch.int64) * w.to(torch.int64).reshape(shape) + b.to(torch.int64).reshape(shape)
    return _requant(node, acc, node.attrs["channel_dim"])


@int_kernel("prelu_int")
def _prelu(node, inputs):
    """``q >= 0``: requantize(q, M, shift); ``q < 0``: requantize(sign(α)·q, M_neg[c], shift_neg[c]) (§10.3)."""
    q = inputs[0].to(torch.int64)
    a = node.attrs
    out = _qdtype(node)
    pos = requantize(q, int(a["multiplier"][0]), int(a["shift"][0]), out)
    shape = _channel_shape(node, q) if len(a["neg_multiplier"]) > 1 else [1] * q.dim()
    sign = torch.tensor(a["neg_sign"], dtype=torch.int64, device=q.device).reshape(shape)
    mult = torch.tensor(a["neg_multiplier"], dtype=torch.int64, device=q.device).reshape(shape)
    shift = torch.tensor(a["neg_shift"], dtype=torch.int64, device=q.device).reshape(shape)
    neg = requantize(q * sign, mult, shift, out)
    return torch.where(q >= 0, pos, neg).to(storage_dtype(out.value))
