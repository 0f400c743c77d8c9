"""The base of the normalizing table overrides (layer_norm, rms_norm, F.normalize): integer constants per normalized
element (``gain``, ``bias``) and the mantissa rsqrt's ``params_q = [eps_term, shift, frac_bits]``, the float
gamma/beta they were built from, and their error measured on probe rows."""

from __future__ import annotations

import math
from typing import Callable

import torch

from quantlens.errors import QuantLensError
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_overrides.report import PROBE_ROWS, probe_rows

__all__ = ["GainTable"]


def _same(now: torch.Tensor | None, ref: torch.Tensor) -> bool:
    """Whether a call's affine parameter is the one the constants were built from (``ref`` empty: none)."""
    return (now is None and ref.numel() == 0) or (
        now is not None and now.shape == ref.shape and torch.equal(now.detach().to(ref), ref))


class GainTable(TableOverride):
    """Buffers ``gain``/``bias`` (int64 per normalized element), ``params_q = [eps_term, shift, frac_bits]``, and
    for each affine parameter the op takes (layer_norm: both, rms_norm: the weight) ``weight_ref``/``bias_ref``, the
    float values the constants were built from (empty when the call passed none)."""

    #: appended to :meth:`describe` (what this kernel leaves out of a layer norm)
    describe_suffix = ""

    def _store(self, c, **affine: torch.Tensor | None) -> None:
        """Register the kernel's constants ``c`` and a ``<name>_ref`` buffer for each affine parameter given."""
        self.register_buffer("gain", c.gain)
        self.register_buffer("bias", c.bias)
        self.register_buffer("params_q", torch.tensor([c.eps_term, c.shift, c.frac_bits], dtype=torch.int64))
        for name, t in affine.items():
            self.register_buffer(f"{name}_ref", torch.empty(0) if t is None else t.detach().to(torch.float32).clone())

    def _ref(self, name: str) -> torch.Tensor:
        return getattr(self, f"{name}_ref", None) if f"{name}_ref" in self._buffers else torch.empty(0)

    def _same_affine(self, weight, bias) -> bool:
        return _same(weight, self._ref("weight")) and _same(bias, self._ref("bias"))

    def _check_affine(self, weight, bias) -> None:
        """Raise when the call's gamma/beta are not the ones the integer constants were built from."""
        for name, now in (("weight", weight), ("bias", bias)):
            if not _same(now, self._ref(name)):
                raise QuantLensError(
                    f"The {self.kind} {name} of op site '{self.site}' changed after pre_export (its integer "
                    "constants were built from the old values). Run pre_export again on the updated model.")

    def _affine_refs(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """gamma and beta in float64 (``None`` where the op has none), for the exact reference."""
        return tuple(r.to(torch.float64) if r.numel() else None for r in (self._ref("weight"), self._ref("bias")))

    def integer(self, q: torch.Tensor, normalized_ndim: int) -> torch.Tensor:
        """The kernel on integer codes ``q`` normalized over their last ``normalized_ndim`` dims."""
        raise NotImplementedError

    def _probe_error(self, shape: tuple[int, ...], exact_fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, str]:
        """Max error in output steps on probe rows of ``shape`` against ``exact_fn`` in float64."""
        s_in, s_out = float(self.table_scales[0]), self.table_scales[1:].to(torch.float64)  # (per channel: §3.1)
        n = int(math.prod(shape))
        q = probe_rows(self.input_dtypes[0], n).reshape(PROBE_ROWS, *shape).to(self.table_scales.device)
        y = self.integer(q, len(shape)).to(torch.float64)
        exact = exact_fn(q.to(torch.float64) * s_in) / (s_out if s_out.numel() > 1 else s_out.reshape(()))
        do = self.output_dtype
        return float((y - exact.clamp(do.qmin, do.qmax)).abs().max()), "probe"

    def entry_count(self):
        return int(self.gain.numel() + self.bias.numel())

    def describe(self):
        eps_term, shift, frac = self.params_q.tolist()
        return f"N={self.gain.numel()}, P={frac}, eps_term={eps_term}, shift={shift}, mantissa rsqrt{self.describe_suffix}"
