"""Float-model transforms that move range between an op and the weights that consume its output, exactly in
float: cross-layer equalization (conv/linear -> ReLU -> conv/linear) and activation smoothing (LayerNorm ->
linears, SmoothQuant-style). Both are applied before ``prepare`` (``docs/remedies.md``).

**Cross-layer equalization.** For a producer ``W1`` (output channel ``c``), a positively homogeneous activation
``f`` (none, ReLU, LeakyReLU: ``f(x / s) = f(x) / s`` for ``s > 0``) and a consumer ``W2`` (input channel
``c``), dividing row ``c`` of ``W1`` and ``b1[c]`` by ``s_c`` and multiplying column ``c`` of ``W2`` by ``s_c``
leaves the float function unchanged. ``s_c = sqrt(r1_c / r2_c)`` with ``r1_c = max|W1[c]|`` and
``r2_c = max|W2[:, c]|`` gives both channels the range ``sqrt(r1_c * r2_c)``, so per-tensor weights (and a
per-tensor activation between them) waste fewer levels on a few wide channels.

**Smoothing.** For a LayerNorm whose output feeds only linears (a pre-LN transformer block: its residual is taken
before the norm), dividing the norm's gain and bias by ``s_j`` and multiplying column ``j`` of every consuming
linear by ``s_j`` is exact. ``s_j = a_j**alpha / w_j**(1 - alpha)`` with ``a_j`` the largest ``|x_j|`` the norm's
output reaches on the calibration data and ``w_j`` the largest ``|W[:, j]|`` over the consumers moves the
activation outliers into the weights (per-channel quantized, where they cost little).

A pair is found from the model's data flow (``sites.record``): the producer's output must go only to the
activation (or the consumers), and the activation's only to the consumers; anything else (a residual add reading
the same tensor, a second use) makes the transform inexact and the pair is not taken.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.search.remedies.watch import watch_modules
from quantlens.sites.record import ModelRecord, record_model

__all__ = ["EqualizationPair", "find_cle_pairs", "find_smoothing_pairs", "cross_layer_equalization",
           "smooth_activations", "activation_absmax"]

#: activations that commute with a positive per-channel scale
_HOMOGENEOUS = frozenset({"relu", "ReLU", "leaky_relu", "LeakyReLU"})
_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class EqualizationPair:
    """A producer (module name), the activation between (op site, ``""``: none) and its consumers (module names),
    with the per-channel scales once computed (``scales``: a tuple of floats, empty before)."""

    kind: str  # "cle" or "smooth"
    producer: str
    activation: str
    consumers: tuple[str, ...]
    scales: tuple[float, ...] = ()


def _consumers(record: ModelRecord) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for site in record.sites.values():
        data = [i for i in site.inputs if not i.is_parameter]
        for k, inp in enumerate(data):
            if inp.producer is not None:
                out.setdefault(inp.producer, []).append((site.name, k))
    return out


def _module(model: nn.Module, record: ModelRecord, site: str) -> nn.Module | None:
    rec = record.sites[site]
    if not rec.is_module:
        return None
    try:
        return model.get_submodule(rec.module_name)
    except AttributeError:
        return None


def _channels_in(module: nn.Module) -> int:
    return module.in_features if isinstance(module, nn.Linear) else module.in_channels


def _channels_out(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return module.out_channels
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine and len(module.normalized_shape) == 1:
        return module.normalized_shape[0]
    return None


def _sole_data_consumers(record, consumers, site) -> list[str] | None:
    """The sites reading ``site``'s output, each as its first data input and only once; None otherwise."""
    uses = consumers.get(site, [])
    if not uses or any(k != 0 for _, k in uses) or len({s for s, _ in uses}) != len(uses):
        return None
    return [s for s, _ in uses]


def _consumer_modules(model, record, consumers, sites, width) -> tuple[str, ...] | None:
    names = []
    for s in sites:
        mod = _module(model, record, s)
        if not isinstance(mod, _WEIGHTED) or record.sites[s].calls != 1 or _channels_in(mod) != width or \
                getattr(mod, "groups", 1) != 1:
            return None
        names.append(record.sites[s].module_name)
    return tuple(names)


def _pairs(model: nn.Module, record: ModelRecord, kind: str) -> list[EqualizationPair]:
    consumers = _consumers(record)
    out = []
    for site in record.sites.values():
        producer = _module(model, record, site.name)
        width = _channels_out(producer) if producer is not None else None
        wanted = nn.LayerNorm if kind == "smooth" else _WEIGHTED
        if width is None or not isinstance(producer, wanted) or site.calls != 1 or \
                getattr(producer, "groups", 1) != 1:
            continue
        if kind == "smooth" and not isinstance(producer, nn.LayerNorm):
            continue
        nxt = _sole_data_consumers(record, consumers, site.name)
        if nxt is None:
            continue
        activation = ""
        if kind == "cle" and len(nxt) == 1 and record.sites[nxt[0]].op_type in _HOMOGENEOUS:
            activation = nxt[0]
            nxt = _sole_data_consumers(record, consumers, activation)
            if nxt is None:
                continue
        names = _consumer_modules(model, record, consumers, nxt, width)
        if names is not None and (kind == "smooth" or len(names) == 1):
            out.append(EqualizationPair(kind, site.module_name, activation, names))
    return out


def find_cle_pairs(model: nn.Module, example: Any) -> list[EqualizationPair]:
    """conv/linear -> (ReLU | LeakyReLU | nothing) -> conv/linear chains of ``model`` (groups 1) where the transform
    is exact, in execution order."""
    return _pairs(model, record_model(model.eval(), [example]), "cle")


def find_smoothing_pairs(model: nn.Module, example: Any) -> list[EqualizationPair]:
    """LayerNorms whose output feeds only linears (each reading it once as its input)."""
    return _pairs(model, record_model(model.eval(), [example]), "smooth")


def _weight_columns_absmax(weight: torch.Tensor) -> torch.Tensor:
    """max |W[:, c]| per input channel of a conv/linear weight."""
    return weight.detach().abs().transpose(0, 1).reshape(weight.shape[1], -1).amax(1)


def _scale_columns(module: nn.Module, s: torch.Tensor) -> None:
    shape = [1, -1] + [1] * (module.weight.dim() - 2)
    module.weight.mul_(s.reshape(shape).to(module.weight.dtype))


def cross_layer_equalization(model: nn.Module, example: Any, pairs: Iterable[EqualizationPair] | None = None,
                             ) -> tuple[nn.Module, list[EqualizationPair]]:
    """A copy of ``model`` with every CLE pair (default: :func:`find_cle_pairs`) equalized, and the pairs with
    their scales. ``model`` is not changed."""
    pairs = list(find_cle_pairs(model, example) if pairs is None else pairs)
    out = copy.deepcopy(model)
    done = []
    with torch.no_grad():
        for pair in pairs:
            first = out.get_submodule(pair.producer)
            (second,) = (out.get_submodule(n) for n in pair.consumers)
            r1 = first.weight.detach().abs().reshape(first.weight.shape[0], -1).amax(1)
            r2 = _weight_columns_absmax(second.weight)
            s = torch.where((r1 > 0) & (r2 > 0), torch.sqrt(r1 / r2.clamp_min(1e-30)), torch.ones_like(r1))
            first.weight.div_(s.reshape([-1] + [1] * (first.weight.dim() - 1)))
            if first.bias is not None:
                first.bias.div_(s)
            _scale_columns(second, s)
            done.append(EqualizationPair(pair.kind, pair.producer, pair.activation, pair.consumers,
                                         tuple(float(v) for v in s)))
    return out, done


def activation_absmax(model: nn.Module, modules: Iterable[str], batches: Iterable[Any]) -> dict[str, torch.Tensor]:
    """The largest ``|x_j|`` per last-dim channel of each named module's output over ``batches`` (forward hooks
    on the float model; removed afterwards)."""
    found: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, _args, output):
            a = output.detach().abs().reshape(-1, output.shape[-1]).amax(0)
            found[name] = torch.maximum(found[name], a) if name in found else a
        return record

    watch_modules(model, batches, outputs={n: hook(n) for n in modules})
    return found


def smooth_activations(model: nn.Module, example: Any, batches: Iterable[Any], alpha: float = 0.5,
                       pairs: Iterable[EqualizationPair] | None = None) -> tuple[nn.Module, list[EqualizationPair]]:
    """A copy of ``model`` with the outliers of every smoothing pair's LayerNorm output (default:
    :func:`find_smoothing_pairs`) migrated into its consumers' weights; ``alpha`` in [0, 1] is the share moved
    (0: nothing, 1: all). ``model`` is not changed."""
    if not 0.0 <= alpha <= 1.0:
        raise QuantLensError(f"smooth_activations: alpha must lie in [0, 1], got {alpha}.")
    pairs = list(find_smoothing_pairs(model, example) if pairs is None else pairs)
    amax = activation_absmax(model, [p.producer for p in pairs], list(batches))
    out = copy.deepcopy(model)
    done = []
    with torch.no_grad():
        for pair in pairs:
            norm = out.get_submodule(pair.producer)
            linears = [out.get_submodule(n) for n in pair.consumers]
            w = torch.stack([_weight_columns_absmax(lin.weight) for lin in linears]).amax(0)
            a = amax[pair.producer]
            ok = (a > 0) & (w > 0)
            s = torch.where(ok, a.clamp_min(1e-30) ** alpha / w.clamp_min(1e-30) ** (1 - alpha), torch.ones_like(a))
            norm.weight.div_(s)
            if norm.bias is not None:
                norm.bias.div_(s)
            for lin in linears:
                _scale_columns(lin, s)
            done.append(EqualizationPair(pair.kind, pair.producer, "", pair.consumers, tuple(float(v) for v in s)))
    return out, done
