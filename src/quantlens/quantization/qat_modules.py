"""QAT versions of weighted modules: the float module plus a weight fake quant (and BN folding when fused).

``prepare`` swaps a float module for its QAT class in place (same qualified name, so op site names do not change).
Activation fake quants are not here: they belong to op sites and live in the model's ``_quantlens_state``.

Bias: when the input is fake-quantized, the bias is fake-quantized to int32 with scale ``s_in * s_w[c]``,
exactly as the integer kernel adds it to the accumulator (``docs/march.md``, "Bias").
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from quantlens.march import rules
from quantlens.quantization.fake_quantize import FakeQuantize, hold_weight, int32_bias, release_weight
from quantlens.quantization.qconfig import QuantSpec
from quantlens.sites.op_rules import computes_as
from quantlens.sites.tracing_state import export_tracing

__all__ = [
    "QATConv1d",
    "QATConv2d",
    "QATConvTranspose1d",
    "QATConvTranspose2d",
    "QATLinear",
    "QATEmbedding",
    "QATConvBn1d",
    "QATConvBn2d",
    "QATLinearBn1d",
    "qat_class_for",
    "fused_class_for",
    "float_base",
    "frozen_folds",
]

class _Folds:
    """The folds of a :func:`frozen_folds` block: id(module) -> its folded (weight, factor, beta, bias, folded bias).
    Without ``keep`` every module's is made on entry; with ``keep``, each is made at the module's first call and
    at most ``keep`` are kept, the least recently used dropped first."""

    def __init__(self, modules: Iterable[nn.Module], keep: int | None):
        self.keep = keep
        self.folds: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        if keep is None:
            for m in modules:
                if isinstance(m, _FoldedBnMixin):  # (the fold is the same in either mode; training forwards skip it)
                    self._add(m)

    def _add(self, m: "_FoldedBnMixin") -> tuple:
        with torch.no_grad():
            w, factor, beta, bias = m._fold()
            fold = self.folds[id(m)] = (w, factor, beta, bias, beta + (bias - m.bn.running_mean) * factor)
        hold_weight(w)  # (one scale per fold in frozen_weights())
        return fold

    def of(self, m: "_FoldedBnMixin") -> tuple | None:
        """The module's fold (None: not one of the block's modules, which then folds at every call)."""
        fold = self.folds.get(id(m))
        if self.keep is None:
            return fold
        if fold is not None:
            self.folds.move_to_end(id(m))
            return fold
        fold = self._add(m)
        while len(self.folds) > self.keep:
            release_weight(self.folds.popitem(last=False)[1][0])
        return fold

    def close(self) -> None:
        for fold in self.folds.values():
            release_weight(fold[0])
        self.folds.clear()


_FROZEN_FOLDS: contextvars.ContextVar[_Folds | None] = contextvars.ContextVar("frozen_folds", default=None)


@contextlib.contextmanager
def frozen_folds(modules: Iterable[nn.Module], keep: int | None = None) -> Iterator[None]:
    """Fold each conv/linear + BatchNorm of ``modules`` once, for a stretch of eval forwards in which neither the
    weights nor the BN statistics change (the profiler's forwards: only fake quants are switched), instead of at
    every forward. Outside the block, and for a module in training mode, every forward folds afresh.

    ``keep=None`` folds every module on entry and keeps them all: the ablation forwards, which run the whole model
    again and again. ``keep=n`` folds a module at its first call and keeps the ``n`` most recently used: a traced
    forward whose same-input re-run follows each op (``run()``), so the folds held stay a layer's weights, not a
    second copy of the model's (resnet18: +30-40 MiB of peak memory with every fold kept)."""
    folds = _Folds(modules, keep)
    token = _FROZEN_FOLDS.set(folds)
    try:
        yield
    finally:
        _FROZEN_FOLDS.reset(token)
        folds.close()


class _WeightQuantMixin:
    """Shared by every QAT class: the weight fake quant and the int32 bias rule."""

    weight_fake_quant: FakeQuantize
    #: (``op_rules.COMPUTES_REGISTERED_OP``) a QAT class computes its float base's op, on fake-quantized operands,
    #: although it overrides ``forward``: the tracer keeps it one op site
    _quantlens_computes_registered_op = True

    def _init_qat(self, weight_spec: QuantSpec) -> None:
        self.weight_fake_quant = FakeQuantize(weight_spec, is_weight=True)
        # Set by the op-site runtime for the duration of one call: the input's fake quant, if any.
        self.__dict__["_ql_input_fq"] = None

    def _quant_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return int32_bias(bias, self.__dict__.get("_ql_input_fq"), self.weight_fake_quant)

    #: the channel dim of the GEMM's output (the bias and the per-channel requantize run along it)
    output_channel_dim = 1

    def integer_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias before quantization, as the NPU sees them (BatchNorm folded in eval mode)."""
        return self.weight, self.bias

    def _gemm(self, x, w, b, *extra):
        """The module's float op on the given operands (the integer emulation calls it on integer values)."""
        raise NotImplementedError

    #: whether the weight folds the exponents of exponent-form input codes (``docs/march.md`` §3.1): a linear,
    #: whose input features are its weight's dim 1 and the codes' last dim
    folds_input_exponents = False

    def _fold_input_exponents(self) -> None:
        """Give the weight fake quant the factors ``2**-k_c`` of this call's exponent-form input (None: none)."""
        if not self.folds_input_exponents or export_tracing():  # (export: the eager pass before it has folded)
            return
        in_fq = self.__dict__.get("_ql_input_fq")
        exponents = (in_fq is not None and in_fq.channel_exponents and bool(in_fq.calibrated)
                     and in_fq.scale.numel() == self.weight.shape[1])
        self.weight_fake_quant.fold(rules.exponent_factors(in_fq.scale) if exponents else None)

    def forward(self, x, *extra):
        w, b = self.integer_operands()
        self._fold_input_exponents()
        return self._gemm(x, self.weight_fake_quant(w), self._quant_bias(b), *extra)

    @classmethod
    def from_float(cls, mod: nn.Module, weight_spec: QuantSpec):
        qat = cls.__new__(cls)
        qat.__dict__.update({k: v for k, v in mod.__dict__.items()})
        # Fresh containers so the QAT module does not share registration dicts with the float one.
        for key in ("_parameters", "_buffers", "_modules"):
            qat.__dict__[key] = dict(mod.__dict__[key])
        qat._init_qat(weight_spec)
        return qat


class QATConv1d(_WeightQuantMixin, nn.Conv1d):
    def _gemm(self, x, w, b, *extra):
        return self._conv_forward(x, w, b)


class QATConv2d(_WeightQuantMixin, nn.Conv2d):
    def _gemm(self, x, w, b, *extra):
        return self._conv_forward(x, w, b)


class _ConvTransposeMixin(_WeightQuantMixin):
    """A transposed conv's weight is ``[in, out / groups, k...]``: its output channels are axis 1. With groups = 1
    the weight is quantized per channel along axis 1 (one scale per output channel, like a conv's axis 0, so the
    int32 bias and the requantize are per output channel); with groups > 1 axis 1 does not index the output
    channels, so the weight gets one scale."""

    _spatial_dims = 1

    @classmethod
    def from_float(cls, mod: nn.Module, weight_spec: QuantSpec):
        if weight_spec.ch_axis is not None:
            weight_spec = QuantSpec(weight_spec.dtype, weight_spec.observer, ch_axis=1 if mod.groups == 1 else None)
        return super().from_float(mod, weight_spec)

    def _gemm(self, x, w, b, output_size=None):
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size,
                                              self._spatial_dims, self.dilation)
        fn = F.conv_transpose1d if self._spatial_dims == 1 else F.conv_transpose2d
        return fn(x, w, b, self.stride, self.padding, output_padding, self.groups, self.dilation)


class QATConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    _spatial_dims = 1


class QATConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    _spatial_dims = 2


class QATLinear(_WeightQuantMixin, nn.Linear):
    output_channel_dim = -1
    folds_input_exponents = True

    def _gemm(self, x, w, b, *extra):
        return F.linear(x, w, b)


class QATEmbedding(_WeightQuantMixin, nn.Embedding):
    """Embedding with a per-tensor weight fake quant; its output is a row of that quantized table."""

    def forward(self, x):
        w = self.weight_fake_quant(self.weight)
        return F.embedding(x, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)


class _FoldedBnMixin(_WeightQuantMixin):
    """conv/linear followed by BatchNorm, folded for quantization.

    * eval (calibration, validation): BN running statistics are folded into the weight and bias, and the
      folded weight is what gets fake-quantized, as the NPU sees it.
    * train (QAT): the folded weight is fake-quantized with the running std, the conv output is scaled back,
      and the real BN runs on it with batch statistics, so running_mean/var keep tracking the data that the
      quantized conv produces (the folding used at eval time stays consistent with training).
    """

    bn: nn.modules.batchnorm._BatchNorm

    def _affine(self, x, w, b):
        raise NotImplementedError

    def _bn_shape(self, x: torch.Tensor) -> list[int]:
        return [1, -1] + [1] * (x.dim() - 2)

    def _fold(self):
        bn = self.bn
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.affine else torch.ones_like(std)
        beta = bn.bias if bn.affine else torch.zeros_like(std)
        factor = gamma / std
        w_shape = [-1] + [1] * (self.weight.dim() - 1)
        bias = self.bias if self.bias is not None else torch.zeros_like(bn.running_mean)
        return self.weight * factor.reshape(w_shape), factor, beta, bias

    def integer_operands(self):
        w, factor, beta, bias = self._fold()
        return w, beta + (bias - self.bn.running_mean) * factor

    def _gemm(self, x, w, b, *extra):
        return self._affine(x, w, b)

    def forward(self, x):
        frozen = _FROZEN_FOLDS.get()
        fold = frozen.of(self) if frozen is not None and not self.training else None
        if fold is not None:
            w, factor, beta, bias, b_fold = fold
            return self._affine(x, self.weight_fake_quant(w), self._quant_bias(b_fold))
        w, factor, beta, bias = self._fold()
        w_fold = self.weight_fake_quant(w)
        if self.training:
            y = self._affine(x, w_fold, None)
            y = y / factor.reshape(self._bn_shape(y)) + bias.reshape(self._bn_shape(y))
            return self.bn(y)
        b_fold = beta + (bias - self.bn.running_mean) * factor
        return self._affine(x, w_fold, self._quant_bias(b_fold))

    @classmethod
    def from_modules(cls, mod: nn.Module, bn: nn.Module, weight_spec: QuantSpec):
        fused = cls.from_float(mod, weight_spec)
        fused.bn = bn
        return fused


class QATConvBn1d(_FoldedBnMixin, nn.Conv1d):
    def _affine(self, x, w, b):
        return self._conv_forward(x, w, b)


class QATConvBn2d(_FoldedBnMixin, nn.Conv2d):
    def _affine(self, x, w, b):
        return self._conv_forward(x, w, b)


class QATLinearBn1d(_FoldedBnMixin, nn.Linear):
    output_channel_dim = -1

    def _affine(self, x, w, b):
        return F.linear(x, w, b)


_QAT_CLASSES = {nn.Conv1d: QATConv1d, nn.Conv2d: QATConv2d, nn.Linear: QATLinear, nn.Embedding: QATEmbedding}
_QAT_CLASSES.update({nn.ConvTranspose1d: QATConvTranspose1d, nn.ConvTranspose2d: QATConvTranspose2d})
_FUSED_CLASSES = {nn.Conv1d: QATConvBn1d, nn.Conv2d: QATConvBn2d, nn.Linear: QATLinearBn1d}


def qat_class_for(module: nn.Module) -> type | None:
    """The QAT class for a float module, by what it computes: ``nn.Conv1d`` -> ``QATConv1d``; a subclass that
    computes as its registered base (an ``__init__`` of its own, a parametrized class) -> a QAT class derived from
    both, so the user's class and its methods stay; ``None`` for a subclass with a ``forward`` of its own (its ops
    are traced one by one and a functional conv/linear quantizes the weight at its op site)."""
    return _class_for(module, _QAT_CLASSES)


def fused_class_for(module: nn.Module) -> type | None:
    """The conv/linear + BatchNorm class for a float module, by what it computes (as :func:`qat_class_for`)."""
    return _class_for(module, _FUSED_CLASSES)


def float_base(module: nn.Module) -> type | None:
    """The registered float class (``nn.Conv2d`` ...) whose op ``module`` computes, or ``None``."""
    base = next((c for c in type(module).__mro__ if c in _QAT_CLASSES), None)
    return base if base is not None and computes_as(type(module), base) else None


def _class_for(module: nn.Module, table: dict[type, type]) -> type | None:
    base = float_base(module)
    qat = table.get(base) if base is not None else None
    if qat is None or type(module) is base:
        return qat
    return _derived_class(qat, type(module))


#: (QAT class, user's float class) -> the QAT class derived from both
_DERIVED: dict[tuple[type, type], type] = {}


def _derived_class(qat: type, user: type) -> type:
    cls = _DERIVED.get((qat, user))
    if cls is None:
        cls = type(f"{qat.__name__}_{user.__name__}", (qat, user),
                   {"__module__": __name__, "__reduce_ex__": _reduce_derived})
        _DERIVED[(qat, user)] = cls
    return cls


def _reduce_derived(self, protocol):
    """A derived class is made at prepare, so pickle (``torch.save`` of a prepared model) rebuilds it from its two
    bases, which are importable."""
    qat, user = type(self).__bases__
    return _new_derived, (qat, user), self.__getstate__()


def _new_derived(qat: type, user: type) -> nn.Module:
    cls = _derived_class(qat, user)
    return cls.__new__(cls)
