"""Per-channel weights as a remedy (``docs/remedies.md``).

A base setter may quantize some weights per tensor (a vendor template, a hand-written qconfig). One wide output
channel then sets the scale of every other channel; the advisor's ``per_tensor_weight_channels`` finding names such
ops. :class:`PerChannelWeightQconfigSetter` gives the weights of the chosen op sites (default: every op site with a
per-tensor weight) one scale per output channel, on top of any setter. ``prepare`` resolves the axis: a transposed
conv takes axis 1 by itself, and a grouped conv stays per tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from torch import nn

from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
    unmatched_message,
)

__all__ = ["PerChannelWeightQconfigSetter", "per_tensor_weight_sites"]


class PerChannelWeightQconfigSetter(QconfigSetter):
    """The base setter's qconfigs with per-channel weights (axis 0) at ``sites`` (``None``: every op site whose
    weight the base quantizes per tensor). Everything else is the base setter's."""

    def __init__(self, sites: Iterable[str] | None = None, base_setter: Any = default_calibration_qconfig_setter):
        self.sites = None if sites is None else frozenset(sites)
        self.base_setter = base_setter
        count = "all" if self.sites is None else ", ".join(sorted(self.sites))
        self.name = f"per_channel_weights({count}) > {getattr(base_setter, 'name', repr(base_setter))}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        """The base assignment with the chosen sites' per-tensor weights made per channel (every member of a fused
        group carries the group's qconfig: all of them change with its head)."""
        result = resolve_qconfigs(self.base_setter, ctx)
        for site in _per_tensor(result, ctx, heads_only=False):
            group = ctx.group_of(site)
            if self.sites is None or (group.head if group is not None else site) in self.sites:
                qconfig = result.qconfigs[site]
                result.qconfigs[site] = qconfig.replace(weight=replace(qconfig.weight, ch_axis=0))
        if self.sites is not None:
            for site in sorted(self.sites - set(ctx.record.sites)):
                result.unmatched.append(unmatched_message("PerChannelWeightQconfigSetter", site, ctx))
        return result


def _per_tensor(assignment: QconfigAssignment, ctx: QconfigContext, heads_only: bool = True) -> list[str]:
    """The op sites whose weight the assignment quantizes per tensor (``heads_only``: a fused group once, by its
    head, the op that has the weight)."""
    def head(site: str) -> bool:
        group = ctx.group_of(site)
        return not heads_only or group is None or group.head == site

    return [site for site, q in assignment.qconfigs.items()
            if q is not None and q.weight is not None and q.weight.ch_axis is None and head(site)]


def per_tensor_weight_sites(model: nn.Module, example: Any, setter: Any) -> list[str]:
    """The op sites whose weights ``setter`` quantizes per tensor on ``model`` (where the remedy applies);
    ``model`` is only run, not changed."""
    from quantlens.quantization.fuse import find_fusions
    from quantlens.sites.record import record_model

    record = record_model(model, [example])
    groups, _ = find_fusions(record, model)
    ctx = QconfigContext(record, groups)
    return _per_tensor(resolve_qconfigs(setter, ctx), ctx)
