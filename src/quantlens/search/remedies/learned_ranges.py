"""Ranges learned jointly: every activation op site's clipping range trained at once so that the fake-quant
model's outputs match the float model's on the calibration batches (``docs/remedies.md``).

The per-site observers (:mod:`.observers`) choose each range from that tensor's own histogram, one site at a time.
A range that is best for its tensor is not the best for the outputs: a clipped channel may matter downstream, and
a coarse step may be harmless where a later op averages it out. :func:`learn_ranges` trains the per-tensor output
scales of every activation op site together (LSQ's straight-through gradient, the weights frozen, the march's exact
fake quant in the forward) to the float model's outputs, and returns them as clipping ranges. A
:class:`FixedRangeQconfigSetter` gives them to ``prepare`` as int8 ranges: an op site the int16 search promotes
goes back to min/max (the learned range traded clipping against int8's step, which int16 does not need).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import warnings
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.quantization import (
    FakeQuantState,
    FixedRangeObserver,
    MinMaxObserver,
    calibrate,
    prepare,
    set_fake_quantize,
)
from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
)
from quantlens.search.remedies.observers import ObserverQconfigSetter
from quantlens.sites.record import call_model

__all__ = ["learn_ranges", "FixedRangeQconfigSetter", "LearnScales", "int8_range_observer", "cosine_loss", "output_tensors",
           "calibrated_with_learned_scales", "learnable_output_fqs", "learned_ranges"]


def int8_range_observer(dtype: QuantDType, ch_axis: int | None = None, *, absmax: float):
    """The observer of a learned int8 range: ``FixedRangeObserver(absmax)`` at int8, min/max at any other dtype.
    A learned range trades clipping against int8's coarse step; an op site the int16 search promotes has 256x
    finer steps and is better served unclipped."""
    if QuantDType.parse(dtype) is QuantDType.qint8:
        return FixedRangeObserver(dtype, ch_axis, absmax=absmax)
    return MinMaxObserver(dtype, ch_axis)


class FixedRangeQconfigSetter(ObserverQconfigSetter):
    """The base setter's qconfigs with each named op site's int8 output given a fixed clipping range ``[-a, a]``
    (:func:`int8_range_observer`: an op site promoted to int16 later gets min/max); everything else is the base
    setter's. ``ranges``: op site -> ``a``."""

    label = "FixedRangeQconfigSetter"

    def __init__(self, ranges: Mapping[str, float], base_setter: Any = default_calibration_qconfig_setter):
        self.ranges = {str(k): float(v) for k, v in ranges.items()}
        super().__init__({site: functools.partial(int8_range_observer, absmax=a) for site, a in self.ranges.items()},
                         base_setter)
        # the name carries a digest of the ranges (an observer factory's repr holds an address): progress files
        # key their measurements by the setter's name
        digest = hashlib.sha256(repr(sorted(self.ranges.items())).encode()).hexdigest()[:12]
        self.name = f"fixed_ranges({len(self.ranges)}, {digest}) > {getattr(base_setter, 'name', repr(base_setter))}"


class LearnScales(QconfigSetter):
    """The base setter's qconfigs with a learned (LSQ) scale on every per-tensor activation output."""

    def __init__(self, base_setter: Any):
        self.base_setter = base_setter
        self.name = f"learn_scales > {getattr(base_setter, 'name', repr(base_setter))}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        result = resolve_qconfigs(self.base_setter, ctx)
        for site, qconfig in list(result.qconfigs.items()):
            if qconfig is not None and qconfig.output is not None and qconfig.output.ch_axis is None:
                result.qconfigs[site] = qconfig.replace(output=replace(qconfig.output, learn_scale=True))
        return result


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, in pytree order."""
    leaves = torch.utils._pytree.tree_leaves(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def cosine_loss(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    """``1 - cosine`` per sample (the first dim; a 0/1-dim output is one sample), summed over the outputs: it
    follows the direction of the outputs, which is what an int8 step loses, and not their overall scale."""
    total = outs[0].new_zeros(())
    for o, r in zip(outs, refs):
        o2, r2 = (o.reshape(1, -1), r.reshape(1, -1)) if o.dim() < 2 else (o.flatten(1), r.flatten(1))
        total = total + (1 - torch.nn.functional.cosine_similarity(o2, r2, dim=1, eps=1e-12)).mean()
    return total


def learn_ranges(model: nn.Module, example: Any, batches: Sequence[Any],
                 setter: Any = default_calibration_qconfig_setter, *, epochs: int = 32,
                 lr: float = 0.03) -> dict[str, float]:
    """Each activation op site's output clipping range (``site -> absmax``), learned jointly on ``batches``.

    The model is prepared with ``setter`` and calibrated (the observers give the starting scales); then only the
    scales train, ``epochs`` passes over the batches (one Adam step per batch, each scale's step ``lr`` times its
    starting value, annealed to zero), on ``1 - cosine`` between each output and the float model's, per sample.
    Only int8 sites are trained. Sites whose scale is shared (add, cat) or a power of two, and decomposed ops (whose inner quantizers share the
    output's qconfig), keep their observer and are not returned. ``model``
    is not changed; the same inputs give the same ranges."""
    batches = list(batches)
    prepared = calibrated_with_learned_scales(model, example, batches, setter, "learn_ranges")
    with torch.no_grad():
        refs = [output_tensors(call_model(model, b)) for b in batches]
    fqs = learnable_output_fqs(prepared)
    if not fqs or not refs[0]:
        return {}
    for p in prepared.parameters():
        p.requires_grad_(False)
    set_fake_quantize(prepared, FakeQuantState.QAT)
    prepared.eval()  # BatchNorm statistics and dropout as in inference
    groups = []
    for fq in fqs.values():
        fq.start_learning()
        fq.learned_scale.requires_grad_(True)
        groups.append({"params": [fq.learned_scale], "lr": lr * float(fq.learned_scale.detach())})
    optimizer = torch.optim.Adam(groups)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(epochs * len(batches), 1))
    for _ in range(epochs):
        for batch, ref in zip(batches, refs):
            optimizer.zero_grad()
            cosine_loss(output_tensors(call_model(prepared, batch)), ref).backward()
            optimizer.step()
            schedule.step()
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    return learned_ranges(fqs)


def calibrated_with_learned_scales(model: nn.Module, example: Any, batches: list, setter: Any,
                                   who: str) -> nn.Module:
    """A copy of ``model`` prepared with ``setter``'s qconfigs and a learned (LSQ) scale on every per-tensor
    activation output, calibrated on ``batches`` (the learned scales start there)."""
    if not batches:
        raise QuantLensError(f"{who}: no calibration batch.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(prepare(copy.deepcopy(model), example, LearnScales(setter), check_result_dir=None,
                                 allow_no_stubs=True), batches)


def learnable_output_fqs(prepared: nn.Module) -> dict:
    """op site -> its output's fake quant where a learned int8 range is given back as a fixed one: not a decomposed
    op's (sdpa: its inner quantizers take the site's output qconfig too, so a fixed output range would fix theirs as
    well), not a shared or power-of-two scale."""
    state = prepared._quantlens_state
    fqs = {plan.name: state.fq[plan.output_fq] for plan in state.plans.values()
           if plan.output_fq in state.fq and plan.override is None}
    return {site: fq for site, fq in fqs.items() if fq.learn_scale and fq.scale_group is None and not fq.pow2_scale
            and fq.dtype is QuantDType.qint8}


def learned_ranges(fqs: Mapping[str, Any]) -> dict[str, float]:
    """``site -> absmax`` of each learned int8 scale (``scale * 127``)."""
    return {site: float(fq.learned_scale.detach().clamp(min=1e-12)) * fq.dtype.qmax for site, fq in fqs.items()}
