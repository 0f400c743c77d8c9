""":class:`IRModelAccess`: the :class:`~.model_access.ModelAccess` of qat IR and quantized IR models (and of files
written by ``save``), for the ``export`` and ``convert`` analysis types.

**Op sites of an IR.** Every IR node carries the op site it came from (``node.site``); a node of the quantized IR
that requantizes straight to the grid of a fused member (a conv whose BatchNorm or ReLU was fused) also names
that member (``attrs["output_site"]``), and its value is attributed to it. One op site may be several nodes: its
**value** is the output of its last node, dequantized to float in the quantized IR (so values compare with the
torch model's, and differences divide by the site's scale into LSB).

**Same-input output.** A site's *program* (its nodes, plus those of the sites fused into it) is re-run with
every input it takes from another site replaced by that site's value in the baseline (quantized to the input's
grid in the quantized IR); model inputs are the same on both sides. So the error a site *adds* is separated
from the error it inherits.

**Sites that run several times** (a recurrent layer's time steps share their op sites): each run is an
*occurrence*, ending at a node with the op of the site's last node whose value another site reads. A site is
reported at its last occurrence (one row), and its program is that occurrence's nodes. An input from an earlier
occurrence (the recurrent state: step ``t`` reads step ``t - 1``) takes the baseline's value of that occurrence,
counted from the end (a first step folded into constants has no node in the quantized IR). Traced without a
same-input source (as the baseline), an IR also reports the earlier occurrences that a program reads (with all
later ones of their site, so that counting from the end still pairs them); a torch model reports every call.

**Mixing stages (sensitivity)**: :mod:`.ir_mixing`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from quantlens.compiler.interpreter import RunHooks, run_nodes
from quantlens.compiler.ir import Node
from quantlens.compiler.kernels_int import storage_dtype
from quantlens.compiler.output_containers import load_spec
from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.march.numerics import dequantize, quantize
from quantlens.march.opset import IR_OPS, Category, ops_in
from quantlens.profiler.ablation.ir_cache import IRAblationCache, IRCachedAblations
from quantlens.profiler.ablation.torch_cache import CachedAblations
from quantlens.profiler.ir_counts import count_node, nonfinite_count
from quantlens.profiler.ir_mixing import SiteOverride
from quantlens.profiler.ir_module import as_ir_module, call_ir
from quantlens.profiler.ir_programs import INPUT as _INPUT
from quantlens.profiler.ir_programs import Program, SitePrograms, Source, attribute_sites
from quantlens.profiler.model_access import (
    AnalysisType,
    ConsistencyInfo,
    IntegerStats,
    ModelAccess,
    Quantizer,
    SameInputSource,
    SiteEvent,
    TraceSink,
)
from quantlens.profiler.same_input_feed import baseline_output, float_heads, is_index_value
from quantlens.sites.record import inputs_to

__all__ = ["IRModelAccess", "SiteOverride"]  # (SiteOverride: from .ir_mixing)

#: the IR's nodes that only move or round values: a site's displayed op type is its last other node
_PLUMBING = ops_in(Category.QUANTIZER, Category.BOUNDARY)  # fake_quant, requantize, quantize, dequantize


class IRModelAccess(ModelAccess):
    """A qat IR or quantized IR module (or the path of a saved one) as the profiler sees it."""

    def __init__(self, model: Any, label: str):
        self.module = as_ir_module(model)
        self.label = label
        self.source = str(model) if isinstance(model, (str, os.PathLike)) else ""
        graph = self.module.graph
        self.nodes: list[Node] = graph.nodes
        self.attributed = attribute_sites(self.nodes)
        self.last: dict[str, int] = {}
        for i, site in enumerate(self.attributed):
            if site and site != "output":  # "output": the boundary dequantizes (the model outputs are compared)
                self.last[site] = i
        #: occurrences and programs of the sites (:mod:`.ir_programs`)
        self.structure = SitePrograms(self.nodes, self.attributed, self.last, graph.outputs, graph.constants)
        self.producer, self.ends = self.structure.producer, self.structure.ends
        self._index = {id(node): i for i, node in enumerate(self.nodes)}  # the hooks get nodes, not positions
        #: sites in the order their values are complete
        self.sites = sorted(self.last, key=self.last.get)
        self.reference: ModelAccess | None = None  # set by QuantAnalysis for sensitivity (see SiteOverride)
        self._flat_cache: dict[int, tuple[bool, bool]] = {}  # table node -> flat beyond (low, high) limit

    def host_sites(self) -> frozenset[str]:
        """The op sites all of whose nodes carry ``attrs["host"]``."""
        sites: dict[str, bool] = {}
        for node in self.nodes:
            if node.site:
                sites[node.site] = sites.get(node.site, True) and bool(node.attrs.get("host"))
        return frozenset(site for site, host in sites.items() if host)

    @property
    def folded(self) -> dict[str, str]:
        """The op sites whose every node went to another site's value (a conv requantized straight to its fused
        ReLU's grid: ``output_site``), with that site."""
        own = {n.site for n in self.nodes if n.site} - set(self.last)
        return {n.site: site for n, site in zip(self.nodes, self.attributed) if n.site in own and site in self.last}

    # -- description -------------------------------------------------------------------------------------
    def describe(self) -> str:
        where = f" from {os.path.basename(self.source)}" if self.source else ""  # reports do not depend on cwd
        model = self.module.meta.get("source_model", "model")
        return f"{model} ({self.module.kind} IR{where})"

    @property
    def kind(self) -> str:
        return self.module.kind

    def consistency(self) -> ConsistencyInfo:
        """The level recorded in the IR's meta by export (kept by convert and by save/load)."""
        return ConsistencyInfo.from_meta(self.module.meta, f"{self.label} model ({self.kind} IR meta)")

    def computed_rules(self) -> str | None:
        """The qat IR computes float + fake quant at every level, the quantized IR the integer rules."""
        level = self.consistency().level
        if level is None or level < 1:
            return None
        return "none" if self.kind == "qat" else "exact"

    # -- values ------------------------------------------------------------------------------------------
    def value_info(self, name: str):
        """The ``ValueInfo`` of an IR value (shape, dtype, integer grid), or None."""
        return self.module.graph.values.get(name)

    def _scale(self, name: str) -> torch.Tensor | None:
        info = self.value_info(name)
        return self.module.graph.constants[info.scale] if info is not None and info.scale else None

    def to_float(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The real value of an IR value (integers of the quantized IR are dequantized)."""
        info = self.value_info(name)
        if info is not None and info.qdtype and not value.is_floating_point():
            return dequantize(value, self._scale(name), info.axis)
        return value

    def from_float(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A real value as this IR holds value ``name``: on its integer grid in the quantized IR."""
        info = self.value_info(name)
        if info is not None and info.qdtype and value.is_floating_point():
            qdtype = QuantDType.parse(info.qdtype)
            return quantize(value, self._scale(name), qdtype, info.axis, storage_dtype(qdtype.value))
        if info is not None and info.dtype not in ("unknown", "") and hasattr(torch, info.dtype):
            return value.to(getattr(torch, info.dtype))
        return value

    def site_grid(self, site: str) -> tuple[str, torch.Tensor | None]:
        """``(quant dtype, scale)`` of a site's (first) value."""
        node = self.nodes[self.last[site]]
        name = node.outputs[0]
        info = self.value_info(name)
        if info is not None and info.qdtype:
            return info.qdtype, self._scale(name)
        if node.op == "fake_quant":
            try:
                qdtype = QuantDType.of_range(int(node.attrs["qmin"]), int(node.attrs["qmax"])).value
            except QuantLensError:
                return "float", None
            return qdtype, self.module.graph.constants.get(node.inputs[1])
        return "float", None

    def site_axis(self, site: str) -> int | None:
        """The channel axis of a site's per-channel scale (None: per tensor)."""
        node = self.nodes[self.last[site]]
        info = self.value_info(node.outputs[0])
        if info is not None and info.qdtype:
            return info.axis
        if node.op == "fake_quant" and node.attrs.get("axis", -1) >= 0:
            return int(node.attrs["axis"])
        return None

    def site_op_type(self, site: str) -> str:
        """The op a site computes: its last node that computes (a fused ReLU after an add is the add's site)."""
        nodes = [self.nodes[i] for i in self.program(site).nodes]
        computing = [n.op for n in nodes if n.op not in _PLUMBING]
        significant = [op for op in computing if op in IR_OPS and IR_OPS[op].category not in
                       (Category.MOVEMENT, Category.INDEX)]
        return (significant or computing or [nodes[-1].op])[-1]

    # -- programs ----------------------------------------------------------------------------------------
    def program(self, site: str, fused: frozenset[str] = frozenset()) -> Program:
        """What the site's last occurrence computes (with the ``fused`` sites feeding it): :mod:`.ir_programs`."""
        return self.structure.program(site, fused)

    def run_program(self, prog: Program, values: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list | None]:
        """Run a site's program on ``values`` (this IR's representation of its externals); returns the site's
        float value and, when its last node is a fake quant, the value before it."""
        env = run_nodes(self.module, [self.nodes[i] for i in prog.nodes], dict(values))
        out = [self.to_float(name, env[name]) for name in prog.outputs]
        last = self.nodes[prog.nodes[-1]]
        pre = [env[last.inputs[0]]] if last.op == "fake_quant" and last.inputs[0] in env else None
        return out, pre

    # -- running -----------------------------------------------------------------------------------------
    def run(self, example: Any, sink: TraceSink | None = None, same_input: SameInputSource | None = None,
            indices: dict[str, list[torch.Tensor]] | None = None, override: "SiteOverride | None" = None) -> Any:
        feeds = call_ir(self.module, example)
        if override is None and self._ablated is not None:
            return self._run_mixed(example, indices)
        if override is not None and override._inputs is None:
            override.set_inputs(feeds)
        if sink is None and indices is None and override is None:
            return self.unflatten(self.module.run(feeds))
        live: dict[str, torch.Tensor] = {}
        wanted = self._live_values(same_input) if same_input is not None else set()
        # a baseline: the earlier occurrences that a same-input run reads
        earlier = self.structure.earlier_read(self.sites) if same_input is None and sink is not None else ()
        count = [0]
        stats: dict[str, IntegerStats] = {}  # per site, until its event is sent

        def observer(node: Node, inputs: list, outs: list) -> None:
            for name, value in zip(node.inputs, inputs):
                if name in wanted:
                    live[name] = value
            i = self._index[id(node)]
            site = self.attributed[i]
            if not site or sink is None:
                return
            count_node(node, inputs, outs, stats, site, self.module.kind == "quantized", self._flat_cache)
            if self.last.get(site) == i:
                event = self.site_event(site, count[0], outs, feeds, live, same_input, stats.pop(site, None))
            elif i in earlier:
                # an earlier occurrence, for the other model's same-input run (its integer counts go to the last)
                event = self.site_event(site, count[0], outs, feeds, live, None, at=i)
            else:
                return
            sink.on_site(event)
            count[0] += 1

        def substitute(node: Node, inputs: list, outs: list):
            return self.substituted(node, outs, indices, override)

        hooks = RunHooks(observer=observer, substitute=substitute)
        return self.unflatten(self.module.run(feeds, hooks=hooks))

    def substituted(self, node: Node, outs: list, indices: dict | None, override) -> list | None:
        """The outputs a node gives in place of ``outs`` when it is the last node of its op site: that site's
        integer outputs from ``indices`` (the other model's index tensors), then ``override``'s values for the
        site (``on_site_value``, in float, put back on the node's grid); ``None`` to keep ``outs``."""
        i = self._index[id(node)]
        site = self.attributed[i]
        if not site or self.last.get(site) != i:
            return None
        new = None
        if indices is not None and site in indices:
            given = iter(indices[site])
            new = [next(given, o) if not o.is_floating_point() else o for o in outs]
        if override is not None:
            values = [self.to_float(n, o) for n, o in zip(node.outputs, new or outs)]
            replaced = override.on_site_value(site, values)
            if replaced is not None:
                new = [self.from_float(n, v) for n, v in zip(node.outputs, replaced)]
        return new


    def unflatten(self, flat: list) -> Any:
        """The model's output structure from the IR's flat outputs, in float."""
        outs = [self.to_float(name, value) for name, value in zip(self.module.graph.outputs, flat)]
        return pytree.tree_unflatten(outs, load_spec(self.module.output_spec))

    def _live_values(self, source: SameInputSource) -> set[str]:
        wanted = set()
        for site in self.sites:
            prog = self.program(site, _fused(source, site))
            # (an earlier occurrence's value is this IR's own where the baseline does not have it)
            wanted.update(name for name, where in prog.externals.items() if where is None or where.occurrence != -1)
        return wanted

    def site_event(self, site: str, index: int, outs: list, feeds: dict, live: dict,
                   same_input: SameInputSource | None, int_stats: IntegerStats | None = None,
                   at: int | None = None) -> SiteEvent:
        """The profiler's event for a site whose last node (or the node ``at`` ending an earlier occurrence)
        produced ``outs`` (with its same-input output when ``same_input`` is given); ``live`` holds this run's
        values that a site's program borrows."""
        node = self.nodes[self.last[site] if at is None else at]
        qdtype, scale = self.site_grid(site)
        values = [self.to_float(n, o) for n, o in zip(node.outputs, outs)]
        prog = self.program(site)
        first = next(iter(prog.externals.values()), None)
        event = SiteEvent(
            index=index, name=site, op_type=self.site_op_type(site), module_type=None, inputs={}, outputs=values,
            quant_dtype=qdtype, scale=scale,
            index_producing=any(not v.is_floating_point() for v in values) and qdtype == "float",
            boundary="input" if any(w is not None and w[0] == _INPUT for w in prog.externals.values()) else
            ("output" if site == "output" else ""),
            producer=first[0] if first is not None and first[0] != _INPUT else None,
            int_stats=int_stats,
            scale_axis=self.site_axis(site) if scale is not None and scale.numel() > 1 else None
        )
        if same_input is not None:
            entering = [0]
            event.set_same_input(*self._same_input(site, feeds, live, same_input, entering))
            if entering[0]:  # the baseline's NaN/Inf handed to this site's integers (not counted twice)
                event.int_stats = event.int_stats or IntegerStats()
                event.int_stats.nonfinite = max(event.int_stats.nonfinite, entering[0])
        return event

    def _same_input(self, site: str, feeds: dict, live: dict, source: SameInputSource,
                    entering: list[int] | None = None):
        prog = self.program(site, _fused(source, site))
        values, borrowed = {}, []
        heads = float_heads(self.nodes, prog.nodes, [n for n, w in prog.externals.items() if w and w.site != _INPUT])
        for name, where in prog.externals.items():
            base = None if where is None or where.site == _INPUT else _site_outputs(source, where)
            if where is None or (base is None and where.occurrence != -1 and name in live):
                # an intermediate of another site, or an earlier occurrence the baseline does not hold: this IR's own
                values[name] = live[name]
                borrowed.append(name)
            elif where.site == _INPUT:
                values[name] = feeds[name]
            else:
                # (an index input takes the baseline's indices, whatever position they have there: same_input_feed)
                given = baseline_output(base, where[1], self.program(where.site).outputs,
                                        lambda n: is_index_value(self.value_info(n))) if base else None
                if given is None:
                    return None, None, f"the baseline has no value for '{where[0]}'"
                info = self.value_info(name)
                if info is not None and not _fits(given.shape, info.shape):
                    # the site means another value in the baseline (a conv quantizing its own input, its output
                    # attributed to the fused BatchNorm's site): this IR's own value, said in the note
                    if name not in live:
                        return None, None, f"the baseline's value of '{where[0]}' has another shape"
                    values[name] = live[name]
                    borrowed.append(name)
                    continue
                if name in heads:  # read through a dequantize: the baseline's float value in place of its result
                    values[self.nodes[prog.nodes[heads[name]]].outputs[0]] = inputs_to(given, self.module.device)
                    continue
                if entering is not None and info is not None and info.qdtype:  # quantized to this IR's integers
                    entering[0] += nonfinite_count(given)
                values[name] = self.from_float(name, inputs_to(given, self.module.device))  # (trace: on the CPU)
        skipped = {prog.nodes[k] for name, k in heads.items() if name not in values}  # (the dequantizes fed past)
        out, pre = self.run_program(Program(prog.site, [i for i in prog.nodes if i not in skipped], prog.externals,
                                            prog.outputs), values)
        note = f"inputs {borrowed} are this model's own" if borrowed else ""
        return out, pre, note

    # -- ablation (sensitivity) --------------------------------------------------------------------------
    _ablated: set[str] | None = None

    def quantizers(self, analysis_type: AnalysisType) -> list[Quantizer]:
        """One unit per op site that computes (the IR's value of that site replaces the reference's)."""
        if self.reference is None:
            raise QuantLensError(
                "sensitivity() of an IR model needs the reference model of the analysis (QuantAnalysis sets it)."
            )
        out = []
        for site in self.sites:
            op = IR_OPS.get(self.site_op_type(site))
            qdtype, _ = self.site_grid(site)
            # a site that rounds onto its own grid counts (a ReLU carrying a fused group's fake quant), and so
            # does any computing op; pure data movement on the input's grid and stubs do not
            if op is None or op.category is Category.BOUNDARY or (
                    qdtype == "float" and op.category in (Category.MOVEMENT, Category.INDEX)):
                continue
            out.append(Quantizer(site, "activation", self.site_op_type(site), qdtype))
        return out

    @contextmanager
    def ablation(self, analysis_type: AnalysisType):
        self._ablated = set()

        def enable(q: Quantizer, on: bool = True) -> None:
            (self._ablated.add if on else self._ablated.discard)(q.op_name)

        try:
            yield enable
        finally:
            self._ablated = None

    def ablation_cache(self, analysis_type: AnalysisType, example: Any, indices):
        """A runner of cached ablation runs (:mod:`.ablation`): the reference model's cached forwards in
        which the ablated site takes this IR's value; None where the reference is not cached."""
        ref = self.reference
        if isinstance(ref, IRModelAccess):
            cache = IRAblationCache(ref, example, indices)
        else:
            factory = getattr(ref, "reference_cache", None)
            cache = factory(example, indices) if factory is not None else None
        if cache is None:
            return None
        inputs = call_ir(self.module, example)

        def override(sites: set[str]) -> SiteOverride:
            replace = SiteOverride(self, set(sites))
            replace.set_inputs(inputs)
            return replace

        if isinstance(ref, IRModelAccess):
            return IRCachedAblations(cache, override)
        return CachedAblations(cache, lambda q: {q.op_name}, override)

    def _run_mixed(self, example: Any, indices) -> Any:
        """The reference model's run in which the enabled sites take this IR's value."""
        override = SiteOverride(self, set(self._ablated))
        override.set_inputs(call_ir(self.module, example))
        return self.reference.run(example, indices=indices, override=override)


def _fused(source: SameInputSource | None, site: str) -> frozenset[str]:
    members = getattr(source, "fused_members", None)
    return frozenset(members(site)) if members is not None else frozenset()


def _site_outputs(source: SameInputSource, where: Source) -> list[torch.Tensor] | None:
    """The baseline's value of ``where``'s site at its occurrence (an earlier one only from a source keeping them
    all: ``TraceReader.site_outputs(site, occurrence)``)."""
    getter = getattr(source, "site_outputs", None)
    if getter is None:
        return None
    if where.occurrence == -1:
        return getter(where.site)
    return getter(where.site, occurrence=where.occurrence) if hasattr(source, "occurrence_count") else None


def _fits(shape, static) -> bool:
    """A baseline value's shape against an IR value's static shape (a dynamic dim, not an int >= 0, fits any)."""
    if static is None:
        return True
    return len(shape) == len(static) and all(not isinstance(d, int) or d < 0 or d == n for n, d in zip(shape, static))
