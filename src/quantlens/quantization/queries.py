"""Questions asked of a prepared model by running it: which op sites one forward visits (:func:`last_sites`,
:func:`get_op_sites`) and the forward without its consistency level's integer rules
(:func:`without_integer_rules`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.runtime import Runtime
from quantlens.quantization.state import QuantState, is_prepared, use_runtime
from quantlens.sites.record import call_model, record_model

__all__ = ["last_sites", "get_op_sites", "without_integer_rules"]


def last_sites(state: QuantState, example: Any) -> list[str]:
    """Op sites visited by one forward of the prepared model that owns ``state`` on ``example`` (no grad;
    observers are paused)."""
    root = state.root()
    runtime = Runtime(state)
    paused = [m for m in root.modules() if isinstance(m, FakeQuantize) and m.observe_enabled]
    for m in paused:
        m.observe_enabled = False
    try:
        with torch.no_grad(), use_runtime(root, runtime):
            call_model(root, example)
    finally:
        for m in paused:
            m.observe_enabled = True
    return runtime.visited


def get_op_sites(model: nn.Module, example_inputs: Any) -> list[str]:
    """Op site names of ``model`` (float or prepared) in execution order, for one example input."""
    if is_prepared(model):
        return list(last_sites(model._quantlens_state, example_inputs))
    was_training = model.training
    model.eval()
    try:
        return list(record_model(model, [example_inputs]).sites)
    finally:
        model.train(was_training)


@contextlib.contextmanager
def without_integer_rules(model) -> Iterator[None]:
    """Run the prepared ``model``'s forwards in this block without its consistency level's integer rules: float +
    fake quant, what ``export`` traces (the qat IR computes that at every level). Below level 1 it changes nothing.

    The block installs a plain runtime (``use_runtime``), so it replaces any runtime installed outside it."""
    if not is_prepared(model):
        raise QuantLensError(f"without_integer_rules expects a model returned by quantlens.quantization.prepare, "
                             f"got {type(model).__name__}.")
    runtime = Runtime(model._quantlens_state)
    runtime.emulator = None
    with use_runtime(model, runtime):
        yield
