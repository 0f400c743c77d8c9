"""Which conv/linear biases saturate when quantized to int32 (``docs/march.md`` §7.2).

``q_bias[c] = sat_int32(rhe(b[c] / (s_in · s_w[c])))``: a large bias over a small scale product (a pruned or
all-zero weight channel gets a tiny per-channel weight scale) exceeds int32 and is clipped, in the fake-quant model
and the kernels alike, so the op is wrong in those channels whatever its output precision. :func:`bias_saturation`
reads it from the analysis model itself:

* a qat IR: every int32 ``fake_quant`` of a constant (the biases), ``|b / scale|`` beyond int32;
* a prepared torch model: every QAT conv/linear with a bias, at the input scale its producer's row of the
  comparison shows (the scale its input fake quant has);
* a quantized IR: the int32 bias constants of the GEMMs at the limits of int32 (already clipped there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quantlens.march.opset import op_def

__all__ = ["BiasSaturation", "bias_saturation"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class BiasSaturation:
    """One op's int32 bias: how many of its channels saturate, and the worst ``|b / s_bias|`` (in int32 steps)."""

    op_name: str
    saturated: int
    channels: int
    worst_ratio: float  # max |b / s_bias| / (2**31 - 1): > 1 saturates


def _entry(site: str, codes: torch.Tensor) -> BiasSaturation | None:
    codes = codes.detach().double().reshape(-1)
    if codes.numel() == 0:
        return None
    worst = float(codes.abs().max()) / _INT32_MAX
    return BiasSaturation(site, int((codes.abs() >= _INT32_MAX).sum()), codes.numel(), worst)


def _from_ir(module) -> dict[str, BiasSaturation]:
    graph, out = module.graph, {}
    for node in graph.nodes:
        if node.op == "fake_quant" and node.attrs.get("qmin") == _INT32_MIN and node.inputs[0] in graph.constants \
                and node.inputs[1] in graph.constants:
            b, s = graph.constants[node.inputs[0]], graph.constants[node.inputs[1]]
            entry = _entry(node.site, b.double() / s.double().reshape(-1).expand(b.numel()).reshape(b.shape))
        else:
            op = op_def(node.op)
            bias = [node.inputs[i] for i in (op.bias_args if op is not None else ()) if i < len(node.inputs)]
            const = graph.constants.get(bias[0]) if bias and bias[0] else None
            if const is None or const.dtype != torch.int32:
                continue
            entry = _entry(node.site, const)
        if entry is not None and node.site not in out:
            out[node.site] = entry
    return out


def _from_torch(model: torch.nn.Module, comparison) -> dict[str, BiasSaturation]:
    rows = {row.op_name: row for row in comparison}
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "_quant_bias") or not hasattr(module, "bias") or name not in rows:
            continue  # no bias at all (an embedding); a conv-bn without one still has its folded bias
        w_fq = module.weight_fake_quant
        _, bias = module.integer_operands()
        producer = rows.get(rows[name].producer)
        if bias is None or producer is None or producer.scale is None or not w_fq.fake_quant_enabled:
            continue
        s_bias = (torch.tensor(producer.scale, dtype=torch.float32) * w_fq.scale.float()).reshape(-1)
        entry = _entry(name, bias.detach().double() / s_bias.double().expand(bias.numel()))
        if entry is not None:
            out[name] = entry
    return out


def bias_saturation(model: Any, comparison) -> dict[str, BiasSaturation]:
    """Op site -> its bias's int32 saturation, for the analysis model of a comparison (a prepared torch model, a
    qat or quantized IR; anything else: empty)."""
    from quantlens.compiler.ir import Module

    if isinstance(model, Module):
        return _from_ir(model)
    if isinstance(model, torch.nn.Module):
        return _from_torch(model, comparison)
    return {}
