"""The cached ablation forwards of a prepared torch model (see :mod:`quantlens.profiler.ablation`): a reference
forward with every quantizer off keeps each op site's output, and an ablation forward hands out the cached value
at every op site its quantizers do not reach (a module site's ``forward`` does not run, a function op is not
called)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.profiler.ablation.base import Budget, CacheUnusable, default_max_bytes
from quantlens.profiler.index_ops import IndexOpMode
from quantlens.profiler.torch_probe import Probe
from quantlens.quantization.runtime import Runtime, emulator_for, tensor_leaves
from quantlens.quantization.state import use_runtime
from quantlens.sites.record import call_model
from quantlens.sites.tracer import TensorMarks, is_float_tensor, module_qualnames

__all__ = ["TorchAblationCache", "CachedAblations"]

_SIMPLE = (int, float, bool, str, type(None), slice, torch.dtype, torch.device, type(Ellipsis), torch.layout,
           torch.memory_format, complex)
#: copies of values made outside op sites (compared bitwise) are kept up to this size each
_MAX_COPY_BYTES = 16 << 20


class _Entry:
    __slots__ = ("output", "leaves", "versions", "marks")

    def __init__(self, output: Any, leaves: list[torch.Tensor], marks: list):
        self.output = output
        self.leaves = leaves
        self.versions = [t._version for t in leaves]
        self.marks = marks


def _tensors(output: Any) -> list[torch.Tensor]:
    return [x for x in tensor_leaves(output) if isinstance(x, torch.Tensor)]


class TorchAblationCache:
    """The cached ablation forwards of a prepared torch model (see :mod:`quantlens.profiler.ablation`)."""

    def __init__(self, access, example: Any, indices: dict | None, max_bytes: int | None = None):
        self.access = access
        self.model: nn.Module = access.model
        self.state = access.state
        self.example = access.on_device(example)
        self.indices = indices
        self.entries: dict[tuple[str, int], _Entry] = {}
        #: per site occurrence, the inputs of the reference forward: (spec, [(kind, ref)]), None: never clean
        self.sigs: dict[tuple[str, int], tuple | None] = {}
        self.budget = Budget(default_max_bytes() if max_bytes is None else max_bytes)
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
        return emulator_for(state) is None and not getattr(state, "scale_groups", None)

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
                mode = IndexOpMode(self.indices) if self.indices else _Null()  # {}: nothing to replace
                with mode, use_runtime(self.model, runtime):
                    return call_model(self.model, self.example)
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


class _CachingRuntime(Runtime):
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

