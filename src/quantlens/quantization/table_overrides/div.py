"""The div table override: ``x / y`` by the mantissa reciprocal of ``y``."""

from __future__ import annotations

import torch

from quantlens.kernels import div_multiplier, int_div
from quantlens.quantization.table_calls import float_leaves
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_registry import TableKind


class DivOverride(TableOverride):
    """``x / y`` with both operands quantized: ``x * (1 / y)`` by the mantissa reciprocal. Buffer ``params_q`` =
    [M, shift]."""

    override_kind = TableKind.DIV

    kind = "div"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        # weight/bias: affine parameters, which only layer_norm has (one constructor for every table op)
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_x, s_y = float(input_fqs[0].scale), float(input_fqs[1].scale)
        m = div_multiplier(s_x, s_y, float(output_fq.scale))
        self.register_buffer("params_q", torch.tensor(m, dtype=torch.int64))

    def int_op(self, call, fqs, out_fq):
        if call.kwargs.get("rounding_mode") is not None:  # floor/trunc division is not a table op
            return torch.div(*call.args, **call.kwargs)
        x, y = float_leaves(call)[:2]
        dx, dy, do = fqs[0].dtype, fqs[1].dtype, out_fq.dtype
        return torch.ops.quantlens.int_div(
            x, y, fqs[0].scale, fqs[1].scale, out_fq.scale, self.params_q,
            dx.qmin, dx.qmax, dy.qmin, dy.qmax, do.qmin, do.qmax,
        )

    def error_steps(self):
        s_x, s_y, s_out = self.table_scales.tolist()
        dx, dy, do = self.input_dtypes[0], self.input_dtypes[1], self.output_dtype
        qx = torch.unique(torch.cat([torch.linspace(dx.qmin, dx.qmax, 29).round().long(),
                                     torch.tensor([-1, 0, 1, dx.qmin, dx.qmax])]))[:, None]
        qy = torch.arange(dy.qmin, dy.qmax + 1)[None, :]
        m, s = (int(v) for v in self.params_q.tolist())
        y = int_div(qx, qy, m, s, do).to(torch.float64)
        exact = (qx.double() * s_x) / (qy.double() * s_y) / s_out
        at_zero = torch.where(qx > 0, float(do.qmax), torch.where(qx < 0, float(do.qmin), 0.0)).double()
        exact = torch.where(qy == 0, at_zero.expand_as(exact), exact).clamp(do.qmin, do.qmax)
        return float((y - exact).abs().max()), "grid"

    def describe(self):
        m, s = self.params_q.tolist()
        return f"x * mantissa reciprocal(y), M={m}, shift={s}"
