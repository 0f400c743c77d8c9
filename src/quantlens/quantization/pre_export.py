"""``pre_export``: compute every nonlinear op of a calibrated/QAT model through the march's integer tables.

``pre_export(model)`` returns a copy of a prepared model in which each op that the march computes by table
(``docs/march.md`` §13) runs its integer emulation instead of the float op: sigmoid, tanh, exp, gelu, silu,
softplus, reciprocal, sqrt, rsqrt, log, pow with a constant exponent, erf, hardswish, hardsigmoid, elu, ``x / y``
with a quantized ``y``, softmax and layer_norm (the table-op registry, :mod:`.table_registry`, says what each one
reads and builds). The integer arithmetic lives in
:mod:`quantlens.kernels`, which the integer simulator calls too, so the copy's outputs are the march's bits.

Each table site gets a :class:`~quantlens.quantization.overrides.SiteOverride` in ``QuantState.overrides`` (its
tables and constants are buffers, so ``state_dict`` and ``deepcopy`` carry them) and ``plan.override`` names it.
The override classes live in
:mod:`quantlens.quantization.table_overrides`; this module finds the table sites and installs them.
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
import warnings
from typing import Any, Iterable

import torch
from torch import nn

from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.march import march_named
from quantlens.quantization.decompositions import SdpaDecomposition
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, switch_fake_quants
from quantlens.quantization.overrides import OverrideCall, SiteOverride
from quantlens.quantization.plan import OutputMode, SitePlan, fq_key
from quantlens.quantization.state import QuantState, is_prepared
from quantlens.quantization.table_overrides import LutSiteInfo, SoftmaxOverride, TableOverride, override_class
from quantlens.quantization.table_registry import TABLE_OP_SPECS, table_op_spec
from quantlens.sites.record import OpSiteRecord, call_model, inputs_to, model_device

__all__ = [
    "TABLE_OPS",
    "pre_export",
    "install_tables",
    "pre_export_report",
    "set_lut_enabled",
    "lut_sites",
    "lut_errors",
    "LutSiteInfo",
    "TableOverride",
]

#: op types that the march computes by table (``docs/march.md`` §13): the keys of the table-op registry.
TABLE_OPS = tuple(TABLE_OP_SPECS)

_ROLE = "lut"  # QuantState.overrides key: fq_key(site, "lut")


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
            if rec.inputs and rec.inputs[0].position in plan.input_fq:  # a movement op that quantizes a float value
                return state.fq[plan.input_fq[rec.inputs[0].position]], ""
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


def _per_channel_output(state: QuantState, plan: SitePlan) -> bool:
    """Whether the site asks for a per-channel output (channel exponents) that its table op's rule cannot write."""
    out_fq = state.fq[plan.output_fq] if plan.output_fq in state.fq else None
    return out_fq is not None and out_fq.ch_axis is not None and not table_op_spec(plan.op_type).channel_output


def table_sites(state: QuantState) -> list[tuple[OpSiteRecord, SitePlan]]:
    """The op sites the model's march computes by table (none for a march without tables, ``March.ORT_CPU``: its
    runtime computes softmax, layer norm, GELU ... in float, or with its own lookup tables, which convert follows)."""
    if not march_named(getattr(state, "march", "ql1")).spec.tables:
        return []
    sites = []
    for name, plan in state.plans.items():
        rec = state.record.sites.get(name)
        if rec is None or plan.op_type not in TABLE_OPS:
            continue
        fused_head = plan.output is OutputMode.FUSED and plan.fused_into is not None and plan.input_dtypes != [
            "(fused)"]
        if plan.output is not OutputMode.QUANTIZED and not fused_head:
            continue  # float sites (no qconfig) stay float
        if not table_op_spec(plan.op_type).applies(rec):
            continue  # e.g. division by (or of) a Python scalar is a multiply, not a table op
        if _per_channel_output(state, plan):
            continue  # a per-channel output its rule cannot write (channel exponents): it stays float (the host)
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
        return table_op_spec(self.op_type).float_op(call)


def _needs_capture(rec: OpSiteRecord) -> bool:
    return not rec.is_module and table_op_spec(rec.op_type).needs_call_args


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
    paused = [m for m in model.modules() if isinstance(m, FakeQuantize) and m.observe_enabled]
    for m in paused:  # install_tables on a QAT model: reading the call arguments must not move the scales
        m.observe_enabled = False
    try:
        with torch.no_grad():
            call_model(model, inputs_to(example_inputs, model_device(model)))
        return {name: state.overrides[key].calls[0] for name, key in keys.items() if state.overrides[key].calls}
    finally:
        for m in paused:
            m.observe_enabled = True
        for name, key in keys.items():
            state.plans[name].override = None
            del state.overrides[key]


def _params(model: nn.Module, rec: OpSiteRecord, call: OverrideCall | None):
    """(params, weight, bias) the site's tables are built for: module attributes, captured call arguments, or
    (function sites run without example inputs) the function's defaults. params ``None``: not a table op."""
    module = model.get_submodule(rec.module_name) if rec.is_module else None
    return table_op_spec(rec.op_type).resolve(rec, module, call)


def _build(model, state, rec, plan, resolved) -> TableOverride:
    params, weight, bias = resolved
    spec = table_op_spec(rec.op_type)
    fqs, out_fq = _site_fqs(model, state, rec, plan, spec.inputs)
    return override_class(spec.kind)(rec.name, rec.op_type, fqs, out_fq, params, weight, bias)


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
    the next forward (with consistency level 3+, ``tables_in_qat``, it is rebuilt for the new scales instead,
    see :func:`install_tables`). In FLOAT and CALIBRATION state a table site computes the float op (like the prepared
    model). Op site names are unchanged. Raises ``QuantLensError`` for models that are not prepared, and for
    table sites whose scales are not calibrated or whose input or output is not quantized.
    """
    _state(model, "pre_export")  # raises for a model that is not prepared
    result = model if inplace else copy.deepcopy(model)
    result.eval()
    switch_fake_quants(result, FakeQuantState.VALIDATION)  # (the tables are installed below)
    for module in result.modules():  # weight fake quants too: the result is a frozen evaluation artifact
        if isinstance(module, FakeQuantize):
            module.observe_enabled = False
    _install(result, example_inputs)
    return result


def install_tables(model: nn.Module, *, example_inputs: Any = None) -> list[str]:
    """Install ``pre_export``'s table overrides IN PLACE on the prepared, calibrated ``model``; returns
    :func:`lut_sites`.

    Idempotent: a model that has its tables keeps them (and the sites switched off by :func:`set_lut_enabled`
    stay off). Nothing else changes: not the fake quant state, the observers or train/eval. With consistency
    level 3+ (``ConsistencyStrategy``, ``tables_in_qat``) ``set_fake_quantize`` calls it when a calibrated model
    is switched to QAT or VALIDATION; the tables then follow the scales (rebuilt when they move) and give the
    float op's gradient (straight-through). ``example_inputs``: as for :func:`pre_export`.
    """
    state = _state(model, "install_tables")
    if not _has_tables(state):
        _install(model, example_inputs)
    return lut_sites(model)


def _has_tables(state: QuantState) -> bool:
    return any(k.endswith("|" + _ROLE) for k in state.overrides) or any(
        isinstance(o, SdpaDecomposition) and o.softmax_table is not None for o in state.overrides.values())


def _install(result: nn.Module, example_inputs: Any) -> None:
    """(Re)build the table override of every table site of ``result`` in place (the code of pre_export)."""
    state = result._quantlens_state
    for key in [k for k in state.overrides if k.endswith("|" + _ROLE)]:
        del state.overrides[key]
    for plan in state.plans.values():
        if plan.override is not None and plan.override.endswith("|" + _ROLE):
            plan.override = None
    sites = table_sites(state)
    floats = [name for name, plan in state.plans.items() if plan.op_type in TABLE_OPS and _per_channel_output(state, plan)]
    if floats and march_named(getattr(state, "march", "ql1")).spec.tables:
        warnings.warn(f"pre_export: op site(s) {', '.join(floats[:4])}{' ...' if len(floats) > 4 else ''} ask for a "
                      "per-channel output scale (channel exponents, docs/march.md §3.1), which their integer table "
                      "does not write (a norm's does): they stay float ops, which convert runs on the host. Give them a per-tensor output "
                      "to compute them on the NPU.", stacklevel=3, category=QuantLensWarning)
    calls = _capture(result, state, sites, example_inputs) if example_inputs is not None else {}
    resolved = [(rec, plan, _params(result, rec, calls.get(rec.name))) for rec, plan in sites]  # raise early
    built = {rec.name: _build(result, state, rec, plan, params) for rec, plan, params in resolved
             if params[0] is not None}  # params None: this call is not a table op (c ** x): it stays float
    rebuild = bool(getattr(getattr(state, "consistency", None), "tables_in_qat", False))
    for name, override in built.items():
        key = fq_key(name, _ROLE)
        override.rebuild_on_change = rebuild
        state.overrides[key] = override
        state.plans[name].override = key
    _attention_softmax_tables(state, rebuild)
    device = model_device(result)
    if device.type != "cpu":  # the tables are built on the CPU: join the model (a rebuild keeps their device)
        state.overrides.to(device)


def _attention_softmax_tables(state: QuantState, rebuild: bool = False) -> None:
    """The softmax inside each decomposed scaled_dot_product_attention gets its table too (where the march has
    tables)."""
    if not march_named(getattr(state, "march", "ql1")).spec.tables:
        return
    for name, plan in state.plans.items():
        override = state.overrides[plan.override] if plan.override in state.overrides else None
        if isinstance(override, SdpaDecomposition):
            length = state.record.sites[name].inputs[1].shape[-2] if len(state.record.sites[name].inputs) > 1 else 16
            override.softmax_table = SoftmaxOverride(
                f"{name}.softmax", "softmax", [override.softmax_input_fq], override.probs_fq, {"length": int(length)}
            )
            override.softmax_table.rebuild_on_change = rebuild


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
