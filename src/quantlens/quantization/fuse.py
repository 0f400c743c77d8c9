"""Fusion: conv/linear + BatchNorm (+ ReLU), and any quantized op + ReLU.

Fusion is found on the recorded data flow, not by pattern-matching source code, so it works whatever the
model's forward looks like. A fused group keeps every member's op site (names do not change); the BatchNorm
site becomes an identity, and the group's one output fake quant sits at its last op.

* conv/linear -> BatchNorm -> [ReLU]: the conv becomes a ``QATConvBn`` (BN folded, see ``qat_modules``);
* any quantized op -> ReLU: the ReLU takes the output fake quant, so the range it sees is ``[0, max]`` and no
  int8 level is spent on values the ReLU removes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quantlens.quantization.qat_modules import float_base
from quantlens.sites.op_rules import OpKind
from quantlens.sites.record import ModelRecord, OpSiteRecord

__all__ = ["FusedGroup", "UnfusedPattern", "find_fusions"]

#: the float class a conv/linear computes as (``qat_modules.float_base``) -> the BatchNorm class folded into it
_BN_HEADS = {nn.Conv1d: "BatchNorm1d", nn.Conv2d: "BatchNorm2d", nn.Linear: "BatchNorm1d"}


@dataclass(frozen=True)
class FusedGroup:
    members: tuple[str, ...]  # op site names, in execution order
    bn: str | None = None  # the BatchNorm member, if folded into the head

    @property
    def head(self) -> str:
        return self.members[0]

    @property
    def last(self) -> str:
        return self.members[-1]


@dataclass(frozen=True)
class UnfusedPattern:
    members: tuple[str, ...]
    reason: str


def _single_consumer(record: ModelRecord, name: str) -> OpSiteRecord | None:
    consumers = record.consumers(name)
    if len(consumers) != 1:
        return None
    consumer = record.sites[consumers[0]]
    data_inputs = [i for i in consumer.inputs if not i.is_parameter]
    if len(data_inputs) != 1 or data_inputs[0].producer != name:
        return None
    return consumer


def _shared(record: ModelRecord, site: OpSiteRecord) -> bool:
    return site.is_module and (f"{site.name}@1" in record.sites or "@" in site.name)


def find_fusions(record: ModelRecord, model: nn.Module) -> tuple[list[FusedGroup], list[UnfusedPattern]]:
    """Groups to fuse, and fusable-looking patterns that could not be fused (with the reason)."""
    groups: list[FusedGroup] = []
    unfused: list[UnfusedPattern] = []
    taken: set[str] = set()
    modules = dict(model.named_modules())
    for site in record.sites.values():
        if site.name in taken or site.kind is not OpKind.QUANTIZED or site.boundary:
            continue
        members = [site.name]
        bn_name = None
        head = modules.get(site.name) if site.is_module else None
        base = float_base(head) if head is not None and type(head).__name__ == site.module_type else None
        expected_bn = _BN_HEADS.get(base)  # (each head has its conv/linear + BatchNorm class in qat_modules)
        nxt = _single_consumer(record, site.name)
        if expected_bn is not None:
            bn_candidates = [record.sites[c] for c in record.consumers(site.name)]
            bn_like = [c for c in bn_candidates if (c.module_type or "").startswith("BatchNorm")]
            if nxt is not None and nxt.module_type == expected_bn and not _shared(record, site) \
                    and not _shared(record, nxt):
                bn_name = nxt.name
                members.append(nxt.name)
                nxt = _single_consumer(record, nxt.name)
            elif bn_like:
                reason = (
                    "the conv/linear output is also used elsewhere" if nxt is None
                    else "the conv/linear or the BatchNorm module is called more than once (shared)"
                )
                unfused.append(UnfusedPattern((site.name, bn_like[0].name), reason))
        if nxt is not None and nxt.op_type == "relu" and nxt.name not in taken:
            members.append(nxt.name)
        if len(members) > 1:
            groups.append(FusedGroup(tuple(members), bn_name))
            taken.update(members)
    return groups, unfused
