"""GroupNorm, InstanceNorm and GLU as the NPU computes them: ops of the march's own rules, each its own op site.

torch runs ``F.group_norm``, ``F.instance_norm`` and ``F.glu`` as one op each, which the march has no rule for. Each
is exactly a short sequence of ops that it does have, so the op set declares the three ``COMPOSITE`` and the tracer
runs the decomposition below (with itself active) instead: every op in it is an ordinary op site, prepared,
observed, fake-quantized, turned into tables by ``pre_export`` and captured by ``torch.export``.

* ``group_norm(x, G, w, b, eps)`` on ``x`` ``(N, C, *)``: ``reshape`` to ``(N, G, C/G · prod(*))``, ``layer_norm``
  over that last dim without affine (the march's layer norm, ``docs/march.md`` §13.7: a table at ``pre_export``),
  ``reshape`` back, then the per-channel affine ``w_c · y + b_c`` as ``batch_norm`` with mean 0 and variance 1
  (eps 0: ``a = w`` and ``b = bias`` exactly; the march's channel affine, §10.3). The layer norm's output fake quant
  is the internal quantization between normalization and affine; without ``w`` and ``b`` there is no affine.
  GroupNorm(1, C) (poolformer) normalizes each sample over all of ``C · prod(*)``; GroupNorm(C, C) (wav2vec2's
  feature extractor) each channel over time.
* ``instance_norm``: with input statistics, ``group_norm`` with ``G = C``; with running statistics
  (``nn.InstanceNorm*`` in eval with ``track_running_stats``), ``batch_norm`` with them. Training such a module
  (instance statistics, and an update of the running ones) is refused: the NPU runs its eval form.
* ``glu(x, dim)``: ``a, b = x.chunk(2, dim)``; ``a · sigmoid(b)`` (``chunk``, the sigmoid table, ``mul``).

Op site names: the ops are named in the scope of the module that called the function, e.g. an ``nn.GroupNorm`` at
``enc.norm`` gives ``enc.norm.reshape_0``, ``enc.norm.layer_norm_0``, ``enc.norm.reshape_1``, ``enc.norm.batch_norm_0``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.sites.source_location import ForwardTracer, user_source_location

__all__ = ["NORM_DECOMPOSED_FUNCTIONS", "group_norm", "instance_norm", "glu"]


def _source() -> str:
    return user_source_location()


def _affine(tracer: ForwardTracer, y: torch.Tensor, weight: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    """``weight_c · y + bias_c`` over dim 1 as the march's channel affine: ``batch_norm`` with mean 0, variance 1
    and eps 0 (so its ``a = weight / sqrt(1 + 0)`` and ``b = bias - 0 · a`` are the parameters exactly)."""
    if weight is None and bias is None:
        return y
    tracer.internal += 1  # the statistics are constants made from a parameter (export folds them), no op sites
    try:
        mean = (weight if weight is not None else bias).detach().reshape(-1).mul(0.0)
        var = mean.add(1.0)
    finally:
        tracer.internal -= 1
    return F.batch_norm(y, mean, var, weight, bias, False, 0.0, 0.0)


def _grouped_norm(tracer: ForwardTracer, x: torch.Tensor, groups: int, weight, bias, eps: float,
                  what: str) -> torch.Tensor:
    if x.dim() < 2 or x.shape[1] % groups:
        raise QuantLensError(
            f"{what} at {_source()}: expected an input (N, C, *) whose C is a multiple of the {groups} groups, got "
            f"shape {tuple(x.shape)}. Fix the num_groups / num_channels of the normalization."
        )
    shape = x.shape
    grouped = x.reshape(shape[0], groups, -1)
    y = F.layer_norm(grouped, (grouped.shape[-1],), None, None, eps).reshape(shape)
    return _affine(tracer, y, weight, bias)


def group_norm(tracer: ForwardTracer, input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.group_norm``: reshape, layer_norm over each group (no affine), reshape, per-channel affine."""
    return _grouped_norm(tracer, input, int(num_groups), weight, bias, float(eps), "group_norm")


def instance_norm(tracer: ForwardTracer, input: torch.Tensor, running_mean: torch.Tensor | None = None,
                  running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1,
                  eps: float = 1e-5) -> torch.Tensor:
    """``F.instance_norm``: ``group_norm`` with one group per channel, or ``batch_norm`` on running statistics."""
    if not use_input_stats:
        if running_mean is None or running_var is None:
            raise QuantLensError(f"instance_norm at {_source()}: use_input_stats=False needs running_mean and "
                                 "running_var.")
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, 0.0, eps)
    if running_mean is not None and running_var is not None:
        raise QuantLensError(
            f"instance_norm at {_source()}: an InstanceNorm with track_running_stats=True normalizes by each "
            "instance's statistics in training but by its running statistics in eval, which is what the NPU runs "
            "(the op sites were recorded in eval). Fix: keep the module in eval() during QAT (its running "
            "statistics stay fixed), or use track_running_stats=False.")
    return _grouped_norm(tracer, input, input.shape[1] if input.dim() >= 2 else 1, weight, bias, float(eps),
                         "instance_norm")


def glu(tracer: ForwardTracer, input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``F.glu``: the first half of ``dim`` times the sigmoid of the second half."""
    if input.dim() == 0 or input.shape[dim] % 2:
        raise QuantLensError(f"glu at {_source()}: dim {dim} of the input (shape {tuple(input.shape)}) must have "
                             "an even size (it is split in halves).")
    a, b = input.chunk(2, dim)
    return a * torch.sigmoid(b)


#: canonical op name -> decomposition ``fn(tracer, *args, **kwargs)`` (merged into the tracer's
#: ``quantlens.sites.rnn.DECOMPOSED_FUNCTIONS``); their op types are ``COMPOSITE`` in the op set.
NORM_DECOMPOSED_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "group_norm": group_norm,
    "instance_norm": instance_norm,
    "glu": glu,
}
