"""The advisor's per-channel rule: per-tensor weights that crush some of an op's output channels.

A whole-tensor SQNR is dominated by the channels with the most energy: a conv whose channels' weights differ
100x in range, quantized with one weight scale, leaves its small channels a step or two of weight resolution
while its overall SQNR stays near the healthy channels'. The rule reads the per-channel figures of the
comparison (:class:`~quantlens.profiler.compare.LayerRow`: ``same_input_worst_channel_sqnr``,
``same_input_inner_worst_channel_sqnr``, ``channels_below``, ``weight_per_channel``)."""

from __future__ import annotations

import math

from quantlens.march.opset import op_def
from quantlens.profiler.advisor.base import (
    CHANNEL_GAP_DB,
    SAME_INPUT_SQNR_LIMIT,
    AdvisorContext,
    Finding,
    Rule,
    registrar,
)
from quantlens.profiler.compare import LayerRow

__all__ = ["RULES", "CHANNEL_GAP_DB"]


#: this module's rules, in the order :func:`~quantlens.profiler.advisor.advise` runs them
RULES: dict[str, Rule] = {}
_rule = registrar(RULES)


def _finite(v: float | None) -> bool:
    return v is not None and not math.isnan(v)


def _weight_fault(row: LayerRow) -> bool:
    """Per-tensor weights, a worst channel far below the whole output and below the limit, and the damage made
    inside the op (before its output's rounding, which per-channel weights would not change)."""
    whole, worst, inner = row.same_input_sqnr, row.same_input_worst_channel_sqnr, row.same_input_inner_worst_channel_sqnr
    if row.weight_per_channel is not False or not (_finite(whole) and _finite(worst)):
        return False
    if worst >= SAME_INPUT_SQNR_LIMIT or worst > whole - CHANNEL_GAP_DB:
        return False
    return inner is None or (not math.isnan(inner) and inner < SAME_INPUT_SQNR_LIMIT)


@_rule("per_tensor_weight_channels")
def per_tensor_weight_channels(ctx: AdvisorContext) -> list[Finding]:
    """An op with per-tensor weights whose worst output channel (same input) is far below its whole output.
    ``fake_quant`` only: the one pair whose analysis model quantizes weights its baseline keeps float (the later
    pairs share the quantized weights, and the integer stages record no weight fake quant)."""
    if ctx.analysis_type != "fake_quant":
        return []
    heads: dict[str, LayerRow] = {}  # a fused group's value is measured at its last op, its weight is its first's
    for row in ctx.comparison:
        if row.fused_into:
            heads.setdefault(row.fused_into, row)
    out = []
    for row in ctx.comparison:
        owner = heads.get(row.op_name, row)
        op = op_def(owner.analy_op_type)
        if op is None or not op.weight_args or not _weight_fault(row):
            continue
        at = "" if owner is row else f" (measured at '{row.op_name}', the output of its fused group)"
        inner = row.same_input_inner_worst_channel_sqnr
        info = (f"per-tensor weights: same-input SQNR {row.same_input_sqnr:.1f} dB over the whole output{at}, but "
                f"{row.same_input_worst_channel_sqnr:.1f} dB in its worst channel; "
                f"{100 * (row.channels_below or 0):.0f}% of its channels are below {SAME_INPUT_SQNR_LIMIT:g} dB"
                + ("" if inner is None else f" (worst channel before the output's rounding: {inner:.1f} dB)"))
        advice = (f"quantize the weight of '{owner.op_name}' per channel: ModuleNameQconfigSetter({{'{owner.op_name}'"
                  ": QConfig(weight=QuantSpec(<its weight dtype>, MinMaxObserver, ch_axis=0), output=...)}) "
                  "(get_qconfig() and the default qconfig templates give per-channel weights; a transposed conv "
                  "takes axis 1 by itself, and with groups > 1 stays per tensor)")
        out.append(Finding("per_tensor_weight_channels", owner.op_name, owner.op_type, info, advice))
    return out
