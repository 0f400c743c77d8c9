"""The integer rules inside the prepared model's forward (consistency levels 1-4, ``docs/consistency.md``).

The plain fake-quant forward computes each op in float and rounds its output once. The NPU instead requantizes
with an integer multiplier (``docs/march.md`` §8), rounds the terms of an add (§10), sums windows exactly (§10.2)...
With the consistency strategy on, :class:`IntegerEmulator` makes the forward compute those rules: at every op
with an output fake quant, the value is what the integer kernel computes from the op's input integers, and (in
QAT) the gradient is the fake quant's straight-through gradient (``float + (integer - float).detach()``).

It calls the very kernels of the quantized IR (``quantlens.kernels``) with the parameters of the spec's rules
(``quantlens.march.rules``, which convert calls too), so there is one implementation of each rule. GEMMs accumulate exactly on the integers in float64 (``exact``: VALIDATION at
levels 1-4, the training forward at level 4), which makes the model equal to the quantized IR wherever it computes
the same rules; otherwise (training below level 4) their float32 result is rounded to the accumulator's integers.

An op whose output is not quantized at once (a conv whose BatchNorm and ReLU are fused after it, an add with a
fused ReLU) leaves a :class:`Deferred` value: the integer computation waits for the fake quant that ends the
chain, as convert requantizes straight to it, and the movement ops on the way (relu, reshape, max-pool) are
applied to the integers.

The package: :mod:`.core` (the emulator, deferred values, the rule registry ``EMULATED_OPS``) and :mod:`.ops` (one
rule per op type).
"""

from quantlens.quantization.emulation import ops  # noqa: F401 (fills EMULATED_OPS)
from quantlens.quantization.emulation.core import (
    EMULATED_OPS,
    Deferred,
    EmuCall,
    IntegerEmulator,
    codes_of,
    current_emulator,
)

__all__ = ["IntegerEmulator", "Deferred", "EmuCall", "current_emulator", "EMULATED_OPS", "codes_of"]
