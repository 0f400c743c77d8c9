"""Lowering the folded time steps of a recurrent layer (``sites/rnn_fold.py``).

``torch.export`` traced iterations 0, 1 and 2 of the layer (their fx nodes tagged ``"<key>/<i>"``) and one
``quantlens::recurrent_steps`` placeholder for the rest. By the time the driver reaches the placeholder, the
three iterations are lowered: the IR nodes of an iteration are those from the first to the last node emitted for
its fx nodes (an iteration runs as one stretch of the trace). Iteration 1 is the template; iteration 2 must be
the same IR up to renaming:

* each input of a node is one of: a value of the same iteration (same producer position and output index), the
  recurrent state (position ``k`` of the state list entering the iteration), the iteration's input (a layer fed
  by the previous layer's steps), or a fixed value (the same name, or constants of equal value: weights, scales,
  tables, the input sequence a step selects from);
* ops, op sites and attributes are equal, except integer attributes, which must move by a fixed amount per
  iteration (a step's ``select`` index: +1, or -1 for the reverse direction);
* the state after the iteration comes from the same node and output.

Then one copy of the template per remaining iteration is appended, the state wired from copy to copy. A mismatch
is a quantlens bug, reported with the op site; ``rnn_fold.unrolled_export()`` exports without folding.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from quantlens.compiler.graph import Node
from quantlens.compiler.lowering.rules import LoweringContext, normalized, register_lowering, value_of
from quantlens.errors import QuantLensError
from quantlens.sites.rnn_fold import STEP_META

__all__ = ["lower_recurrent_steps"]

_NO_INPUT = ("none",)


@dataclass
class _Template:
    nodes: list[Node]  # the IR nodes of iteration 1
    inputs: list[list[tuple]]  # per node, per input: ("local", pos, out) | ("state", k) | ("x",) | ("fixed", name)
    deltas: list[dict[str, int]]  # per node: integer attribute -> its change per iteration
    state_outputs: list[tuple[int, int]]  # state k after the iteration: (node position, output index)


def _names(ctx: LoweringContext, values) -> list[str]:
    return [value_of(ctx, v) for v in values]


def _iteration_nodes(ctx: LoweringContext, node: fx.Node, key: int, iteration: int, position: dict[str, int]) -> list[int]:
    """Positions in the IR of the nodes lowered from one traced iteration (first to last)."""
    tag = f"{key}/{iteration}"
    found = []
    for n in node.graph.nodes:
        if (n.meta.get("custom") or {}).get(STEP_META) != tag or n not in ctx.names:
            continue
        names = ctx.names[n]
        for name in names if isinstance(names, list) else [names]:
            if isinstance(name, str) and name in position:
                found.append(position[name])
    if not found:
        raise QuantLensError(f"export: the traced time steps of a recurrent layer (iteration {iteration}, before "
                             f"{node.name}) lowered to no IR node; please report this.")
    return list(range(min(found), max(found) + 1))


def _classify(nodes: list[Node], state: list[str], x: str | None) -> list[list[tuple]]:
    local: dict[str, tuple[int, int]] = {}
    result = []
    for pos, n in enumerate(nodes):
        kinds = []
        for name in n.inputs:
            if not name:
                kinds.append(_NO_INPUT)
            elif name in local:
                kinds.append(("local", *local[name]))
            elif name in state:
                kinds.append(("state", state.index(name)))
            elif x is not None and name == x:
                kinds.append(("x",))
            else:
                kinds.append(("fixed", name))
        result.append(kinds)
        for j, out in enumerate(n.outputs):
            local[out] = (pos, j)
    return result


def _same_constant(ctx: LoweringContext, a: str, b: str) -> bool:
    c = ctx.graph.constants
    return a in c and b in c and c[a].dtype == c[b].dtype and c[a].shape == c[b].shape and bool(torch.equal(c[a], c[b]))


def _deltas(a: Node, b: Node) -> dict[str, int] | None:
    if a.attrs.keys() != b.attrs.keys():
        return None
    deltas = {}
    for name, value in a.attrs.items():
        other = b.attrs[name]
        if value == other:
            continue
        if type(value) is not int or type(other) is not int:
            return None
        deltas[name] = other - value
    return deltas


def _mismatch(a: Node, b: Node, what: str) -> QuantLensError:
    return QuantLensError(
        f"export: two time steps of a recurrent layer lowered to different IR at op site '{a.site}' ({what}: "
        f"{a!r} vs {b!r}), so the remaining steps cannot be repeated from one traced step. Please report this; "
        "meanwhile export inside quantlens.sites.rnn_fold.unrolled_export(), which traces every step."
    )


def _template(ctx: LoweringContext, first: list[Node], second: list[Node], states: tuple[list[str], list[str], list[str]],
              xs: list[str]) -> _Template:
    """Iteration 1 as a template, checked against iteration 2."""
    if len(first) != len(second):
        raise _mismatch(first[0], second[0], f"{len(first)} vs {len(second)} nodes")
    ins_a = _classify(first, states[0], xs[0] if xs else None)
    ins_b = _classify(second, states[1], xs[1] if xs else None)
    deltas = []
    for a, b, ka, kb in zip(first, second, ins_a, ins_b):
        if (a.op, a.site, len(a.outputs)) != (b.op, b.site, len(b.outputs)):
            raise _mismatch(a, b, "op, op site or outputs")
        for i, (x, y) in enumerate(zip(ka, kb)):
            if x != y and not (x[0] == y[0] == "fixed" and _same_constant(ctx, x[1], y[1])):
                raise _mismatch(a, b, f"input {i}")
        if len(ka) != len(kb):
            raise _mismatch(a, b, "inputs")
        for out_a, out_b in zip(a.outputs, b.outputs):
            va, vb = ctx.graph.values.get(out_a), ctx.graph.values.get(out_b)
            if (va and (va.shape, va.dtype)) != (vb and (vb.shape, vb.dtype)):
                raise _mismatch(a, b, "output type")
        delta = _deltas(a, b)
        if delta is None:
            raise _mismatch(a, b, "attributes")
        deltas.append(delta)
    outputs = {out: (pos, j) for pos, n in enumerate(first) for j, out in enumerate(n.outputs)}
    outputs_b = {out: (pos, j) for pos, n in enumerate(second) for j, out in enumerate(n.outputs)}
    state_outputs = [outputs.get(s) for s in states[1]]
    if None in state_outputs or state_outputs != [outputs_b.get(s) for s in states[2]]:
        raise _mismatch(first[-1], second[-1], "the state after the step")
    return _Template(first, ins_a, deltas, state_outputs)


def _fresh(ctx: LoweringContext, name: str, iteration: int) -> str:
    new = f"{name}_r{iteration}"
    while new in ctx.graph.values:
        new = ctx.fresh(new)
    return new


def _copy_attrs(attrs: dict[str, Any], deltas: dict[str, int], steps: int) -> dict[str, Any]:
    out = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else copy.deepcopy(v)) for k, v in attrs.items()}
    for name, delta in deltas.items():
        out[name] = attrs[name] + delta * steps
    return out


def _repeat(ctx: LoweringContext, template: _Template, state: list[str], xs: list[str], repeats: int) -> list[str]:
    """Append one copy of the template per further iteration (3, 4, ...); the states after each, flat."""
    results: list[str] = []
    for iteration in range(3, 3 + repeats):
        outs: list[list[str]] = []
        for node, kinds, deltas in zip(template.nodes, template.inputs, template.deltas):
            inputs = []
            for kind in kinds:
                if kind[0] == "local":
                    inputs.append(outs[kind[1]][kind[2]])
                elif kind[0] == "state":
                    inputs.append(state[kind[1]])
                elif kind[0] == "x":
                    inputs.append(xs[iteration - 1])
                else:
                    inputs.append(kind[1] if kind[0] == "fixed" else "")
            names = [_fresh(ctx, out, iteration) for out in node.outputs]
            for old, new in zip(node.outputs, names):
                if old in ctx.graph.values:
                    ctx.graph.values[new] = dataclasses.replace(ctx.graph.values[old])
            ctx.graph.nodes.append(Node(node.op, inputs, names, _copy_attrs(node.attrs, deltas, iteration - 1),
                                        node.site))
            outs.append(names)
        state = [outs[pos][j] for pos, j in template.state_outputs]
        results.extend(state)
    return results


def lower_recurrent_steps(ctx: LoweringContext, node: fx.Node) -> None:
    """``recurrent_steps(state_in, state_mid, state_out, xs, key, repeats)``: the folded iterations, unrolled."""
    bound = normalized(node)
    states = tuple(_names(ctx, bound[k]) for k in ("state_in", "state_mid", "state_out"))
    xs = _names(ctx, bound["xs"])
    position = {out: i for i, n in enumerate(ctx.graph.nodes) for out in n.outputs}
    first, second = (_iteration_nodes(ctx, node, bound["key"], i, position) for i in (1, 2))
    template = _template(ctx, [ctx.graph.nodes[i] for i in first], [ctx.graph.nodes[i] for i in second], states,
                         xs)
    ctx.names[node] = _repeat(ctx, template, states[2], xs, bound["repeats"])


register_lowering(torch.ops.quantlens.recurrent_steps.default, lower_recurrent_steps)
