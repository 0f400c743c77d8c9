"""QConfig: what dtype and observer each tensor of an op site gets.

A :class:`QConfig` carries three optional :class:`QuantSpec` s:

* ``input``: used when an input reaches the op unquantized (e.g. a constant, or a tensor whose producer keeps
  int32 high precision), or with a dtype the march forbids for this op (int16 x int16 GEMM);
* ``weight``: per-channel (axis 0) for conv/linear, per-tensor for embedding;
* ``output``: the op's output. ``qint32`` means "high precision": the output is not rounded to int8/int16 (only
  legal for a conv/linear, the march's int32 output).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType

__all__ = ["QuantSpec", "QConfig", "get_qconfig"]


def _default_observer():
    from quantlens.quantization.observers import MinMaxObserver

    return MinMaxObserver


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized: dtype, observer factory, and per-channel axis (``None`` = per-tensor)."""

    dtype: QuantDType
    observer: Callable = field(default_factory=_default_observer)
    ch_axis: int | None = None
    #: LSQ-style learned scale in QAT (per-tensor activations): the observer calibrates it, then QAT trains it
    #: with straight-through gradients (``FakeQuantize``); VALIDATION, export and convert use the learned value
    learn_scale: bool = False
    #: per-channel scales in channel-exponent form ``s · 2**-k_c`` (``docs/march.md`` §3.1; an int8 activation
    #: with ``ch_axis``): a tensor with a few outlier channels (a residual stream) keeps the others' resolution
    channel_exponents: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", QuantDType.parse(self.dtype))
        if self.channel_exponents and (self.ch_axis is None or self.dtype is not QuantDType.qint8):
            raise QuantLensError(
                f"QuantSpec: channel_exponents needs a per-channel (ch_axis) qint8 spec, got ch_axis={self.ch_axis} "
                f"and {self.dtype.value} (docs/march.md §3.1: the shifted codes must fit int16).")
        if not callable(self.observer):
            raise QuantLensError(
                f"QuantSpec.observer must be an observer class or factory (e.g. MinMaxObserver.with_args(...)), "
                f"got {self.observer!r}."
            )

    def describe(self) -> str:
        """Short text used in model_check_result.txt, e.g. ``qint8 MinMaxObserver(avg=0.01) ch0``."""
        obs = getattr(self.observer, "func", self.observer)
        name = getattr(obs, "__name__", type(obs).__name__)
        kwargs = getattr(self.observer, "keywords", None) or {}
        args = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
        text = f"{self.dtype.value} {name}({args})"
        text += "" if self.ch_axis is None else f" ch{self.ch_axis}"
        text += " exponents" if self.channel_exponents else ""
        return text + (" learned-scale" if self.learn_scale else "")

    def with_dtype(self, dtype: QuantDType | str) -> "QuantSpec":
        """The same spec at ``dtype``; channel exponents (an int8 form) become one scale for the tensor at any other
        dtype (int16's finer step is what they stood in for)."""
        dtype = QuantDType.parse(dtype)
        if self.channel_exponents and dtype is not QuantDType.qint8:
            return replace(self, dtype=dtype, ch_axis=None, channel_exponents=False)
        return replace(self, dtype=dtype)


@dataclass(frozen=True)
class QConfig:
    """Quantization of one op site. ``activation`` is accepted as an alias of ``output``."""

    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    output: QuantSpec | None = None

    def __init__(self, input=None, weight=None, output=None, activation=None):
        if activation is not None and output is not None:
            raise QuantLensError("QConfig got both output= and its alias activation=; pass only output=.")
        for name, spec in (("input", input), ("weight", weight), ("output", output or activation)):
            if spec is not None and not isinstance(spec, QuantSpec):
                raise QuantLensError(f"QConfig.{name} must be a QuantSpec or None, got {type(spec).__name__}.")
        object.__setattr__(self, "input", input)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "output", output if output is not None else activation)

    @property
    def high_precision_output(self) -> bool:
        return self.output is not None and self.output.dtype is QuantDType.qint32

    def replace(self, **changes) -> "QConfig":
        values = {"input": self.input, "weight": self.weight, "output": self.output}
        values.update(changes)
        return QConfig(**values)


def get_qconfig(
    observer: Callable | None = None,
    in_dtype: QuantDType | str | None = None,
    weight_dtype: QuantDType | str = "qint8",
    out_dtype: QuantDType | str = "qint8",
    weight_observer: Callable | None = None,
    learn_scale: bool = False,
) -> QConfig:
    """Build a QConfig the way the templates do: per-tensor activations, per-channel (axis 0) weights.
    ``learn_scale``: the activation scales are learned in QAT (LSQ, see :class:`QuantSpec`)."""
    from quantlens.quantization.observers import MinMaxObserver

    observer = observer or MinMaxObserver
    out = QuantSpec(QuantDType.parse(out_dtype), observer, learn_scale=learn_scale)
    return QConfig(
        input=None if in_dtype is None else QuantSpec(QuantDType.parse(in_dtype), observer, learn_scale=learn_scale),
        weight=QuantSpec(QuantDType.parse(weight_dtype), weight_observer or MinMaxObserver, ch_axis=0),
        output=out,
    )
