"""Find the op site where NaN/Inf first appears in a prepared model (a NaN loss in QAT, a NaN calibration batch).

* :func:`find_nonfinite(model, example) <find_nonfinite>`: one diagnostic forward; returns the first op site
  (execution order) whose output holds NaN/Inf, or ``None``.
* :func:`detect_nonfinite(model) <detect_nonfinite>`: a context for the training loop; every forward of the
  prepared model inside it checks each op site's output and, at the first non-finite one, raises
  :class:`NonFiniteError` (``action="raise"``) or warns (``action="warn"``), naming the op site and the forward
  (step) it happened in.

Both check every op site's output with ``torch.isfinite(...).all()``, one host synchronisation per op: a debugging
aid, not something to leave on in production training. NaN that appears only in the loss (outside the model) or
only in gradients is not seen here; :func:`torch.autograd.detect_anomaly` covers the backward pass.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.runtime import Runtime
from quantlens.quantization.state import is_prepared, use_runtime

__all__ = ["NonFiniteSite", "NonFiniteError", "find_nonfinite", "detect_nonfinite"]


@dataclass(frozen=True)
class NonFiniteSite:
    """The first op site of a forward whose output holds NaN/Inf."""

    site: str  # op site name, as in model_check_result.txt and the profiler
    op_type: str
    nan: int  # NaN elements in the site's float outputs
    inf: int  # +/-Inf elements
    numel: int
    inputs_finite: bool  # False: a float input was already non-finite (a model input, or a value made outside a site)
    forward: int  # 1-based count of forwards (steps) in the detect_nonfinite context; 1 for find_nonfinite

    def describe(self) -> str:
        cause = ("its float inputs were finite, so this op produced them (overflow, log/sqrt of a negative or zero, "
                 "division by zero, an exploding weight)" if self.inputs_finite else
                 "one of its float inputs was already non-finite: the model input, or code between op sites")
        return (f"op site '{self.site}' ({self.op_type}) output holds {self.nan} NaN and {self.inf} Inf of "
                f"{self.numel} values at forward {self.forward}; {cause}")


class NonFiniteError(QuantLensError):
    """Raised by :func:`detect_nonfinite` at the first op site whose output is non-finite; ``.site`` tells which."""

    def __init__(self, message: str, site: NonFiniteSite):
        super().__init__(message)
        self.site = site


def _float_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        leaves = [value]
    elif isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_fields"):
        leaves = list(value)  # torch.return_types
    else:
        leaves = pytree.tree_leaves(value)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _runtime_class():
    # The prepared model's runtime, subclassed here like the profiler's RuntimeProbe.
    class _NonFiniteRuntime(Runtime):
        """The prepared model's runtime, checking each op site's output once it is computed."""

        def __init__(self, state, watcher: "_Watcher"):
            super().__init__(state)
            self.watcher = watcher

        def function_op(self, site, func, args, kwargs):
            out = super().function_op(site, func, args, kwargs)
            self.watcher.check(site, (args, kwargs), out)
            return out

        def module_enter(self, site, args):
            self.watcher.entered[site.name] = args
            return super().module_enter(site, args)

        def module_exit(self, site, args, output):
            out = super().module_exit(site, args, output)
            self.watcher.check(site, self.watcher.entered.pop(site.name, args), out)
            return out

    return _NonFiniteRuntime


class _Watcher:
    def __init__(self, action: str):
        self.action = action
        self.forward = 0
        self.first: NonFiniteSite | None = None  # of the current forward
        self.found: list[NonFiniteSite] = []  # first site of each forward that had one
        self.entered: dict[str, Any] = {}

    def start(self) -> None:
        self.forward += 1
        self.first = None
        self.entered.clear()

    def check(self, site, inputs: Any, output: Any) -> None:
        if self.first is not None:
            return
        outs = _float_leaves(output)
        if _all_finite(outs):
            return
        nan = sum(int(torch.isnan(t).sum()) for t in outs)
        inf = sum(int(torch.isinf(t).sum()) for t in outs)
        self.first = NonFiniteSite(site.name, site.rule.op_type, nan, inf, sum(t.numel() for t in outs),
                                   _all_finite(_float_leaves(inputs)), self.forward)
        self.found.append(self.first)
        if self.action == "raise":
            raise NonFiniteError(f"detect_nonfinite: {self.first.describe()}.", self.first)
        if self.action == "warn":
            warnings.warn(f"detect_nonfinite: {self.first.describe()}.", stacklevel=2, category=QuantLensWarning)


def _require_prepared(model: nn.Module, what: str):

    if not is_prepared(model):
        raise QuantLensError(
            f"{what} expects a model returned by quantlens.quantization.prepare, got {type(model).__name__}. For a "
            "float model, torch.autograd.detect_anomaly() or forward hooks do the same job."
        )
    return model._quantlens_state


@contextmanager
def detect_nonfinite(model: nn.Module, action: str = "raise") -> Iterator[list[NonFiniteSite]]:
    """Within the context, every forward of the prepared ``model`` checks each op site's output.

    At the first op site of a forward whose output holds NaN/Inf: ``action="raise"`` raises
    :class:`NonFiniteError` right there (the step that produced the NaN, before the loss and the optimizer step
    spread it into the weights); ``action="warn"`` emits one warning per such forward and carries on. Yields the
    list of :class:`NonFiniteSite` found so far (one per forward that had one). The model runs as it would
    (training mode, observers, gradients unchanged); only the checks are added::

        with detect_nonfinite(qat_model):
            for step, (x, y) in enumerate(loader):
                loss = criterion(qat_model(x), y)   # raises NonFiniteError naming the op site and the forward
                ...
    """
    if action not in ("raise", "warn"):
        raise QuantLensError(f"detect_nonfinite: action must be 'raise' or 'warn', got {action!r}.")
    state = _require_prepared(model, "detect_nonfinite")
    watcher = _Watcher(action)
    runtime_cls = _runtime_class()
    ours: list = []

    def pre_hook(module, args):
        watcher.start()
        _drop_ours()  # a forward that raised left its runtime behind
        # A runtime already in place (the profiler's) is left alone: this context only adds checks.
        if state.current_runtime() is None:
            scope = use_runtime(model, runtime_cls(state, watcher))
            scope.__enter__()
            ours.append(scope)

    def post_hook(module, args, output):
        _drop_ours()

    def _drop_ours():
        while ours:
            ours.pop().__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(pre_hook), model.register_forward_hook(post_hook)]
    try:
        yield watcher.found
    finally:
        for handle in handles:
            handle.remove()
        _drop_ours()


def find_nonfinite(model: nn.Module, example: Any) -> NonFiniteSite | None:
    """The first op site (execution order) whose output holds NaN/Inf in one forward of the prepared ``model``
    on ``example`` (a tuple is positional arguments, as for ``prepare``), or ``None`` when every output is finite.

    The forward runs in the model's current mode and fake quant state (a training-mode model uses batch
    statistics, as the QAT step did), without gradients and with every observer paused (weights keep the scale
    of their last observation, so a NaN weight does not stop the forward before its op site); BatchNorm running
    statistics are restored afterwards, so the model is left as it was.
    """
    from quantlens.sites.record import call_model

    state = _require_prepared(model, "find_nonfinite")
    watcher = _Watcher("record")
    paused = [m for m in model.modules() if isinstance(m, FakeQuantize) and m.observe_enabled]
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [{k: v.clone() for k, v in m._buffers.items() if v is not None} for m in bns]
    for m in paused:
        m.observe_enabled = False
    watcher.start()
    try:
        with torch.no_grad(), use_runtime(model, _runtime_class()(state, watcher)):
            call_model(model, example)
    finally:
        for m in paused:
            m.observe_enabled = True
        with torch.no_grad():
            for m, buffers in zip(bns, saved):
                for k, v in buffers.items():
                    m._buffers[k].copy_(v)
    return watcher.first
