"""The integer rules inside the prepared model's forward (consistency levels 1-4, ``docs/consistency.md``).

The plain fake-quant forward computes each op in float and rounds its output once. The NPU instead requantizes
with an integer multiplier (``docs/march.md`` §8), rounds the terms of an add (§10), sums windows exactly (§10.2)...
With the consistency strategy on, :class:`IntegerEmulator` makes the forward compute those rules: at every op
with an output fake quant, the value is what the integer kernel computes from the op's input integers, and (in
QAT) the gradient is the fake quant's straight-through gradient (``float + (integer - float).detach()``).

It calls the very kernels of the quantized IR (``quantlens.kernels``) with the parameters of the spec's rules
(``quantlens.march.rules``, which convert calls too), so there is one implementation of each rule. GEMMs accumulate exactly on the integers in float64 (``exact``: VALIDATION at
levels 1-4, the training forward at level 4), which makes the model equal to the quantized IR wherever it computes
the same rules; otherwise (training below level 4) their float32 result is rounded to the accumulator's integers.

An op whose output is not quantized at once (a conv whose BatchNorm and ReLU are fused after it, an add with a
fused ReLU) leaves a :class:`Deferred` value: the integer computation waits for the fake quant that ends the
chain, as convert requantizes straight to it, and the movement ops on the way (relu, reshape, max-pool) are
applied to the integers.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens._registry import make_registry
from quantlens.kernels import INT_KERNELS
from quantlens.march import Qpp, QuantDType, rules
from quantlens.march.numerics import interpolation_weights, quantize
from quantlens.march.opset import Category, op_def
from quantlens.quantization.tracer import TensorMarks

__all__ = ["IntegerEmulator", "Deferred", "current_emulator", "EMULATED_OPS"]

_CURRENT: contextvars.ContextVar["IntegerEmulator | None"] = contextvars.ContextVar("quantlens_emulator",
                                                                                   default=None)


def current_emulator() -> "IntegerEmulator | None":
    """The emulator of the forward running now (site overrides such as sdpa's decomposition use it)."""
    return _CURRENT.get()


@dataclass
class Deferred:
    """An integer result that waits for its output grid: ``codes(out_fq)`` then the movement ops in ``ops``."""

    compute: Callable[[Any], torch.Tensor]  # out fake quant -> int64 codes
    ops: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()

    def codes(self, fq) -> torch.Tensor:
        q = self.compute(fq).to(torch.float64)
        for op in self.ops:
            q = op(q)
        return q.to(torch.int64)

    def then(self, op: Callable[[torch.Tensor], torch.Tensor]) -> "Deferred":
        return Deferred(self.compute, self.ops + (op,))


@dataclass
class EmuCall:
    """One op site's call as the emulator sees it: inputs after their fake quants, with the grid of each."""

    site: str
    op_type: str
    func: Callable | None
    module: torch.nn.Module | None
    args: tuple
    kwargs: dict
    grids: dict[int, Any]  # leaf position -> fake quant whose grid that float leaf is on
    leaves: list = field(default_factory=list)
    output: Any = None  # the float op's result, once computed

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[position] if position < len(self.args) else default


def _kernel(op: str, attrs: dict, inputs: list, site: str = "") -> torch.Tensor:
    return INT_KERNELS[op](inputs, attrs, site).to(torch.int64)


def _s64(fq) -> torch.Tensor:
    return fq.scale.detach().to(torch.float64)


def codes_of(x: torch.Tensor, fq) -> torch.Tensor:
    """The integers of a tensor on ``fq``'s grid (``x = fl32(q · s)``, so ``x / s`` is within 2**-24 of q)."""
    s = _s64(fq)
    if s.numel() > 1 and fq.ch_axis is not None:
        shape = [1] * x.dim()
        shape[fq.ch_axis] = -1
        s = s.reshape(shape)
    return torch.round(x.detach().to(torch.float64) / s).to(torch.int64)


def _value(codes: torch.Tensor, fq, like: torch.Tensor) -> torch.Tensor:
    """``q · s`` in float32, as the fake quant writes it."""
    return (codes.to(torch.float32) * fq.scale.detach().to(torch.float32)).to(like.dtype)


def _same_grid(a, b) -> bool:
    return a is b or (a.dtype is b.dtype and a.scale.numel() == b.scale.numel()
                      and bool(torch.equal(a.scale.reshape(-1), b.scale.reshape(-1))))


class IntegerEmulator:
    """The integer rules of one forward of a prepared model (see the module docstring).

    ``exact``: GEMMs accumulate exactly on the integers (float64), as the quantized IR does; otherwise their
    float32 result is rounded to the accumulator's integers. ``qpp``: the requantize profile convert will use.
    """

    def __init__(self, qpp: Qpp, exact: bool):
        self.qpp = qpp
        self.exact = exact
        self.deferred = TensorMarks()
        self._token = None

    # -- lifetime ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self):
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)
            self.deferred.clear()

    # -- grids ------------------------------------------------------------------------------------------------
    def requantize_codes(self, q: torch.Tensor, src, dst) -> torch.Tensor:
        """Integers on ``src``'s grid moved to ``dst``'s (convert's ``requantize`` node, §8)."""
        if _same_grid(src, dst):
            return q
        attrs = {**rules.move(src.scale, dst.scale, dst.dtype, self.qpp), "axis": None}
        return _kernel("requantize", attrs, [q])

    def to_grid(self, x: torch.Tensor, src, dst, quantized: torch.Tensor) -> torch.Tensor:
        """An input fake quant ``dst`` applied to ``x``: ``quantized`` is ``dst(x)`` (the float result, which
        carries the gradient); the value becomes the integer requantize from ``src`` (or the deferred op)."""
        pending = self.deferred.get(x)
        if pending is not None:
            codes = pending.codes(dst)
        elif src is not None and src is not dst and src.dtype is not QuantDType.qint32 and src.scale.numel() == 1:
            codes = self.requantize_codes(codes_of(x, src), src, dst)
        else:
            return quantized
        return _ste(quantized, _value(codes, dst, quantized))

    def resolve(self, output: torch.Tensor, fq, float_quantized: torch.Tensor | None,
                call: EmuCall | None) -> torch.Tensor | None:
        """The value at an output fake quant: a deferred result, or the op's integer rule; ``None`` if the op
        has none (the fake quant's float result stands)."""
        pending = self.deferred.get(output)
        if pending is None and call is not None:
            pending = self.integer_rule(call)
        if pending is None:
            return None
        codes = pending.codes(fq)
        like = float_quantized if float_quantized is not None else output
        return _ste(float_quantized, _value(codes, fq, like))

    def integer_rule(self, call: EmuCall) -> Deferred | None:
        handler = EMULATED_OPS.get(call.op_type)
        if handler is None:
            op = op_def(call.op_type)
            if op is not None and op.category is Category.MOVEMENT:
                handler = _grid_op
        return handler(self, call) if handler is not None else None

    def defer(self, output: Any, pending: Deferred) -> None:
        if isinstance(output, torch.Tensor):
            self.deferred.set(output, pending)

    def movement(self, call: EmuCall, output: Any) -> None:
        """A movement op on a deferred input: the same op applied to its integers, still deferred."""
        positions = [p for p, leaf in enumerate(call.leaves) if isinstance(leaf, torch.Tensor)
                     and self.deferred.get(leaf) is not None]
        if len(positions) != 1:
            return
        pos = positions[0]
        pending = self.deferred.get(call.leaves[pos])
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for index, out in enumerate(outputs):
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                self.deferred.set(out, pending.then(_apply_on(call, pos, index if out is not output else None)))

    # -- GEMMs --------------------------------------------------------------------------------------------
    def gemm(self, call: EmuCall, float_op: Callable[[], torch.Tensor], *, x_fq, w_fq, weight_pos: int | None,
             bias: torch.Tensor | None, bias_pos: int | None, channel_dim: int | None,
             module: torch.nn.Module | None = None, module_weight: torch.Tensor | None = None,
             factor: float = 1.0, exact_acc: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """conv / linear / matmul: the accumulator (exact, or the float32 result rounded to integers), then a
        value deferred to the output grid. Returns the float value of the int32 accumulator (what the quantized
        IR's high-precision output dequantizes to), carrying the float op's gradient (``float_op()``)."""
        s_x, s_w = _s64(x_fq), _s64(w_fq)
        acc_scale = s_x * s_w  # exact product of float32 scales, as convert computes it
        output = None
        if self.exact:
            acc = exact_acc() if exact_acc is not None else self._exact_acc(call, x_fq, w_fq, weight_pos, bias_pos,
                                                                             module, module_weight)
            if bias is not None:
                s_bias = (x_fq.scale.detach().reshape(()) * w_fq.scale.detach()).reshape(-1).expand(
                    bias.shape[0]).contiguous()
                q_bias = quantize(bias.detach(), s_bias, QuantDType.qint32, 0).to(torch.float64)
                bshape = [1] * acc.dim()
                bshape[channel_dim % acc.dim()] = -1
                acc = acc + q_bias.reshape(bshape)
            if torch.is_grad_enabled():
                output = float_op()
        else:
            output = float_op()
            acc = output.detach().to(torch.float64)
        shape = None
        if acc_scale.numel() > 1:
            shape = [1] * acc.dim()
            shape[channel_dim % acc.dim()] = -1
        scale_b = acc_scale.reshape(shape) if shape else acc_scale.reshape(())
        if not self.exact:
            acc = torch.round(acc / (scale_b * factor))
        acc = torch.clamp(acc, -(2**31), 2**31 - 1)
        qpp = self.qpp

        def compute(fq, acc=acc, acc_scale=acc_scale, channel_dim=channel_dim):
            # convert folds a positive scalar multiply after the GEMM (attention's 1/sqrt(d)) into the multiplier
            attrs = rules.gemm(x_fq.scale, w_fq.scale, fq.scale, fq.dtype, qpp, factor)
            attrs["axis"] = channel_dim if len(attrs["multiplier"]) > 1 else None
            return _kernel("requantize", attrs, [acc.to(torch.int64)])

        dtype = output.dtype if output is not None else call.leaves[0].dtype if call.leaves else torch.float32
        value = (acc.to(torch.float32) * scale_b.to(torch.float32)).to(dtype)
        if factor != 1.0:
            value = value * factor
        value = _ste(output, value)
        self.deferred.set(value, Deferred(compute))
        return value

    def matmul(self, a: torch.Tensor, b: torch.Tensor, a_fq, b_fq, float_out: Callable[[], torch.Tensor],
               factor: float = 1.0) -> torch.Tensor:
        """``a @ b`` of two quantized activations inside a site override (sdpa's decomposition), deferred to the
        fake quant that follows; ``factor``: a positive scalar the result is multiplied by before it."""
        call = EmuCall("", "matmul", None, None, (a, b), {}, {}, [a, b])

        def exact():
            return torch.matmul(codes_of(a, a_fq).to(torch.float64), codes_of(b, b_fq).to(torch.float64))

        def float_op():
            return float_out()

        return self.gemm(call, float_op, x_fq=a_fq, w_fq=b_fq, weight_pos=None, bias=None, bias_pos=None,
                         channel_dim=None, factor=factor, exact_acc=exact)

    def quantize_output(self, value: torch.Tensor, fq) -> torch.Tensor:
        """``fq(value)`` inside a site override: a deferred value resolves to its integer result."""
        quantized = fq(value)
        exact = self.resolve(value, fq, quantized, None)
        return quantized if exact is None else exact

    def _exact_acc(self, call, x_fq, w_fq, weight_pos, bias_pos, module, module_weight) -> torch.Tensor:
        if module is not None:
            q_x = codes_of(call.args[0], x_fq).to(torch.float64)
            q_w = quantize(module_weight.detach(), w_fq.scale.detach(), w_fq.dtype, w_fq.ch_axis).to(torch.float64)
            return module._gemm(q_x, q_w, None, *call.args[1:])
        leaves = list(call.leaves)
        for pos, leaf in enumerate(leaves):
            if pos == bias_pos:
                leaves[pos] = None
            elif pos == weight_pos:
                leaves[pos] = codes_of(leaf, w_fq).to(torch.float64)
            elif pos in call.grids:
                leaves[pos] = codes_of(leaf, call.grids[pos]).to(torch.float64)
        args, kwargs = pytree.tree_unflatten(leaves, pytree.tree_flatten((call.args, call.kwargs))[1])
        return call.func(*args, **kwargs)


class _StraightThrough(torch.autograd.Function):
    """Forward: the integer value, exactly (``f + (i - f).detach()`` would round in float32); backward: the
    gradient goes to the float value unchanged."""

    @staticmethod
    def forward(ctx, float_value, int_value):
        return int_value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _ste(float_value: torch.Tensor | None, int_value: torch.Tensor) -> torch.Tensor:
    """The integer value with the float value's gradient (straight-through)."""
    if float_value is None or not (torch.is_grad_enabled() and float_value.requires_grad):
        return int_value
    return _StraightThrough.apply(float_value, int_value)


def _apply_on(call: EmuCall, pos: int, index: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``q -> op(q)``: the call's op with its deferred input replaced by the integers (float64 holds them)."""
    spec = pytree.tree_flatten((call.args, call.kwargs))[1]

    def op(q: torch.Tensor) -> torch.Tensor:
        leaves = list(call.leaves)
        leaves[pos] = q
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = call.module(*args, **kwargs) if call.module is not None else call.func(*args, **kwargs)
        return out[index] if index is not None else out

    return op


# -- the integer rules, one small function per op type (docs/march.md §8-§11) ----------------------------------
#: op type -> its emulation rule (``IntegerEmulator, EmuCall -> Deferred | None``)
EMULATED_OPS, emulates = make_registry("emulation rule for op type")


def _input(call: EmuCall, position: int, name: str):
    """``(codes, fake quant)`` of a quantized tensor argument, a Python/constant scalar as ``(float, None)``,
    or ``None`` when the argument is neither (a float tensor left unquantized)."""
    value = call.arg(position, name)
    if isinstance(value, torch.Tensor):
        pos = next((p for p, leaf in enumerate(call.leaves) if leaf is value), None)
        fq = call.grids.get(pos) if pos is not None else None
        if fq is not None:
            return codes_of(value, fq), fq
        if value.numel() == 1 and not value.requires_grad:
            return float(value), None
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), None
    return None


@emulates("add", "sub", "rsub")
def _add(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    if call.kwargs.get("alpha", 1) != 1 or len(call.args) + len(call.kwargs) < 2:
        return None
    a, b = _input(call, 0, "input"), _input(call, 1, "other")
    if a is None or b is None or (a[1] is None and b[1] is None):
        return None
    if call.op_type == "rsub":  # rsub(x, y) = y - x
        a, b = b, a
    op = "add" if call.op_type == "add" else "sub"
    qpp = emu.qpp

    if a[1] is not None and b[1] is not None:
        def compute(fq):
            attrs = rules.add([a[1].scale, b[1].scale], fq.scale, fq.dtype, qpp)
            return _kernel(op, attrs, [a[0], b[0]], call.site)
        return Deferred(compute)
    # x ± k / k ± x: convert's add_const (the constant enters in the sum's fractional units)
    if a[1] is None:
        k, x, negate = a[0], b, op == "sub"
    else:
        k, x, negate = b[0] * (-1 if op == "sub" else 1), a, False

    def compute_const(fq):
        attrs = rules.add_constant(x[1].scale, k, fq.scale, fq.dtype, qpp, negate)
        return _kernel("add_const", attrs, [x[0]], call.site)
    return Deferred(compute_const)


@emulates("cat", "concat", "stack")
def _cat(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    tensors = call.arg(0, "tensors")
    dim = call.arg(1, "dim", 0)
    if not isinstance(tensors, (list, tuple)):
        return None
    parts = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() == 0:
            continue  # an empty constant adds nothing (convert drops it)
        pos = next((p for p, leaf in enumerate(call.leaves) if leaf is t), None)
        fq = call.grids.get(pos) if pos is not None else None
        if fq is None:
            return None
        q = codes_of(t, fq)
        parts.append((q.unsqueeze(dim) if call.op_type == "stack" else q, fq))
    qpp = emu.qpp

    def compute(fq):
        attrs = rules.cat([p[1].scale for p in parts], fq.scale, fq.dtype, qpp, dim)
        return _kernel("cat", attrs, [p[0] for p in parts], call.site)
    return Deferred(compute)


@emulates("mul", "div")
def _mul(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    a, b = _input(call, 0, "input"), _input(call, 1, "other")
    if a is None or b is None or a[1] is None:
        if call.op_type == "mul" and a is not None and b is not None and a[1] is None and b[1] is not None:
            a, b = b, a  # k * x
        else:
            return None
    qpp = emu.qpp
    if b[1] is None:  # by a constant: convert's "scale" op
        real = 1.0 / b[0] if call.op_type == "div" else b[0]
        if real == 0 or not math.isfinite(real):
            return None

        def compute_scale(fq):
            attrs = rules.scale_by_constant(real, a[1].scale, fq.scale, fq.dtype, qpp)
            return _kernel("scale", attrs, [a[0]], call.site)
        return Deferred(compute_scale)
    if call.op_type == "div":
        return None  # x / y of two tensors is a table op (§13.5)

    def compute(fq):
        return _kernel("mul", rules.mul(a[1].scale, b[1].scale, fq.scale, fq.dtype, qpp), [a[0], b[0]], call.site)
    return Deferred(compute)


def _single(call: EmuCall):
    x = _input(call, 0, "input")
    return x if x is not None and x[1] is not None else None


@emulates("mean", "sum")
def _reduce(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None or call.arg(3, "dtype") is not None:
        return None
    q, x_fq = x
    dims = call.arg(1, "dim")
    keepdim = bool(call.arg(2, "keepdim", False))
    dims = list(range(q.dim())) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    count = 1
    for d in dims:
        count *= q.shape[d]
    divisor = count if call.op_type == "mean" else 1
    qpp = emu.qpp

    def compute(fq):
        attrs = {"dim": dims, "keepdim": keepdim, **rules.average(x_fq.scale, divisor, fq.scale, fq.dtype, qpp)}
        return _kernel("sum_int", attrs, [q], call.site)
    return Deferred(compute)


def _pool_window(call: EmuCall, q: torch.Tensor) -> tuple[str, dict, int] | None:
    """(kernel op, attrs, window count) of an average pool with fixed windows, as convert derives them."""
    op, m = call.op_type, call.module
    if op in ("adaptive_avg_pool2d", "adaptive_avg_pool1d"):
        size = m.output_size if m is not None else call.arg(1, "output_size")
        dims = 2 if op.endswith("2d") else 1
        size = [size] * dims if isinstance(size, int) else list(size)
        ins = list(q.shape[-dims:])
        size = [i if s is None else s for s, i in zip(size, ins)]
        if any(i % s for i, s in zip(ins, size)):
            return None
        kernel = [i // s for i, s in zip(ins, size)]
        if dims == 1:
            return "avg_pool1d_int", {"kernel_size": kernel, "stride": kernel, "padding": [0]}, kernel[0]
        return "avg_pool2d_int", {"kernel_size": kernel, "stride": kernel, "padding": [0, 0], "ceil_mode": False,
                                  "count_include_pad": True}, kernel[0] * kernel[1]
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    if m is not None:
        values = {n: getattr(m, n, None) for n in names}
    else:
        values = {n: call.arg(i + 1, n) for i, n in enumerate(names)}
    dims = 2 if op == "avg_pool2d" else 1
    pair = (lambda v: [v] * dims if isinstance(v, int) else list(v))
    kernel = pair(values["kernel_size"])
    stride = pair(values["stride"]) if values["stride"] not in (None, [], ()) else kernel
    padding = pair(values["padding"] or 0)
    if values["divisor_override"] is not None or (any(padding) and values["count_include_pad"] is False):
        return None
    if values["ceil_mode"]:
        return None
    if dims == 1:
        return "avg_pool1d_int", {"kernel_size": kernel, "stride": stride, "padding": padding}, kernel[0]
    return "avg_pool2d_int", {"kernel_size": kernel, "stride": stride, "padding": padding, "ceil_mode": False,
                              "count_include_pad": True}, kernel[0] * kernel[1]


@emulates("avg_pool2d", "adaptive_avg_pool2d", "avg_pool1d", "adaptive_avg_pool1d")
def _avg_pool(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    window = _pool_window(call, q)
    if window is None:
        return None
    op, pool_attrs, count = window
    qpp = emu.qpp

    def compute(fq):
        attrs = {**pool_attrs, **rules.average(x_fq.scale, count, fq.scale, fq.dtype, qpp)}
        return _kernel(op, attrs, [q], call.site)
    return Deferred(compute)


@emulates("clamp", "clip", "hardtanh", "relu6")
def _clamp(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    m = call.module
    if call.op_type == "relu6":
        lo, hi = 0.0, 6.0
    elif call.op_type == "hardtanh":
        lo = m.min_val if m is not None else call.arg(1, "min_val", -1.0)
        hi = m.max_val if m is not None else call.arg(2, "max_val", 1.0)
    else:
        lo, hi = call.arg(1, "min"), call.arg(2, "max")
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    qpp = emu.qpp

    def compute(fq):
        return _kernel("clamp", rules.clamp(lo, hi, x_fq.scale, fq.scale, fq.dtype, qpp), [q], call.site)
    return Deferred(compute)


@emulates("abs", "neg")
def _sign(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    qpp = emu.qpp
    return Deferred(lambda fq: _kernel(f"{call.op_type}_int", rules.sign_op(x_fq.scale, fq.scale, fq.dtype, qpp),
                                       [q], call.site))


@emulates("interpolate")
def _interpolate(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    m = call.module
    mode = m.mode if m is not None else call.arg(3, "mode", "nearest")
    if mode == "nearest":
        return _grid_op(emu, call)
    if mode != "bilinear" or q.dim() != 4:
        return None
    align = bool(m.align_corners if m is not None else call.arg(4, "align_corners", False))
    out_shape = _float_output_shape(call)
    if out_shape is None:
        return None
    (in_h, in_w), (out_h, out_w) = q.shape[-2:], out_shape[-2:]
    a_h, a_w = interpolation_weights(in_h, out_h, align), interpolation_weights(in_w, out_w, align)
    qpp = emu.qpp

    def compute(fq):
        attrs = rules.bilinear(x_fq.scale, fq.scale, fq.dtype, qpp)
        return _kernel("bilinear_int", attrs, [q, a_h, a_w], call.site)
    return Deferred(compute)


def _float_output_shape(call: EmuCall):
    return tuple(call.output.shape) if isinstance(call.output, torch.Tensor) else None


@emulates("batch_norm")
def _batch_norm(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    m = call.module
    if m is not None:
        if m.training or m.running_mean is None:
            return None
        mean, var, weight, bias, eps = m.running_mean, m.running_var, m.weight, m.bias, m.eps
    else:
        if call.arg(5, "training", False):
            return None
        mean, var = call.arg(1, "running_mean"), call.arg(2, "running_var")
        weight, bias, eps = call.arg(3, "weight"), call.arg(4, "bias"), call.arg(7, "eps", 1e-5)
    channels = mean.numel()
    weight = torch.ones(channels, dtype=torch.float64) if weight is None else weight.detach().to(torch.float64)
    bias = torch.zeros(channels, dtype=torch.float64) if bias is None else bias.detach().to(torch.float64)
    a = weight / torch.sqrt(var.detach().to(torch.float64) + eps)
    b = bias - mean.detach().to(torch.float64) * a
    qpp = emu.qpp

    def compute(fq):
        w_q, bias_q, attrs = rules.channel_affine(a, b, x_fq.scale, fq.scale, fq.dtype, qpp)
        return _kernel("channel_affine", attrs, [q, w_q, bias_q], call.site)
    return Deferred(compute)


@emulates("prelu", "leaky_relu")
def _prelu(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    if x is None:
        return None
    q, x_fq = x
    if call.op_type == "leaky_relu":
        slope = call.module.negative_slope if call.module is not None else call.arg(1, "negative_slope", 0.01)
        alpha = torch.tensor([float(slope)], dtype=torch.float64)
    else:
        w = call.arg(1, "weight")
        pos = next((p for p, leaf in enumerate(call.leaves) if leaf is w), None)
        w_fq = call.grids.get(pos) if pos is not None else None
        if w_fq is None:
            alpha = w.detach().to(torch.float64).reshape(-1)
        else:  # the integer model uses exactly the weight's grid value
            alpha = (codes_of(w, w_fq).to(torch.float64) * _s64(w_fq)).reshape(-1)
    qpp = emu.qpp

    def compute(fq):
        return _kernel("prelu_int", rules.prelu(alpha, x_fq.scale, fq.scale, fq.dtype, qpp), [q], call.site)
    return Deferred(compute)


@emulates("masked_fill")
def _masked_fill(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    x = _single(call)
    mask, value = call.arg(1, "mask"), call.arg(2, "value")
    if x is None or not isinstance(mask, torch.Tensor):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = float(value)
    q, x_fq = x
    filled = q.masked_fill(mask, rules.fill_code(float(value), x_fq.scale, x_fq.dtype))
    return Deferred(lambda fq: emu.requantize_codes(filled, x_fq, fq))


def _grid_op(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    """A movement op (its float result lies on its input's grid) that ends in a fake quant of another grid:
    the integers move, then one requantize (convert: the passthrough op, then a ``requantize`` node)."""
    positions = [p for p in call.grids if isinstance(call.leaves[p], torch.Tensor)]
    if len(positions) != 1:
        return None
    pos = positions[0]
    src = call.grids[pos]
    if src.scale.numel() != 1:
        return None
    q = codes_of(call.leaves[pos], src).to(torch.float64)
    moved = _apply_on(call, pos, None)(q)
    if not isinstance(moved, torch.Tensor):
        return None
    return Deferred(lambda fq: emu.requantize_codes(moved.to(torch.int64), src, fq))
