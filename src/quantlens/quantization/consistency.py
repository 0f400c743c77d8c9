"""The consistency strategy: how closely the deployed integer model follows the QAT model (``docs/consistency.md``).

``ConsistencyStrategy.set_consistency_level(n)``, called before ``prepare``, selects one of five levels; the
prepared model remembers the level it was built with (``QuantState.consistency``), and export and convert read it
from there. Each level is a set of switches (:class:`ConsistencyConfig`), and every stage reads the switch it
needs, never the level number:

===== ================================================================ ===================== =================
level adds                                                             needs retraining      qpp at convert
===== ================================================================ ===================== =================
off   nothing: the QAT forward is float math + fake quant              no                    default (cheap)
0     the high-precision requantize ("qpp") everywhere                 no                    high precision
1     the QAT forward rounds like the cheap kernels (multiplier, add); yes                   default
      VALIDATION sums GEMMs exactly on the integers, as the NPU does
2     1 + power-of-two activation scales, one scale per add/cat        yes                   default
3     2 + the lookup tables computed in the QAT forward (STE)          yes                   default
4     3 + the training forward sums GEMMs exactly too (bit-exact QAT)  yes                   default
===== ================================================================ ===================== =================

What each stage computes at levels 1-4: the prepared model's QAT/VALIDATION forward computes the integer rules (the
emulation), and so does the quantized IR; the qat IR computes float + fake quant at every level (``export`` traces
the forward with the rules off: :func:`without_integer_rules` runs that forward in eager), so it differs from both
by exactly those rules. The profiler's ``export`` pair therefore runs its pre_export baseline without them, and its
``convert`` pair on a qat IR baseline does not count them as faults (``docs/consistency.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantlens.errors import QuantLensError
from quantlens.march import Qpp

__all__ = ["ConsistencyStrategy", "ConsistencyConfig", "MAX_LEVEL"]

MAX_LEVEL = 4
#: the boolean switches of :class:`ConsistencyConfig`, in the order the levels add them
SWITCHES = ("emulate_integer_rules", "exact_validation", "pow2_activation_scales", "shared_elementwise_scales",
            "tables_in_qat", "exact_training")


@dataclass(frozen=True)
class ConsistencyConfig:
    """What one consistency level switches on. ``level`` is ``None`` when the strategy is off."""

    level: int | None = None
    #: the requantize precision profile convert uses everywhere (level 0: high precision)
    qpp: Qpp = Qpp.DEFAULT
    #: the QAT/VALIDATION forward rounds requantize, add/sub/cat and the other integer rules like the kernels
    #: (values from the integer rule, straight-through gradients)
    emulate_integer_rules: bool = False
    #: activation scales are powers of two (requantize between activations becomes a shift)
    pow2_activation_scales: bool = False
    #: the inputs and the output of every add/sub/cat share one scale (no rescale at the op)
    shared_elementwise_scales: bool = False
    #: the lookup tables of ``docs/march.md`` §13 run in the QAT forward (straight-through gradients)
    tables_in_qat: bool = False
    #: in VALIDATION, GEMMs accumulate exactly on the integers (float64) as the NPU does, so the quantized IR
    #: equals the model wherever the QAT forward computes the same integer rules (levels 1-4; no backward runs
    #: there, so exactness costs only the float64 GEMM)
    exact_validation: bool = False
    #: the training (QAT) forward accumulates exactly too: training sees the deployed values (level 4; a float64
    #: GEMM next to the float32 one that carries the gradient)
    exact_training: bool = False

    @property
    def high_precision_qpp(self) -> bool:
        return self.qpp is Qpp.HIGH_PRECISION

    @property
    def needs_retraining(self) -> bool:
        """Levels 1-4 change what the QAT forward computes, so the model must be (re)trained with them."""
        return self.level is not None and self.level >= 1

    def switches_on(self) -> list[str]:
        """The boolean switches this level turns on, in words (``"tables in qat"``)."""
        return [name.replace("_", " ") for name in SWITCHES if getattr(self, name)]

    def describe(self) -> str:
        if self.level is None:
            return "consistency strategy off (default qpp)"
        parts = [f"qpp {self.qpp.value}"]
        parts += self.switches_on()
        return f"consistency level {self.level}: " + ", ".join(parts)

    @classmethod
    def for_level(cls, level: int | None) -> "ConsistencyConfig":
        if level is None:
            return cls()
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
            raise QuantLensError(
                f"ConsistencyStrategy.set_consistency_level: level must be an int in 0..{MAX_LEVEL} (or None to "
                f"turn the strategy off), got {level!r}. docs/consistency.md describes each level."
            )
        if level == 0:
            return cls(level=0, qpp=Qpp.HIGH_PRECISION)
        return cls(
            level=level,
            emulate_integer_rules=True,
            pow2_activation_scales=level >= 2,
            shared_elementwise_scales=level >= 2,
            tables_in_qat=level >= 3,
            exact_validation=True,
            exact_training=level >= 4,
        )


class ConsistencyStrategy:
    """The seed's high-consistency QAT strategy. Set the level before ``prepare``::

        ConsistencyStrategy.set_consistency_level(2)
        qat = prepare(model, example_inputs)      # remembers level 2
        ConsistencyStrategy.disable()             # later prepares: strategy off

    Levels 1-4 change the QAT forward, so they take effect only with (re)training; level 0 needs none.
    """

    _config: ConsistencyConfig = ConsistencyConfig()

    @classmethod
    def set_consistency_level(cls, level: int | None) -> None:
        """Select level 0..4 for the models prepared from now on (``None``: off, as :meth:`disable`)."""
        cls._config = ConsistencyConfig.for_level(level)

    @classmethod
    def disable(cls) -> None:
        """Turn the strategy off: the models prepared from now on use the default arithmetic."""
        cls._config = ConsistencyConfig()

    @classmethod
    def get_consistency_level(cls) -> int | None:
        return cls._config.level

    @classmethod
    def config(cls) -> ConsistencyConfig:
        """The switches that ``prepare`` will record."""
        return cls._config
