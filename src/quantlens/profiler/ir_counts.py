"""What an IR's integer arithmetic did, counted node by node while it runs (:class:`IntegerStats` of each op
site): GEMM accumulators beyond int32, table inputs clipped where the function is not flat, and NaN/Inf handed
to the integers. Counts only: nothing is kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantlens.compiler.ir import Node
from quantlens.kernels import dtype_from_range, real_function
from quantlens.march.numerics import quantize
from quantlens.march.opset import Category, ops_in
from quantlens.profiler.model_access import IntegerStats

__all__ = ["count_node", "nonfinite_count"]


#: the GEMM nodes of the quantized IR whose exact accumulator ``docs/march.md`` §6 saturates to int32 once
_GEMMS = ops_in(Category.GEMM, level="quantized")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def count_node(node: Node, inputs: list, outs: list, stats: dict[str, IntegerStats], site: str, quantized: bool,
               flat_cache: dict | None = None) -> None:
    """Add what this node's integer arithmetic did to its site's :class:`IntegerStats` (counts only);
    ``quantized``: the node is one of a quantized IR; ``flat_cache`` keeps each table's flat ends (see
    :func:`_table_clipping`) from run to run."""
    if node.attrs.get("host"):
        return
    if quantized and node.op in _GEMMS:
        saturated, numel = _acc_saturation(node, inputs, outs)
        if numel:
            st = stats.setdefault(site, IntegerStats())
            st.acc_saturated += saturated
            st.acc_numel += numel
    elif node.op in ("lut", "segment_lut"):
        clipped, numel = _table_clipping(node, inputs, flat_cache)
        st = stats.setdefault(site, IntegerStats())
        st.table_clipped += clipped
        st.table_numel += numel
    elif quantized and node.op == "quantize" and inputs and isinstance(inputs[0], torch.Tensor) and \
            inputs[0].is_floating_point():
        bad = nonfinite_count(inputs[0])
        if bad:
            stats.setdefault(site, IntegerStats()).nonfinite += bad


def nonfinite_count(t: torch.Tensor) -> int:
    """The NaN and Inf elements of a float tensor (0 for an integer one)."""
    return int((~torch.isfinite(t)).sum()) if t.is_floating_point() and t.numel() else 0


def _absmax(t: torch.Tensor) -> int:
    """max |t| of an integer tensor, without a widened copy (int8 ``abs(-128)`` would wrap)."""
    if not t.numel():
        return 0
    lo, hi = torch.aminmax(t)
    return max(-int(lo), int(hi))


def _acc_saturation(node: Node, inputs: list, outs: list) -> tuple[int, int]:
    """``(saturated, numel)`` of an integer GEMM node's exact accumulator (the sum of ``kernels_int``, bias
    included, before its int32 saturation). The accumulator is recomputed (float64 holds it exactly) only
    when a bound ``terms · max|a| · max|b| + max|bias|`` allows an element beyond int32; nothing is kept."""
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 and node.op != "matmul" else None
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.is_floating_point() or \
            w.is_floating_point():
        return 0, 0
    numel = outs[0].numel() if outs and isinstance(outs[0], torch.Tensor) else 0
    op, a = node.op, node.attrs
    if op in ("conv1d", "conv2d"):
        terms, channel_dim = w[0].numel(), 1
    elif op in ("conv_transpose1d", "conv_transpose2d"):
        terms, channel_dim = w.shape[0] * w[0, 0].numel(), 1
    elif op == "linear":
        terms, channel_dim = w.shape[-1], -1
    else:
        terms, channel_dim = x.shape[-1], -1
    bias_max = _absmax(bias) if isinstance(bias, torch.Tensor) else 0
    if terms * _absmax(x) * _absmax(w) + bias_max <= _INT32_MAX:
        return 0, numel
    xd, wd = x.to(torch.float64), w.to(torch.float64)
    if op in ("conv1d", "conv2d"):
        conv = F.conv2d if op == "conv2d" else F.conv1d
        acc = conv(xd, wd, None, a["stride"], a["padding"], a["dilation"], a["groups"])
    elif op in ("conv_transpose1d", "conv_transpose2d"):
        fn = F.conv_transpose2d if op == "conv_transpose2d" else F.conv_transpose1d
        acc = fn(xd, wd, None, a["stride"], a["padding"], a["output_padding"], a["groups"], a["dilation"])
    elif op == "linear":
        acc = F.linear(xd, wd)
    else:
        acc = torch.matmul(xd, wd)
    del xd, wd
    if isinstance(bias, torch.Tensor):
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        acc += bias.to(torch.float64).reshape(shape)
    return int(((acc > _INT32_MAX) | (acc < _INT32_MIN)).sum()), acc.numel()


def _table_clipping(node: Node, inputs: list, flat_cache: dict | None = None) -> tuple[int, int]:
    """``(clipped, numel)``: input codes of a ``lut``/``segment_lut`` node at a limit of its input type (the range
    its table is built for) where the function is not flat beyond it, and (``segment_lut``) codes outside the
    domain its segments were built for where the function is not the constant tail (:func:`_outside_domain`). Such inputs were clipped to that range,
    and a wider range would have given other outputs. A limit counts as flat when the op's real function,
    rounded to the output type, is constant from the limit out to one more input range beyond it (sigmoid,
    tanh: clipping their saturated tails costs nothing)."""
    x = inputs[0]
    if node.op == "lut":
        lo, hi = -128, 127
    else:
        lo, hi = int(node.attrs["in_qmin"]), int(node.attrs["in_qmax"])
    key = id(node)
    if flat_cache is not None and key in flat_cache:
        flat_lo, flat_hi = flat_cache[key]
    else:
        flat_lo, flat_hi = _flat_ends(node, inputs, lo, hi)
        if flat_cache is not None:
            flat_cache[key] = (flat_lo, flat_hi)
    if flat_lo and flat_hi and node.op == "lut":
        return 0, x.numel()
    q = quantize(x, inputs[1], dtype_from_range(lo, hi)) if x.is_floating_point() else x
    clipped = (0 if flat_lo else int((q <= lo).sum())) + (0 if flat_hi else int((q >= hi).sum()))
    if node.op == "segment_lut":
        clipped += _outside_domain(node, inputs, q, lo, hi)
    return clipped, x.numel()


def _outside_domain(node: Node, inputs: list, q: torch.Tensor, lo: int, hi: int) -> int:
    """Input codes of a segmented table inside its input type but outside the domain its segments were built for
    (``SegmentedTable``: such codes get the constant tails) where the op's real function, rounded to the output
    step, is not that tail: the table was built for a narrower input range than the data."""
    bounds, tails = inputs[3], inputs[6] if len(inputs) > 6 else None
    if not isinstance(tails, torch.Tensor) or tails.numel() != 2:
        return 0
    first, last = int(bounds[0]), int(bounds[-1]) - 1
    below, above = (q < first) & (q > lo), (q > last) & (q < hi)  # the type limits are counted above
    if not bool(below.any() or above.any()):
        return 0
    ref = dict(node.attrs.get("reference") or {})
    if "op" not in ref:
        return 0  # no real function recorded: the tails cannot be judged
    fn = real_function(ref.pop("op"), **ref)
    s_in, s_out = float(inputs[1].reshape(-1)[0]), float(inputs[2].reshape(-1)[0])
    out_min, out_max = int(node.attrs["out_qmin"]), int(node.attrs["out_qmax"])
    count = 0
    for mask, tail in ((below, tails[0]), (above, tails[1])):
        codes = q[mask].to(torch.float64)
        if codes.numel():
            real = torch.round(fn(codes * s_in) / s_out).clamp(out_min, out_max)
            count += int(((real - tail.to(torch.float64)).abs() >= 1).sum())  # tails are output codes
    return count


def _flat_ends(node: Node, inputs: list, lo: int, hi: int) -> tuple[bool, bool]:
    """Whether the table's function is constant (at the output's resolution) beyond each input limit."""
    ref = dict(node.attrs.get("reference") or {})
    try:
        fn = real_function(ref.pop("op"), **ref)
        s_in, s_out = float(inputs[1].reshape(-1)[0]), float(inputs[2].reshape(-1)[0])
        out_min, out_max = int(node.attrs["out_qmin"]), int(node.attrs["out_qmax"])
    except Exception:  # no real function recorded (an older IR): judge by the table's own end entries
        if node.op == "lut":
            table = inputs[3]
            return bool(table[0] == table[1]), bool(table[-1] == table[-2])
        bounds = inputs[3]
        return int(bounds[0]) > lo, int(bounds[-1]) - 1 < hi
    width = hi - lo + 1

    def constant(codes: torch.Tensor) -> bool:
        y = torch.nan_to_num(torch.round(fn(codes.to(torch.float64) * s_in) / s_out), nan=0.0)
        y = y.clamp(out_min, out_max)
        return bool((y == y[0]).all())

    return (constant(torch.arange(lo - width, lo + 1, dtype=torch.float64)),
            constant(torch.arange(hi, hi + width + 1, dtype=torch.float64)))

