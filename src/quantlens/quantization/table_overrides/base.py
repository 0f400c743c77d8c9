"""The base of the table site overrides: :class:`TableOverride` (live fake quants, the scale check, rebuilds at
consistency level 3+, the straight-through QAT result, the :class:`~.report.LutSiteInfo` report)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.quantization.fake_quantize import FakeQuantize
from quantlens.quantization.overrides import OverrideCall, SiteOverride
from quantlens.quantization.table_overrides.report import LutSiteInfo
from quantlens.quantization.table_registry import table_op_spec
from quantlens.sites.tracing_state import export_tracing


def _scales(grids: list[tuple[float, QuantDType]], out_fq: FakeQuantize) -> list[float]:
    """The scales a site's tables are built for: its inputs' grids, then its output's (every channel's, for a norm
    writing channel exponents, §3.1)."""
    return [scale for scale, _ in grids] + out_fq.scale.detach().reshape(-1).tolist()


def input_grid(fq: FakeQuantize) -> tuple[float, QuantDType]:
    """The grid a table op reads an input's codes on (:meth:`FakeQuantize.read_grid`), its scale as a number."""
    scale, dtype = fq.read_grid()
    return float(scale), dtype


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
        grids = [input_grid(fq) for fq in input_fqs]
        self.input_dtypes = tuple(dtype for _, dtype in grids)
        self.output_dtype = output_fq.dtype
        #: the op parameters the tables were built for (gelu approximate, softplus beta/threshold, eps ...)
        self.params = dict(params)
        scales = _scales(grids, output_fq)
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
        if export_tracing():
            return
        built = self.table_scales.tolist()
        grids = [input_grid(fq) for fq in fqs]
        now = _scales(grids, out_fq)
        dtypes = tuple(dtype for _, dtype in grids) + (out_fq.dtype,)
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
        grids = [input_grid(fq) for fq in fqs]
        scales = _scales(grids, out_fq)
        dtypes = tuple(dtype for _, dtype in grids) + (out_fq.dtype,)
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
        if not torch.is_grad_enabled() or export_tracing():
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
        if self.rebuild_on_change and not export_tracing():
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
        return table_op_spec(self.op_type).float_op(call, self.site)

    def observes_output(self) -> bool:
        return self.rebuild_on_change and not export_tracing()

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


def _straight_through(table_out: torch.Tensor, float_out: torch.Tensor) -> torch.Tensor:
    """The table's value with the float op's gradient: ``table_out + (float_out - float_out.detach())``, which is
    ``table_out`` bit for bit where the float op is finite (and exactly ``table_out`` where it is not, e.g.
    ``1 / 0``: there the gradient is what the float op gives through a saturated output fake quant)."""
    if not isinstance(float_out, torch.Tensor) or not float_out.requires_grad:
        return table_out
    delta = float_out - float_out.detach()
    return torch.where(torch.isfinite(float_out.detach()), table_out + delta.to(table_out.dtype), table_out)
