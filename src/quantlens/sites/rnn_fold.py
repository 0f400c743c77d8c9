"""Folding the time steps of a recurrent layer at export: ``torch.export`` traces three, the IR repeats the rest.

``rnn.py`` unrolls ``nn.LSTM`` / ``nn.GRU`` into one set of gate ops per time step, every step with the same op
sites. Eagerly that is what the NPU computes, but ``torch.export`` pays a few milliseconds per traced op (fake
tensors, functionalization, proxies, stack traces; twice, as ``run_decompositions`` traces the graph again), so
a 3-layer LSTM over 160 steps (~15,000 ops) took many minutes to export while the steps are all alike.

Under ``quantlens.compiler.export`` (the op-site annotations on, inside ``torch.export``), a layer direction of
more than ``TRACED_STEPS`` steps is therefore traced for its first three iterations only, each tagged
``node.meta["custom"][STEP_META] = "<key>/<iteration>"``. The remaining iterations become one placeholder op,
``torch.ops.quantlens.recurrent_steps`` (shapes only), whose lowering (``compiler/lowering/recurrence.py``)
checks that iterations 1 and 2 lowered to the same IR up to renaming (iteration 0 may differ: its state can
enter from outside the layer) and appends a copy of iteration 2's IR nodes per remaining iteration: same ops,
same op sites, same attributes (an integer attribute that moves from iteration 1 to 2, such as the step's
``select`` index, moves on by the same amount), the state wired from the previous copy. The IR is the one a full
trace gives, up to value names: one node per gate op and time step, each carrying its step's op site.

:func:`unrolled_export` turns folding off (every step traced), as the reference the tests compare against.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import is_fake

from quantlens.errors import QuantLensError
from quantlens.sites.source_location import ForwardTracer

__all__ = ["STEP_META", "TRACED_STEPS", "folds", "run_folded", "unrolled_export", "recurrent_steps"]

#: ``node.meta["custom"]`` key of the fx nodes of a traced iteration: ``"<key>/<iteration>"``
STEP_META = "quantlens_recurrent_step"
#: iterations traced before the rest are folded: 0 (may differ), 1 (the template) and 2 (its check)
TRACED_STEPS = 3

_KEYS = itertools.count()
_FOLDING = [True]


@contextlib.contextmanager
def unrolled_export() -> Iterator[None]:
    """Exports inside trace every time step of a recurrent layer (slow; the reference for the folded IR)."""
    saved = _FOLDING[0]
    _FOLDING[0] = False
    try:
        yield
    finally:
        _FOLDING[0] = saved


@torch.library.custom_op("quantlens::recurrent_steps", mutates_args=())
def recurrent_steps(state_in: list[torch.Tensor], state_mid: list[torch.Tensor], state_out: list[torch.Tensor],
                    xs: list[torch.Tensor], key: int, repeats: int) -> list[torch.Tensor]:
    """Placeholder for ``repeats`` more iterations of a traced recurrence: the states after iterations 0, 1 and
    2, the per-iteration inputs of iterations 1... (a layer fed by the previous layer's steps; else empty), and
    the key of the traced iterations. Returns the states after each further iteration, flat. Only export's
    lowering expands it; it has no eager computation."""
    raise QuantLensError(
        "torch.ops.quantlens.recurrent_steps is a placeholder that quantlens.compiler.export puts in a traced "
        "graph for the folded time steps of an LSTM/GRU; only export's lowering expands it. Export the prepared "
        "model with quantlens.compiler.export, or trace it inside quantlens.sites.rnn_fold.unrolled_export()."
    )


@recurrent_steps.register_fake
def _recurrent_steps_fake(state_in, state_mid, state_out, xs, key, repeats):
    return [torch.empty_like(s) for _ in range(repeats) for s in state_out]


def folds(tracer: ForwardTracer, length: int, state: list) -> bool:
    """Whether a layer direction of ``length`` steps is folded: long enough, inside quantlens' export (sites
    annotated) while ``torch.export`` traces it (its tensors are fake; the eager pass of export, like every traced
    forward, also answers ``torch.compiler.is_exporting()`` with True, see the tracer)."""
    return (_FOLDING[0] and length > TRACED_STEPS and type(tracer).annotate_sites
            and any(is_fake(s) for s in state))


def run_folded(tracer: ForwardTracer, run_step: Callable[[int, list], list], order: list[int], state: list,
               xs: list) -> list[list]:
    """The states after each iteration over ``order`` (time indices): ``run_step(t, state)`` traced for the first
    ``TRACED_STEPS``, one ``recurrent_steps`` placeholder for the rest. ``xs``: the inputs of iterations 1...
    when the layer's input is a list of steps (else empty: each step selects its input from a tensor)."""
    key = next(_KEYS)
    after: list[list] = []
    for i, t in enumerate(order[:TRACED_STEPS]):
        with fx_traceback.annotate({STEP_META: f"{key}/{i}"}):
            state = list(run_step(t, state))
        after.append(state)
    repeats = len(order) - TRACED_STEPS
    tracer.internal += 1  # the placeholder is no op site
    try:
        flat = torch.ops.quantlens.recurrent_steps(after[0], after[1], after[2], list(xs), key, repeats)
    finally:
        tracer.internal -= 1
    # each further state is on the grid of the same state after iteration 2: the ops after the layer (stack,
    # the next layer's first steps, the user's code) see the marks a full trace gives them
    marks = getattr(tracer.handler, "marks", None)
    n = len(state)
    for j in range(repeats):
        step = list(flat[j * n:(j + 1) * n])
        if marks is not None:
            for src, dst in zip(after[2], step):
                if src in marks:
                    marks.set(dst, marks.get(src))
        after.append(step)
    return after
