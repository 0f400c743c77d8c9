"""Average pools with fixed windows (``docs/march.md`` §10.2); others are refused with the reason."""

from __future__ import annotations

from quantlens.compiler.convert.state import (
    _required_grid,
    converter,
)
from quantlens.errors import QuantLensError
from quantlens.march import rules


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
    qdtype, out_scale = _required_grid(c, node)
    attrs = _pool1d_attrs(c, node)
    attrs.update(rules.average(x.scale, attrs["kernel_size"][0], out_scale, qdtype, c.qpp))
    c.emit(node, "avg_pool1d_int", [x.name], attrs, qdtype, out_scale)
