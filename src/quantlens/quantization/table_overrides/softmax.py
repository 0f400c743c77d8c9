"""The softmax table override: the exp table and the integer normalization."""

from __future__ import annotations

import torch

from quantlens.kernels import (
    SegmentedTable,
    Table256,
    exp_bits,
    exp_table_from,
    int_softmax,
    softmax_exp_table,
    softmax_multiplier,
)
from quantlens.quantization.table_calls import float_leaves, softmax_call
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_overrides.report import probe_rows
from quantlens.quantization.table_registry import TableKind


class SoftmaxOverride(TableOverride):
    """Integer softmax. Buffers: ``exp_entries`` (+ ``exp_bounds``/``exp_shifts``/``exp_tails`` for an int16
    input; empty for an int8 input) and ``params_q`` = [M, shift]."""

    override_kind = TableKind.SOFTMAX

    kind = "softmax"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        # weight/bias: affine parameters, which only layer_norm has (one constructor for every table op)
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_in, s_out = float(input_fqs[0].scale), float(output_fq.scale)
        table = softmax_exp_table(s_in, input_fqs[0].dtype, output_fq.dtype)
        if isinstance(table, Table256):
            self.exp_frac_bits = 0
            self.register_buffer("exp_bounds", torch.zeros(0, dtype=torch.int64))
            self.register_buffer("exp_shifts", torch.zeros(0, dtype=torch.int64))
            self.register_buffer("exp_tails", torch.zeros(0, dtype=torch.int64))
        else:
            self.exp_frac_bits = table.frac_bits
            self.register_buffer("exp_bounds", table.bounds.clone())
            self.register_buffer("exp_shifts", table.shifts.clone())
            self.register_buffer("exp_tails", table.tails.clone())
        self.register_buffer("exp_entries", table.entries.to(torch.int32))
        self.register_buffer("params_q", torch.tensor(self._output_params(s_in, s_out), dtype=torch.int64))

    def _output_params(self, s_in: float, s_out: float) -> list[int]:
        """The integer constants of the output step: ``[M, shift]``."""
        return list(softmax_multiplier(s_out))

    def int_op(self, call, fqs, out_fq):
        x = float_leaves(call)[0]
        dim, dtype = softmax_call(call, self.site)
        di, do = fqs[0].dtype, out_fq.dtype
        y = torch.ops.quantlens.int_softmax(
            x, fqs[0].scale, out_fq.scale, self.exp_bounds, self.exp_shifts, self.exp_entries, self.exp_tails,
            self.params_q, dim, self.exp_frac_bits, di.qmin, di.qmax, do.qmin, do.qmax,
        )
        return y if dtype is None else y.to(dtype)

    def exp_table(self) -> Table256 | SegmentedTable:
        return exp_table_from(self.exp_bounds, self.exp_shifts, self.exp_entries.to(torch.int64), self.exp_tails,
                              self.exp_frac_bits, self.output_dtype)

    def integer(self, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
        m, s = (int(v) for v in self.params_q.tolist())
        return int_softmax(q, dim, self.exp_table(), m, s, self.output_dtype)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        length = int(self.params.get("length", 16))
        q = probe_rows(self.input_dtypes[0], length).to(self.table_scales.device)
        y = self.integer(q).to(torch.float64)
        do = self.output_dtype
        exact = (self._exact_op(q.to(torch.float64) * s_in) / s_out).clamp(do.qmin, do.qmax)
        return float((y - exact).abs().max()), "probe"

    @staticmethod
    def _exact_op(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)

    def entry_count(self):
        return int(self.exp_entries.numel())

    def describe(self):
        kind = "256 entries" if self.exp_bounds.numel() == 0 else (
            f"segmented {tuple(self.exp_entries.shape)}, domain [{int(self.exp_bounds[0])}, 0]")
        m, s = self.params_q.tolist()
        return f"exp table {kind} at 2**-{exp_bits(self.output_dtype)}; output M={m}, shift={s}"
