"""``cached_attrs`` of :class:`~.quant_analysis.QuantAnalysis`: state a sequence model's torch modules keep
between calls (``"decoder.memory"``), copied from the baseline to the analysis model before each of its calls so
that both start every call from the same state."""

from __future__ import annotations

import copy
from typing import Any

import torch

from quantlens.errors import QuantLensError

__all__ = ["install_cached_attrs"]


def _attr_owner(access, path: str):
    """``(object holding the attribute, attribute name)`` for a dotted ``path`` such as ``"decoder.memory"`` in
    the torch model of ``access``; a QuantLensError naming the attribute and the model when it is missing."""
    model = getattr(access, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise QuantLensError(
            f"cached_attrs=[{path!r}, ...]: the {access.label} model ({access.describe()}) is not a torch module; "
            "cached attributes are copied between torch models (float, calibration/QAT, pre_export).")
    parts = path.split(".")
    owner = model
    for i, part in enumerate(parts):
        if not part or not hasattr(owner, part):
            where = ".".join(parts[:i]) or type(model).__name__
            raise QuantLensError(
                f"cached_attrs: the {access.label} model ({access.describe()}) has no attribute '{path}' ('{where}' "
                f"has no '{part}'). Both models must hold every cached attribute (a module's state kept between "
                "calls, e.g. 'decoder.memory'); check the name against both models.")
        if i < len(parts) - 1:
            owner = getattr(owner, part)
    return owner, parts[-1]


def _copy_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def install_cached_attrs(baseline, analysis, cached_attrs) -> tuple[str, ...]:
    """``cached_attrs``: before each call of the analysis model, its cached attributes are set to copies of the
    baseline's values at the start of the baseline's latest call (its current values when the baseline has
    not run yet), so that both models of a sequence (stateful) model start each call from the same state.
    Wraps the two accesses' ``run`` (which also makes sensitivity run full forwards, not the ablation cache:
    the state enters every op)."""
    if cached_attrs is None:
        return ()
    paths = (cached_attrs,) if isinstance(cached_attrs, str) else tuple(cached_attrs)
    for path in paths:
        if not isinstance(path, str):
            raise QuantLensError(f"cached_attrs must be attribute names such as 'decoder.memory', got {path!r}.")
    if not paths:
        return ()
    for path in paths:  # both models hold every attribute: checked now, not at the first call
        _attr_owner(baseline, path), _attr_owner(analysis, path)
    state: dict[str, Any] = {}

    def snapshot() -> dict[str, Any]:
        out = {}
        for path in paths:
            owner, name = _attr_owner(baseline, path)
            out[path] = _copy_value(getattr(owner, name))
        return out

    base_run, analy_run = baseline.run, analysis.run

    def run_baseline(example, *args, **kwargs):
        state.clear()
        state.update(snapshot())
        return base_run(example, *args, **kwargs)

    def run_analysis(example, *args, **kwargs):
        values = state if state else snapshot()
        for path in paths:
            owner, name = _attr_owner(analysis, path)
            setattr(owner, name, _copy_value(values[path]))
        return analy_run(example, *args, **kwargs)

    baseline.run, analysis.run = run_baseline, run_analysis
    return paths
