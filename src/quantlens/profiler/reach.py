"""Which op sites matter: those whose values reach a compared output, and those computed on the model's inputs
alone (host-side).

An op whose output reaches no compared output (an unused pooler, a head the post-process drops) cannot explain
the outputs' error, however large its own; the per-layer table lists it apart and never ranks it. An op whose
every input is a model input (a mask or position computation) is labelled ``host-side``: its error is what
quantizing the model's own inputs costs, not what an op in the network adds.

* IR models: the graph's data flow, backward from the outputs the comparison uses;
* torch models: one extra forward whose events record, for every op site, the sites that produced its inputs
  (tensor identity; the output tensors are not kept), then backward from the producers of the compared outputs.
  When a compared output was not produced by an op site (made by code the tracer does not see) nothing is
  claimed: every site counts as reaching.

Every float model output counts as compared (``QuantAnalysis`` compares the model outputs, and a post-process
only adds outputs computed from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from quantlens.profiler.model_access import SiteEvent
from quantlens.profiler.outputs import float_outputs, named_outputs

__all__ = ["SiteReach", "site_reach", "ReachTee"]

#: the op types of the model-input boundary (quantizing the model's input is their job, not host-side work)
_QUANT_STUBS = frozenset({"quant_stub", "QuantStub"})


@dataclass(frozen=True)
class SiteReach:
    """``reaching``: the op sites whose values reach a compared output (None: not known, every site counts);
    ``host_side``: the op sites whose every input is a model input."""

    reaching: frozenset[str] | None
    host_side: frozenset[str]


class _FlowRecorder:
    """Trace sink: each site's producing sites (by tensor identity) and the sites fed by model inputs only."""

    def __init__(self, example: Any):
        self.inputs = {id(t) for t in pytree.tree_leaves(example) if isinstance(t, torch.Tensor)}
        self.producer: dict[int, str] = {}  # a live tensor's id -> the last site that produced a tensor with it
        self.sources: dict[str, set[str]] = {}
        #: sites fed by model inputs only; those of them that quantize the input themselves; whether any QuantStub ran
        self.candidates: set[str] = set()
        self.implicit: set[str] = set()
        self.has_stub = False

    @property
    def host_side(self) -> frozenset[str]:
        """The sites fed by model inputs only. In a model without any QuantStub the first ops quantize the inputs
        themselves: they are the NPU's boundary, not host work (with QuantStubs, the user drew the boundary)."""
        return frozenset(self.candidates if self.has_stub else self.candidates - self.implicit)

    def on_site(self, event: SiteEvent) -> None:
        tensors = [t for t in event.inputs.values() if isinstance(t, torch.Tensor)]
        sources = self.sources.setdefault(event.name, set())
        sources.update(self.producer[id(t)] for t in tensors if id(t) in self.producer)
        self.has_stub = self.has_stub or event.op_type in _QUANT_STUBS
        if tensors and event.op_type not in _QUANT_STUBS and all(id(t) in self.inputs for t in tensors):
            self.candidates.add(event.name)
            if any(d.startswith("qint") for d in event.input_dtypes):
                self.implicit.add(event.name)
        for t in event.outputs:
            self.producer[id(t)] = event.name


def _backward(sources: dict[str, set[str]], start: set[str]) -> frozenset[str]:
    seen, stack = set(start), list(start)
    while stack:
        for s in sources.get(stack.pop(), ()):
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return frozenset(seen)


def _ir_reach(access) -> SiteReach:
    graph = access.module.graph
    producers = {out: node for node in graph.nodes for out in node.outputs}
    start = list(graph.outputs)
    seen, stack, sites = set(start), list(start), set()
    inputs = set(graph.inputs)
    host = set()
    while stack:
        node = producers.get(stack.pop())
        if node is None:
            continue
        if node.site:
            sites.add(node.site)
        for value in node.inputs:
            if value and value not in seen:
                seen.add(value)
                stack.append(value)
    external: dict[str, set[str]] = {}  # site -> the values entering it from outside its own nodes
    for node in graph.nodes:
        if not node.site:
            continue
        for value in node.inputs:
            producer = producers.get(value)
            if value and value not in graph.constants and (producer is None or producer.site != node.site):
                external.setdefault(node.site, set()).add(value)
    # the sites that quantize a model input: a QuantStub's (nothing else) or, in a model without any, the first
    # ops' (the NPU's boundary, not host work)
    quantizing = {node.site for node in graph.nodes if node.op in ("quantize", "fake_quant") and node.inputs
                  and node.inputs[0] in inputs}
    stubs = {s for s in quantizing if all(n.op in ("quantize", "fake_quant") for n in graph.nodes if n.site == s)}
    implicit = set() if stubs else quantizing
    for site, values in external.items():
        if values <= inputs and site not in stubs and site not in implicit and site in access.last and \
                access.site_op_type(site) not in _QUANT_STUBS:
            host.add(site)
    return SiteReach(frozenset(sites), frozenset(host))


def _from_flow(recorder: _FlowRecorder, output: Any) -> SiteReach:
    start = set()
    for t in float_outputs(named_outputs(output)).values():
        site = recorder.producer.get(id(t))
        if site is None:
            return SiteReach(None, recorder.host_side)
        start.add(site)
    return SiteReach(_backward(recorder.sources, start), recorder.host_side)


def site_reach(access, example: Any) -> SiteReach:
    """The :class:`SiteReach` of a model (its :class:`~.model_access.ModelAccess`) on ``example``; the march's host
    ops (``ModelAccess.host_sites``) count as host-side too."""
    if hasattr(access, "module") and hasattr(access.module, "graph"):  # an IR: its graph says it
        reach = _ir_reach(access)
    else:
        recorder = _FlowRecorder(example)
        reach = _from_flow(recorder, access.run(example, sink=recorder))
    return SiteReach(reach.reaching, reach.host_side | access.host_sites())


class ReachTee:
    """A trace sink that passes every event on to ``sink`` and records the data flow as it goes, so the run that
    writes a trace also gives the :class:`SiteReach` (:meth:`reach`), without the extra forward of
    :func:`site_reach`."""

    def __init__(self, sink, example: Any):
        self.sink = sink
        self._flow = _FlowRecorder(example)

    # The probes ask the sink what it takes: a tee answers for the sink behind it (without this, the analysis
    # model's output quantization split was computed on the forward's thread instead of the writer's).
    @property
    def deferred_quant_error(self) -> bool:
        return getattr(self.sink, "deferred_quant_error", False)

    @property
    def wants_index_ops(self) -> bool:
        return getattr(self.sink, "wants_index_ops", False)

    def on_site(self, event: SiteEvent) -> None:
        self._flow.on_site(event)
        self.sink.on_site(event)

    def reach(self, output: Any) -> SiteReach:
        """The reach of the run whose model output is ``output``."""
        return _from_flow(self._flow, output)


def mark(comparison, reach: SiteReach):
    """``comparison`` with each row's ``reaches_output`` and ``host_side`` set from ``reach`` (rows are frozen:
    a new :class:`~.compare.LayerComparison` with the same attributes); a fused group's member counts as
    reaching when its group's last op does."""
    import copy
    from dataclasses import replace

    def reaches(row) -> bool | None:
        if reach.reaching is None:
            return None
        return row.op_name in reach.reaching or bool(row.fused_into and row.fused_into in reach.reaching)

    out = copy.copy(comparison)
    out.rows = [replace(r, reaches_output=reaches(r), host_side=r.op_name in reach.host_side)
                for r in comparison.rows]
    return out


def reached_only(comparison):
    """``comparison`` without the rows that reach no compared output (what the advisor reads)."""
    import copy

    out = copy.copy(comparison)
    out.rows = [r for r in comparison.rows if r.reaches_output is not False]
    return out
