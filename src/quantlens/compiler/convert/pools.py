"""Average pools (``docs/march.md`` §10.2): fixed windows by one multiplier, windows of different counts (border,
``ceil_mode``) by one multiplier per divisor; uneven adaptive windows are refused with the reason."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantlens.compiler.convert.state import (
    converter,
    required_grid,
)
from quantlens.errors import QuantLensError
from quantlens.march import rules


def _divisors(node, in_hw) -> torch.Tensor:
    """The divisor torch uses at each output position of an avg_pool2d: the window's sum of ones over its average
    of ones (both exact), whatever padding, ``count_include_pad``, ``ceil_mode`` or ``divisor_override`` say."""
    a = node.attrs
    ones = torch.ones(1, 1, *[int(n) for n in in_hw], dtype=torch.float64)
    stride = a["stride"] or a["kernel_size"]
    sums = F.avg_pool2d(ones, a["kernel_size"], stride, a["padding"], a["ceil_mode"], True, divisor_override=1)
    means = F.avg_pool2d(ones, a["kernel_size"], stride, a["padding"], a["ceil_mode"], a["count_include_pad"],
                         a.get("divisor_override"))
    return torch.where(means > 0, sums / means.clamp(min=1e-300), torch.ones_like(sums)).round().to(torch.int64)[0, 0]


def pool_attrs(c, node) -> tuple[dict, int | torch.Tensor]:
    """The sum pool's attrs and the divisor: one int, or a map of them where windows hold different counts."""
    if node.op == "avg_pool2d":
        a = node.attrs
        divisors = _divisors(node, c.src.values[node.inputs[0]].shape[-2:])
        attrs = {"kernel_size": a["kernel_size"], "stride": a["stride"] or a["kernel_size"], "padding": a["padding"],
                 "ceil_mode": a["ceil_mode"], "count_include_pad": True}
        first = int(divisors.reshape(-1)[0])
        return attrs, first if bool((divisors == first).all()) else divisors
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
    qdtype, out_scale = required_grid(c, node)
    attrs, count = pool_attrs(c, node)
    if isinstance(count, torch.Tensor):  # windows of different counts (border, ceil_mode): a divisor per window
        attrs.update(rules.average_by_window(x.scale, count.reshape(-1).tolist(), out_scale, qdtype, c.qpp))
        attrs["divisors"] = count.tolist()
        c.emit(node, "avg_pool2d_div_int", [x.name], attrs, qdtype, out_scale)
        return
    attrs.update(rules.average(x.scale, count, out_scale, qdtype, c.qpp))
    c.emit(node, "avg_pool2d_int", [x.name], attrs, qdtype, out_scale)


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
    qdtype, out_scale = required_grid(c, node)
    attrs = _pool1d_attrs(c, node)
    attrs.update(rules.average(x.scale, attrs["kernel_size"][0], out_scale, qdtype, c.qpp))
    c.emit(node, "avg_pool1d_int", [x.name], attrs, qdtype, out_scale)
