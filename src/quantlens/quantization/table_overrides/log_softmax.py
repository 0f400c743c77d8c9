"""The log_softmax table override (``docs/march.md`` §13.6.1): the softmax's exp table and sum, the ``ln`` of that
sum by the ln mantissa table, and one rounded shift onto the output grid."""

from __future__ import annotations

import torch

from quantlens.kernels import exp_bits, int_log_softmax
from quantlens.march import rules
from quantlens.quantization.table_calls import float_leaves, softmax_call
from quantlens.quantization.table_overrides.softmax import SoftmaxOverride
from quantlens.quantization.table_registry import TableKind

__all__ = ["LogSoftmaxOverride"]


class LogSoftmaxOverride(SoftmaxOverride):
    """Integer log_softmax. Buffers: the softmax's exp table (``exp_entries``, and ``exp_bounds``/``exp_shifts``/
    ``exp_tails`` for an int16 input) and ``params_q`` = [M_x, M_l, T] (``quantlens.march.rules.log_softmax``)."""

    override_kind = TableKind.LOG_SOFTMAX

    kind = "log_softmax"

    def _output_params(self, s_in: float, s_out: float) -> list[int]:
        p = rules.log_softmax(s_in, s_out, self.output_dtype)
        return [p["multiplier"], p["ln_multiplier"], p["shift"]]

    def int_op(self, call, fqs, out_fq):
        x = float_leaves(call)[0]
        dim, dtype = softmax_call(call, self.site)
        di, do = fqs[0].dtype, out_fq.dtype
        y = torch.ops.quantlens.int_log_softmax(
            x, fqs[0].scale, out_fq.scale, self.exp_bounds, self.exp_shifts, self.exp_entries, self.exp_tails,
            self.params_q, dim, self.exp_frac_bits, di.qmin, di.qmax, do.qmin, do.qmax,
        )
        return y if dtype is None else y.to(dtype)

    def integer(self, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
        m_x, m_ln, shift = (int(v) for v in self.params_q.tolist())
        return int_log_softmax(q, dim, self.exp_table(), m_x, m_ln, shift, self.output_dtype)

    @staticmethod
    def _exact_op(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, -1)

    def describe(self):
        kind = "256 entries" if self.exp_bounds.numel() == 0 else (
            f"segmented {tuple(self.exp_entries.shape)}, domain [{int(self.exp_bounds[0])}, 0]")
        m_x, m_ln, shift = self.params_q.tolist()
        return (f"exp table {kind} at 2**-{exp_bits(self.output_dtype)}, ln mantissa table at 2**-24; output "
                f"M_x={m_x}, M_l={m_ln}, shift={shift}")
