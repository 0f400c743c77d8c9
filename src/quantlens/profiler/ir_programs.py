"""What an op site computes in an IR (see :mod:`.ir_access`): the *occurrences* of a site that runs several times
in one forward, and its *program*, the nodes of its last occurrence with the values they take from outside.

A recurrent layer's time steps carry the same op sites, so one site is several stretches of nodes. An occurrence
ends at a node with the op of the site's last node whose value another site reads (or that is a model output);
an IR without repeated sites has one occurrence per site, ending at its last node. Occurrences are counted from
the end (-1 the last, -2 the one before): a first step that export folded into constants (a zero initial state)
has nodes in the qat IR but none in the quantized IR, so counting from the start would pair different steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from quantlens.compiler.host_ops import node_draws_random
from quantlens.compiler.ir import Node

__all__ = ["INPUT", "Source", "Program", "SitePrograms", "attribute_sites"]

#: pseudo producer of a model input (the same tensor on both sides of an analysis)
INPUT = "<input>"


class Source(NamedTuple):
    """Where a program's outside value comes from: ``output`` of ``site`` at its ``occurrence`` (counted from the
    end: -1 is the last, -2 the one before), or ``(INPUT, name)`` for a model input."""

    site: str
    output: Any
    occurrence: int = -1


@dataclass
class Program:
    """What one op site computes in an IR (its last occurrence): its nodes, the values it takes from outside
    (value name -> :class:`Source`, ``None`` when the value is an intermediate of another site), and the names
    of its value."""

    site: str
    nodes: list[int]
    externals: dict[str, Source | None]
    outputs: list[str]


class SitePrograms:
    """The occurrences and programs of an IR's op sites. ``attributed``: each node's site (``""``: none);
    ``last``: each site's last node."""

    def __init__(self, nodes: list[Node], attributed: list[str], last: dict[str, int], graph_outputs: list[str],
                 constants: dict[str, Any]):
        self.nodes, self.attributed, self.last, self.constants = nodes, attributed, last, constants
        self.producer = {out: i for i, node in enumerate(nodes) for out in node.outputs}
        #: the nodes ending each occurrence of a site, in order (the last one is ``last[site]``)
        self.ends = self._occurrence_ends(graph_outputs)
        #: node ending an occurrence -> (its site, the occurrence counted from the end)
        self.end_of = {i: (site, k - len(ends)) for site, ends in self.ends.items() for k, i in enumerate(ends)}
        self._programs: dict[tuple[str, frozenset], Program] = {}

    def _occurrence_ends(self, graph_outputs: list[str]) -> dict[str, list[int]]:
        nodes, attributed, last, producer = self.nodes, self.attributed, self.last, self.producer
        read = {producer[name] for i, node in enumerate(nodes) for name in node.inputs
                if name in producer and attributed[producer[name]] != attributed[i]}
        read |= {producer[name] for name in graph_outputs if name in producer}
        ends: dict[str, list[int]] = {site: [] for site in last}
        for i in sorted(read):
            site = attributed[i]
            if site in last and i < last[site] and nodes[i].op == nodes[last[site]].op and \
                    len(nodes[i].outputs) == len(nodes[last[site]].outputs):
                ends[site].append(i)
        for site, i in last.items():
            ends[site].append(i)
        return ends

    def program(self, site: str, fused: frozenset[str] = frozenset()) -> Program:
        """The nodes of the site's last occurrence (and of the ``fused`` sites' nodes feeding it, and of the nodes of
        no site between it and other sites) and their outside values: an earlier occurrence of a site (the site's
        own included) is an outside value."""
        key = (site, fused)
        if key in self._programs:
            return self._programs[key]
        members = {site} | set(fused)
        nodes, todo = set(), [self.last[site]]
        while todo:  # back from the site's value through its members' nodes, up to earlier occurrences
            i = todo.pop()
            if i in nodes:
                continue
            nodes.add(i)
            for name in self.nodes[i].inputs:
                p = self.producer.get(name) if name and name not in self.constants else None
                # a node of no site (index math on the host: the reshape, sort and floor division of a router's
                # top-k indices) is recomputed here from the site values it reads, so that a same-input run feeds
                # such an op the baseline's indices, not this IR's own
                # (a random draw is not recomputed: it would draw other numbers than the run it stands for)
                if p is not None and (self.attributed[p] in members
                                      or not self.attributed[p] and not node_draws_random(self.nodes[p])) \
                        and self.end_of.get(p, ("", -1))[1] == -1:
                    todo.append(p)
        order = sorted(nodes)
        inside = {out for i in order for out in self.nodes[i].outputs}
        externals: dict[str, Source | None] = {}
        for i in order:
            for name in self.nodes[i].inputs:
                if not name or name in inside or name in self.constants or name in externals:
                    continue
                p = self.producer.get(name)
                end = self.end_of.get(p) if p is not None else None
                externals[name] = Source(INPUT, name) if p is None else \
                    None if end is None else Source(end[0], self.nodes[p].outputs.index(name), end[1])
        prog = Program(site, order, externals, list(self.nodes[self.last[site]].outputs))
        self._programs[key] = prog
        return prog

    def earlier_read(self, sites: list[str]) -> frozenset[int]:
        """The nodes ending an earlier occurrence that a program of ``sites`` reads, with the later occurrences of
        their site (so that a trace holding them pairs occurrences counted from the end)."""
        first: dict[str, int] = {}
        for site in sites:
            for where in self.program(site).externals.values():
                if where is not None and where.occurrence < -1:
                    first[where.site] = min(first.get(where.site, -1), where.occurrence)
        return frozenset(i for site, k in first.items() for i in self.ends[site][k:-1])


def attribute_sites(nodes: list[Node]) -> list[str]:
    """Each node's op site: its own, or the fused member it requantizes to (``output_site``). A site left with
    nothing but the quantize of a model input once its compute moved to a fused member (a model without a
    QuantStub: the first conv's input is quantized at the conv's site) goes with it, so the site's name keeps
    one meaning on both sides of ``convert`` (the qat IR never holds that site with the quantize alone)."""
    attributed = [n.attrs.get("output_site") or n.site for n in nodes]
    moved: dict[str, str] = {}
    for n, site in zip(nodes, attributed):
        if site != n.site and n.site:
            moved.setdefault(n.site, site)
    left: dict[str, list[int]] = {}
    for i, site in enumerate(attributed):
        if site in moved:
            left.setdefault(site, []).append(i)
    for site, members in left.items():
        if all(nodes[i].op == "quantize" for i in members):
            for i in members:
                attributed[i] = moved[site]
    return attributed
