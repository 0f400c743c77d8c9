"""The integer rules, one small function per op type (``docs/march.md`` §8-§11): each reads its inputs' grids from
the fake quants and its parameters from ``quantlens.march.rules`` (as convert does), and defers the kernel call
until the output fake quant is known."""

from __future__ import annotations

import math

import torch

from quantlens.march import rules
from quantlens.march.numerics import interpolation_weights
from quantlens.quantization.emulation.core import (
    Deferred,
    EmuCall,
    IntegerEmulator,
    codes_of,
    codes_scale,
    emulates,
    exponent_axis,
    grid_op,
    on_one_input,
    read_codes,
    run_kernel,
    site_input,
)


@emulates("add", "sub", "rsub")
def _add(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    if call.kwargs.get("alpha", 1) != 1 or len(call.args) + len(call.kwargs) < 2:
        return None
    a, b = site_input(call, 0, "input"), site_input(call, 1, "other")
    if a is None or b is None or (a[1] is None and b[1] is None):
        return None
    if call.op_type == "rsub":  # rsub(x, y) = y - x
        a, b = b, a
    op = "add" if call.op_type == "add" else "sub"
    qpp = emu.qpp

    if a[1] is not None and b[1] is not None:
        rank = max(a[0].dim(), b[0].dim())

        def compute(fq):  # (an output in channel-exponent form: each channel rescales with its exponent, §3.1)
            attrs = rules.add([a[1].scale, b[1].scale], fq.scale, fq.dtype, qpp, out_axis=exponent_axis(fq, rank))
            return run_kernel(op, attrs, [a[0], b[0]], call.site)
        return Deferred(compute)
    # x ± k / k ± x: convert's add_const (the constant enters in the sum's fractional units)
    if a[1] is None:
        k, x, negate = a[0], b, op == "sub"
    else:
        k, x, negate = b[0] * (-1 if op == "sub" else 1), a, False

    def compute_const(fq):
        attrs = rules.add_constant(x[1].scale, k, fq.scale, fq.dtype, qpp, negate)
        return run_kernel("add_const", attrs, [x[0]], call.site)
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
        q, grid = read_codes(t, fq)
        parts.append((q.unsqueeze(dim) if call.op_type == "stack" else q, grid))
    qpp = emu.qpp

    def compute(fq):
        attrs = rules.cat([p[1].scale for p in parts], fq.scale, fq.dtype, qpp, dim)
        return run_kernel("cat", attrs, [p[0] for p in parts], call.site)
    return Deferred(compute)


@emulates("mul", "div")
def _mul(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    a, b = site_input(call, 0, "input"), site_input(call, 1, "other")
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
            return run_kernel("scale", attrs, [a[0]], call.site)
        return Deferred(compute_scale)
    if call.op_type == "div":
        return None  # x / y of two tensors is a table op (§13.5)

    def compute(fq):
        return run_kernel("mul", rules.mul(a[1].scale, b[1].scale, fq.scale, fq.dtype, qpp), [a[0], b[0]], call.site)
    return Deferred(compute)


@emulates("mean", "sum")
@on_one_input
def _reduce(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    if call.arg(3, "dtype") is not None:
        return None
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
        return run_kernel("sum_int", attrs, [q], call.site)
    return Deferred(compute)


@emulates("cumsum")
@on_one_input
def _cumsum(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    dim = call.arg(1, "dim")
    if dim is None or call.arg(2, "dtype") is not None:
        return None
    qpp = emu.qpp

    def compute(fq):
        return run_kernel("cumsum_int", {"dim": int(dim), **rules.average(x_fq.scale, 1, fq.scale, fq.dtype, qpp)},
                       [q], call.site)
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
@on_one_input
def _avg_pool(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    window = _pool_window(call, q)
    if window is None:
        return None
    op, pool_attrs, count = window
    qpp = emu.qpp

    def compute(fq):
        attrs = {**pool_attrs, **rules.average(x_fq.scale, count, fq.scale, fq.dtype, qpp)}
        return run_kernel(op, attrs, [q], call.site)
    return Deferred(compute)


@emulates("clamp", "clip", "hardtanh", "relu6")
@on_one_input
def _clamp(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
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
        return run_kernel("clamp", rules.clamp(lo, hi, x_fq.scale, fq.scale, fq.dtype, qpp), [q], call.site)
    return Deferred(compute)


@emulates("abs", "neg")
@on_one_input
def _sign(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    qpp = emu.qpp
    return Deferred(lambda fq: run_kernel(f"{call.op_type}_int", rules.sign_op(x_fq.scale, fq.scale, fq.dtype, qpp),
                                       [q], call.site))


@emulates("interpolate")
@on_one_input
def _interpolate(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    m = call.module
    mode = m.mode if m is not None else call.arg(3, "mode", "nearest")
    if mode == "nearest":
        return grid_op(emu, call)
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
        return run_kernel("bilinear_int", attrs, [q, a_h, a_w], call.site)
    return Deferred(compute)


def _float_output_shape(call: EmuCall):
    return tuple(call.output.shape) if isinstance(call.output, torch.Tensor) else None


@emulates("batch_norm")
@on_one_input
def _batch_norm(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
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
        return run_kernel("channel_affine", attrs, [q, w_q, bias_q], call.site)
    return Deferred(compute)


@emulates("prelu", "leaky_relu")
@on_one_input
def _prelu(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
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
            alpha = (codes_of(w, w_fq).to(torch.float64) * codes_scale(w_fq)).reshape(-1)
    qpp = emu.qpp

    def compute(fq):
        return run_kernel("prelu_int", rules.prelu(alpha, x_fq.scale, fq.scale, fq.dtype, qpp), [q], call.site)
    return Deferred(compute)


@emulates("masked_fill")
@on_one_input
def _masked_fill(emu: IntegerEmulator, call: EmuCall, q: torch.Tensor, x_fq) -> Deferred | None:
    mask, value = call.arg(1, "mask"), call.arg(2, "value")
    if not isinstance(mask, torch.Tensor):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = float(value)
    filled = q.masked_fill(mask, rules.fill_code(float(value), x_fq.scale, x_fq.dtype))
    return Deferred(lambda fq: emu.requantize_codes(filled, x_fq, fq))


@emulates("where")
def _where(emu: IntegerEmulator, call: EmuCall) -> Deferred | None:
    """§11 select: each value operand moved to the output grid (a scalar: its code there), then picked."""
    cond = call.arg(0, "condition")
    operands = [site_input(call, 1, "input"), site_input(call, 2, "other")]
    if not isinstance(cond, torch.Tensor) or any(o is None for o in operands) or all(o[1] is None for o in operands):
        return None
    if any(src is not None and src.scale.numel() != 1 for _, src in operands):
        return None  # convert refuses a per-channel operand
    qpp = emu.qpp

    def compute(fq):
        codes = []
        for value, src in operands:
            if src is None:
                codes.append(torch.tensor(rules.fill_code(value, fq.scale, fq.dtype), dtype=torch.int64))
            elif torch.equal(src.scale, fq.scale) and src.dtype == fq.dtype:
                codes.append(value)
            else:
                attrs = {**rules.move(src.scale, fq.scale, fq.dtype, qpp), "axis": None}
                codes.append(run_kernel("requantize", attrs, [value], call.site))
        return torch.where(cond, *codes)
    return Deferred(compute)
