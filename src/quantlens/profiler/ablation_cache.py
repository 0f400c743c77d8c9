"""Cached ablation forwards for ``sensitivity()``: each ablation computes only what its quantizer changes.

Before the first ablation, one **reference forward** runs with every quantizer off (the ablation state, with the
baseline's indices); it keeps each op site's output (the value the forward went on with). The forward of
ablation ``k`` then runs as usual, but at every op site that does not depend on quantizer ``k`` it hands out the
cached value instead of computing the op (a module site's ``forward`` does not run, a function op is not called).
An op site is taken from the cache when it is not one of the sites quantizer ``k`` acts at (the sites whose plan
uses its fake quants; for the deployed stages the one site the IR replaces; a fused group's members before such a
site compute what they computed in the reference, so a ReLU's output fake quant reuses its conv's cached value) and
every input leaf is what it was in the reference forward: a tensor produced by the same op site occurrence and
itself clean in this forward, the same parameter, a bitwise-equal tensor (model inputs, buffers, values made
outside op sites: a copy is kept), or an equal Python value. So the outputs are the same tensors the full
forward computes, and the tables are identical.

* IR references (``convert`` on a qat IR baseline): the IR's data flow is explicit, so the nodes downstream of
  site ``k``'s last node run and every other node takes its cached outputs (the interpreter's kernel override).
* Not cached (every ablation is a full forward, as before): float torch models, models prepared at a
  consistency level that emulates integer rules or shares scales (their runtime keeps per-tensor state across
  op sites), ONNX.
* In-place ops: a site whose output is one of its inputs is never taken from the cache, and a cached value
  that the reference forward changed in place later is dropped; after every ablation the cached tensors'
  version counters are checked, and a cached tensor changed by the model makes that ablation rerun as a full
  forward and switches the cache off for the rest of the run.

**Memory.** The cache holds op site outputs in execution order up to ``max_bytes`` (default 1 GiB, or
``QUANTLENS_SENSITIVITY_CACHE_MB``; storages shared by views count once); op sites beyond it are computed in
every ablation (still without recomputing what is cached before them), so the budget only trades time for
memory. It lives for one ``sensitivity()`` call.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.profiler.index_ops import IndexOpMode
from quantlens.quantization.prepare import _emulator_for, _leaves, _Runtime
from quantlens.quantization.record import call_model
from quantlens.quantization.tracer import TensorMarks, is_float_tensor, module_qualnames

__all__ = ["CacheUnusable", "TorchAblationCache", "IRAblationCache", "CachedAblations", "default_max_bytes"]


def default_max_bytes() -> int:
    return int(float(os.environ.get("QUANTLENS_SENSITIVITY_CACHE_MB", "1024")) * (1 << 20))


class CacheUnusable(Exception):
    """A cached value was changed by the model during an ablation: rerun it as a full forward."""


_SIMPLE = (int, float, bool, str, type(None), slice, torch.dtype, torch.device, type(Ellipsis), torch.layout,
           torch.memory_format, complex)
#: copies of values made outside op sites (compared bitwise) are kept up to this size each
_MAX_COPY_BYTES = 16 << 20


class _Budget:
    def __init__(self, max_bytes: int):
        self.left = max_bytes
        self.seen: set[int] = set()

    def take(self, tensors: list[torch.Tensor]) -> bool:
        new = {}
        for t in tensors:
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                return False
            if ptr not in self.seen:
                new[ptr] = storage.nbytes()
        need = sum(new.values())
        if need > self.left:
            return False
        self.left -= need
        self.seen.update(new)
        return True


class _Entry:
    __slots__ = ("output", "leaves", "versions", "marks")

    def __init__(self, output: Any, leaves: list[torch.Tensor], marks: list):
        self.output = output
        self.leaves = leaves
        self.versions = [t._version for t in leaves]
        self.marks = marks


def _tensors(output: Any) -> list[torch.Tensor]:
    return [x for x in _leaves(output) if isinstance(x, torch.Tensor)]


class TorchAblationCache:
    """The cached ablation forwards of a prepared torch model (see the module docstring)."""

    def __init__(self, access, example: Any, indices: dict | None, max_bytes: int | None = None):
        self.access = access
        self.model: nn.Module = access.model
        self.state = access.state
        self.example = access.on_device(example)
        self.indices = indices
        self.entries: dict[tuple[str, int], _Entry] = {}
        #: per site occurrence, the inputs of the reference forward: (spec, [(kind, ref)]), None: never clean
        self.sigs: dict[tuple[str, int], tuple | None] = {}
        self.budget = _Budget(default_max_bytes() if max_bytes is None else max_bytes)
        self.groups = {m: set(g.members) for g in self.state.groups for m in g.members}
        self.kwarg_modules: set[int] = set()  # module sites called with tensor keyword arguments: never cached
        records = self.state.record.sites
        modules = dict(self.model.named_modules())
        #: the module names, made once: nobody restructures the model during the ablations (the op-site tracer
        #: would walk it again in every forward)
        self.qualnames = module_qualnames(self.model)
        self.site_modules = {id(m): m for s in records.values() if s.is_module
                             for m in [modules.get(s.module_name)] if isinstance(m, nn.Module)}
        self.active: _CachingRuntime | None = None
        #: the runtime of the latest forward: its marks answer :meth:`producer` (reference) and :meth:`taint`
        self._last: _CachingRuntime | None = None
        #: the reference forward's output (its tensors are the cached values; kept for :meth:`producer`)
        self.reference = self._forward(set(), None, recording=True)
        self._reference_marks = self._last.clean
        for key, entry in list(self.entries.items()):  # changed in place later in the forward: not its output
            if [t._version for t in entry.leaves] != entry.versions:
                del self.entries[key]

    @staticmethod
    def supported(access) -> bool:
        state = access.state
        return _emulator_for(state) is None and not getattr(state, "scale_groups", None)

    def widen(self, sites: set[str]) -> set[str]:
        """The sites plus the other members of their fused groups (the shared forwards' plan and taint: a
        quantizer counts as reaching its whole group, which over-approximates and never misses)."""
        out = set(sites)
        for s in sites:
            out |= self.groups.get(s, set())
        return out

    def run(self, affected: set[str], override: Any = None, taint: dict[str, frozenset[int]] | None = None) -> Any:
        """One ablation forward in which ``affected`` op sites (and everything depending on them) compute.

        ``taint`` (shared ablations: several quantizers on in one forward) maps op sites to the ids of the
        quantizers acting there; every computed tensor then carries the ids that reached it (see :meth:`taint`)."""
        out = self._forward(set(affected), override, recording=False, taint=taint)
        for entry in self.entries.values():
            if [t._version for t in entry.leaves] != entry.versions:
                raise CacheUnusable("a cached op site output was changed in place")
        return out

    # -- shared ablations ----------------------------------------------------------------------------------
    def producer(self, tensor: Any) -> tuple[str, int] | None:
        """The op site occurrence whose output ``tensor`` is in the reference forward (None: made elsewhere)."""
        mark = self._reference_marks.get(tensor)
        return None if mark is None else (mark[0], mark[1])

    def reached(self, sites: set[str]) -> set[tuple[str, int]]:
        """The op site occurrences of the reference forward that depend on ``sites`` (widened to their fused
        groups): theirs, and every one taking a value of a reached one. An occurrence whose inputs were not
        recorded counts as depending on everything before it. (A plan: shared ablations check their result.)"""
        sites = self.widen(sites)
        out: set[tuple[str, int]] = set()
        for key, sig in self.sigs.items():  # in execution order: a value's producer comes before its users
            if key[0] in sites:
                hit = True
            elif sig is None:
                hit = bool(out)
            else:
                hit = any(kind == "s" and (ref[0], ref[1]) in out for kind, ref in sig[1])
            if hit:
                out.add(key)
        return out

    def taint(self, tensor: Any) -> frozenset[int] | None:
        """After a forward with ``taint``: the ids of the quantizers whose values reached ``tensor`` (empty for a
        cached reference value); None where that cannot be told (a tensor made outside op sites from changed
        values, or a site whose inputs cannot be matched with the reference's)."""
        runtime = self._last
        if runtime is None:
            return None
        found = runtime.taint.get(tensor)
        if found is not None:
            return found
        return frozenset() if runtime.clean.get(tensor) is not None else None

    def _forward(self, affected: set[str], override: Any, recording: bool,
                 taint: dict[str, frozenset[int]] | None = None) -> Any:
        from quantlens.profiler.torch_probe import Probe

        probe = Probe(None, None, self.indices, override)
        runtime = _CachingRuntime(self.state, self, probe, affected, recording, taint)
        self._last = runtime
        installed = []
        for module in self.site_modules.values():
            installed.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
            # the instance dict directly: nn.Module.__setattr__ costs more than a small op, once per site per run
            module.__dict__["forward"] = _stub(self, module, module.forward)
        self.active = runtime
        try:
            with self.access._profiling():
                self.state.__dict__["_next_runtime"] = runtime
                try:
                    mode = IndexOpMode(self.indices) if self.indices else _Null()  # {}: nothing to replace
                    with mode:
                        return call_model(self.model, self.example)
                finally:
                    self.state.__dict__.pop("_next_runtime", None)
        finally:
            self.active = None
            for module, had, previous in installed:
                if had:
                    module.__dict__["forward"] = previous
                else:
                    module.__dict__.pop("forward", None)


def _flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """``pytree.tree_flatten((args, kwargs))``, with a cheap spec for the common call of flat positional leaves
    (most op calls; tree_flatten costs more than the check of a cached op): ``("flat", n)``. The two kinds of
    spec never compare equal, so a call is only matched against a reference flattened the same way."""
    if not kwargs and type(args) is tuple and not any(isinstance(a, (list, tuple, dict)) for a in args):
        return list(args), ("flat", len(args))
    return pytree.tree_flatten((args, kwargs))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stub(cache: TorchAblationCache, module: nn.Module, original):
    def forward(*args, **kwargs):
        runtime = cache.active
        if runtime is not None:
            if kwargs and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(kwargs)):
                if runtime.recording:
                    cache.kwarg_modules.add(id(module))
                elif id(module) in runtime.skip:
                    raise CacheUnusable("a module site took tensor keyword arguments it did not take before")
            if id(module) in runtime.skip:
                return runtime.skip.pop(id(module))
        return original(*args, **kwargs)

    return forward


class _CachingRuntime(_Runtime):
    """The prepared model's runtime for one reference or ablation forward (index substitution and the deployed
    stages' site override as in the profiler's runtime probe, no trace)."""

    def __init__(self, state, cache: TorchAblationCache, probe, affected: set[str], recording: bool,
                 taint: dict[str, frozenset[int]] | None = None):
        super().__init__(state)
        self.cache = cache
        self.probe = probe
        self.affected = affected
        self.recording = recording
        self.occurrence: dict[str, int] = defaultdict(int)
        self.clean = TensorMarks()  # tensor -> (site occurrence key, leaf index): same as in the reference
        self.skip: dict[int, Any] = {}  # id(module) -> the cached output its forward returns
        self._pending: dict[str, tuple] = {}
        self.taint_sites = taint  # op site -> ids of the quantizers acting there (shared ablations)
        self.qualnames = cache.qualnames  # (read by the prepared model's forward: its tracer's module names)
        self.taint = TensorMarks()  # computed tensor -> the quantizer ids that reached it; absent: unknown

    def _key(self, site) -> tuple[str, int]:
        n = self.occurrence[site.name]
        self.occurrence[site.name] = n + 1
        return site.name, n

    # -- the handler ------------------------------------------------------------------------------------
    def function_op(self, site, func, args, kwargs):
        key = self._key(site)
        clean_in = self._clean_inputs(key, site, args, kwargs)
        entry = self.cache.entries.get(key) if clean_in else None
        if entry is not None:
            return self._hand_out(site, entry)
        out = super().function_op(site, func, args, kwargs)
        out = self._after(site, args, kwargs, out)
        self._done(key, site, args, kwargs, out, clean_in)
        return out

    def module_enter(self, site, args):
        key = self._key(site)
        clean_in = self._clean_inputs(key, site, args, {}) and id(site.module) not in self.cache.kwarg_modules
        entry = self.cache.entries.get(key) if clean_in else None
        self._pending[site.name] = (key, clean_in, args, entry)
        if entry is not None:
            self.skip[id(site.module)] = entry.output
            self._hand_out(site, entry)
            return None
        return super().module_enter(site, args)

    def module_exit(self, site, args, output):
        key, clean_in, original, entry = self._pending.pop(site.name)
        if entry is not None:
            self.skip.pop(id(site.module), None)
            return entry.output
        out = super().module_exit(site, args, output)
        out = self._after(site, original, {}, out)
        self._done(key, site, original, {}, out, clean_in)
        return out

    # -- substitution (as the runtime probe does it) ----------------------------------------------------
    def _after(self, site, args, kwargs, out):
        new = self.probe.substitute(site, args, kwargs, out)
        if new is not out:
            if site.rule.index_producing:
                leaves = pytree.tree_leaves((args, kwargs))
                src = next((x for x in leaves if is_float_tensor(x) and not isinstance(x, nn.Parameter)), None)
            else:
                src = out
            self._set_marks(new, self._mark(src) if src is not None else None)
            out = new
        return out

    # -- the cache ---------------------------------------------------------------------------------------
    def _clean_inputs(self, key, site, args, kwargs) -> bool:
        if self.recording:
            return True
        if site.name in self.affected:
            return False
        sig = self.cache.sigs.get(key)
        if sig is None:
            return False
        spec, items = sig
        leaves, s = _flatten(args, kwargs)
        if len(leaves) != len(items) or s != spec:
            return False
        for leaf, (kind, ref) in zip(leaves, items):
            if kind == "s":
                if not isinstance(leaf, torch.Tensor) or self.clean.get(leaf) != ref:
                    return False
            elif kind == "p":
                if leaf is not ref:
                    return False
            elif kind == "v":
                if not isinstance(leaf, torch.Tensor) or leaf.dtype != ref.dtype or leaf.shape != ref.shape or \
                        leaf.device != ref.device or not torch.equal(leaf, ref):
                    return False
            elif type(leaf) is not type(ref) or leaf != ref:
                return False
        return True

    def _reached_by(self, key, site, args, kwargs) -> frozenset[int] | None:
        """The quantizer ids reaching a computed site's output: those acting at the site and those reaching its
        inputs. An input that is neither a cached reference value, nor a tracked computed one, nor equal to the
        reference forward's input there makes it unknown (None)."""
        found = set(self.taint_sites.get(site.name, ()))
        sig = self.cache.sigs.get(key)
        leaves, spec = _flatten(args, kwargs)
        items = sig[1] if sig is not None and sig[0] == spec and len(sig[1]) == len(leaves) else None
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, nn.Parameter):
                continue
            if isinstance(leaf, torch.Tensor):
                upstream = self.taint.get(leaf)
                if upstream is not None:
                    found |= upstream
                    continue
                if self.clean.get(leaf) is not None:
                    continue
            if items is None:
                return None
            kind, ref = items[j]
            if kind == "v" and isinstance(leaf, torch.Tensor):
                if leaf.dtype == ref.dtype and leaf.shape == ref.shape and torch.equal(leaf, ref):
                    continue
                return None
            if kind == "c" and type(leaf) is type(ref) and leaf == ref:
                continue
            return None
        return frozenset(found)

    def _hand_out(self, site, entry: _Entry) -> Any:
        self.visited.append(site.name)
        for i, (leaf, fq) in enumerate(zip(entry.leaves, entry.marks)):
            if leaf.is_floating_point():
                self.marks.set(leaf, fq)
            self.clean.set(leaf, (site.name, self.occurrence[site.name] - 1, i))
        override = self.probe.override
        if override is not None:  # the override sees every site's value (a later site's program may take it)
            out = entry.output
            override.on_site_value(site.name, [out] if isinstance(out, torch.Tensor) else list(entry.leaves))
        return entry.output

    def _done(self, key, site, args, kwargs, out, clean_in: bool) -> None:
        leaves = _tensors(out)
        if self.recording:
            self.cache.sigs[key] = self._signature(args, kwargs)
            inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            inplace = any(leaf is x for leaf in leaves for x in inputs)
            if not inplace and id(getattr(site, "module", None)) not in self.cache.kwarg_modules and \
                    self.cache.budget.take(leaves):
                marks = [self._mark(t) if t.is_floating_point() else None for t in leaves]
                self.cache.entries[key] = _Entry(out, leaves, marks)
        elif not clean_in:
            if self.taint_sites is not None:
                reached = self._reached_by(key, site, args, kwargs)
                if reached is not None:
                    for leaf in leaves:
                        self.taint.set(leaf, reached)
            return
        for i, leaf in enumerate(leaves):
            self.clean.set(leaf, (key[0], key[1], i))

    def _signature(self, args, kwargs) -> tuple | None:
        leaves, spec = _flatten(args, kwargs)
        items = []
        for leaf in leaves:
            if isinstance(leaf, nn.Parameter):
                items.append(("p", leaf))
            elif isinstance(leaf, torch.Tensor):
                ref = self.clean.get(leaf)
                if ref is not None:
                    items.append(("s", ref))
                    continue
                if leaf.numel() * leaf.element_size() > _MAX_COPY_BYTES or not self.cache.budget.take([leaf]):
                    return None
                items.append(("v", leaf.detach().clone()))
            elif isinstance(leaf, _SIMPLE):
                items.append(("c", leaf))
            else:
                return None
        return spec, items


class CachedAblations:
    """The ablation forwards of ``sensitivity()`` from a :class:`TorchAblationCache`: ``run(q)`` with one
    quantizer on, ``run_shared(qs)`` with several (already switched on by the caller), and what the shared
    forwards' plan and check need (the reference output, producers, reached sites, taint).

    ``acting(q)``: the op sites quantizer ``q`` acts at; ``override(sites)`` (the deployed stages): the reference
    run's value replacement at those sites (``ir_access.SiteOverride``), or None."""

    def __init__(self, cache: TorchAblationCache, acting: Callable[[Any], set[str]],
                 override: Callable[[set[str]], Any] | None = None):
        self.cache = cache
        self.acting = acting
        self.override = override

    def run(self, q) -> Any:
        sites = self.acting(q)
        return self.cache.run(sites, self.override(sites) if self.override is not None else None)

    @property
    def reference(self) -> Any:
        return self.cache.reference

    def producer(self, tensor: Any) -> tuple[str, int] | None:
        return self.cache.producer(tensor)

    def reached(self, q) -> set[tuple[str, int]]:
        return self.cache.reached(self.acting(q))

    def run_shared(self, qs: list) -> Any:
        """One forward with every quantizer of ``qs`` on; :meth:`taint` then names, by position in ``qs``, the
        quantizers that reached a tensor."""
        taint: dict[str, set[int]] = defaultdict(set)
        sites: set[str] = set()
        for i, q in enumerate(qs):
            acting = self.acting(q)
            sites |= acting
            for site in self.cache.widen(acting):
                taint[site].add(i)
        return self.cache.run(sites, self.override(sites) if self.override is not None else None,
                              taint={k: frozenset(v) for k, v in taint.items()})

    def taint(self, tensor: Any) -> frozenset[int] | None:
        return self.cache.taint(tensor)


class IRCachedAblations:
    """:class:`CachedAblations` for an IR reference (:class:`IRAblationCache`): a quantizer is one op site whose
    value the analysis IR hands the reference run (``override(sites)``). The IR's data flow is explicit, so the
    outputs each site reaches are known exactly: a shared run's outputs are attributed from that, by position."""

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
        from quantlens.profiler.ir_access import call_ir

        self.access = access
        self.indices = indices
        self.feeds = call_ir(access.module, example)
        self.budget = _Budget(default_max_bytes() if max_bytes is None else max_bytes)
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

        def substitute(node, inputs, outs):  # as IRModelAccess.run does it
            i = index[id(node)]
            site = access.attributed[i]
            new = None
            if site and access.last.get(site) == i:
                if indices is not None and site in indices:
                    given = iter(indices[site])
                    new = [next(given, o) if not o.is_floating_point() else o for o in outs]
                if override is not None:
                    values = [access.to_float(n, o) for n, o in zip(node.outputs, new or outs)]
                    replaced = override.on_site_value(site, values)
                    if replaced is not None:
                        new = [access.from_float(n, v) for n, v in zip(node.outputs, replaced)]
            if recording:
                final = list(new or outs)
                tensors = [t for t in final if isinstance(t, torch.Tensor)]
                if len(tensors) == len(final) and self.budget.take(tensors):
                    cached[i] = final
            return new

        hooks = RunHooks(override=kernel, substitute=substitute)
        return access._unflatten(access.module.run(self.feeds, hooks=hooks))
