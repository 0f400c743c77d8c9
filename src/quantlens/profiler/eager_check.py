"""Is the float model the profiler traces the one the user runs?

Every traced forward answers ``torch.compiler.is_exporting()`` with True, so that the op sites prepare records are
the ones export meets (see :class:`~quantlens.sites.tracer.OpSiteTracer`). A library branch that computes
differently under export (a norm that skips its centring, an attention that drops its mask) is then taken by the
float baseline of every stage pair too, and no pair can show it, while the user's own evaluation of the float
model takes the other branch. :func:`eager_divergence` runs the float model as the user runs it (a plain call,
the flags untouched) next to the traced forward on the same input; when their outputs differ it traces both once
more, recording a fingerprint of every op site's output, and names the first op site where they part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quantlens.profiler.outputs import float_outputs, named_outputs
from quantlens.sites.record import call_model
from quantlens.sites.tracer import OpSiteTracer, SiteHandler

__all__ = ["EagerDivergence", "eager_divergence", "outputs_part", "check_baseline"]

#: relative difference below which two float32 results of the same ops count as equal (summation order noise)
_RTOL = 1e-5


@dataclass(frozen=True)
class EagerDivergence:
    """The float model's output as the user runs it differs from the traced one (the export branch).

    ``output``: the first model output that differs, with its ``max_abs_diff`` and ``cosine``; ``site``: the first
    op site (execution order) where the two runs part, its ``op_type``; ``traced`` / ``eager`` what each ran there
    (``op site (op type)``, or ``"-"`` when that run has no op site there), ``why`` in words."""

    output: str
    max_abs_diff: float
    cosine: float
    site: str
    op_type: str
    traced: str
    eager: str
    why: str

    def words(self) -> str:
        """One sentence for the summary and the advisor."""
        return (f"the float model computes differently as you run it than under torch.export: output '{self.output}' "
                f"differs (max |diff| {self.max_abs_diff:.3g}, cosine {self.cosine:.6f}); the two runs part at op "
                f"site '{self.site}' ({self.why})")


@dataclass(frozen=True)
class _Print:
    """One op site's output as a few numbers: equal ops on equal inputs give equal prints (up to :data:`_RTOL`)."""

    name: str
    op_type: str
    shapes: tuple
    sums: tuple

    def same(self, other: _Print) -> bool:
        if (self.name, self.shapes) != (other.name, other.shapes):
            return False
        return all(math.isclose(a, b, rel_tol=_RTOL, abs_tol=_RTOL * max(1.0, abs(m)))
                   for (a, m), (b, _) in zip(self.sums, other.sums))


def _fingerprint(name: str, op_type: str, output: Any) -> _Print:
    leaves = [t for t in named_outputs(output).values() if t.is_floating_point() or t.is_complex()]
    leaves = [torch.view_as_real(t) if t.is_complex() else t for t in leaves]
    sums = tuple((float(t.double().sum()), float(t.double().abs().sum())) for t in leaves)
    return _Print(name, op_type, tuple(tuple(t.shape) for t in leaves), sums)


class _Recorder(SiteHandler):
    """Runs every op unchanged and keeps its output's print, in execution order."""

    def __init__(self):
        self.prints: list[_Print] = []

    def function_op(self, site, func, args, kwargs):
        out = func(*args, **kwargs)
        self.prints.append(_fingerprint(site.name, site.rule.op_type, out))
        return out

    def module_exit(self, site, args, output):
        self.prints.append(_fingerprint(site.name, site.rule.op_type, output))
        return None


def _prints(model: nn.Module, example: Any, export_branch: bool) -> list[_Print]:
    recorder = _Recorder()
    with torch.no_grad(), OpSiteTracer(model, recorder, export_branch=export_branch):
        call_model(model, example)
    return recorder.prints


def outputs_part(traced: Any, eager: Any) -> tuple[str, float, float] | None:
    """The first float output whose two values differ beyond float32 noise: ``(name, max |diff|, cosine)``, or None
    when every output agrees (a different structure or shape counts as differing, at the first such output)."""
    a, b = float_outputs(named_outputs(traced)), float_outputs(named_outputs(eager))
    for name in list(a) + [n for n in b if n not in a]:
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape:
            return name, math.inf, math.nan
        x, y = x.detach().double().reshape(-1), y.detach().double().reshape(-1)
        diff = float((x - y).abs().max()) if x.numel() else 0.0
        if diff > _RTOL * max(1.0, float(y.abs().max()) if y.numel() else 0.0):
            norm = float(x.norm() * y.norm())
            return name, diff, float(x @ y) / norm if norm else math.nan
    return None


def _label(p: _Print | None) -> str:
    return "-" if p is None else f"{p.name} ({p.op_type})"


def eager_divergence(model: nn.Module, example: Any) -> EagerDivergence | None:
    """``model`` (a float torch model, in eval mode) run as the user runs it on ``example``, against its traced
    forward (the export branch) on the same example: None when they agree, else where and how they part. Two
    forwards, and two traced ones more only when they differ."""
    with torch.no_grad():
        eager = call_model(model, example)
        with OpSiteTracer(model, SiteHandler()):
            traced_output = call_model(model, example)
    parted = outputs_part(traced_output, eager)
    if parted is None:
        return None
    traced_prints, eager_prints = _prints(model, example, True), _prints(model, example, False)
    for k in range(max(len(traced_prints), len(eager_prints))):
        t = traced_prints[k] if k < len(traced_prints) else None
        e = eager_prints[k] if k < len(eager_prints) else None
        if t is not None and e is not None and t.same(e):
            continue
        if t is not None and e is not None and t.name == e.name:
            why = "the same op site computes another value in each run"
        else:
            why = f"under export it runs {_label(t)}, as you run it {_label(e)}"
        first = t or e
        return EagerDivergence(*parted, first.name, first.op_type, _label(t), _label(e), why)
    # every op site agrees: the difference is made by code the tracer does not see (outside any op site)
    return EagerDivergence(*parted, "(none: every op site agrees)", "-", "-", "-",
                           "code outside every op site computes differently")


def check_baseline(access: Any, example: Any) -> EagerDivergence | None:
    """:func:`eager_divergence` of a float torch baseline (a model ``prepare`` returned runs its export branch
    whoever calls it, and an IR or ONNX model has one branch: nothing to check there)."""
    model = getattr(access, "model", None)
    if not isinstance(model, nn.Module) or getattr(access, "prepared", True):
        return None
    training = [m for m in model.modules() if m.training]
    for m in training:  # the profiler compares in eval mode (a dropout would part the two runs by chance)
        m.training = False
    try:
        return eager_divergence(model, access.on_device(example))
    finally:
        for m in training:
            m.training = True
