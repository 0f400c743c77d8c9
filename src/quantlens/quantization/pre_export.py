"""``pre_export``: compute every nonlinear op of a calibrated/QAT model through the march's integer tables.

``pre_export(model)`` returns a copy of a prepared model in which each op that the march computes by table
(``docs/march.md`` §13) runs its integer emulation instead of the float op: sigmoid, tanh, exp, gelu, silu,
softplus, reciprocal, ``x / y`` with a quantized ``y``, softmax and layer_norm. The integer arithmetic lives in
:mod:`quantlens.kernels`, which the integer simulator calls too, so the copy's outputs are the march's bits.

Each table site gets a :class:`~quantlens.quantization.overrides.SiteOverride` in ``QuantState.overrides`` (its
tables and constants are buffers, so ``state_dict`` and ``deepcopy`` carry them) and ``plan.override`` names it.
Op site names do not change. The tables are built from the calibrated scales when ``pre_export`` runs; the
result is meant for evaluation in ``FakeQuantState.VALIDATION`` (which ``pre_export`` sets), and for
``torch.export``, where every table op is one ``torch.ops.quantlens`` node.

    >>> qat.eval(); set_fake_quantize(qat, FakeQuantState.VALIDATION)
    >>> table_model = pre_export(qat)
    >>> for info in pre_export_report(table_model): print(info.site, info.max_error_steps)
    >>> set_lut_enabled(table_model, ["act"], False)   # site "act" computes the QAT float op again
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.kernels import (
    SegmentedTable,
    Table256,
    div_multiplier,
    elementwise_table,
    exp_bits,
    int_div,
    int_layer_norm,
    int_reciprocal,
    int_softmax,
    layer_norm_constants,
    real_function,
    reciprocal_multiplier,
    softmax_exp_table,
    softmax_multiplier,
)
from quantlens.march import QuantDType
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, set_fake_quantize
from quantlens.quantization.decompositions import SdpaDecomposition
from quantlens.quantization.overrides import OverrideCall, SiteOverride
from quantlens.quantization.plan import OutputMode, SitePlan, fq_key
from quantlens.quantization.prepare import QuantState, is_prepared
from quantlens.quantization.record import OpSiteRecord, call_model
from quantlens.quantization.tracer import is_float_tensor

__all__ = [
    "TABLE_OPS",
    "pre_export",
    "pre_export_report",
    "set_lut_enabled",
    "lut_sites",
    "lut_errors",
    "LutSiteInfo",
    "TableOverride",
]

#: op types that the march computes by table (``docs/march.md`` §13).
TABLE_OPS = ("sigmoid", "tanh", "exp", "gelu", "silu", "softplus", "reciprocal", "div", "layer_norm", "softmax")

_ROLE = "lut"  # QuantState.overrides key: fq_key(site, "lut")
_PROBE_ROWS = 256


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


# ------------------------------------------------------------------------------------------------------------
# overrides


def _float_leaves(call: OverrideCall) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves((call.args, call.kwargs)) if is_float_tensor(x)]


def _arg(call: OverrideCall, position: int, name: str, default: Any) -> Any:
    if name in call.kwargs:
        return call.kwargs[name]
    if len(call.args) > position:
        return call.args[position]
    return default


def _exporting() -> bool:
    return torch.compiler.is_compiling()


def _elementwise_params(op_type: str, call: OverrideCall) -> dict[str, Any]:
    """The call's arguments that an elementwise table depends on."""
    module = call.module
    if op_type == "gelu":
        return {"approximate": module.approximate if module is not None else _arg(call, 1, "approximate", "none")}
    if op_type == "softplus":
        return {"beta": float(_arg(call, 1, "beta", 1.0)), "threshold": float(_arg(call, 2, "threshold", 20.0))}
    return {}


def _softmax_call(call: OverrideCall, site: str) -> tuple[int, torch.dtype | None]:
    if call.module is not None:
        dim, dtype = call.module.dim, None
    else:
        dim = _arg(call, 1, "dim", None)
        dtype = call.kwargs.get("dtype")
        if dtype is None and len(call.args) > 2 and isinstance(call.args[2], torch.dtype):
            dtype = call.args[2]
    if dim is None:
        raise QuantLensError(
            f"Op site '{site}': softmax without an explicit dim cannot be computed by table. Pass dim= "
            "(e.g. torch.softmax(x, dim=-1))."
        )
    return int(dim), dtype


def _layer_norm_call(call: OverrideCall):
    """(normalized_shape, weight, bias, eps) of a layer_norm call (module or function)."""
    m = call.module
    if m is not None:
        return tuple(m.normalized_shape), m.weight, m.bias, float(m.eps)
    shape = _arg(call, 1, "normalized_shape", None)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return shape, _arg(call, 2, "weight", None), _arg(call, 3, "bias", None), float(_arg(call, 4, "eps", 1e-5))


def _float_op(op_type: str, call: OverrideCall, site: str = "") -> Any:
    """The site's float op (what the prepared model computes before its output fake quant)."""
    if op_type == "div":
        return torch.div(*call.args, **call.kwargs)
    x = _float_leaves(call)[0]
    if op_type == "softmax":
        dim, dtype = _softmax_call(call, site)
        return torch.softmax(x, dim, dtype=dtype)
    if op_type == "layer_norm":
        shape, w, b, eps = _layer_norm_call(call)
        return F.layer_norm(x, shape, w, b, eps)
    if op_type == "reciprocal":
        return torch.reciprocal(x)
    return real_function(op_type, **_elementwise_params(op_type, call))(x)


class TableOverride(SiteOverride):
    """Base of pre_export's site overrides.

    Buffers: ``table_scales`` (float32: the input scales then the output scale the tables were built for) and
    the subclass's tables/constants. The fake quants found when the site was built are kept (unregistered) as a
    fallback for inputs that the runtime does not mark (inputs quantized at the op itself).
    """

    kind = ""

    def __init__(self, site: str, op_type: str, input_fqs: list[FakeQuantize], output_fq: FakeQuantize,
                 params: dict[str, Any]):
        super().__init__()
        self.site = site
        self.op_type = op_type
        self.input_dtypes = tuple(fq.dtype for fq in input_fqs)
        self.output_dtype = output_fq.dtype
        #: the op parameters the tables were built for (gelu approximate, softplus beta/threshold, eps ...)
        self.params = dict(params)
        scales = [float(fq.scale) for fq in input_fqs] + [float(output_fq.scale)]
        self.register_buffer("table_scales", torch.tensor(scales, dtype=torch.float32))
        self.__dict__["_static_fqs"] = (list(input_fqs), output_fq)

    # -- helpers --------------------------------------------------------------------------------------------
    def _fqs(self, call: OverrideCall) -> tuple[list[FakeQuantize], FakeQuantize]:
        static_in, static_out = self.__dict__["_static_fqs"]
        live = list(call.input_fqs)
        fqs = []
        for i, fallback in enumerate(static_in):
            fq = live[i] if i < len(live) and live[i] is not None else fallback
            fqs.append(fq)
        return fqs, call.output_fq if call.output_fq is not None else static_out

    def _check(self, fqs: list[FakeQuantize], out_fq: FakeQuantize) -> None:
        """Eager only: the tables must match the fake quants' current scales and dtypes."""
        if _exporting():
            return
        built = self.table_scales.tolist()
        now = [float(fq.scale) for fq in fqs] + [float(out_fq.scale)]
        dtypes = tuple(fq.dtype for fq in fqs) + (out_fq.dtype,)
        if now != built or dtypes != self.input_dtypes + (self.output_dtype,):
            raise QuantLensError(
                f"The lookup table of op site '{self.site}' ({self.op_type}) was built for scales {built} "
                f"(inputs, output) but the model's fake quants now have {now}: the model was calibrated, "
                "trained or loaded after pre_export. Run pre_export again on the updated model (and evaluate "
                "pre_export models in FakeQuantState.VALIDATION, where scales are frozen)."
            )

    def _param_mismatch(self, name: str, built: Any, now: Any) -> QuantLensError:
        return QuantLensError(
            f"Op site '{self.site}' ({self.op_type}) is called with {name}={now!r}, but its table was built for "
            f"{name}={built!r}. A function call's arguments are only seen when the model runs: pass "
            "example_inputs to pre_export(model, example_inputs=...) so the tables are built for the real call."
        )

    def compute(self, call: OverrideCall) -> Any:
        fqs, out_fq = self._fqs(call)
        if not out_fq.fake_quant_enabled:  # FLOAT / CALIBRATION: the float op, like the prepared model
            return self.float_op(call)
        self._check(fqs, out_fq)
        out = self.int_op(call, fqs, out_fq)
        errors = self.__dict__.get("_errors")
        if errors is not None:  # lut_errors(): the QAT result on the same input, in output steps
            ref = out_fq(self.float_op(call))
            errors.append(float(((out.float() - ref.float()).abs() / out_fq.scale).max()) if out.numel() else 0.0)
        return out

    def float_op(self, call: OverrideCall) -> Any:
        return _float_op(self.op_type, call, self.site)

    def int_op(self, call: OverrideCall, fqs: list[FakeQuantize], out_fq: FakeQuantize) -> Any:
        raise NotImplementedError

    # -- report ---------------------------------------------------------------------------------------------
    def info(self, enabled: bool) -> LutSiteInfo:
        error, basis = self.error_steps()
        scales = self.table_scales.tolist()
        return LutSiteInfo(
            site=self.site, op_type=self.op_type, input_dtypes=tuple(d.value for d in self.input_dtypes),
            input_scales=tuple(scales[:-1]), output_dtype=self.output_dtype.value, output_scale=scales[-1],
            table_kind=self.kind, table_entries=self.entry_count(), max_error_steps=error, error_basis=basis,
            enabled=enabled, detail=self.describe(),
        )

    def error_steps(self) -> tuple[float, str]:
        raise NotImplementedError

    def entry_count(self) -> int:
        return 0

    def describe(self) -> str:
        return ""

    def extra_repr(self) -> str:
        dts = ", ".join(d.value for d in self.input_dtypes)
        return f"site={self.site!r}, {self.op_type}, kind={self.kind}, in=({dts}), out={self.output_dtype.value}"


class ElementwiseOverride(TableOverride):
    """sigmoid, tanh, exp, gelu, silu, softplus, reciprocal: one table (or, for an int16 reciprocal, the
    mantissa rule). Buffers: ``entries`` (Table256), or ``bounds``/``shifts``/``entries``/``tails``
    (SegmentedTable), or ``params_q`` = [M, shift] (mantissa reciprocal)."""

    def __init__(self, site, op_type, input_fqs, output_fq, params):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_in, s_out = float(input_fqs[0].scale), float(output_fq.scale)
        in_dtype, out_dtype = input_fqs[0].dtype, output_fq.dtype
        self.frac_bits = 0
        if op_type == "reciprocal" and in_dtype is QuantDType.qint16:
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

    def int_op(self, call, fqs, out_fq):
        for name, value in _elementwise_params(self.op_type, call).items():
            if self.params.get(name) != value:
                raise self._param_mismatch(name, self.params.get(name), value)
        x = _float_leaves(call)[0]
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


class DivOverride(TableOverride):
    """``x / y`` with both operands quantized: ``x * (1 / y)`` by the mantissa reciprocal. Buffer ``params_q`` =
    [M, shift]."""

    kind = "div"

    def __init__(self, site, op_type, input_fqs, output_fq, params):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_x, s_y = float(input_fqs[0].scale), float(input_fqs[1].scale)
        m = div_multiplier(s_x, s_y, float(output_fq.scale))
        self.register_buffer("params_q", torch.tensor(m, dtype=torch.int64))

    def int_op(self, call, fqs, out_fq):
        if call.kwargs.get("rounding_mode") is not None:  # floor/trunc division is not a table op
            return torch.div(*call.args, **call.kwargs)
        x, y = _float_leaves(call)[:2]
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


class SoftmaxOverride(TableOverride):
    """Integer softmax. Buffers: ``exp_entries`` (+ ``exp_bounds``/``exp_shifts``/``exp_tails`` for an int16
    input; empty for an int8 input) and ``params_q`` = [M, shift]."""

    kind = "softmax"

    def __init__(self, site, op_type, input_fqs, output_fq, params):
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
        self.register_buffer("params_q", torch.tensor(softmax_multiplier(s_out), dtype=torch.int64))

    def int_op(self, call, fqs, out_fq):
        x = _float_leaves(call)[0]
        dim, dtype = _softmax_call(call, self.site)
        di, do = fqs[0].dtype, out_fq.dtype
        y = torch.ops.quantlens.int_softmax(
            x, fqs[0].scale, out_fq.scale, self.exp_bounds, self.exp_shifts, self.exp_entries, self.exp_tails,
            self.params_q, dim, self.exp_frac_bits, di.qmin, di.qmax, do.qmin, do.qmax,
        )
        return y if dtype is None else y.to(dtype)

    def exp_table(self) -> Table256 | SegmentedTable:
        top = 1 << exp_bits(self.output_dtype)
        if self.exp_bounds.numel() == 0:
            return Table256(self.exp_entries.to(torch.int64), 255, 0, top)
        return SegmentedTable(self.exp_bounds, self.exp_shifts, self.exp_entries.to(torch.int64),
                              self.exp_frac_bits, 0, top, self.exp_tails)

    def integer(self, q: torch.Tensor, dim: int = -1) -> torch.Tensor:
        m, s = (int(v) for v in self.params_q.tolist())
        return int_softmax(q, dim, self.exp_table(), m, s, self.output_dtype)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        length = int(self.params.get("length", 16))
        q = _probe_rows(self.input_dtypes[0], length).to(self.table_scales.device)
        y = self.integer(q).to(torch.float64)
        do = self.output_dtype
        exact = (torch.softmax(q.to(torch.float64) * s_in, -1) / s_out).clamp(do.qmin, do.qmax)
        return float((y - exact).abs().max()), "probe"

    def entry_count(self):
        return int(self.exp_entries.numel())

    def describe(self):
        kind = "256 entries" if self.exp_bounds.numel() == 0 else (
            f"segmented {tuple(self.exp_entries.shape)}, domain [{int(self.exp_bounds[0])}, 0]")
        m, s = self.params_q.tolist()
        return f"exp table {kind} at 2**-{exp_bits(self.output_dtype)}; output M={m}, shift={s}"


class LayerNormOverride(TableOverride):
    """Integer layer_norm. Buffers: ``gain``/``bias`` (int64 per normalized element), ``params_q`` =
    [eps_term, shift, frac_bits], and ``weight_ref``/``bias_ref`` (the float gamma/beta the constants were
    built from, to detect later changes)."""

    kind = "layer_norm"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight, bias):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        n = int(math.prod(params["normalized_shape"]))
        c = layer_norm_constants(float(input_fqs[0].scale), float(output_fq.scale), input_fqs[0].dtype, n,
                                 weight, bias, float(params["eps"]))
        self.normalized_ndim = len(params["normalized_shape"])
        self.register_buffer("gain", c.gain)
        self.register_buffer("bias", c.bias)
        self.register_buffer("params_q", torch.tensor([c.eps_term, c.shift, c.frac_bits], dtype=torch.int64))
        ref = lambda t: torch.empty(0) if t is None else t.detach().to(torch.float32).clone()  # noqa: E731
        self.register_buffer("weight_ref", ref(weight))
        self.register_buffer("bias_ref", ref(bias))

    def int_op(self, call, fqs, out_fq):
        shape, w, b, eps = _layer_norm_call(call)
        if shape != tuple(self.params["normalized_shape"]):
            raise self._param_mismatch("normalized_shape", tuple(self.params["normalized_shape"]), shape)
        if eps != self.params["eps"]:
            raise self._param_mismatch("eps", self.params["eps"], eps)
        if not _exporting():
            for name, now, ref in (("weight", w, self.weight_ref), ("bias", b, self.bias_ref)):
                same = (now is None and ref.numel() == 0) or (
                    now is not None and now.shape == ref.shape and torch.equal(now.detach().to(ref), ref))
                if not same:
                    raise QuantLensError(
                        f"The layer_norm {name} of op site '{self.site}' changed after pre_export (its integer "
                        "constants were built from the old values). Run pre_export again on the updated model."
                    )
        x = _float_leaves(call)[0]
        di, do = fqs[0].dtype, out_fq.dtype
        return torch.ops.quantlens.int_layer_norm(
            x, fqs[0].scale, out_fq.scale, self.gain, self.bias, self.params_q, self.normalized_ndim,
            di.qmin, di.qmax, do.qmin, do.qmax,
        )

    def integer(self, q: torch.Tensor) -> torch.Tensor:
        eps_term, shift, frac = (int(v) for v in self.params_q.tolist())
        return int_layer_norm(q, self.normalized_ndim, self.gain, self.bias, eps_term, frac, shift,
                              self.output_dtype)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        shape = tuple(self.params["normalized_shape"])
        n = int(math.prod(shape))
        q = _probe_rows(self.input_dtypes[0], n).reshape(_PROBE_ROWS, *shape).to(self.table_scales.device)
        y = self.integer(q).to(torch.float64)
        w = self.weight_ref.to(torch.float64) if self.weight_ref.numel() else None
        b = self.bias_ref.to(torch.float64) if self.bias_ref.numel() else None
        exact = F.layer_norm(q.to(torch.float64) * s_in, shape, w, b, float(self.params["eps"])) / s_out
        do = self.output_dtype
        return float((y - exact.clamp(do.qmin, do.qmax)).abs().max()), "probe"

    def entry_count(self):
        return int(self.gain.numel() + self.bias.numel())

    def describe(self):
        eps_term, shift, frac = self.params_q.tolist()
        return f"N={self.gain.numel()}, P={frac}, eps_term={eps_term}, shift={shift}, mantissa rsqrt"


def _probe_rows(dtype: QuantDType, length: int) -> torch.Tensor:
    """Seeded rows of input codes: each row has its own centre and spread (from 1 code to the full range)."""
    gen = torch.Generator().manual_seed(0)
    spread = 2.0 ** (torch.rand(_PROBE_ROWS, 1, generator=gen, dtype=torch.float64) * (dtype.bits - 1))
    centre = (torch.rand(_PROBE_ROWS, 1, generator=gen, dtype=torch.float64) - 0.5) * dtype.qmax
    values = centre + spread * torch.randn(_PROBE_ROWS, length, generator=gen, dtype=torch.float64)
    return values.round().clamp(dtype.qmin, dtype.qmax).to(torch.int64)


# ------------------------------------------------------------------------------------------------------------
# building


def _fq_name(state: QuantState, fq: FakeQuantize) -> str:
    for key, module in state.fq.items():
        if module is fq:
            return key
    return "weight_fake_quant"


def _producer_fq(model: nn.Module, state: QuantState, name: str | None) -> tuple[FakeQuantize | None, str]:
    """The fake quant whose grid the output of site ``name`` is on (following passthrough sites), and why not."""
    seen = set()
    while name is not None and name not in seen:
        seen.add(name)
        plan = state.plans.get(name)
        if plan is None:
            return None, f"'{name}' has no plan"
        if plan.output is OutputMode.QUANTIZED:
            return state.fq[plan.output_fq], ""
        if plan.output is OutputMode.FUSED and plan.fused_into:
            tail = state.plans[plan.fused_into]
            return (state.fq[tail.output_fq], "") if tail.output_fq else (None, f"'{name}' is fused")
        if plan.output is OutputMode.WEIGHT:
            rec = state.record.sites[name]
            module = model.get_submodule(rec.module_name) if rec.is_module else None
            fq = getattr(module, "weight_fake_quant", None) if module is not None else None
            if fq is None and plan.weight_fq:
                fq = state.fq[next(iter(plan.weight_fq.values()))]
            return fq, "" if fq is not None else f"'{name}' has no weight fake quant"
        if plan.output is OutputMode.INHERIT:
            rec = state.record.sites[name]
            name = rec.inputs[0].producer if rec.inputs else None
            continue
        if plan.output is OutputMode.HIGH_PRECISION:
            return None, f"it comes from '{name}', which keeps an int32 high-precision output"
        return None, f"it comes from '{name}', which stays float (no qconfig)"
    return None, "it is a float model input or constant that is not quantized at this site"


def _site_fqs(model: nn.Module, state: QuantState, rec: OpSiteRecord, plan: SitePlan, count: int):
    fqs = []
    for i, inp in enumerate(rec.inputs[:count]):
        if inp.position in plan.input_fq:
            fq, why = state.fq[plan.input_fq[inp.position]], ""
        else:
            fq, why = _producer_fq(model, state, inp.producer)
        if fq is None:
            raise QuantLensError(
                f"pre_export: input {i} of op site '{rec.name}' ({rec.op_type}, at {rec.source}) is not quantized "
                f"({why}), so its lookup table has no integer input scale. Fix: quantize that tensor (give its "
                "producer an int8/int16 output in the qconfig), or give this site an input QuantSpec "
                "(QConfig(input=QuantSpec('qint8')))."
            )
        fqs.append(fq)
    out_key = plan.output_fq
    if out_key is None and plan.output is OutputMode.FUSED and plan.fused_into:
        out_key = state.plans[plan.fused_into].output_fq
    if out_key is None:
        raise QuantLensError(
            f"pre_export: op site '{rec.name}' ({rec.op_type}) has no output fake quant, so its lookup table has "
            "no output scale. Fix: give it an int8/int16 output in its qconfig."
        )
    out_fq = state.fq[out_key]
    for role, fq in [(f"input {i}", f) for i, f in enumerate(fqs)] + [("output", out_fq)]:
        if not bool(fq.calibrated):
            raise QuantLensError(
                f"pre_export: the {role} fake quant '{_fq_name(state, fq)}' of op site '{rec.name}' "
                f"({rec.op_type}) has no calibrated scale. Tables are built from calibrated scales: run "
                "calibration (FakeQuantState.CALIBRATION on data) or QAT, or load a calibrated state_dict, "
                "before pre_export."
            )
    return fqs, out_fq


def _table_sites(state: QuantState) -> list[tuple[OpSiteRecord, SitePlan]]:
    sites = []
    for name, plan in state.plans.items():
        rec = state.record.sites.get(name)
        if rec is None or plan.op_type not in TABLE_OPS:
            continue
        fused_head = plan.output is OutputMode.FUSED and plan.fused_into is not None and plan.input_dtypes != [
            "(fused)"]
        if plan.output is not OutputMode.QUANTIZED and not fused_head:
            continue  # float sites (no qconfig) stay float
        if plan.op_type == "div" and len(rec.inputs) < 2:
            continue  # division by (or of) a Python scalar is a multiply, not a table op
        if not rec.inputs:
            continue
        sites.append((rec, plan))
    return sites


class _Capture(SiteOverride):
    """Records a function site's call during pre_export's example run, and computes the float op."""

    def __init__(self, op_type: str):
        super().__init__()
        self.op_type = op_type
        self.calls: list[OverrideCall] = []

    def compute(self, call):
        self.calls.append(call)
        return _float_op(self.op_type, call)


def _needs_capture(rec: OpSiteRecord) -> bool:
    return not rec.is_module and rec.op_type in ("gelu", "softplus", "layer_norm")


def _capture(model: nn.Module, state: QuantState, sites, example_inputs: Any) -> dict[str, OverrideCall]:
    keys = {}
    for rec, plan in sites:
        if _needs_capture(rec):
            key = fq_key(rec.name, "capture")
            state.overrides[key] = _Capture(rec.op_type)
            plan.override = key
            keys[rec.name] = key
    if not keys:
        return {}
    try:
        with torch.no_grad():
            call_model(model, example_inputs)
        return {name: state.overrides[key].calls[0] for name, key in keys.items() if state.overrides[key].calls}
    finally:
        for name, key in keys.items():
            state.plans[name].override = None
            del state.overrides[key]


def _params(model: nn.Module, rec: OpSiteRecord, call: OverrideCall | None):
    """(params, weight, bias) the site's tables are built for: module attributes, captured call arguments, or
    (function sites run without example inputs) the function's defaults."""
    module = model.get_submodule(rec.module_name) if rec.is_module else None
    fake = OverrideCall(rec.name, rec.op_type, (), {}, module, [], None) if call is None else call
    if rec.op_type in ("gelu", "softplus"):
        return _elementwise_params(rec.op_type, fake), None, None
    if rec.op_type == "softmax":
        shape = rec.inputs[0].shape
        length = shape[-1] if shape else 1
        if module is not None and module.dim is not None and shape:
            length = shape[module.dim]
        elif call is not None:
            dim = _arg(call, 1, "dim", None)
            if dim is not None and shape:
                length = shape[int(dim)]
        return {"length": int(length)}, None, None
    if rec.op_type == "layer_norm":
        if module is not None:
            return ({"normalized_shape": tuple(module.normalized_shape), "eps": float(module.eps)},
                    module.weight, module.bias)
        if call is None:
            raise QuantLensError(
                f"pre_export: op site '{rec.name}' calls layer_norm as a function (at {rec.source}); its "
                "normalized shape, weight, bias and eps are only known when it runs. Pass example inputs: "
                "pre_export(model, example_inputs=...), or use an nn.LayerNorm module."
            )
        shape, weight, bias, eps = _layer_norm_call(call)
        return {"normalized_shape": shape, "eps": eps}, weight, bias
    return {}, None, None


def _build(model, state, rec, plan, resolved) -> TableOverride:
    params, weight, bias = resolved
    count = 2 if rec.op_type == "div" else 1
    fqs, out_fq = _site_fqs(model, state, rec, plan, count)
    if rec.op_type == "div":
        return DivOverride(rec.name, rec.op_type, fqs, out_fq, params)
    if rec.op_type == "softmax":
        return SoftmaxOverride(rec.name, rec.op_type, fqs, out_fq, params)
    if rec.op_type == "layer_norm":
        return LayerNormOverride(rec.name, rec.op_type, fqs, out_fq, params, weight, bias)
    return ElementwiseOverride(rec.name, rec.op_type, fqs, out_fq, params)


def _state(model: nn.Module, what: str) -> QuantState:
    if not isinstance(model, nn.Module) or not is_prepared(model):
        raise QuantLensError(
            f"{what} expects a model returned by quantlens.quantization.prepare (then calibrated or trained), got "
            f"{type(model).__name__}. Fix: model = prepare(float_model, example_inputs, qconfig_setter), "
            f"calibrate it, then call {what}(model)."
        )
    return model._quantlens_state


# ------------------------------------------------------------------------------------------------------------
# public API


def pre_export(model: nn.Module, inplace: bool = False, *, example_inputs: Any = None) -> nn.Module:
    """Return a copy of the prepared, calibrated model ``model`` whose table ops run the march's integer tables.

    Args:
        model: a model returned by ``prepare``, calibrated or trained (the tables are built from its current
            scales). It is not modified unless ``inplace``.
        inplace: modify ``model`` itself instead of a deep copy.
        example_inputs: optional, one call's inputs (like ``prepare``'s). Needed only when a table op is called
            as a function with arguments that the tables depend on (``F.layer_norm(x, shape, w, b, eps)``, a
            non-default ``F.gelu(x, approximate=...)`` or ``F.softplus(x, beta, threshold)``): one forward
            reads them.

    The result is in ``eval()`` mode and ``FakeQuantState.VALIDATION`` with every observer off (weight fake
    quants included, so their scales are frozen too): it is meant for evaluation and export.
    Switching it to a state that observes (CALIBRATION, QAT) makes its tables stale; a table then raises on
    the next forward. In FLOAT and CALIBRATION state a table site computes the float op (like the prepared
    model). Op site names are unchanged. Raises ``QuantLensError`` for models that are not prepared, and for
    table sites whose scales are not calibrated or whose input or output is not quantized.
    """
    state = _state(model, "pre_export")
    result = model if inplace else copy.deepcopy(model)
    state = result._quantlens_state
    result.eval()
    set_fake_quantize(result, FakeQuantState.VALIDATION)
    for module in result.modules():  # weight fake quants too: the result is a frozen evaluation artifact
        if isinstance(module, FakeQuantize):
            module.observe_enabled = False
    for key in [k for k in state.overrides if k.endswith("|" + _ROLE)]:
        del state.overrides[key]
    for plan in state.plans.values():
        if plan.override is not None and plan.override.endswith("|" + _ROLE):
            plan.override = None
    sites = _table_sites(state)
    calls = _capture(result, state, sites, example_inputs) if example_inputs is not None else {}
    resolved = [(rec, plan, _params(result, rec, calls.get(rec.name))) for rec, plan in sites]  # raise early
    built = {rec.name: _build(result, state, rec, plan, params) for rec, plan, params in resolved}
    for name, override in built.items():
        key = fq_key(name, _ROLE)
        state.overrides[key] = override
        state.plans[name].override = key
    _attention_softmax_tables(state)
    return result


def _attention_softmax_tables(state: QuantState) -> None:
    """The softmax inside each decomposed scaled_dot_product_attention gets its table too."""
    for name, plan in state.plans.items():
        override = state.overrides[plan.override] if plan.override in state.overrides else None
        if isinstance(override, SdpaDecomposition):
            length = state.record.sites[name].inputs[1].shape[-2] if len(state.record.sites[name].inputs) > 1 else 16
            override.softmax_table = SoftmaxOverride(
                f"{name}.softmax", "softmax", [override.scores_fq], override.probs_fq, {"length": int(length)}
            )


def lut_sites(model: nn.Module) -> list[str]:
    """Names of the op sites of a pre_export model that have a table (enabled or not), in execution order."""
    state = _state(model, "lut_sites")
    return [name for name in state.plans if fq_key(name, _ROLE) in state.overrides]


def set_lut_enabled(model: nn.Module, site_names: str | Iterable[str] | None, enabled: bool) -> nn.Module:
    """Switch the integer table of the given op sites on or off (``None``: every table site).

    A disabled site computes the float op followed by its output fake quant, exactly like the QAT model. The
    profiler uses this to measure one table at a time. Returns ``model``.
    """
    state = _state(model, "set_lut_enabled")
    available = lut_sites(model)
    names = available if site_names is None else [site_names] if isinstance(site_names, str) else list(site_names)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise QuantLensError(
            f"set_lut_enabled: {unknown} {'is' if len(unknown) == 1 else 'are'} not table sites of this model. "
            f"Table sites: {available or 'none (run pre_export first)'}."
        )
    for name in names:
        state.plans[name].override = fq_key(name, _ROLE) if enabled else None
    return model


def lut_errors(model: nn.Module, example_inputs: Any) -> dict[str, float]:
    """Same-input error of every enabled table site on one forward of ``example_inputs``, in output steps.

    At each table site the table's output is compared with what the QAT model computes from the same input
    (the float op, then the site's output fake quant): ``max |table - qat| / s_out``. The model's outputs are
    those of the pre_export model. Sites that did not run are left out.
    """
    state = _state(model, "lut_errors")
    overrides = {name: state.overrides[fq_key(name, _ROLE)] for name in lut_sites(model)}
    for override in overrides.values():
        override.__dict__["_errors"] = []
    try:
        with torch.no_grad():
            call_model(model, example_inputs)
        return {name: max(o.__dict__["_errors"]) for name, o in overrides.items() if o.__dict__["_errors"]}
    finally:
        for override in overrides.values():
            override.__dict__.pop("_errors", None)


def pre_export_report(model: nn.Module) -> list[LutSiteInfo]:
    """One :class:`LutSiteInfo` per table site of a pre_export model, in execution order."""
    state = _state(model, "pre_export_report")
    report = []
    for name in lut_sites(model):
        override: TableOverride = state.overrides[fq_key(name, _ROLE)]
        report.append(override.info(enabled=state.plans[name].override is not None))
    return report
