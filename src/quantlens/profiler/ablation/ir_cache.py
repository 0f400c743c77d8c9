"""The cached ablation runs of an IR reference model (``convert`` on a qat IR baseline, see
:mod:`quantlens.profiler.ablation`): the IR's data flow is explicit, so only the nodes downstream of the replaced
site run and every other node takes its cached outputs (the interpreter's kernel override)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from quantlens.profiler.ablation.base import Budget, default_max_bytes
from quantlens.profiler.ir_module import call_ir

__all__ = ["IRAblationCache", "IRCachedAblations"]


class IRCachedAblations:
    """:class:`~.torch_cache.CachedAblations` for an IR reference (:class:`IRAblationCache`): a quantizer is one
    op site whose value the analysis IR hands the reference run (``override(sites)``). The IR's data flow is
    explicit, so the outputs each site reaches are known exactly: a shared run's outputs are attributed from that,
    by position."""

    def __init__(self, cache: "IRAblationCache", override: Callable[[set[str]], Any]):
        self.cache = cache
        self.override = override
        self._positions: dict[int, int] = {}  # id(output tensor) -> graph output position, of the latest run
        self._owner: dict[int, int] = {}  # graph output position -> position in qs of the site reaching it

    def run(self, q) -> Any:
        return self.cache.run({q.op_name}, self.override({q.op_name}))

    @property
    def reference(self) -> Any:
        return self.cache.reference

    def producer(self, tensor: Any) -> int | None:
        leaves = pytree.tree_leaves(self.cache.reference)
        return next((i for i, t in enumerate(leaves) if t is tensor), None)

    def reached(self, q) -> set[int]:
        return self.cache.reached({q.op_name})

    def run_shared(self, qs: list) -> Any:
        sites = {q.op_name for q in qs}
        out = self.cache.run(sites, self.override(sites))
        self._positions = {id(t): i for i, t in enumerate(pytree.tree_leaves(out))}
        self._owner = {}
        for pos, q in enumerate(qs):
            for i in self.cache.reached({q.op_name}):
                self._owner[i] = -1 if i in self._owner else pos  # -1: two of them (the plan never does that)
        return out

    def taint(self, tensor: Any) -> frozenset[int] | None:
        i = self._positions.get(id(tensor))
        if i is None:
            return None
        owner = self._owner.get(i)
        return frozenset() if owner is None else (None if owner < 0 else frozenset({owner}))


class IRAblationCache:
    """The cached ablation runs of an IR reference model: only the nodes downstream of the replaced site run."""

    def __init__(self, access, example: Any, indices: dict | None, max_bytes: int | None = None):
        self.access = access
        self.indices = indices
        self.feeds = call_ir(access.module, example)
        self.budget = Budget(default_max_bytes() if max_bytes is None else max_bytes)
        self.cached: dict[int, list] = {}
        nodes = access.nodes
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(nodes):
            for name in node.inputs:
                if name:
                    self.consumers[name].append(i)
        self._downstream: dict[str, frozenset[int]] = {}
        #: the reference run's output; each graph output's producing node (None: an input or a constant)
        self.reference = self._run(frozenset(), None, recording=True)
        made_by = {name: i for i, node in enumerate(nodes) for name in node.outputs}
        self.output_nodes = [made_by.get(name) for name in access.module.graph.outputs]

    def reached(self, sites: set[str]) -> set[int]:
        """The graph outputs (by position) that take a value of ``sites``: exact, the IR's data flow is
        explicit."""
        nodes = set()
        for site in sites:
            nodes |= self.downstream(site)
            if site in self.access.last:
                nodes.add(self.access.last[site])
        return {i for i, n in enumerate(self.output_nodes) if n is not None and n in nodes}

    def downstream(self, site: str) -> frozenset[int]:
        """The nodes that take (transitively) a value of the site's last node."""
        if site not in self._downstream:
            nodes = self.access.nodes
            start = self.access.last.get(site)
            seen: set[int] = set()
            todo = list(nodes[start].outputs) if start is not None else []
            while todo:
                for j in self.consumers.get(todo.pop(), ()):
                    if j not in seen:
                        seen.add(j)
                        todo.extend(nodes[j].outputs)
            self._downstream[site] = frozenset(seen)
        return self._downstream[site]

    def run(self, affected: set[str], override: Any = None) -> Any:
        dirty = frozenset().union(*(self.downstream(s) for s in affected)) if affected else frozenset()
        return self._run(dirty, override, recording=False)

    def _run(self, dirty: frozenset[int], override: Any, recording: bool) -> Any:
        from quantlens.compiler.interpreter import RunHooks

        access, indices, cached = self.access, self.indices, self.cached
        index = access._index
        if override is not None and override._inputs is None:
            override.set_inputs(self.feeds)

        def kernel(node, inputs):
            if recording:
                return None
            i = index[id(node)]
            return cached.get(i) if i not in dirty else None

        def substitute(node, inputs, outs):  # as IRModelAccess.run does it, recording what the nodes give
            i = index[id(node)]
            new = access.substituted(node, outs, indices, override)
            if recording:
                final = list(new or outs)
                tensors = [t for t in final if isinstance(t, torch.Tensor)]
                if len(tensors) == len(final) and self.budget.take(tensors):
                    cached[i] = final
            return new

        hooks = RunHooks(override=kernel, substitute=substitute)
        return access.unflatten(access.module.run(self.feeds, hooks=hooks))
