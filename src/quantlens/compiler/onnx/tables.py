"""pre_export's table ops as exact ONNX: onnxruntime computes what the qat IR computes, bit for bit.

ONNX has no integer tables, but each table op of ``quantlens.kernels.ops`` is integer arithmetic on its input
codes, and ONNX has what that arithmetic needs: ``Gather`` for tables, float64 for integers below ``2**53``
(``quantlens.kernels.int_ops`` proves where its own float64 paths are exact, and the same operations in the same
order give the same IEEE results in onnxruntime), int64 for the one step beyond ``2**53`` (layer_norm's gain and
bias, the layer norm's sums). One converter per op, registered in :data:`EXACT_TABLE_EXPORTS`; each returns
``False`` when the site is outside the range its proof covers (a per-channel input scale, a constant it cannot
read, a softmax requantize outside its short formula's range), and then ``_table_reference`` writes the float
op the table emulates instead.

* elementwise (``lut``, ``segment_lut``, ``int_reciprocal``): a function of one input code, so a ``Gather`` over
  the op's own output at every input code (256 or 65536 values, computed at export by the op itself);
* ``int_softmax``: max, ``d = q - max``, the exp table as a ``Gather`` over every ``d``, the exact sum, its
  mantissa and exponent, the reciprocal mantissa table by its integer interpolation, ``t``, and the output
  requantize in int64;
* ``int_log_softmax``: the softmax's steps up to the sum's mantissa and exponent, the ln mantissa table by its integer
  interpolation, ``L``, and ``rhe(d · M_x - L · M_l, T)`` in int64;
* ``int_layer_norm``: the mean, centred values, variance and the mantissa normalisation in int64 (as the kernel's
  int64 path), the rsqrt mantissa table and ``u`` in float64, then ``rhe(u * gain + bias, T)`` in int64.

``_table_reference`` is the converter of every table op (``quantlens.kernels.TABLE_OP_IO``) in
:data:`~.registry.ONNX_CONVERTERS`.
"""

from __future__ import annotations

import torch

from quantlens._registry import make_registry
from quantlens.compiler.ir import Node
from quantlens.compiler.onnx.builder import Builder, onnx_dtype
from quantlens.compiler.onnx.registry import ONNX_CONVERTERS, onnx_converter
from quantlens.kernels import TABLE_OP_IO, dtype_from_range
from quantlens.kernels.int_ops import (
    LN_NORM_BITS,
    MANTISSA_BITS,
    RECIP_BITS,
    RSQRT_BITS,
    SOFTMAX_PROB_BITS,
    exp_bits,
    exp_table_from,
)
from quantlens.kernels.log_softmax_ops import LN2_FIXED
from quantlens.kernels.tables import SegmentedTable, ln_mantissa_table, recip_mantissa_table, rsqrt_mantissa_table

__all__ = ["EXACT_TABLE_EXPORTS"]

#: table op name -> ``(builder, node) -> bool`` (False: not exact here; the float reference is written instead)
#: table op -> its exact export ``fn(builder, node) -> bool`` (False: outside what it covers)
EXACT_TABLE_EXPORTS, exact_export = make_registry("exact ONNX export of table op")

_POW2_RANGE = 256  # 2**e for e in [-256, 256]: every exponent the kernels use


# -- helpers: float64 integers ------------------------------------------------------------------------------------
class F64:
    """Small float64 / int64 graph helpers for one node (names derived from its first output)."""

    def __init__(self, b: Builder, node: Node):
        self.b, self.node, self.out = b, node, node.outputs[0]

    def const(self, value, dtype: str = "float64") -> str:
        return self.b.scalar(value, dtype, f"{self.out}/c")

    def op(self, op_type: str, *inputs: str, dtype: str = "float64", **attrs) -> str:
        return self.b.add(op_type, list(inputs), f"{self.out}/{op_type.lower()}", dtype=dtype, **attrs)

    def codes(self, x: str, scale: str, qmin: int, qmax: int) -> str:
        """``numerics.quantize``: ``clamp(round(x / s), qmin, qmax)`` in float32, then float64 (exact)."""
        dtype = self.b.dtype(x) or "float32"
        q = self.op("Round", self.op("Div", x, self.b.value(scale), dtype=dtype), dtype=dtype)
        q = self.op("Clip", q, self.b.scalar(float(qmin), dtype, f"{self.out}/qmin"),
                    self.b.scalar(float(qmax), dtype, f"{self.out}/qmax"), dtype=dtype)
        return self.op("Cast", q, to=onnx_dtype("float64"))

    def gather(self, values: torch.Tensor, index: str, dtype: str = "float64") -> str:
        """``values[index]`` (``index``: integer-valued float64, or int64)."""
        table = self.b.init(values.to(getattr(torch, dtype)).contiguous(), f"{self.out}/table")
        if self.b.dtype(index) != "int64":
            index = self.op("Cast", index, to=onnx_dtype("int64"), dtype="int64")
        return self.op("Gather", table, index, axis=0, dtype=dtype)

    def pow2(self, exponent: str) -> str:
        """``2.0**e`` for integer-valued float64 ``e``, exact (a gather from the powers of two)."""
        powers = torch.pow(torch.tensor(2.0, dtype=torch.float64),
                           torch.arange(-_POW2_RANGE, _POW2_RANGE + 1, dtype=torch.float64))
        return self.gather(powers, self.op("Add", exponent, self.const(float(_POW2_RANGE))))

    def bitlen(self, v: str) -> str:
        """``bit_length(v)`` for integer-valued float64 ``0 < v < 2**53``: the count of ``2**i <= v``."""
        thresholds = self.b.init(torch.pow(torch.tensor(2.0, dtype=torch.float64),
                                           torch.arange(0, 54, dtype=torch.float64)), f"{self.out}/pow2")
        above = self.op("GreaterOrEqual", self.op("Unsqueeze", v, self.b.ints([-1], f"{self.out}/ax")), thresholds,
                        dtype="bool")
        count = self.op("Cast", above, to=onnx_dtype("float64"))
        return self.op("ReduceSum", count, self.b.ints([-1], f"{self.out}/ax"), keepdims=0)

    def mantissa_lookup(self, table: SegmentedTable, m: str) -> str:
        """``segmented_lookup`` of a mantissa table (one or two segments, no tails, no fractional bits) on
        integer-valued float64 ``m`` inside its domain: ``rhe(E[j] * (2**p - r) + E[j + 1] * r, p)``, all
        below ``2**40`` (exact)."""
        bounds = [int(v) for v in table.bounds]
        shifts = [int(v) for v in table.shifts]
        width = table.entries.shape[1]
        x = self.op("Clip", m, self.const(float(bounds[0])), self.const(float(bounds[-1] - 1)))
        if len(shifts) == 1:
            seg = self.op("Mul", x, self.const(0.0))
        else:
            seg = self.op("Cast", self.op("GreaterOrEqual", x, self.const(float(bounds[1])), dtype="bool"),
                          to=onnx_dtype("float64"))

        def per_segment(values: list[float]) -> str:
            return self.gather(torch.tensor(values, dtype=torch.float64), seg)

        start = per_segment([float(v) for v in bounds[:-1]])
        step = per_segment([float(1 << p) for p in shifts])
        o = self.op("Sub", x, start)
        j = self.op("Floor", self.op("Div", o, step))  # exact: a power-of-two divisor
        r = self.op("Sub", o, self.op("Mul", j, step))
        flat = table.entries.reshape(-1).to(torch.float64)
        base = self.op("Add", self.op("Mul", seg, self.const(float(width))), j)
        e0 = self.gather(flat, base)
        e1 = self.gather(flat, self.op("Add", base, self.const(1.0)))
        acc = self.op("Add", self.op("Mul", e0, self.op("Sub", step, r)), self.op("Mul", e1, r))
        y = self.op("Round", self.op("Div", acc, step))  # rhe(acc, p): exact quotient, half to even
        return self.op("Clip", y, self.const(float(table.out_min)), self.const(float(table.out_max)))

    def to_int64(self, v: str) -> str:
        return self.op("Cast", v, to=onnx_dtype("int64"), dtype="int64")

    def rhe_div_int64(self, a: str, d: str) -> str:
        """``numerics``' ``div_round_half_even(a, d)`` for int64 ``a`` (any sign) and positive int64 ``d``: the
        floor by a non-negative remainder (``Mod``, fmod 0), then up when ``2 * rem`` passes ``d`` or equals it
        with an odd floor (``d = 1`` never rounds)."""
        rem = self.op("Mod", a, d, dtype="int64", fmod=0)
        floor = self.op("Div", self.op("Sub", a, rem, dtype="int64"), d, dtype="int64")
        twice = self.op("Mul", rem, self.const(2, "int64"), dtype="int64")
        odd = self.op("Equal", self.op("Mod", floor, self.const(2, "int64"), dtype="int64", fmod=0),
                      self.const(1, "int64"), dtype="bool")
        up = self.op("Or", self.op("Greater", twice, d, dtype="bool"),
                     self.op("And", self.op("Equal", twice, d, dtype="bool"), odd, dtype="bool"), dtype="bool")
        return self.op("Add", floor, self.op("Cast", up, to=onnx_dtype("int64"), dtype="int64"), dtype="int64")

    def pow2_int64(self, exponent: str) -> str:
        """``2**e`` as int64 for int64 ``e`` in ``[0, 62]`` (a gather)."""
        powers = torch.tensor([1 << e for e in range(63)], dtype=torch.int64)
        return self.gather(powers, exponent, dtype="int64")

    def bitlen_int64(self, v: str) -> str:
        """``bit_length(v)`` for int64 ``0 <= v < 2**62``, as float64: the count of ``2**i <= v``."""
        thresholds = self.b.init(torch.tensor([1 << i for i in range(63)], dtype=torch.int64), f"{self.out}/pow2")
        above = self.op("GreaterOrEqual", self.op("Unsqueeze", v, self.b.ints([-1], f"{self.out}/ax"),
                                                  dtype="int64"), thresholds, dtype="bool")
        count = self.op("Cast", above, to=onnx_dtype("float64"))
        return self.op("ReduceSum", count, self.b.ints([-1], f"{self.out}/ax"), keepdims=0)

    def dequantize(self, codes: str, scale: str, out_min: int, out_max: int) -> None:
        """Saturate the int64 codes, then ``numerics.dequantize`` (float32 codes times the float32 scale) into the
        node's output."""
        dtype = self.b.dtype(self.node.inputs[0]) or "float32"
        codes = self.op("Clip", codes, self.const(out_min, "int64"), self.const(out_max, "int64"), dtype="int64")
        y = self.op("Cast", codes, to=onnx_dtype(dtype), dtype=dtype)
        self.b.add("Mul", [y, self.b.value(scale)], self.out)


def table_constants(b: Builder, node: Node) -> list[torch.Tensor] | None:
    """A table node's parameter inputs as constants, when all are constants and its input scale is per tensor (what
    the exact exports read); ``None`` otherwise."""
    constants = b.graph.constants
    if any(name not in constants for name in node.inputs[1:]):
        return None
    values = [constants[name] for name in node.inputs[1:]]
    return values if values[0].numel() == 1 else None  # a per-tensor input scale


# -- elementwise --------------------------------------------------------------------------------------------------
@exact_export("lut", "segment_lut", "int_reciprocal")
def _elementwise(b: Builder, node: Node) -> bool:
    from quantlens.compiler.kernels_qat import call_torch_op
    from quantlens.kernels import table_torch_op

    constants = table_constants(b, node)
    if constants is None:
        return False
    qmin, qmax = (-128, 127) if node.op == "lut" else (int(node.attrs["in_qmin"]), int(node.attrs["in_qmax"]))
    codes = torch.arange(qmin, qmax + 1, dtype=torch.float32)
    x_all = codes * constants[0].reshape(()).to(torch.float32)  # every input value, as its fake quant gives it
    values = call_torch_op(table_torch_op(node.op), node, [x_all] + constants)
    f = F64(b, node)
    q = f.codes(b.value(node.inputs[0]), node.inputs[1], qmin, qmax)
    dtype = b.dtype(node.inputs[0]) or "float32"
    index = f.to_int64(f.op("Sub", q, f.const(float(qmin))))
    table = b.init(values.to(getattr(torch, dtype)).contiguous(), f"{f.out}/table")
    b.add("Gather", [table, index], f.out, axis=0)
    return True


# -- softmax, log_softmax ------------------------------------------------------------------------------------------
def _exp_sum(f: F64, node: Node, constants: list[torch.Tensor]) -> tuple[str, str, str, str]:
    """The first steps of ``int_softmax`` and ``int_log_softmax`` (``int_ops.exp_row_sums``, ``sum_mantissa``):
    ``d = q - max(q)``, ``e = E(d)`` (a ``Gather`` over every ``d``), the exact sum ``S`` and its mantissa ``m`` and
    exponent ``k``, all integer-valued float64. Returns ``(d, e, m, k)``."""
    _, _, bounds, shifts, entries, tails, _ = constants
    a = node.attrs
    out_dtype = dtype_from_range(int(a["out_qmin"]), int(a["out_qmax"]))
    exp = exp_table_from(bounds, shifts, entries, tails, int(a["exp_frac_bits"]), out_dtype)
    low = -255 if bounds.numel() == 0 else -(int(a["in_qmax"]) - int(a["in_qmin"]))
    e_all = exp.lookup(torch.arange(low, 1, dtype=torch.int64)).to(torch.float64)  # E(d) for every d = q - max(q)
    dim = f.b.ints([int(a["dim"])], f"{f.out}/dim")
    q = f.codes(f.b.value(node.inputs[0]), node.inputs[1], int(a["in_qmin"]), int(a["in_qmax"]))
    d = f.op("Sub", q, f.op("ReduceMax", q, dim, keepdims=1))
    e = f.gather(e_all, f.op("Sub", d, f.const(float(low))))
    s = f.op("ReduceSum", e, dim, keepdims=1)  # exact: integers below 2**39
    bits = f.bitlen(s)
    mant = f.op("Round", f.op("Mul", s, f.pow2(f.op("Sub", f.const(float(MANTISSA_BITS)), bits))))
    k = f.op("Sub", bits, f.const(float(MANTISSA_BITS)))
    over = f.op("Equal", mant, f.const(float(1 << MANTISSA_BITS)), dtype="bool")
    mant = f.op("Where", over, f.const(float(1 << (MANTISSA_BITS - 1))), mant)
    k = f.op("Add", k, f.op("Cast", over, to=onnx_dtype("float64")))
    return d, e, mant, k


@exact_export("int_softmax")
def _softmax(b: Builder, node: Node) -> bool:
    constants = table_constants(b, node)
    if constants is None:
        return False
    multiplier, shift = (int(v) for v in constants[-1].tolist())
    if not (0 < multiplier < (1 << 31) and 0 < shift <= 62):
        return False  # the kernel's general requantize: not written here
    f = F64(b, node)
    _, e, mant, k = _exp_sum(f, node, constants)
    r = f.mantissa_lookup(recip_mantissa_table(), mant)
    scale = f.op("Mul", r, f.pow2(f.op("Neg", f.op("Add", k, f.const(float(RECIP_BITS - SOFTMAX_PROB_BITS))))))
    t = f.to_int64(f.op("Round", f.op("Mul", e, scale)))
    # requantize(t, M, shift) for 0 <= t < 2**31 + 2**14 (``int_ops._softmax_requantize``): x + 2**(shift - 1)
    # stays below 2**63
    x = f.op("Mul", t, f.const(multiplier, "int64"), dtype="int64")
    p = f.const(1 << shift, "int64")
    odd = f.op("Mod", f.op("Div", x, p, dtype="int64"), f.const(2, "int64"), dtype="int64", fmod=0)
    y = f.op("Div", f.op("Add", f.op("Add", x, f.const((1 << (shift - 1)) - 1, "int64"), dtype="int64"), odd,
                         dtype="int64"), p, dtype="int64")
    f.dequantize(y, node.inputs[2], int(node.attrs["out_qmin"]), int(node.attrs["out_qmax"]))
    return True


@exact_export("int_log_softmax")
def _log_softmax(b: Builder, node: Node) -> bool:
    """``int_log_softmax`` (``kernels.log_softmax_ops``): ``L = LN(m) + (k + 23 - X) · LN2`` in float64 (integers
    below ``2**29``), then ``rhe(d · M_x - L · M_l, T)`` in int64 (``|.| < 2**61``)."""
    constants = table_constants(b, node)
    if constants is None:
        return False
    multiplier, ln_multiplier, shift = (int(v) for v in constants[-1].tolist())
    a = node.attrs
    x_bits = exp_bits(dtype_from_range(int(a["out_qmin"]), int(a["out_qmax"])))
    f = F64(b, node)
    d, _, mant, k = _exp_sum(f, node, constants)
    ln_s = f.op("Add", f.mantissa_lookup(ln_mantissa_table(), mant),
                f.op("Mul", f.op("Add", k, f.const(float(MANTISSA_BITS - 1 - x_bits))), f.const(float(LN2_FIXED))))
    acc = f.op("Sub", f.op("Mul", f.to_int64(d), f.const(multiplier, "int64"), dtype="int64"),
               f.op("Mul", f.to_int64(ln_s), f.const(ln_multiplier, "int64"), dtype="int64"), dtype="int64")
    y = f.rhe_div_int64(acc, f.const(1 << shift, "int64"))
    f.dequantize(y, node.inputs[2], int(a["out_qmin"]), int(a["out_qmax"]))
    return True


# -- layer norm ---------------------------------------------------------------------------------------------------
@exact_export("int_layer_norm")
def _layer_norm(b: Builder, node: Node, center: bool = True) -> bool:
    """The kernel's int64 path (``int_ops.int_layer_norm``), valid for every site it accepts (its ``P`` keeps
    ``sum(c**2) < 2**61``); ``u`` in float64, exact as the kernel proves (``|c * r| < 2**47``). ``center=False``:
    ``int_rms_norm`` (no mean)."""
    constants = table_constants(b, node)
    shape = b.shape(node.inputs[0])
    if constants is None or shape is None or any(not isinstance(v, int) or v < 0 for v in shape[1:]):
        return False
    _, _, gain, bias, params = constants
    eps_term, shift, p = (int(v) for v in params.tolist())
    a = node.attrs
    lead = len(shape) - int(a["normalized_ndim"])
    n = 1
    for size in shape[lead:]:
        n *= int(size)
    f = F64(b, node)
    x = b.value(node.inputs[0])
    q = f.to_int64(f.codes(x, node.inputs[1], int(a["in_qmin"]), int(a["in_qmax"])))
    rows = f.op("Reshape", q, b.ints([0] * lead + [-1], f"{f.out}/rows"), dtype="int64")
    last = b.ints([-1], f"{f.out}/last")
    scaled = f.op("Mul", rows, f.const(1 << p, "int64"), dtype="int64")
    if center:
        mu = f.rhe_div_int64(f.op("ReduceSum", scaled, last, keepdims=1, dtype="int64"), f.const(n, "int64"))
        c = f.op("Sub", scaled, mu, dtype="int64")
    else:
        c = scaled
    v = f.op("Add", f.op("ReduceSum", f.op("Mul", c, c, dtype="int64"), last, keepdims=1, dtype="int64"),
             f.const(eps_term, "int64"), dtype="int64")
    v = f.op("Max", v, f.const(1, "int64"), dtype="int64")
    # k = floor((bitlen(V) - 23) / 2), small: float64 is exact
    k = f.op("Floor", f.op("Div", f.op("Sub", f.bitlen_int64(v), f.const(float(MANTISSA_BITS - 1))), f.const(2.0)))
    two_k = f.to_int64(f.op("Mul", k, f.const(2.0)))
    zero = f.const(0, "int64")
    down = f.rhe_div_int64(v, f.pow2_int64(f.op("Max", two_k, zero, dtype="int64")))
    up = f.op("Mul", v, f.pow2_int64(f.op("Max", f.op("Neg", two_k, dtype="int64"), zero, dtype="int64")),
              dtype="int64")
    mant = f.op("Where", f.op("Greater", two_k, zero, dtype="bool"), down, up, dtype="int64")
    mant = f.op("Cast", mant, to=onnx_dtype("float64"))  # below 2**24 + 1
    over = f.op("Equal", mant, f.const(float(1 << MANTISSA_BITS)), dtype="bool")
    mant = f.op("Where", over, f.const(float(1 << (MANTISSA_BITS - 2))), mant)
    k = f.op("Add", k, f.op("Cast", over, to=onnx_dtype("float64")))
    r = f.mantissa_lookup(rsqrt_mantissa_table(), mant)
    scale = f.op("Mul", r, f.pow2(f.op("Neg", f.op("Add", k, f.const(float(RSQRT_BITS - LN_NORM_BITS))))))
    c64 = f.op("Cast", c, to=onnx_dtype("float64"))  # |c| <= 2**24: exact
    u = f.to_int64(f.op("Round", f.op("Mul", c64, scale)))
    acc = f.op("Add", f.op("Mul", u, b.init(gain.to(torch.int64).reshape(-1), f"{f.out}/gain"), dtype="int64"),
               b.init(bias.to(torch.int64).reshape(-1), f"{f.out}/bias"), dtype="int64")
    y = f.rhe_div_int64(acc, f.const(1 << shift, "int64"))  # |acc| < 2**61
    y = f.op("Reshape", y, f.op("Shape", x, dtype="int64"), dtype="int64")
    f.dequantize(y, node.inputs[2], int(a["out_qmin"]), int(a["out_qmax"]))
    return True


@exact_export("int_rms_norm")
def _rms_norm(b: Builder, node: Node) -> bool:
    return _layer_norm(b, node, center=False)


# -- pre_export's table ops: exact where this module can write their integer arithmetic (the elementwise tables,
#    softmax, log_softmax, layer_norm); otherwise the float op they emulate runs, and the fake quants around them (QDQ pairs)
#    keep the grid, so ONNX agrees with those tables to within rounding.
@onnx_converter(*TABLE_OP_IO)
def _table_reference(b: Builder, node: Node) -> None:
    exact = EXACT_TABLE_EXPORTS.get(node.op)
    if exact is not None and exact(b, node):
        return
    io = TABLE_OP_IO[node.op]
    if io.float_op:  # softmax, log_softmax, div, reciprocal: the float op is fixed
        inputs = [node.inputs[i] for i in range(len(io.data))]
        attrs = {name: node.attrs[name] for name in io.float_attrs}
        if io.float_op == "div":  # the march's 0 / 0 = 0 (§13.5, march/semantics.div); float division gives NaN
            inputs[1] = _divisor_one_at_zero_over_zero(b, node, *inputs)
        ONNX_CONVERTERS[io.float_op](b, Node(io.float_op, inputs, list(node.outputs), attrs, node.site))
        return
    ref = node.attrs.get("reference")
    if not ref:
        raise b.error(node, "a table op without its float reference",
                      "Export the qat IR again with this version of quantlens.")
    attrs = {k: v for k, v in ref.items() if k not in ("op", "weight", "bias")}
    inputs = [node.inputs[0]]
    if ref["op"] == "layer_norm":
        inputs += [ref.get("weight", ""), ref.get("bias", "")]
    ONNX_CONVERTERS[ref["op"]](b, Node(ref["op"], inputs, list(node.outputs), attrs, node.site))


def _divisor_one_at_zero_over_zero(b: Builder, node: Node, x: str, y: str) -> str:
    """``where(x == 0 and y == 0, 1, y)``: the divisor that makes ``x / y`` the march's ``0 / 0 = 0``."""
    dtype = b.dtype(y) or "float32"
    zero, one = (b.init(torch.tensor(v, dtype=getattr(torch, dtype)), f"{node.outputs[0]}/{n}")
                 for v, n in ((0.0, "zero"), (1.0, "one")))
    both = b.add("And", [b.add("Equal", [b.value(x), zero], f"{node.outputs[0]}/x0", dtype="bool"),
                         b.add("Equal", [b.value(y), zero], f"{node.outputs[0]}/y0", dtype="bool")],
                 f"{node.outputs[0]}/both0", dtype="bool")
    return b.add("Where", [both, one, b.value(y)], f"{node.outputs[0]}/divisor", dtype=dtype, rank=b.rank(y))

