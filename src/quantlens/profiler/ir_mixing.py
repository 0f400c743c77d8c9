"""Mixing stages (sensitivity): :class:`SiteOverride` lets another model's run take an IR's value for chosen op
sites.

The reference model (the torch model for ``export``, the qat IR for ``convert``) runs, and at the chosen
site its value is replaced by this IR's program run on the reference's own values there. A site that runs several
times is not mixed (its program is its last occurrence's, and a torch reference does not say which call is last).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quantlens.compiler.interpreter import run_nodes
from quantlens.profiler.ir_programs import INPUT as _INPUT

__all__ = ["SiteOverride"]


@dataclass
class SiteOverride:
    """Hands the chosen sites of a reference run this IR's value: the reference calls
    :meth:`on_site_value` with every site's value as it completes; the values the chosen sites' programs take
    are remembered, and at a chosen site its value is replaced by the program run on them."""

    #: the :class:`~.ir_access.IRModelAccess` whose op site programs give the values
    ir: Any
    sites: set[str]
    _needed: dict[str, set] = field(default_factory=dict)
    _seen: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self):
        self._programs = {s: self.ir.program(s) for s in self.sites if s in self.ir.last}
        self._needed = {w.site for p in self._programs.values() for w in p.externals.values()
                        if w is not None and w.site != _INPUT}
        self._inputs: dict[str, torch.Tensor] | None = None

    def on_site_value(self, site: str, values: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if site in self._needed:
            self._seen[site] = values
        prog = self._programs.get(site)
        if prog is None:
            return None
        if len(self.ir.ends[site]) > 1:
            # its program is its last occurrence's, and a reference run does not say which of its calls is the last
            return None
        feeds = {}
        for name, where in prog.externals.items():
            if where is None:  # no site made it: a value computed from the IR's inputs alone (a mask) is recomputed
                value = self._unsited(name)
                if value is None:
                    return None  # another site's intermediate: cannot be mixed, keep the reference's value
                feeds[name] = value
                continue
            if where.occurrence != -1:
                return None
            if where[0] == _INPUT:
                if self._inputs is None or name not in self._inputs:
                    return None
                feeds[name] = self._inputs[name]
            elif where[0] not in self._seen or where[1] >= len(self._seen[where[0]]):
                return None
            else:
                feeds[name] = self.ir.from_float(name, self._seen[where[0]][where[1]])
        out, _ = self.ir.run_program(prog, feeds)
        if len(out) != len(values):
            return None
        self._seen[site] = out
        return out

    def set_inputs(self, feeds: dict[str, torch.Tensor]) -> None:
        self._inputs = feeds
        self._unsited_values: dict[str, torch.Tensor | None] = {}

    def _unsited(self, name: str) -> torch.Tensor | None:
        """A value no op site produced, recomputed from this run's IR inputs when every node it takes is
        attributed to no site either (the attention mask's cast/index/expand); None otherwise."""
        if self._inputs is None:
            return None
        cache = self.__dict__.setdefault("_unsited_values", {})
        if name not in cache:
            ir, graph = self.ir, self.ir.module.graph
            needed, stack, seen = set(), [name], set()
            while stack:
                value = stack.pop()
                if value in seen or value in graph.constants or value in self._inputs:
                    continue
                seen.add(value)
                i = ir.producer.get(value)
                if i is None or ir.attributed[i]:
                    cache[name] = None
                    break
                needed.add(i)
                stack.extend(v for v in ir.nodes[i].inputs if v)
            else:
                env = run_nodes(ir.module, [ir.nodes[i] for i in sorted(needed)], dict(self._inputs))
                cache[name] = env.get(name)
        return cache[name]
