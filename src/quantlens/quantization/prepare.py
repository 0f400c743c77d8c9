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
import warnings as _warnings
from typing import Any, Iterable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType, get_march
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, int32_bias, set_fake_quantize
from quantlens.quantization.consistency import ConsistencyConfig, ConsistencyStrategy
from quantlens.quantization.decompositions import DECOMPOSITIONS
from quantlens.quantization.emulation import EmuCall, IntegerEmulator
from quantlens.quantization.fuse import FusedGroup, UnfusedPattern, find_fusions
from quantlens.quantization.observers import FixedScaleObserver
from quantlens.march.opset import Stage, op_def
from quantlens.quantization.op_rules import OpKind
from quantlens.quantization.overrides import OverrideCall
from quantlens.quantization.plan import OutputMode, SitePlan, build_plans
from quantlens.quantization.qat_modules import fused_class_for, qat_class_for
from quantlens.quantization.qconfig import QConfig, QuantSpec
from quantlens.quantization.qconfig_template import (
    QconfigContext,
    default_qat_qconfig_setter,
    resolve_qconfigs,
)
from quantlens.quantization.record import ModelRecord, call_model, inputs_to, model_device, record_model
from quantlens.quantization.stubs import QuantStub
from quantlens.quantization.tracer import OpSiteTracer, SiteCall, SiteHandler, TensorMarks, is_float_tensor
from torch.utils import _pytree as pytree

__all__ = ["prepare", "is_prepared", "QuantState"]


class QuantState(nn.Module):
    """Everything ``prepare`` adds to a model: fake quants by key, site plans, and the prepare-time record."""

    def __init__(self, record: ModelRecord, groups, unfused, plans, warnings, setter_name: str):
        super().__init__()
        self.fq = nn.ModuleDict()
        #: site overrides (pre_export's lookup tables), keyed like fake quants
        self.overrides = nn.ModuleDict()
        self.record = record
        self.groups: list[FusedGroup] = groups
        self.unfused: list[UnfusedPattern] = unfused
        self.plans: dict[str, SitePlan] = plans
        self.warnings: list[str] = warnings
        self.setter_name = setter_name
        self.march = get_march().spec.name
        self.fake_quant_state = FakeQuantState.QAT
        #: the consistency level this model was prepared with (``ConsistencyStrategy``); every stage reads it here
        self.consistency: ConsistencyConfig = ConsistencyStrategy.config()

    def last_sites(self, example: Any) -> list[str]:
        """Op sites visited by one forward on ``example`` (no grad; observers are paused)."""
        root = self._root()
        runtime = _Runtime(self)
        paused = [m for m in root.modules() if isinstance(m, FakeQuantize) and m.observe_enabled]
        for m in paused:
            m.observe_enabled = False
        self.__dict__["_next_runtime"] = runtime
        try:
            with torch.no_grad():
                call_model(root, example)
        finally:
            self.__dict__.pop("_next_runtime", None)
            for m in paused:
                m.observe_enabled = True
        return runtime.visited

    def _root(self) -> nn.Module:
        root = self.__dict__.get("_root_ref")
        if root is None:
            raise QuantLensError("This QuantState is not attached to a prepared model.")
        return root

    def forward(self, *args):
        """Identity. A prepared ``nn.Sequential`` calls every child in turn, this one (added last) included, so
        it must pass the output through unchanged."""
        return args[0] if len(args) == 1 else args


class _Runtime(SiteHandler):
    """Follows the site plans during one forward of the prepared model."""

    _generation = 0

    def __init__(self, state: QuantState):
        _Runtime._generation += 1
        self.generation = _Runtime._generation
        self.state = state
        self.plans = state.plans
        self.fq = state.fq
        self.visited: list[str] = []
        #: the fake quant (grid) each tensor of this forward is on; a side table, so the user's tensors carry
        #: no attribute of quantlens (cleared when the forward ends)
        self.marks = TensorMarks()
        #: the integer rules in this forward (consistency levels 1-4), or None
        self.emulator = _emulator_for(state)

    # -- helpers ------------------------------------------------------------------------------------------
    def _mark(self, tensor: torch.Tensor):
        return self.marks.get(tensor)

    def _set_marks(self, output: Any, fq: FakeQuantize | None) -> None:
        for leaf in _leaves(output):
            if is_float_tensor(leaf):
                self.marks.set(leaf, fq)

    def _plan(self, site: SiteCall) -> SitePlan | None:
        plan = self.plans.get(site.name)
        if plan is None:
            if site.rule.kind is OpKind.QUANTIZED:
                from quantlens.quantization.tracer import user_source_location

                raise QuantLensError(
                    f"Op site '{site.name}' ({site.rule.op_type}, called at {user_source_location()}) was not seen "
                    "when the model was prepared, so it has no fake quant. A branch that the example inputs did "
                    "not take ran now. Fix: pass example inputs that take every branch, e.g. "
                    "prepare(model, example_inputs, extra_example_inputs=[other_inputs, ...])."
                )
            return None
        if plan.runtime_op_type != site.rule.op_type:
            self._mismatch(site, plan)
        return plan

    def _mismatch(self, site: SiteCall, plan: SitePlan):
        from quantlens.quantization.tracer import user_source_location

        recorded = self.state.record.sites[site.name].source
        raise QuantLensError(
            f"Op site '{site.name}' was a {plan.op_type} (at {recorded}) when the model was prepared but is a "
            f"{site.rule.op_type} now (at {user_source_location()}). Control flow in module "
            f"'{site.module_name or '<root>'}' changed the order of its ops; move each branch into its own "
            "submodule so op site names stay stable, and pass example inputs for every branch to prepare."
        )

    def _quantize_inputs(self, plan: SitePlan, args: tuple, kwargs: dict):
        if not plan.input_fq and not plan.weight_fq:
            return args, kwargs, None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first = None
        for pos, key in plan.input_fq.items():
            if pos < len(leaves) and is_float_tensor(leaves[pos]):
                original = leaves[pos]
                leaves[pos] = self.fq[key](original)
                if self.emulator is not None:  # the NPU requantizes from the producer's grid
                    leaves[pos] = self.emulator.to_grid(original, self._mark(original), self.fq[key], leaves[pos])
                self._set_marks(leaves[pos], self.fq[key])  # the op (and an override) sees its input scale
                first = first or self.fq[key]
        for pos, key in plan.weight_fq.items():
            if pos < len(leaves) and is_float_tensor(leaves[pos]):
                leaves[pos] = self.fq[key](leaves[pos])
        if plan.bias_position is not None and plan.bias_position < len(leaves):
            in_fq = first or next((self._mark(x) for x in leaves if is_float_tensor(x)), None)
            w_fq = self.fq[next(iter(plan.weight_fq.values()))]
            leaves[plan.bias_position] = int32_bias(leaves[plan.bias_position], in_fq, w_fq)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, kwargs, first

    def _finish(self, plan: SitePlan | None, output: Any, inputs: tuple, kwargs: dict, site: SiteCall,
                call: EmuCall | None = None) -> Any:
        if self.emulator is not None and plan is not None and plan.output is OutputMode.FUSED and call is not None \
                and isinstance(output, torch.Tensor) and output not in self.emulator.deferred:
            # the fused group's last op quantizes: the integer rule waits for its grid
            pending = self.emulator.integer_rule(call)
            if pending is not None:
                self.emulator.defer(output, pending)
        if plan is None or plan.output is OutputMode.INHERIT:
            src = next((x for x in _leaves((inputs, kwargs)) if is_float_tensor(x)), None)
            self._set_marks(output, self._mark(src) if src is not None else None)
            return output
        if plan.output is OutputMode.QUANTIZED:
            fq = self.fq[plan.output_fq]
            if is_float_tensor(output):
                observed = (plan.override is not None and self.state.overrides[plan.override].observes_output()
                            and not fq._learning())  # a learned (LSQ) scale takes the fake quant's own path
                quantized = fq.quantize(output) if observed else fq(output)
                if self.emulator is not None:
                    exact = self.emulator.resolve(output, fq, quantized, call)
                    quantized = quantized if exact is None else exact
                output = quantized
            else:
                leaves, spec = pytree.tree_flatten(output)
                output = pytree.tree_unflatten([fq(x) if is_float_tensor(x) else x for x in leaves], spec)
            self._set_marks(output, fq)
        elif plan.output is OutputMode.WEIGHT:
            wfq = getattr(site.module, "weight_fake_quant", None) if site.module is not None else None
            if wfq is None and plan.weight_fq:
                wfq = self.fq[next(iter(plan.weight_fq.values()))]
            self._set_marks(output, wfq)
        else:
            self._set_marks(output, None)
        return output

    def _override(self, plan: SitePlan, site: SiteCall, args: tuple, kwargs: dict) -> Any:
        leaves = [x for x in _leaves((args, kwargs)) if is_float_tensor(x)]
        call = OverrideCall(
            site=site.name,
            op_type=plan.op_type,
            func=site.func,
            args=args,
            kwargs=kwargs,
            module=site.module,
            input_fqs=[self._mark(x) for x in leaves],
            output_fq=self.fq[plan.output_fq] if plan.output_fq else None,
        )
        return self.state.overrides[plan.override].compute(call)

    # -- handler interface --------------------------------------------------------------------------------
    def function_op(self, site, func, args, kwargs):
        self.visited.append(site.name)
        plan = self._plan(site)
        target = args[0] if args and _is_inplace(func) and isinstance(args[0], torch.Tensor) else None
        raw = args, kwargs
        if plan is not None:
            args, kwargs, _ = self._quantize_inputs(plan, args, kwargs)
        call = None
        if plan is not None and plan.override is not None:
            out = self._override(plan, site, args, kwargs)
        elif self.emulator is not None and plan is not None:
            call = self._emu_call(site, plan, func, None, args, kwargs)
            out = self._emulated_function(site, plan, call, raw)
        else:
            out = func(*args, **kwargs)
        out = self._finish(plan, out, args, kwargs, site, call)
        if target is not None and isinstance(out, torch.Tensor) and out is not target:
            # x += y, x.mul_(2), x.clamp_(..): the user reads x afterwards, so x must hold the fake-quantized
            # result (the op may have run on a quantized copy of x). Export functionalizes the copy.
            target.copy_(out)
            return target
        return out

    def module_enter(self, site, args):
        self.visited.append(site.name)
        plan = self._plan(site)
        if plan is None:
            return None
        new_args, _, first = self._quantize_inputs(plan, args, {})
        if first is None and args and isinstance(args[0], torch.Tensor):
            first = self._mark(args[0])
        site.module.__dict__["_ql_input_fq"] = first
        return new_args if plan.input_fq else None

    def module_exit(self, site, args, output):
        plan = self.plans.get(site.name)
        site.module.__dict__["_ql_input_fq"] = None
        call = None
        if plan is not None and plan.override is not None:
            # The module's float result is discarded (export drops it as dead code).
            output = self._override(plan, site, args, {})
        elif self.emulator is not None and plan is not None:
            call = self._emu_call(site, plan, None, site.module, args, {})
            output = self._emulated_module(site, plan, call, output)
        return self._finish(plan, output, args, {}, site, call)

    # -- the integer rules (consistency levels 1-4, emulation.py) ------------------------------------------
    def _emu_call(self, site, plan: SitePlan, func, module, args: tuple, kwargs: dict) -> EmuCall:
        leaves = pytree.tree_flatten((args, kwargs))[0]
        grids = {}
        for pos, leaf in enumerate(leaves):
            if not is_float_tensor(leaf):
                continue
            fq = self.fq[plan.weight_fq[pos]] if pos in plan.weight_fq else self._mark(leaf)
            if fq is not None:
                grids[pos] = fq
        return EmuCall(site.name, site.rule.op_type, func, module, args, kwargs, grids, leaves)

    def _emulated_function(self, site, plan: SitePlan, call: EmuCall, raw: tuple) -> Any:
        emulator = self.emulator
        channel_dim = GEMM_CHANNEL_DIM.get(site.rule.op_type, False)
        if channel_dim is not False and plan.output is not OutputMode.FLOAT:
            weight_pos = next(iter(plan.weight_fq), None)
            data = [p for p in call.grids if p != weight_pos and p != plan.bias_position]
            if weight_pos is None and len(data) == 2:  # matmul of two activations
                x_fq, w_fq, weight_pos = call.grids[data[0]], call.grids[data[1]], data[1]
            elif weight_pos is not None and len(data) == 1:
                x_fq, w_fq = call.grids[data[0]], call.grids[weight_pos]
            else:
                x_fq = None
            if x_fq is not None:
                bias = None
                if plan.bias_position is not None:
                    raw_leaves = pytree.tree_flatten(raw)[0]
                    bias = raw_leaves[plan.bias_position] if plan.bias_position < len(raw_leaves) else None
                return emulator.gemm(call, lambda: call.func(*call.args, **call.kwargs), x_fq=x_fq, w_fq=w_fq,
                                     weight_pos=weight_pos, bias=bias, bias_pos=plan.bias_position,
                                     channel_dim=channel_dim)
        out = call.func(*call.args, **call.kwargs)
        call.output = out
        if site.rule.kind is OpKind.PASSTHROUGH:
            emulator.movement(call, out)
        return out

    def _emulated_module(self, site, plan: SitePlan, call: EmuCall, output: Any) -> Any:
        module = site.module
        call.output = output
        # a conv/linear + BatchNorm in training runs BatchNorm on batch statistics: no integer rule applies there
        folded_training = module.training and isinstance(getattr(module, "bn", None), nn.Module)
        if hasattr(module, "integer_operands") and plan.output is not OutputMode.FLOAT and not folded_training \
                and call.args and call.grids.get(0) is not None and module.weight_fake_quant.fake_quant_enabled:
            weight, bias = module.integer_operands()
            return self.emulator.gemm(call, lambda: output, x_fq=call.grids[0], w_fq=module.weight_fake_quant,
                                      weight_pos=None, bias=bias if call.grids.get(0) is not None else None,
                                      bias_pos=None, channel_dim=module.output_channel_dim, module=module,
                                      module_weight=weight)
        if site.rule.kind is OpKind.PASSTHROUGH:
            self.emulator.movement(call, output)
        return output


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__imatmul__"}


def _is_inplace(func) -> bool:
    """``Tensor.add_``, ``Tensor.__iadd__`` ... (``torch.relu_``-style functions too)."""
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _leaves(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_fields"):
        return [x for x in value if isinstance(x, torch.Tensor)]  # torch.return_types
    return pytree.tree_leaves(value)


#: GEMM op types -> the channel dim of their output (None: per-tensor operands)
GEMM_CHANNEL_DIM = {"conv1d": 1, "conv2d": 1, "conv_transpose1d": 1, "conv_transpose2d": 1, "linear": -1,
                    "matmul": None, "bmm": None, "mm": None}


def _emulator_for(state: QuantState) -> IntegerEmulator | None:
    """The integer rules run in QAT and VALIDATION forwards of a model prepared at consistency level 1-4 (never
    while export traces it: the qat IR keeps the float + fake-quant semantics, and convert the integer ones)."""
    config = getattr(state, "consistency", None)
    if config is None or not config.emulate_integer_rules or OpSiteTracer.annotate_sites:
        return None
    if state.fake_quant_state not in (FakeQuantState.QAT, FakeQuantState.VALIDATION):
        return None
    if torch.compiler.is_compiling():
        return None
    validation = state.fake_quant_state is FakeQuantState.VALIDATION
    exact = config.exact_validation if validation else config.exact_training
    return IntegerEmulator(config.qpp, exact)


class _QuantizedForward:
    """Replaces ``forward`` on the prepared model's instance: runs the class's own forward under the tracer."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        model = self.model
        state: QuantState = model._quantlens_state
        state.__dict__["_root_ref"] = model
        runtime = state.__dict__.get("_next_runtime") or _Runtime(state)
        try:
            from quantlens.quantization.scale_policy import forward_scope

            emulation = runtime.emulator.active() if runtime.emulator is not None else contextlib.nullcontext()
            tracer = OpSiteTracer(model, runtime, getattr(runtime, "qualnames", None))
            with tracer, forward_scope(state), emulation:  # grouped fake quants resolve through state
                return type(model).forward(model, *args, **kwargs)
        finally:
            runtime.marks.clear()  # the marks belong to this forward only


def is_prepared(model: nn.Module) -> bool:
    """Whether ``model`` was returned by :func:`prepare`."""
    return isinstance(getattr(model, "_quantlens_state", None), QuantState)


def prepare(
    model: nn.Module,
    example_inputs: Any,
    qconfig_setter: Any = default_qat_qconfig_setter,
    *,
    extra_example_inputs: Iterable[Any] = (),
    check_result_dir: str | None = ".",
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

    The returned model is in ``FakeQuantState.QAT``; use :func:`set_fake_quantize` to switch.
    """
    if not isinstance(model, nn.Module):
        raise QuantLensError(f"prepare expects a torch.nn.Module, got {type(model).__name__}.")
    if is_prepared(model):
        raise QuantLensError("prepare: this model is already prepared; pass the float model instead.")
    prepared = copy.deepcopy(model)
    was_training = prepared.training
    prepared.eval()  # recording must not update BatchNorm statistics or sample dropout masks
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
    weight_dtypes = _swap_modules(prepared, record, groups, assignment.qconfigs)
    plans, requests, plan_warnings = build_plans(record, groups, assignment.qconfigs, fixed, weight_dtypes)

    refusals = stage_refusals(record, groups)
    warnings = list(assignment.warnings) + plan_warnings + list(refusals.values())
    if refusals:
        # One console line; model_check_result.txt lists every op site with its source line.
        sites = list(refusals)
        shown = ", ".join(f"'{n}'" for n in sites[:5]) + (f" and {len(sites) - 5} more" if len(sites) > 5 else "")
        _warnings.warn(
            f"prepare: {len(sites)} op site(s) use ops that a later stage will refuse ({shown}); "
            "model_check_result.txt lists each with the stage and its source line.", stacklevel=2
        )
    state = QuantState(record, groups, unfused, plans, warnings, getattr(qconfig_setter, "name", repr(qconfig_setter)))
    for request in requests:
        spec = request.spec
        if request.fixed_scale is not None:
            spec = QuantSpec(spec.dtype, FixedScaleObserver.with_args(scale=request.fixed_scale))
        state.fq[request.key] = FakeQuantize(spec, is_weight=request.is_weight)
    _install_decompositions(state)
    prepared._quantlens_state = state
    state.__dict__["_root_ref"] = prepared
    from quantlens.quantization.scale_policy import install_scale_policy

    install_scale_policy(prepared)  # consistency level 2: pow2 activation scales, shared add/sub/cat scales
    if device.type != "cpu":  # the fake quants and swapped-in modules are made on the CPU: join the model
        prepared.to(device)
    prepared.forward = _QuantizedForward(prepared)
    set_fake_quantize(prepared, FakeQuantState.QAT)
    prepared.train(was_training)
    if check_result_dir is not None:
        _write_check_report(prepared, inputs_to(_copy_inputs(example_inputs), device), check_result_dir)
    return prepared


def _copy_inputs(example: Any) -> Any:
    """``example`` with every tensor leaf cloned (containers rebuilt, other leaves as they are)."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, example)


def _write_check_report(prepared: nn.Module, example: Any, directory: Any) -> None:
    """``model_check_result.txt``: a report, so a folder that cannot take it is a warning, never a failure."""
    import os

    from quantlens._io import atomic_write_text
    from quantlens.quantization.check import CHECK_FILE, check_qat_model

    result = check_qat_model(prepared, example, None)
    path = os.path.join(os.fspath(directory), CHECK_FILE)
    try:
        atomic_write_text(path, result.to_text())
    except OSError as exc:
        _warnings.warn(f"prepare: could not write the check report {path} ({exc.strerror or exc}); the model is "
                       "prepared. Pass check_result_dir= a writable folder, or None to skip the report.",
                       stacklevel=3)


def stage_refusals(record: ModelRecord, groups: list[FusedGroup] = ()) -> dict[str, str]:
    """Op site name -> one line for each op site whose op a later stage refuses (the op set's stage support), with its source line.

    Host post-processing (after a DeQuantStub) stays float, so only export and ONNX matter there; a BatchNorm
    folded into its conv/linear is no op of its own."""
    folded = {g.bn for g in groups if g.bn is not None}
    lines: dict[str, str] = {}
    for site in record.sites.values():
        if site.name in folded:
            continue
        op = op_def(site.op_type) if site.known else None
        if site.known and op is None:
            continue  # a module op type the op set does not list (QuantStub, DeQuantStub)
        stages = [s for s in Stage if s is not Stage.FAKE_QUANT] if op is None else op.refused_by()
        if site.after_dequant:
            stages = [s for s in stages if s in (Stage.EXPORT, Stage.ONNX)]
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


def _swap_modules(
    model: nn.Module, record: ModelRecord, groups: list[FusedGroup], qconfigs: dict[str, QConfig]
) -> dict[str, QuantDType]:
    """Replace weighted modules by QAT classes (fused with their BatchNorm where grouped)."""
    bn_of = {g.head: g.bn for g in groups if g.bn is not None}
    weight_dtypes: dict[str, QuantDType] = {}
    for site in record.sites.values():
        if not site.is_module or "@" in site.name:
            continue
        qc = qconfigs.get(site.name)
        module = model.get_submodule(site.module_name)
        if qc is None or qc.weight is None:
            continue
        wspec = qc.weight
        if site.output_from_weight:  # embedding: one scale for the whole table (its rows are outputs)
            wspec = QuantSpec(wspec.dtype, wspec.observer, ch_axis=None)
        if site.name in bn_of:
            cls = fused_class_for(module)
            bn = model.get_submodule(bn_of[site.name])
            new = cls.from_modules(module, bn, wspec)
            _set_submodule(model, bn_of[site.name], nn.Identity())
        else:
            cls = qat_class_for(module)
            if cls is None:
                continue
            new = cls.from_float(module, wspec)
        _set_submodule(model, site.module_name, new)
        weight_dtypes[site.name] = wspec.dtype
    return weight_dtypes


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
