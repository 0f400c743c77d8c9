"""Integer kernels of the quantized IR: the bit-exact simulator of ``docs/march.md``.

Values are integer tensors (int8/int16/int32 storage; int64 for indices). GEMMs and pooling sums are computed in
float64 on integer operands, which is exact (every partial sum of int8/int16 products stays far below 2**53) and
therefore independent of summation order and thread count; results are then rounded/saturated with the
functions of :mod:`quantlens.numerics`, which implement the spec's rules once.

Requantize parameters live in node attrs: ``multiplier``/``shift`` (lists: one entry per tensor, or per channel
along ``axis``) and the output type's ``qmin``/``qmax``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from quantlens.compiler.interpreter import QAT_KERNELS, call_torch_op
from quantlens.compiler.ir import Node
from quantlens.compiler.lowering import TORCH_OPS
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.kernels import TABLE_OP_IO, table_torch_op
from quantlens.opset import ops_in
from quantlens.numerics import dequantize, quantize, requantize, rescaled_sum, rshift_round_half_to_even

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


def _requant(node: Node, acc: torch.Tensor, channel_dim: int | None = None) -> torch.Tensor:
    """Apply the node's requantize attrs to an int64 accumulator; store in the output's integer type."""
    out = _qdtype(node)
    mult = node.attrs.get("multiplier")
    if mult is None:  # int32 high-precision output: saturate only
        y = torch.clamp(acc, _INT32.qmin, _INT32.qmax)
    else:
        shifts = node.attrs["shift"]
        acc = torch.clamp(acc, _INT32.qmin, _INT32.qmax)
        if len(mult) == 1:
            y = requantize(acc, int(mult[0]), int(shifts[0]), out)
        else:  # per channel: broadcast along the channel dim
            shape = [1] * acc.dim()
            shape[channel_dim % acc.dim()] = -1
            m = torch.tensor(mult, dtype=torch.int64).reshape(shape)
            sh = shifts[0] if len(set(shifts)) == 1 else torch.tensor(shifts, dtype=torch.int64).reshape(shape)
            y = requantize(acc, m, sh, out)
    return y.to(storage_dtype(out.value))


def _exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _gemm_dtype(a: torch.Tensor, b: torch.Tensor, terms: int) -> torch.dtype:
    """float32 when every partial sum of the integer products is below 2**24 (exact in float32 whatever the
    summation order), else float64 (exact below 2**53). Both give the exact integer result."""
    bound = terms * _magnitude(a) * _magnitude(b)
    return torch.float32 if bound < 2**24 else torch.float64


def _magnitude(t: torch.Tensor) -> int:
    return {torch.int8: 128, torch.int16: 32768}.get(t.dtype, 2**31)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """An exact integer-valued GEMM/pool result, kept in float64 (exact below 2**53; requantize reads it)."""
    return t.to(torch.float64)


# -- boundary and requantize ----------------------------------------------------------------------------------
@int_kernel("quantize")
def _quantize(node, inputs):
    x, scale = inputs
    return quantize(x, scale, _qdtype(node), node.attrs.get("axis")).to(storage_dtype(node.attrs["out_dtype"]))


@int_kernel("dequantize")
def _dequantize(node, inputs):
    q, scale = inputs
    return dequantize(q, scale, node.attrs.get("axis"))


@int_kernel("requantize")
def _requantize(node, inputs):
    return _requant(node, inputs[0].to(torch.int64), node.attrs.get("axis"))


# -- GEMM -----------------------------------------------------------------------------------------------------
def _bias(acc: torch.Tensor, bias: torch.Tensor | None, channel_dim: int) -> torch.Tensor:
    if bias is None:
        return acc
    shape = [1] * acc.dim()
    shape[channel_dim] = -1
    return acc + bias.to(acc.dtype).reshape(shape)


@int_kernel("conv2d", "conv1d")
def _conv(node, inputs):
    x, w, b = inputs
    conv = F.conv2d if node.op == "conv2d" else F.conv1d
    a = node.attrs
    dtype = _gemm_dtype(x, w, w[0].numel())
    acc = _acc(conv(x.to(dtype), w.to(dtype), None, a["stride"], a["padding"], a["dilation"], a["groups"]))
    return _requant(node, _bias(acc, b, 1), 1)


@int_kernel("conv_transpose1d", "conv_transpose2d")
def _conv_transpose(node, inputs):
    """§6 like a conv: the exact sum over every (input channel, kernel tap) that reaches an output, bias, one
    requantize per output channel (dim 1). A weight ``[in, out / groups, k...]`` gives each output at most
    ``in · prod(k)`` terms."""
    x, w, b = inputs
    fn = F.conv_transpose2d if node.op == "conv_transpose2d" else F.conv_transpose1d
    a = node.attrs
    dtype = _gemm_dtype(x, w, w.shape[0] * w[0, 0].numel())
    acc = _acc(fn(x.to(dtype), w.to(dtype), None, a["stride"], a["padding"], a["output_padding"], a["groups"],
                  a["dilation"]))
    return _requant(node, _bias(acc, b, 1), 1)


@int_kernel("linear")
def _linear(node, inputs):
    x, w, b = inputs
    dtype = _gemm_dtype(x, w, w.shape[-1])
    acc = _acc(F.linear(x.to(dtype), w.to(dtype)))
    return _requant(node, _bias(acc, b, acc.dim() - 1), -1)


@int_kernel("matmul")
def _matmul(node, inputs):
    a, b = inputs
    dtype = _gemm_dtype(a, b, a.shape[-1])
    return _requant(node, _acc(torch.matmul(a.to(dtype), b.to(dtype))))


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
    y = rescaled_sum([(inputs[0], ma, sa, 1), (inputs[1], mb, sb, sign_b)], 0, _qdtype(node), _frac_bits(node))
    return y.to(storage_dtype(node.attrs["out_dtype"]))


@int_kernel("add_const")
def _add_const(node, inputs):
    sign = -1 if node.attrs["negate"] else 1
    term = (inputs[0], node.attrs["multipliers"][0], node.attrs["shifts"][0], sign)
    y = rescaled_sum([term], node.attrs["addend"], _qdtype(node), _frac_bits(node))
    return y.to(storage_dtype(node.attrs["out_dtype"]))


@int_kernel("cat")
def _cat(node, inputs):
    parts = [
        _rescale(q, m, s) for q, m, s in zip(inputs, node.attrs["multipliers"], node.attrs["shifts"])
    ]
    return _store(node, torch.cat(parts, dim=node.attrs["dim"]))


@int_kernel("mul")
def _mul(node, inputs):
    a, b = inputs
    return _requant(node, a.to(torch.int64) * b.to(torch.int64))


@int_kernel("scale")
def _scale(node, inputs):
    """Multiply by a constant real number: its sign flips the integers, its magnitude joins the multiplier."""
    q = inputs[0].to(torch.int64)
    if node.attrs["negative"]:
        q = -q
    return _requant(node, q)


@int_kernel("clamp")
def _clamp(node, inputs):
    q = inputs[0].to(torch.int64)
    lo, hi = node.attrs["lo"], node.attrs["hi"]
    q = torch.clamp(q, min=lo, max=hi)
    return _requant(node, q)


@int_kernel("masked_fill_int")
def _masked_fill(node, inputs):
    q, mask = inputs
    return q.masked_fill(mask, node.attrs["value"])


# -- reductions and pooling (exact integer sums, one requantize) ---------------------------------------------
@int_kernel("sum_int")
def _sum(node, inputs):
    acc = _acc(torch.sum(_exact(inputs[0]), dim=node.attrs["dim"], keepdim=node.attrs["keepdim"]))
    return _requant(node, acc)


@int_kernel("avg_pool2d_int")
def _avg_pool(node, inputs):
    a = node.attrs
    acc = _acc(F.avg_pool2d(_exact(inputs[0]), a["kernel_size"], a["stride"], a["padding"], a["ceil_mode"],
                            a["count_include_pad"], divisor_override=1))
    return _requant(node, acc)


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
    q = inputs[0].to(torch.int64)
    return _requant(node, q.abs() if node.op == "abs_int" else -q)


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
    return quantize(out, by_name["scale_out"], out_dtype).to(storage_dtype(out_dtype.value))


def _qdtype_from_range(qmin: int) -> QuantDType:
    return {-128: QuantDType.qint8, -32768: QuantDType.qint16}[qmin]


for _op in TABLE_OP_IO:
    INT_KERNELS[_op] = _table_kernel


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
    sign = torch.tensor(a["neg_sign"], dtype=torch.int64).reshape(shape)
    mult = torch.tensor(a["neg_multiplier"], dtype=torch.int64).reshape(shape)
    shift = torch.tensor(a["neg_shift"], dtype=torch.int64).reshape(shape)
    neg = requantize(q * sign, mult, shift, out)
    return torch.where(q >= 0, pos, neg).to(storage_dtype(out.value))
