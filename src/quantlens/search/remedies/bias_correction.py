"""Bias correction (a weights remedy, ``docs/remedies.md``): the shift that weight rounding adds to a conv/linear's
output on average, taken back out of its bias.

With quantized weights ``Wq = W + dW`` the layer computes ``Wq x + b = W x + b + dW x``; over the calibration data
the term ``dW x`` has the mean ``dW E[x]`` per output channel (a conv: summed over its kernel taps, with the
per-channel input mean). A model whose ``b`` is replaced by ``b - dW E[x]`` has quantized-weight outputs that are
unbiased: the error that remains has mean zero. ``dW`` is what the prepared model's own weight fake quant gives
(the same observer and rounding as the deployed weights), ``E[x]`` the float model's input mean over the batches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.remedies.watch import watch_modules

__all__ = ["BiasCorrection", "bias_correction", "has_correctable_layers"]

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)


@dataclass(frozen=True)
class BiasCorrection:
    """One layer's correction: its module name and the largest ``|dW E[x]|`` taken out of its bias."""

    module: str
    largest: float


def _input_means(model: nn.Module, names: list[str], batches: list) -> dict[str, torch.Tensor]:
    """Per input channel mean of each named layer's input over the batches (channel: dim 1, or the last dim of a
    linear)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name, linear):
        def record(_module, args):
            x = args[0].detach().double()
            flat = x.reshape(-1, x.shape[-1]) if linear else x.transpose(0, 1).reshape(x.shape[1], -1).T
            sums[name] = sums.get(name, 0) + flat.sum(0)
            counts[name] = counts.get(name, 0) + flat.shape[0]
        return record

    watch_modules(model, batches, inputs={n: hook(n, isinstance(model.get_submodule(n), nn.Linear)) for n in names})
    return {n: sums[n] / counts[n] for n in sums}


def has_correctable_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a layer bias correction applies to (conv/linear, groups 1)."""
    return any(isinstance(m, _LAYERS) and getattr(m, "groups", 1) == 1 for m in model.modules())


def bias_correction(model: nn.Module, example: Any, batches: Iterable[Any],
                    setter: Any = default_calibration_qconfig_setter) -> tuple[nn.Module, list[BiasCorrection]]:
    """A copy of ``model`` whose conv/linear biases (groups 1) absorb the mean output shift of their weights'
    quantization under ``setter`` (see the module docstring); ``model`` is not changed."""
    batches = list(batches)
    prepared = calibrate(prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True), batches)
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, _LAYERS) or getattr(module, "groups", 1) != 1:
            continue
        try:
            qat = prepared.get_submodule(name)
        except AttributeError:
            continue
        # a plain QAT layer (a conv-bn group folds its weight: its dW is not the float conv's)
        if hasattr(qat, "weight_fake_quant") and not hasattr(qat, "bn"):
            layers[name] = qat
    means = _input_means(model, list(layers), batches)
    out = copy.deepcopy(model)
    done = []
    with torch.no_grad():
        for name, qat in layers.items():
            if name not in means:
                continue
            w = qat.weight.detach()
            dw = (qat.weight_fake_quant(w) - w).double()
            shift = dw.reshape(dw.shape[0], dw.shape[1], -1).sum(2) @ means[name]  # dW summed over taps, E[x]
            layer = out.get_submodule(name)
            if layer.bias is None:
                layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype))
            layer.bias.sub_(shift.to(layer.bias.dtype))
            done.append(BiasCorrection(name, float(shift.abs().max())))
    return out, done
