"""Learned rounding (AdaRound-style) for post-training quantization (``docs/remedies.md``).

Rounding every weight to its nearest int8 level is best for each weight alone, not for the layer's output: errors
of the same sign add up along a dot product. :func:`learn_rounding` chooses, for each weight of each conv/linear
layer, whether it rounds down or up, trained jointly over the whole network to the float model's outputs:

* each weight gets a free variable ``v``; its level is ``floor(w / s) + h(v)`` with ``h`` a rectified sigmoid,
  started at the fraction ``w / s - floor(w / s)`` (so training starts from the float weight);
* the forward is the march's exact fake quant of that weight: it rounds ``h`` to 0 or 1, and the straight-through
  gradient reaches ``v``; the activations are quantized as the setter says, so the rounding also makes up for
  their error;
* ``1 - cosine`` per sample between each output and the float model's (as for learned ranges), Adam (``lr``
  0.01 on ``v``: larger steps flip levels back and forth and end worse than nearest rounding on held-out data);
* the element with the largest ``|w|`` of each output channel keeps its nearest rounding, so each channel's
  min/max scale is the same before and after, and the result is exact: the returned float model's weights are
  integer multiples of their scales, and ``prepare`` quantizes them to exactly the learned levels.

Layers with per-channel scales on axis 0 (or per tensor, or a linear's ``[out, in]`` scale with its input's
channel exponents folded in, ``docs/march.md`` §3.1), groups of any size, without a folded BatchNorm.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from quantlens.errors import QuantLensError
from quantlens.quantization import FakeQuantState, calibrate, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.remedies.learned_ranges import cosine_loss, output_tensors
from quantlens.sites.record import call_model

__all__ = ["learn_rounding", "has_roundable_layers"]

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ZETA, _GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch (AdaRound's values)


class _Rounding(nn.Module):
    """The weight as ``s * clamp(floor(w / s) + h(v), qmin, qmax)``; ``h`` rounds to 0/1 in the weight's fake
    quant, the largest element of each channel keeps its nearest level."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int):
        super().__init__()
        shape = (-1,) + (1,) * (weight.dim() - 1)
        if scale.dim() > 1:  # a linear's weight folded with its input's channel exponents: [out, in] (march §3.1)
            shape = tuple(weight.shape)
        s = scale.detach().clone().reshape(shape if scale.numel() > 1 else ()).to(weight.dtype)  # not a view: the
        # weight fake quant rewrites its scale in place at every forward
        q = weight.detach() / s
        self.register_buffer("s", s)
        self.register_buffer("floor", torch.floor(q))
        frac = (q - torch.floor(q)).clamp(1e-4, 1 - 1e-4)
        # h(v) = frac: v = logit((frac - gamma) / (zeta - gamma))
        p = (frac - _GAMMA) / (_ZETA - _GAMMA)
        self.v = nn.Parameter(torch.log(p / (1 - p)))
        # the largest level of each row sets its scale (a folded weight's: the largest |w / s|, not |w|)
        flat = q.abs().reshape(weight.shape[0], -1) if weight.dim() > 1 else q.abs()
        top = flat == flat.amax(dim=-1, keepdim=True) if weight.dim() > 1 else flat == flat.max()
        self.register_buffer("fixed", top.reshape(weight.shape))
        self.register_buffer("nearest", torch.round(q) - torch.floor(q))
        self.qmin, self.qmax = qmin, qmax

    def h(self) -> torch.Tensor:
        soft = (torch.sigmoid(self.v) * (_ZETA - _GAMMA) + _GAMMA).clamp(0, 1)
        return torch.where(self.fixed, self.nearest, soft)

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        return self.s * torch.clamp(self.floor + self.h(), self.qmin, self.qmax)

    def chosen(self) -> torch.Tensor:
        """The learned weight: each element at its level, rounded down or up."""
        with torch.no_grad():
            hard = torch.where(self.fixed, self.nearest, (self.h() >= 0.5).to(self.v.dtype))
            return self.s * torch.clamp(self.floor + hard, self.qmin, self.qmax)


def has_roundable_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a conv/linear layer learned rounding may apply to."""
    return any(isinstance(m, _LAYERS) for m in model.modules())


def _layers(model: nn.Module, prepared: nn.Module) -> dict[str, nn.Module]:
    """Float layer name -> its QAT module, where learned rounding applies."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, _LAYERS):
            continue
        try:
            qat = prepared.get_submodule(name)
        except AttributeError:
            continue
        fq = getattr(qat, "weight_fake_quant", None)
        if fq is None or hasattr(qat, "bn") or fq.ch_axis not in (None, 0) or not bool(fq.calibrated):
            continue
        out[name] = qat
    return out


def learn_rounding(model: nn.Module, example: Any, batches: Sequence[Any],
                   setter: Any = default_calibration_qconfig_setter, *, epochs: int = 40,
                   lr: float = 0.01) -> tuple[nn.Module, list[str]]:
    """A copy of ``model`` whose conv/linear weights sit on their int8 levels, each rounded down or up as
    trained on ``batches`` (see the module docstring), and the names of those layers. ``model`` is not changed;
    the same inputs give the same weights."""
    batches = list(batches)
    if not batches:
        raise QuantLensError("learn_rounding: no calibration batch.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(copy.deepcopy(model), example, setter, check_result_dir=None,
                                     allow_no_stubs=True), batches)
    layers = _layers(model, prepared)
    if not layers:
        return copy.deepcopy(model), []
    with torch.no_grad():
        refs = [output_tensors(call_model(model, b)) for b in batches]
    for p in prepared.parameters():
        p.requires_grad_(False)
    roundings = {}
    for name, qat in layers.items():
        fq = qat.weight_fake_quant
        roundings[name] = _Rounding(qat.weight, fq.scale, fq.dtype.qmin, fq.dtype.qmax)
        parametrize.register_parametrization(qat, "weight", roundings[name])
    # VALIDATION: the calibrated activation ranges stay as they are; a weight's scale is still recomputed from the
    # (parametrized) weight at every forward
    set_fake_quantize(prepared, FakeQuantState.VALIDATION)
    optimizer = torch.optim.Adam([r.v for r in roundings.values()], lr=lr)
    for _ in range(epochs):
        for batch, ref in zip(batches, refs):
            optimizer.zero_grad()
            # Each parametrized weight is computed once here, before the forward: a model whose own forward
            # reads a layer's weight (transformers' ViT reads its patch projection's dtype) would otherwise run
            # the rounding's ops where op sites are traced, and prepare's plan has no such site.
            with parametrize.cached():
                for qat in layers.values():
                    qat.weight  # noqa: B018 (fills the cache)
                cosine_loss(output_tensors(call_model(prepared, batch)), ref).backward()
            optimizer.step()
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, rounding in roundings.items():
            out.get_submodule(name).weight.copy_(rounding.chosen())
    return out, list(roundings)
