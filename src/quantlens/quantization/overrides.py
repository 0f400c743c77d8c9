"""Site overrides: replace the computation of one op site in a prepared model.

``pre_export`` uses them to make nonlinear ops compute through the march's integer lookup tables. An override
receives the site's inputs after input fake quant, the fake quants that produced its float inputs (their
scales are the integer input scales) and the site's output fake quant; it returns the op's output. The runtime
then applies the output fake quant as usual, which is exact for an output already on the output grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from quantlens.quantization.fake_quantize import FakeQuantize

__all__ = ["OverrideCall", "SiteOverride"]


@dataclass
class OverrideCall:
    site: str
    op_type: str
    args: tuple
    kwargs: dict
    module: nn.Module | None  # the module of a module site (e.g. the nn.LayerNorm holding gamma/beta)
    input_fqs: list[FakeQuantize | None]  # per float tensor input, in flattened (args, kwargs) order
    output_fq: FakeQuantize | None
    func: Any = None  # the torch function of a function site (None for module sites)


class SiteOverride(nn.Module):
    """Base class; subclasses implement :meth:`compute`. Being a module, its tables are buffers (state_dict)."""

    def compute(self, call: OverrideCall) -> Any:
        raise NotImplementedError

    def observes_output(self) -> bool:
        """Whether :meth:`compute` has already fed the output fake quant's observer (QAT), so the runtime only
        fake-quantizes the result (default: the runtime's output fake quant observes it, as at any site)."""
        return False

    def forward(self, call: OverrideCall) -> Any:  # pragma: no cover - compute() is the entry point
        return self.compute(call)
