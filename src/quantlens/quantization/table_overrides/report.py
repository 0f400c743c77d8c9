"""What ``pre_export_report`` reports per table site (:class:`LutSiteInfo`), and the seeded probe rows on which the
softmax and layer_norm overrides measure their error."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlens.march import QuantDType

PROBE_ROWS = 256


@dataclass(frozen=True)
class LutSiteInfo:
    """One table site of a pre_export model (see :func:`pre_export_report`).

    ``max_error_steps`` is the largest ``|table output - exact result|`` in output steps, where the exact result
    is the real function on the quantized input(s), divided by the output scale and saturated (not rounded: a
    perfect table still shows up to 0.5). ``error_basis`` says over which inputs: ``"exhaustive"`` (every
    input code), ``"grid"`` (div: 29 evenly spaced numerator codes and -1, 0, 1, times every divisor code) or
    ``"probe"`` (softmax and layer_norm: 256 seeded rows of the site's recorded row length).
    """

    site: str
    op_type: str
    input_dtypes: tuple[str, ...]
    input_scales: tuple[float, ...]
    output_dtype: str
    output_scale: float
    table_kind: str
    table_entries: int
    max_error_steps: float
    error_basis: str
    enabled: bool
    detail: str


def probe_rows(dtype: QuantDType, length: int) -> torch.Tensor:
    """Seeded rows of input codes: each row has its own centre and spread (from 1 code to the full range)."""
    gen = torch.Generator().manual_seed(0)
    spread = 2.0 ** (torch.rand(PROBE_ROWS, 1, generator=gen, dtype=torch.float64) * (dtype.bits - 1))
    centre = (torch.rand(PROBE_ROWS, 1, generator=gen, dtype=torch.float64) - 0.5) * dtype.qmax
    values = centre + spread * torch.randn(PROBE_ROWS, length, generator=gen, dtype=torch.float64)
    return values.round().clamp(dtype.qmin, dtype.qmax).to(torch.int64)
