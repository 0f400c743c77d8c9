"""The elementwise table override: one table per site (256 entries or segmented), or the mantissa reciprocal."""

from __future__ import annotations

import torch

from quantlens.kernels import (
    SegmentedTable,
    Table256,
    elementwise_table,
    int_reciprocal,
    real_function,
    reciprocal_multiplier,
)
from quantlens.march import QuantDType
from quantlens.quantization.table_calls import float_leaves
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_registry import TableKind, table_op_spec


class ElementwiseOverride(TableOverride):
    """The elementwise table ops of the registry (sigmoid, tanh, exp, gelu, silu, softplus, reciprocal, sqrt,
    rsqrt, log, pow, erf, hardswish, hardsigmoid, elu): one table (or, for an int16 reciprocal, the mantissa rule). Buffers: ``entries`` (Table256), or ``bounds``/``shifts``/``entries``/``tails``
    (SegmentedTable), or ``params_q`` = [M, shift] (mantissa reciprocal)."""

    override_kind = TableKind.ELEMENTWISE

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        # weight/bias: affine parameters, which only layer_norm has (one constructor for every table op)
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_in, s_out = float(input_fqs[0].scale), float(output_fq.scale)
        in_dtype, out_dtype = input_fqs[0].dtype, output_fq.dtype
        self.frac_bits = 0
        if in_dtype is QuantDType.qint16 and table_op_spec(op_type).int16 == "mantissa_reciprocal":
            self.kind = "mantissa_reciprocal"
            self.register_buffer("params_q", torch.tensor(reciprocal_multiplier(s_in, s_out), dtype=torch.int64))
            return
        table = elementwise_table(op_type, s_in, s_out, in_dtype, out_dtype, **params)
        if isinstance(table, Table256):
            self.kind = "table256"
            self.register_buffer("entries", table.entries.to(torch.int32))
        else:
            self.kind = "segmented"
            self.frac_bits = table.frac_bits
            self.register_buffer("bounds", table.bounds.clone())
            self.register_buffer("shifts", table.shifts.clone())
            self.register_buffer("entries", table.entries.to(torch.int32))
            self.register_buffer("tails", table.tails.clone())

    def _call_params(self, call):
        params = table_op_spec(self.op_type).params_from_call(call)
        return (self.params if params is None else dict(params)), None, None

    def int_op(self, call, fqs, out_fq):
        for name, value in (table_op_spec(self.op_type).params_from_call(call) or {}).items():
            if self.params.get(name) != value:
                raise self._param_mismatch(name, self.params.get(name), value)
        x = float_leaves(call)[0]
        in_dt, out_dt = fqs[0].dtype, out_fq.dtype
        if self.kind == "table256":
            return torch.ops.quantlens.lut(x, fqs[0].scale, out_fq.scale, self.entries, out_dt.qmin, out_dt.qmax)
        if self.kind == "segmented":
            return torch.ops.quantlens.segment_lut(
                x, fqs[0].scale, out_fq.scale, self.bounds, self.shifts, self.entries, self.tails, self.frac_bits,
                in_dt.qmin, in_dt.qmax, out_dt.qmin, out_dt.qmax,
            )
        return torch.ops.quantlens.int_reciprocal(
            x, fqs[0].scale, out_fq.scale, self.params_q, in_dt.qmin, in_dt.qmax, out_dt.qmin, out_dt.qmax
        )

    def integer(self, q: torch.Tensor) -> torch.Tensor:
        """The site's integer function on input codes."""
        if self.kind == "table256":
            return Table256(self.entries.to(torch.int64), 128).lookup(q)
        if self.kind == "segmented":
            return SegmentedTable(self.bounds, self.shifts, self.entries.to(torch.int64), self.frac_bits,
                                  self.output_dtype.qmin, self.output_dtype.qmax, self.tails).lookup(q)
        m, s = (int(v) for v in self.params_q.tolist())
        return int_reciprocal(q, m, s, self.output_dtype)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        din, dout = self.input_dtypes[0], self.output_dtype
        q = torch.arange(din.qmin, din.qmax + 1, device=self.table_scales.device)
        y = self.integer(q).to(torch.float64)
        exact = (real_function(self.op_type, **self.params)(q.to(torch.float64) * s_in) / s_out)
        exact = torch.nan_to_num(exact, nan=0.0).clamp(dout.qmin, dout.qmax)
        return float((y - exact).abs().max()), "exhaustive"

    def entry_count(self):
        return 0 if self.kind == "mantissa_reciprocal" else int(self.entries.numel())

    def describe(self):
        if self.kind == "segmented":
            k, width = self.entries.shape
            return (f"{k} segments x {width} entries, steps 2**{self.shifts.tolist()}, F={self.frac_bits}, "
                    f"domain [{int(self.bounds[0])}, {int(self.bounds[-1]) - 1}], tails {self.tails.tolist()}")
        if self.kind == "mantissa_reciprocal":
            m, s = self.params_q.tolist()
            return f"mantissa reciprocal, M={m}, shift={s}"
        return "256 entries, index q + 128"
