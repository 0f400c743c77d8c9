"""``prepare``: turn a float model into a fake-quant model that still runs the user's own ``forward``.

Steps (each in its own module):

1. record the float model's op sites on every example input (:mod:`.record`);
2. find fusions on the recorded data flow (:mod:`.fuse`);
3. resolve qconfigs with the setters (:mod:`.qconfig_template`);
4. plan every site's fake quants (:mod:`.plan`);
5. swap weighted modules for their QAT classes (:mod:`.qat_modules`) and attach the fake quants;
6. make ``forward`` run under the op-site tracer with the runtime below, and write the check report.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import warnings as _warnings
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens._advice import setting
from quantlens._io import atomic_write_text
from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.march import get_march
from quantlens.march.opset import Stage, op_def
from quantlens.quantization.check import CHECK_FILE, check_qat_model
from quantlens.quantization.consistency import ConsistencyStrategy
from quantlens.quantization.decompositions import DECOMPOSITIONS
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, switch_fake_quants
from quantlens.quantization.fuse import FusedGroup, UnfusedPattern, find_fusions
from quantlens.quantization.module_swap import swap_modules
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.quantization.plan import OutputMode, SitePlan, build_plans
from quantlens.quantization.qconfig import QConfig, QuantSpec
from quantlens.quantization.qconfig_template import (
    QconfigContext,
    default_qat_qconfig_setter,
    resolve_qconfigs,
)
from quantlens.quantization.runtime import Runtime
from quantlens.quantization.scale_groups import forward_scope
from quantlens.quantization.scale_policy import install_scale_policy
from quantlens.quantization.state import QuantState, is_prepared
from quantlens.sites.op_rules import WEIGHT_CHANNEL_AXIS
from quantlens.sites.record import ModelRecord, inputs_to, model_device, record_model
from quantlens.sites.stubs import QuantStub
from quantlens.sites.tracer import OpSiteTracer

__all__ = ["prepare"]


class _QuantizedForward:
    """Replaces ``forward`` on the prepared model's instance: runs the class's own forward under the tracer."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        state: QuantState = model._quantlens_state
        state.__dict__["_root_ref"] = model
        runtime = state.current_runtime() or Runtime(state)
        try:
            emulation = runtime.emulator.active() if runtime.emulator is not None else contextlib.nullcontext()
            tracer = OpSiteTracer(model, runtime, getattr(runtime, "qualnames", None))
            with tracer, forward_scope(state), emulation:  # grouped fake quants resolve through state
                return type(model).forward(model, *args, **kwargs)
        finally:
            runtime.marks.clear()  # the marks belong to this forward only


def _check_march_consistency() -> None:
    """Consistency levels 1-4 emulate QL1's integer rules in the QAT forward; a runtime march (``March.ORT_CPU``)
    has other rules, which that emulation does not compute yet: refused rather than trained against the wrong
    arithmetic."""
    level = ConsistencyStrategy.config().level
    march = get_march()
    if march.spec.float_requantize and level is not None and level >= 1:
        raise QuantLensError(
            f"prepare: consistency level {level} emulates QL1's integer rules in the QAT forward, and the selected "
            f"march {march.name} computes onnxruntime's (docs/march_ort.md); that emulation is not built for it. "
            "Use ConsistencyStrategy level 0 or off (the fake quant then follows the runtime's scheme, and convert "
            "is exact to the runtime), or set_march(March.QL1).")


def prepare(
    model: nn.Module,
    example_inputs: Any,
    qconfig_setter: Any = default_qat_qconfig_setter,
    *,
    extra_example_inputs: Iterable[Any] = (),
    check_result_dir: str | None = ".",
    allow_no_stubs: bool = False,
) -> nn.Module:
    """Return a fake-quant copy of ``model``; the original is not modified.

    Args:
        model: a float ``nn.Module``; its ``forward`` may use any Python control flow and input structure.
        example_inputs: one call's inputs: a tuple is passed as positional arguments, anything else as the single
            argument (``model(example_inputs)``).
        qconfig_setter: a setter or a tuple of setters, first wins. Defaults to ``default_qat_qconfig_setter``.
        extra_example_inputs: more calls' inputs, so every branch of the model is seen (op sites first met
            after prepare raise an error).
        check_result_dir: where ``model_check_result.txt`` is written (``None``: do not write).
        allow_no_stubs: accept a model without any ``QuantStub`` (third-party code one does not edit): its float
            inputs are then quantized where the first op sites consume them. Without it such a model is refused,
            since a newcomer's forgotten stub is the likelier cause.

    The returned model is in ``FakeQuantState.QAT``; use :func:`set_fake_quantize` to switch.
    """
    if not isinstance(model, nn.Module):
        raise QuantLensError(f"prepare expects a torch.nn.Module, got {type(model).__name__}.")
    if is_prepared(model):
        raise QuantLensError("prepare: this model is already prepared; pass the float model instead.")
    _check_march_consistency()
    prepared = _copy_model(model)
    was_training = prepared.training
    prepared.eval()  # recording must not update BatchNorm statistics or sample dropout masks
    folded = _fold_parametrizations(prepared)  # (after eval(): spectral norm folds without a power iteration)
    # The model runs on copies: a forward that changes its input in place (x.mul_(2)) leaves the user's
    # example inputs as they were.
    device = model_device(model)  # (example inputs held elsewhere, e.g. on the CPU, move to the model)
    examples = [inputs_to(_copy_inputs(e), device) for e in (example_inputs, *list(extra_example_inputs))]
    record = record_model(prepared, examples)
    groups, unfused = find_fusions(record, prepared)
    ctx = QconfigContext(record, groups)
    assignment = resolve_qconfigs(qconfig_setter, ctx)
    _apply_module_qconfigs(prepared, record, groups, assignment.qconfigs)
    groups, dropped = _drop_unquantized_bn_groups(groups, assignment.qconfigs)
    unfused = unfused + dropped

    modules = dict(prepared.named_modules())
    fixed = {
        s.name: modules[s.module_name].scale
        for s in record.sites.values()
        if s.boundary == "input" and isinstance(modules.get(s.module_name), QuantStub)
        and modules[s.module_name].scale is not None
    }
    weight_dtypes = swap_modules(prepared, record, groups, assignment.qconfigs)
    plans, requests, plan_warnings = build_plans(record, groups, assignment.qconfigs, fixed, weight_dtypes)
    requests = _weight_channel_axes(plans, requests)
    if not allow_no_stubs:
        _refuse_missing_stubs(record, plans)

    refusals = stage_refusals(record, groups, plans)
    if assignment.unmatched:
        _warnings.warn("prepare: " + " ".join(assignment.unmatched), stacklevel=2, category=QuantLensWarning)
    warnings = folded + list(assignment.warnings) + list(assignment.unmatched) + plan_warnings + list(
        refusals.values())
    if refusals:
        # One console line; model_check_result.txt lists every op site with its source line.
        sites = list(refusals)
        shown = ", ".join(f"'{n}'" for n in sites[:5]) + (f" and {len(sites) - 5} more" if len(sites) > 5 else "")
        listed = (f"{os.path.join(os.fspath(check_result_dir), CHECK_FILE)} lists each with the stage and its source line"
                  if check_result_dir is not None else
                  f"{setting('check_result_dir', 'FOLDER')} writes {CHECK_FILE} listing each with the stage "
                  "and its source line")
        _warnings.warn(f"prepare: {len(sites)} op site(s) use ops that a later stage will refuse ({shown}); "
                       f"{listed}.", stacklevel=2, category=QuantLensWarning)
    _say_host_sites(plans, check_result_dir)
    state = QuantState(record, groups, unfused, plans, warnings, getattr(qconfig_setter, "name", repr(qconfig_setter)))
    for request in requests:
        spec = request.spec
        if request.fixed_scale is not None:
            spec = QuantSpec(spec.dtype, FixedScaleObserver.with_args(scale=request.fixed_scale))
        state.fq[request.key] = FakeQuantize(spec, is_weight=request.is_weight)
    _install_decompositions(state)
    prepared._quantlens_state = state
    state.__dict__["_root_ref"] = prepared
    install_scale_policy(prepared)  # consistency level 2: pow2 activation scales, shared add/sub/cat scales
    if device.type != "cpu":  # the fake quants and swapped-in modules are made on the CPU: join the model
        prepared.to(device)
    prepared.forward = _QuantizedForward(prepared)
    switch_fake_quants(prepared, FakeQuantState.QAT)  # (uncalibrated: no lookup tables yet at any level)
    prepared.train(was_training)
    if check_result_dir is not None:
        _write_check_report(prepared, inputs_to(_copy_inputs(example_inputs), device), check_result_dir)
    return prepared


def _say_host_sites(plans: dict[str, SitePlan], check_result_dir: str | None) -> None:
    """One console line: how many op sites run on the host in float inside the integer region, and where to read
    more (post-processing after the DeQuantStub is host by design and not counted)."""
    host = [p for p in plans.values() if p.host and p.host_reason != "after the DeQuantStub"]
    if not host:
        return
    ops = sorted({p.op_type for p in host})
    shown = ", ".join(ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")
    where = (os.path.join(os.fspath(check_result_dir), CHECK_FILE) if check_result_dir is not None else
             f"{CHECK_FILE} ({setting('check_result_dir', 'FOLDER')})")
    _warnings.warn(f"prepare: {len(host)} op site(s) run on the host in float ({shown}): the march has no integer "
                   f"rule for them, or they compute on values made inside forward; {where} lists each with why "
                   "(column 'runs on').", stacklevel=3, category=QuantLensWarning)


def _refuse_missing_stubs(record: ModelRecord, plans: dict[str, SitePlan]) -> None:
    """Refuse a model whose float inputs reach quantized op sites with no ``QuantStub`` anywhere (issue #26)."""
    if any(s.boundary == "input" for s in record.sites.values()):
        return
    # only the model's own float inputs: values made inside forward (masks, positions, an empty cache) are
    # constants or host values, and a model whose inputs are all integer has nothing to mark
    entries = [f"{p.name} (input {i.position})" for p in plans.values() for i in record.sites[p.name].inputs
               if i.position in p.input_fq and i.from_input]
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise QuantLensError(  # (the advice names the setting as the reader, Python or CONFIG, changes it)
        f"prepare: the model has no QuantStub, so its float inputs enter the integer region unmarked at {shown}. "
        "Expected a QuantStub on each float model input (and a DeQuantStub on each output the host reads). "
        "Fix: wrap the inputs in quantlens.quantization.QuantStub() and the outputs in DeQuantStub() in the "
        "model's forward (or in a wrapper module), or, for code you do not edit, set "
        f"{setting('allow_no_stubs', True)} to quantize the inputs where those op sites consume them.")


def _copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``. A tensor that a hook computed and left on a module (the hook-based
    ``torch.nn.utils.weight_norm``'s ``weight`` before any no-grad forward) is no graph leaf, which deepcopy
    refuses; it is copied detached (its hook computes it afresh at every forward, and prepare folds that hook)."""
    memo = {id(v): v.detach().clone() for m in model.modules() for v in m.__dict__.values()
            if isinstance(v, torch.Tensor) and not v.is_leaf}
    return copy.deepcopy(model, memo)


def _copy_inputs(example: Any) -> Any:
    """``example`` with every tensor leaf cloned (containers rebuilt, other leaves as they are)."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, example)


def _write_check_report(prepared: nn.Module, example: Any, directory: Any) -> None:
    """``model_check_result.txt``: a report, so a folder that cannot take it is a warning, never a failure."""

    result = check_qat_model(prepared, example, None)
    path = os.path.join(os.fspath(directory), CHECK_FILE)
    try:
        atomic_write_text(path, result.to_text())
    except OSError as exc:
        _warnings.warn(f"prepare: could not write the check report {path} ({exc.strerror or exc}); the model is "
                       "prepared. Pass check_result_dir= a writable folder, or None to skip the report.",
                       stacklevel=3, category=QuantLensWarning)


def stage_refusals(record: ModelRecord, groups: list[FusedGroup] = (),
                   plans: dict[str, SitePlan] | None = None) -> dict[str, str]:
    """Op site name -> one line for each op site whose op a later stage refuses (the op set's stage support), with its source line.

    A host op (no integer rule, after the DeQuantStub, values made inside forward) runs in float at every stage, and
    torch's ONNX exporter writes it, so no stage refuses it; a BatchNorm folded into its conv/linear is no op of its
    own."""
    folded = {g.bn for g in groups if g.bn is not None}
    lines: dict[str, str] = {}
    for site in record.sites.values():
        if site.name in folded or (plans is not None and site.name in plans and plans[site.name].host):
            continue
        op = op_def(site.op_type) if site.known else None
        if op is None:
            continue  # a module op type the op set does not list (QuantStub, DeQuantStub); an op it does not know
            # runs on the host (§12.1): no stage refuses it
        stages = op.refused_by()
        if site.after_dequant:  # export keeps any aten op there as a float host op; ONNX needs a form for it
            stages = [s for s in stages if s is Stage.ONNX]
        if not stages:
            continue
        why = f"no integer rule in march {get_march().spec.name}" if op is None else (op.note or "not supported")
        lines[site.name] = (
            f"Op site '{site.name}' ({site.op_type}, at {site.source}): {', '.join(s.value for s in stages)} will "
            f"refuse op '{site.op_type}' ({why}); docs/ops.md lists each op's support per stage."
        )
    return lines


def _drop_unquantized_bn_groups(groups: list[FusedGroup], qconfigs: dict[str, QConfig]):
    """Folding a BatchNorm needs the conv/linear's weight fake quant; without one the group stays unfused."""
    kept, dropped = [], []
    for group in groups:
        qc = qconfigs.get(group.head)
        if group.bn is not None and (qc is None or qc.weight is None):
            dropped.append(UnfusedPattern(group.members, "its qconfig has no weight quantization, so the "
                                          "BatchNorm cannot be folded into quantized weights"))
        else:
            kept.append(group)
    return kept, dropped


def _install_decompositions(state: QuantState) -> None:
    """Ops the march computes as several integer ops get internal fake quants (see decompositions.py)."""
    for plan in state.plans.values():
        factory = DECOMPOSITIONS.get(plan.op_type)
        if factory is None or plan.output is not OutputMode.QUANTIZED or plan.qconfig is None:
            continue
        key = plan.output_fq.replace("|out", "|decomposition")
        state.overrides[key] = factory(plan.qconfig.output)
        plan.override = key


def _apply_module_qconfigs(
    model: nn.Module, record: ModelRecord, groups: list[FusedGroup], qconfigs: dict[str, QConfig]
) -> None:
    """A ``qconfig`` attribute set directly on a submodule overrides the setters for its op sites (and, like
    any qconfig, applies to the whole fused group of a site it reaches)."""
    direct = {name: m.qconfig for name, m in model.named_modules() if isinstance(getattr(m, "qconfig", None), QConfig)}
    if not direct:
        return
    applied: dict[str, QConfig] = {}
    for site in record.sites.values():
        owners = [n for n in direct if n == "" or site.module_name == n or site.module_name.startswith(n + ".")]
        if owners:
            applied[site.name] = direct[max(owners, key=len)]
    for group in groups:
        members = [m for m in group.members if m in applied]
        for member in group.members if members else ():
            applied[member] = applied[members[-1]]
    qconfigs.update(applied)


def _fold_parametrizations(model: nn.Module) -> list[str]:
    """Fold every weight reparametrization of ``model`` (prepare's copy) into a plain parameter, in place, and
    return one check-report line for each: ``torch.nn.utils.parametrizations.weight_norm`` / ``spectral_norm``
    (any ``torch.nn.utils.parametrize`` parametrization) and the hook-based ``torch.nn.utils.weight_norm`` /
    ``spectral_norm``. The NPU computes with the weight they produce, so that weight is what gets quantized; QAT
    then trains it directly (the module keeps its class, its op site and its name)."""
    from torch.nn.utils import parametrize, remove_spectral_norm, remove_weight_norm
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    notes = []
    for name, module in list(model.named_modules()):
        where = f"module '{name or '<root>'}' ({type(module).__name__})"
        if parametrize.is_parametrized(module):
            # torch generated one class per parametrized module, which the deep copy shares with the user's module,
            # and removing a parametrization deletes its property from that class: give the copy its own class
            cls = type(module)
            module.__class__ = type(cls.__name__, cls.__bases__, {
                k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")})
            for tensor in list(module.parametrizations.keys()):
                kinds = ", ".join(type(p).__name__ for p in module.parametrizations[tensor])
                parametrize.remove_parametrizations(module, tensor, leave_parametrized=True)
                notes.append(f"{where}: its parametrized '{tensor}' ({kinds}) was folded into a plain parameter, "
                             "which is quantized and trained in its place; the user's model keeps the parametrization.")
        hooks = [h for h in module._forward_pre_hooks.values() if isinstance(h, (WeightNorm, SpectralNorm))]
        for hook in hooks:
            remove = remove_weight_norm if isinstance(hook, WeightNorm) else remove_spectral_norm
            remove(module, hook.name)
            notes.append(f"{where}: its '{hook.name}' ({type(hook).__name__} hook) was folded into a plain parameter, "
                         "which is quantized and trained in its place; the user's model keeps the hook.")
    return notes


def _weight_channel_axes(plans: dict[str, SitePlan], requests: list) -> list:
    """A functional op whose weight's output channels are not axis 0 (``torch.addmm``'s ``[in, out]``) gets its
    per-channel weight fake quant along them (``op_rules.WEIGHT_CHANNEL_AXIS``)."""
    axis_of = {key: WEIGHT_CHANNEL_AXIS[p.op_type] for p in plans.values() if p.op_type in WEIGHT_CHANNEL_AXIS
               for key in p.weight_fq.values()}
    return [dataclasses.replace(r, spec=QuantSpec(r.spec.dtype, r.spec.observer, ch_axis=axis_of[r.key]))
            if r.key in axis_of and r.spec.ch_axis is not None else r for r in requests]
