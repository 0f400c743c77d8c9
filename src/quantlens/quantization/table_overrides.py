"""The site overrides that compute a table op site through the march's integer tables (``docs/march.md`` §13).

:class:`TableOverride` (base, reports a :class:`LutSiteInfo`) and one subclass per kind: :class:`ElementwiseOverride`,
:class:`DivOverride`, :class:`SoftmaxOverride`, :class:`LayerNormOverride`. :mod:`.pre_export` finds and installs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.overrides import OverrideCall, SiteOverride
from quantlens.quantization.tracer import is_float_tensor

__all__ = ["LutSiteInfo", "TableOverride", "ElementwiseOverride", "DivOverride", "SoftmaxOverride",
           "LayerNormOverride"]

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


def _spec(op_type: str):
    """The op's entry in the table-op registry (:mod:`.table_registry`, which imports this module)."""
    from quantlens.quantization.table_registry import table_op_spec

    return table_op_spec(op_type)


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
        #: consistency level 3+ (``tables_in_qat``): when the fake quants' scales (or the call's parameters,
        #: layer_norm's gamma/beta) no longer match the tables, rebuild them for the current ones instead of
        #: raising; set by :func:`~quantlens.quantization.pre_export.install_tables` / ``pre_export``
        self.rebuild_on_change = False

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

    def _call_params(self, call: OverrideCall) -> tuple[dict[str, Any], Any, Any]:
        """(params, weight, bias) that this call needs the tables built for (layer_norm adds gamma/beta)."""
        return self.params, None, None

    def _same_affine(self, weight: Any, bias: Any) -> bool:
        return True

    def _refresh(self, call: OverrideCall, fqs: list[FakeQuantize], out_fq: FakeQuantize) -> bool:
        """Eager, ``rebuild_on_change`` only: rebuild the tables when the scales, dtypes or parameters they were
        built for are not the current ones (the tables are keyed by those values: unchanged, nothing is done).
        Returns whether the tables were rebuilt. The buffer names stay the same."""
        params, weight, bias = self._call_params(call)
        scales = [float(fq.scale) for fq in fqs] + [float(out_fq.scale)]
        dtypes = tuple(fq.dtype for fq in fqs) + (out_fq.dtype,)
        if (scales == self.table_scales.tolist() and dtypes == self.input_dtypes + (self.output_dtype,)
                and params == self.params and self._same_affine(weight, bias)):
            return False
        fresh = type(self)(self.site, self.op_type, fqs, out_fq, params, weight, bias)
        device = self.table_scales.device
        for name, buffer in fresh._buffers.items():
            self._buffers[name] = buffer.to(device) if buffer is not None else None
        for name, value in fresh.__dict__.items():
            if not name.startswith("_") and name not in ("training", "rebuild_on_change"):
                self.__dict__[name] = value
        return True

    def _straight_through(self, call: OverrideCall) -> bool:
        """Whether this call is differentiated (QAT): grad mode on and an input (or a module parameter, e.g.
        layer_norm's gamma) requires grad; never while exporting."""
        if not torch.is_grad_enabled() or _exporting():
            return False
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves((call.args, call.kwargs))):
            return True
        return call.module is not None and any(p.requires_grad for p in call.module.parameters(recurse=False))

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
        if self.observes_output() and out_fq.observe_enabled:
            # QAT with the tables (level 3+): the observer follows the float op, as at a plain site (the table's
            # output saturates at the current range), and the table is then built for the scale it gives
            out_fq.observe(self.float_op(call))
        if self.rebuild_on_change and not _exporting():
            self._refresh(call, fqs, out_fq)
        self._check(fqs, out_fq)
        straight_through = self._straight_through(call)
        if straight_through:  # the integer result carries no gradient (the custom ops have none)
            with torch.no_grad():
                out = self.int_op(call, fqs, out_fq)
        else:
            out = self.int_op(call, fqs, out_fq)
        errors = self.__dict__.get("_errors")
        if errors is not None:  # lut_errors(): the QAT result on the same input, in output steps
            ref = out_fq(self.float_op(call))
            errors.append(float(((out.float() - ref.float()).abs() / out_fq.scale).max()) if out.numel() else 0.0)
        if straight_through:
            out = _straight_through(out, self.float_op(call))
        return out

    def float_op(self, call: OverrideCall) -> Any:
        return _spec(self.op_type).float_op(call, self.site)

    def observes_output(self) -> bool:
        return self.rebuild_on_change and not _exporting()

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
    """The elementwise table ops of the registry (sigmoid, tanh, exp, gelu, silu, softplus, reciprocal, sqrt,
    rsqrt, log, pow, erf, hardswish, hardsigmoid, elu): one table (or, for an int16 reciprocal, the mantissa rule). Buffers: ``entries`` (Table256), or ``bounds``/``shifts``/``entries``/``tails``
    (SegmentedTable), or ``params_q`` = [M, shift] (mantissa reciprocal)."""

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        # weight/bias: affine parameters, which only layer_norm has (one constructor for every table op)
        super().__init__(site, op_type, input_fqs, output_fq, params)
        s_in, s_out = float(input_fqs[0].scale), float(output_fq.scale)
        in_dtype, out_dtype = input_fqs[0].dtype, output_fq.dtype
        self.frac_bits = 0
        if in_dtype is QuantDType.qint16 and _spec(op_type).int16 == "mantissa_reciprocal":
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
        params = _spec(self.op_type).params_from_call(call)
        return (self.params if params is None else dict(params)), None, None

    def int_op(self, call, fqs, out_fq):
        for name, value in (_spec(self.op_type).params_from_call(call) or {}).items():
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

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        # weight/bias: affine parameters, which only layer_norm has (one constructor for every table op)
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

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
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

    def _call_params(self, call):
        shape, w, b, eps = _layer_norm_call(call)
        return {"normalized_shape": shape, "eps": eps}, w, b

    def _same_affine(self, weight, bias):
        return all((now is None and ref.numel() == 0) or (
            now is not None and now.shape == ref.shape and torch.equal(now.detach().to(ref), ref))
            for now, ref in ((weight, self.weight_ref), (bias, self.bias_ref)))

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


def _straight_through(table_out: torch.Tensor, float_out: torch.Tensor) -> torch.Tensor:
    """The table's value with the float op's gradient: ``table_out + (float_out - float_out.detach())``, which is
    ``table_out`` bit for bit where the float op is finite (and exactly ``table_out`` where it is not, e.g.
    ``1 / 0``: there the gradient is what the float op gives through a saturated output fake quant)."""
    if not isinstance(float_out, torch.Tensor) or not float_out.requires_grad:
        return table_out
    delta = float_out - float_out.detach()
    return torch.where(torch.isfinite(float_out.detach()), table_out + delta.to(table_out.dtype), table_out)


def _probe_rows(dtype: QuantDType, length: int) -> torch.Tensor:
    """Seeded rows of input codes: each row has its own centre and spread (from 1 code to the full range)."""
    gen = torch.Generator().manual_seed(0)
    spread = 2.0 ** (torch.rand(_PROBE_ROWS, 1, generator=gen, dtype=torch.float64) * (dtype.bits - 1))
    centre = (torch.rand(_PROBE_ROWS, 1, generator=gen, dtype=torch.float64) - 0.5) * dtype.qmax
    values = centre + spread * torch.randn(_PROBE_ROWS, length, generator=gen, dtype=torch.float64)
    return values.round().clamp(dtype.qmin, dtype.qmax).to(torch.int64)
