"""The emulator: deferred integer values, the per-forward state, and the registry of integer rules (filled by
:mod:`.ops`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens._registry import make_registry
from quantlens.kernels import INT_KERNELS
from quantlens.march import Qpp, QuantDType, rules
from quantlens.march.numerics import quantize
from quantlens.march.opset import Category, op_def
from quantlens.sites.tracer import TensorMarks

__all__ = ["IntegerEmulator", "Deferred", "EmuCall", "current_emulator", "EMULATED_OPS", "emulates", "codes_of",
           "read_codes", "ReadGrid", "straight_through", "exponent_axis"]


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


def run_kernel(op: str, attrs: dict, inputs: list, site: str = "") -> torch.Tensor:
    """The march's integer kernel of IR op ``op`` on integer ``inputs`` (the one the quantized IR runs), in int64."""
    return INT_KERNELS[op](inputs, attrs, site).to(torch.int64)


def codes_scale(fq) -> torch.Tensor:
    """A fake quant's scale in float64, the dtype the emulation holds integer codes in."""
    return fq.scale.detach().to(torch.float64)


def _along_channels(s: torch.Tensor, fq, dim: int) -> torch.Tensor:
    """A per-channel scale shaped to broadcast along ``fq``'s channel axis of a ``dim``-dim tensor (a folded
    weight's ``[out, in]`` scale as it is)."""
    if s.dim() > 1 and s.dim() == dim:
        return s
    if s.numel() > 1 and fq.ch_axis is not None:
        shape = [1] * dim
        shape[fq.ch_axis] = -1
        return s.reshape(shape)
    return s


def codes_of(x: torch.Tensor, fq) -> torch.Tensor:
    """The integers of a tensor on ``fq``'s grid (``x = fl32(q · s)``, so ``x / s`` is within 2**-24 of q)."""
    s = _along_channels(codes_scale(fq), fq, x.dim())
    return torch.round(x.detach().to(torch.float64) / s).to(torch.int64)


@dataclass(frozen=True)
class ReadGrid:
    """The grid an integer op reads a fake quant's codes on when it is not the fake quant's own: the common int16
    grid of channel-exponent codes (``docs/march.md`` §3.1). The rules read ``scale`` and ``dtype``."""

    scale: torch.Tensor
    dtype: QuantDType
    ch_axis = None
    channel_exponents = False


def read_codes(x: torch.Tensor, fq) -> tuple[torch.Tensor, Any]:
    """``(codes, grid)`` of ``x`` as an integer op reads it: on ``fq``'s own grid, or for channel-exponent codes
    shifted onto their common grid (convert's ``channel_shift``, §3.1; exact)."""
    q = codes_of(x, fq)
    if not getattr(fq, "channel_exponents", False):
        return q, fq
    attrs, _ = rules.channel_shift(fq.scale)
    attrs["axis"] = fq.ch_axis % q.dim()
    scale, dtype = fq.read_grid()
    return run_kernel("channel_shift", attrs, [q]), ReadGrid(scale.detach(), dtype)


def exponent_axis(fq, dim: int) -> int | None:
    """The channel axis of an output fake quant in channel-exponent form (the rules that write one take it)."""
    return fq.ch_axis % dim if getattr(fq, "channel_exponents", False) else None


def _value(codes: torch.Tensor, fq, like: torch.Tensor) -> torch.Tensor:
    """``q · s`` in float32, as the fake quant writes it."""
    s = _along_channels(fq.scale.detach().to(torch.float32), fq, codes.dim())
    return (codes.to(torch.float32) * s).to(like.dtype)


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
        """Integers on ``src``'s grid moved to ``dst``'s (convert's ``requantize`` node, §8; per channel from
        channel-exponent codes, as convert moves them)."""
        if _same_grid(src, dst):
            return q
        axis = src.ch_axis % q.dim() if src.scale.numel() > 1 and src.ch_axis is not None else None
        attrs = {**rules.move(src.scale, dst.scale, dst.dtype, self.qpp), "axis": axis}
        return run_kernel("requantize", attrs, [q])

    def to_grid(self, x: torch.Tensor, src, dst, quantized: torch.Tensor) -> torch.Tensor:
        """An input fake quant ``dst`` applied to ``x``: ``quantized`` is ``dst(x)`` (the float result, which
        carries the gradient); the value becomes the integer requantize from ``src`` (or the deferred op)."""
        pending = self.deferred.get(x)
        if pending is not None:
            codes = pending.codes(dst)
        elif src is not None and src is not dst and src.dtype is not QuantDType.qint32 and (
                src.scale.numel() == 1 or getattr(src, "channel_exponents", False)):
            codes = self.requantize_codes(codes_of(x, src), src, dst)
        else:
            return quantized
        return straight_through(quantized, _value(codes, dst, quantized))

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
        return straight_through(float_quantized, _value(codes, fq, like))

    def integer_rule(self, call: EmuCall) -> Deferred | None:
        handler = EMULATED_OPS.get(call.op_type)
        if handler is None:
            op = op_def(call.op_type)
            if op is not None and op.category is Category.MOVEMENT:
                handler = grid_op
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
        x_grid, s_x, s_w = _gemm_grids(x_fq, w_fq)
        acc_scale = s_x * s_w  # exact product of float32 scales, as convert computes it
        output = None
        if self.exact:
            acc = exact_acc() if exact_acc is not None else self._exact_acc(call, x_grid, w_fq, weight_pos,
                                                                             bias_pos, module, module_weight)
            if bias is not None:  # the int32 bias at s_x · s_w (float32 values, exact in float64)
                s_bias = (s_x.reshape(()) * s_w).to(torch.float32).reshape(-1).expand(bias.shape[0]).contiguous()
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
            attrs = rules.gemm(s_x, s_w, fq.scale, fq.dtype, qpp, factor)
            attrs["axis"] = channel_dim if len(attrs["multiplier"]) > 1 else None
            return run_kernel("requantize", attrs, [acc.to(torch.int64)])

        dtype = output.dtype if output is not None else call.leaves[0].dtype if call.leaves else torch.float32
        value = (acc.to(torch.float32) * scale_b.to(torch.float32)).to(dtype)
        if factor != 1.0:
            value = value * factor
        value = straight_through(output, value)
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

    def _exact_acc(self, call, x_grid, w_fq, weight_pos, bias_pos, module, module_weight) -> torch.Tensor:
        if module is not None:
            q_x = x_grid(call.args[0]).to(torch.float64)
            q_w = quantize(module_weight.detach(), w_fq.scale.detach(), w_fq.dtype, w_fq.ch_axis).to(torch.float64)
            return module._gemm(q_x, q_w, None, *call.args[1:])
        leaves = list(call.leaves)
        for pos, leaf in enumerate(leaves):
            if pos == bias_pos:
                leaves[pos] = None
            elif pos == weight_pos:
                leaves[pos] = codes_of(leaf, w_fq).to(torch.float64)
            elif pos in call.grids:
                leaves[pos] = read_codes(leaf, call.grids[pos])[0].to(torch.float64)
        args, kwargs = pytree.tree_unflatten(leaves, pytree.tree_flatten((call.args, call.kwargs))[1])
        return call.func(*args, **kwargs)


def _gemm_grids(x_fq, w_fq) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
    """How a GEMM reads its input (``x -> codes``) and the scales its accumulator is at, as convert's: a weight
    folded with the input's channel exponents (an ``[out, in]`` scale, §3.1) multiplies the codes as they are at
    ``s`` (the widest channel's) times its row scales; other channel-exponent codes are read on their common
    grid."""
    if getattr(x_fq, "channel_exponents", False) and w_fq.scale.dim() > 1:
        rows = rules.folded_rows(w_fq.scale, x_fq.scale).to(torch.float64)
        return (lambda x: codes_of(x, x_fq)), x_fq.scale.detach().amax().to(torch.float64), rows
    if getattr(x_fq, "channel_exponents", False):
        scale = x_fq.read_grid()[0].detach().to(torch.float64)
        return (lambda x: read_codes(x, x_fq)[0]), scale, codes_scale(w_fq)
    return (lambda x: codes_of(x, x_fq)), codes_scale(x_fq), codes_scale(w_fq)


class _StraightThrough(torch.autograd.Function):
    """Forward: the integer value, exactly (``f + (i - f).detach()`` would round in float32); backward: the
    gradient goes to the float value unchanged."""

    @staticmethod
    def forward(ctx, float_value, int_value):
        return int_value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(float_value: torch.Tensor | None, int_value: torch.Tensor) -> torch.Tensor:
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


def site_input(call: EmuCall, position: int, name: str):
    """``(codes, fake quant)`` of a quantized tensor argument, a Python/constant scalar as ``(float, None)``,
    or ``None`` when the argument is neither (a float tensor left unquantized)."""
    value = call.arg(position, name)
    if isinstance(value, torch.Tensor):
        pos = next((p for p, leaf in enumerate(call.leaves) if leaf is value), None)
        fq = call.grids.get(pos) if pos is not None else None
        if fq is not None:
            return read_codes(value, fq)
        if value.numel() == 1 and not value.requires_grad:
            return float(value), None
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), None
    return None


def _single(call: EmuCall):
    x = site_input(call, 0, "input")
    return x if x is not None and x[1] is not None else None


def on_one_input(rule: Callable) -> Callable:
    """A rule of an op on one quantized input, called as ``rule(emu, call, q, x_fq)`` with that input's integers
    and its fake quant; the op stays float (None) when its input 0 is not on a grid."""

    @functools.wraps(rule)
    def wrapped(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
        x = _single(call)
        return None if x is None else rule(emu, call, *x)
    return wrapped


def grid_op(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
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
