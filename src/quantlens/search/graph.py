"""What the search reads from a prepared base model: the candidates, the data flow, the int16 x int16 rule.

The march has no int16 x int16 GEMM, so the search never forms a set that needs prepare's resolution: an int16
weight is not combined with an int16 output reaching that GEMM's data input, and at most one data input of an
activation x activation GEMM (matmul, attention) is int16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from torch import nn

from quantlens.quantization.plan import OutputMode
from quantlens.search.promotion import Promotion, as_promotion
from quantlens.sites.op_rules import OpKind

__all__ = ["SearchGraph", "search_graph", "graph_candidates", "conflicts", "mixed_precision_candidates",
           "int16_conflicts", "int16x16_resolutions"]


@dataclass
class SearchGraph:
    """What the search needs of a prepared base model: candidates and the data flow for the GEMM rule."""

    activations: list[str]
    weights: list[str]
    order: dict[str, int]
    #: GEMM site -> origins (computing sites) of its data inputs
    gemm_inputs: dict[str, list[str]]
    weighted_gemms: set[str]
    #: site -> the sites whose output dtype it sets (its fused group)
    group: dict[str, tuple[str, ...]]
    #: weight sites whose output is the (int16) weight itself (embeddings)
    output_from_weight: set[str]
    #: site -> the computing sites (fused groups named by their last op) it reads from or feeds
    neighbours: dict[str, set[str]] = field(default_factory=dict)


def search_graph(prepared: nn.Module) -> SearchGraph:
    """The :class:`SearchGraph` of a prepared model."""
    state = prepared._quantlens_state
    record = state.record
    group: dict[str, tuple[str, ...]] = {}
    for g in state.groups:
        for m in g.members:
            group[m] = tuple(g.members)
    activations, weights, gemm_inputs, weighted, ofw = [], [], {}, set(), set()
    module_map = dict(prepared.named_modules())
    for site in record.sites.values():
        plan = state.plans.get(site.name)
        if site.kind is not OpKind.QUANTIZED or site.after_dequant or plan is None or plan.qconfig is None:
            continue
        if plan.output is OutputMode.QUANTIZED and plan.output_fq is not None and (
                site.name not in group or group[site.name][-1] == site.name):
            activations.append(site.name)
        has_weight = bool(plan.weight_fq) or (
            site.is_module and isinstance(getattr(module_map.get(site.module_name), "weight", None), nn.Parameter)
            and (site.gemm or site.output_from_weight))
        if has_weight and plan.qconfig.weight is not None and plan.output is not OutputMode.FUSED:
            weights.append(site.name)
            if site.output_from_weight:
                ofw.add(site.name)
        if site.gemm:
            data = [i for i in site.inputs if not i.is_parameter and i.position not in site.bias_args]
            gemm_inputs[site.name] = [record.origin(i.producer) for i in data if i.producer is not None]
            if has_weight:
                weighted.add(site.name)
    order = {name: k for k, name in enumerate(record.sites)}
    return SearchGraph(activations, weights, order, gemm_inputs, weighted, group, ofw, _neighbours(record, group))


def _neighbours(record, group: dict[str, tuple[str, ...]]) -> dict[str, set[str]]:
    """Site -> the computing sites it reads from or feeds, each fused group named by its last op."""
    rep = lambda n: group[n][-1] if n in group else n  # noqa: E731
    neighbours: dict[str, set[str]] = {}
    for site in record.sites.values():
        for i in site.inputs:
            if i.is_parameter or i.producer is None:
                continue
            src = record.origin(i.producer)
            if src is None or rep(src) == rep(site.name):
                continue
            neighbours.setdefault(rep(site.name), set()).add(rep(src))
            neighbours.setdefault(rep(src), set()).add(rep(site.name))
    return neighbours


def graph_candidates(g: SearchGraph) -> list[Promotion]:
    """Every promotion of ``g``: each op site's output, then each weight, in execution order."""
    return [Promotion(s, "activation") for s in g.activations] + [Promotion(s, "weight") for s in g.weights]


def _int16_outputs(selection: Iterable[Promotion], g: SearchGraph) -> set[str]:
    out: set[str] = set()
    for p in selection:
        if p.kind == "activation" or p.site in g.output_from_weight:
            out.update(g.group.get(p.site, (p.site,)))
    return out


def conflicts(selection: Sequence[Promotion], g: SearchGraph) -> list[str]:
    """Why ``selection`` would need an int16 x int16 GEMM (empty: it does not)."""
    int16_out = _int16_outputs(selection, g)
    int16_weight = {p.site for p in selection if p.kind == "weight"}
    problems = []
    for gemm, origins in g.gemm_inputs.items():
        hot = [o for o in origins if o in int16_out]
        if gemm in g.weighted_gemms:
            if gemm in int16_weight and hot:
                problems.append(f"'{gemm}': int16 weight and int16 input from {hot}")
        elif len(hot) > 1:
            problems.append(f"'{gemm}': int16 on more than one operand ({sorted(set(hot))})")
    return problems


def mixed_precision_candidates(prepared: nn.Module) -> list[Promotion]:
    """Every promotion the search may consider on a prepared model: each quantized op site's output, then each
    weight, in execution order."""
    return graph_candidates(search_graph(prepared))


def int16_conflicts(prepared_base: nn.Module, promotions: Iterable[Any]) -> list[str]:
    """The int16 x int16 GEMMs that ``promotions`` would need on the model of ``prepared_base`` (empty: none)."""
    return conflicts([as_promotion(p) for p in promotions], search_graph(prepared_base))


def int16x16_resolutions(prepared: nn.Module) -> list[str]:
    """Op sites where prepare requantized an input to int8 because of int16 x int16."""
    return [name for name, plan in prepared._quantlens_state.plans.items()
            if any("no int16 x int16" in note for note in plan.notes)]
