"""The spec layer: the integer NPU ("march") quantlens targets, in code.

Every other layer points down to this one, and this one imports nothing of quantlens but :mod:`quantlens.errors`:

* :mod:`.spec`: the march's numbers (dtypes, rounding, requantize profiles, cost model) and the current march;
* :mod:`.numerics`: the integer primitives of ``docs/march.md`` (quantize, rounding shifts, multipliers);
* :mod:`.opset`: the one declaration of every op (category, stage support, cost kind);
* :mod:`.functions`: the spec half of each elementwise table op (its real function, float op, int16 rule);
* :mod:`.rules`: one function per op family from scales and constants to a kernel's integer parameters, called
  by convert and by the fake quant's emulation alike.
"""

from quantlens.march.spec import *  # noqa: F401,F403 - the spec's public names, as quantlens.march.X
from quantlens.march.spec import __all__ as _spec_all

__all__ = list(_spec_all)
