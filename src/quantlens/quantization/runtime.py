"""The prepared model's runtime: what a forward does at each op site (fake quants, integer emulation, overrides).

:class:`Runtime` is the plain one every forward of a prepared model uses; the layers above subclass it (the
profiler's probes, the non-finite watcher) and install theirs for a block with
:func:`quantlens.quantization.use_runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.march.opset import OPS
from quantlens.quantization.emulation import EmuCall, IntegerEmulator
from quantlens.quantization.fake_quantize import FakeQuantize, FakeQuantState, int32_bias
from quantlens.quantization.overrides import OverrideCall
from quantlens.quantization.plan import OutputMode, SitePlan
from quantlens.sites.op_rules import OpKind
from quantlens.sites.tracer import (
    OpSiteTracer,
    SiteCall,
    SiteHandler,
    TensorMarks,
    is_float_tensor,
    is_inplace,
)
from quantlens.sites.tracing_state import export_tracing

if TYPE_CHECKING:
    from quantlens.quantization.state import QuantState

__all__ = ["Runtime", "is_inplace", "tensor_leaves", "emulator_for", "GEMM_CHANNEL_DIM"]


class Runtime(SiteHandler):
    """Follows the site plans during one forward of the prepared model."""

    _generation = 0

    def __init__(self, state: QuantState):
        Runtime._generation += 1
        self.generation = Runtime._generation
        self.state = state
        self.plans = state.plans
        self.fq = state.fq
        self.visited: list[str] = []
        #: the fake quant (grid) each tensor of this forward is on; a side table, so the user's tensors carry
        #: no attribute of quantlens (cleared when the forward ends)
        self.marks = TensorMarks()
        #: the integer rules in this forward (consistency levels 1-4), or None
        self.emulator = emulator_for(state)

    # -- helpers ------------------------------------------------------------------------------------------
    def _mark(self, tensor: torch.Tensor):
        return self.marks.get(tensor)

    def _set_marks(self, output: Any, fq: FakeQuantize | None) -> None:
        for leaf in tensor_leaves(output):
            if is_float_tensor(leaf):
                self.marks.set(leaf, fq)

    def _plan(self, site: SiteCall) -> SitePlan | None:
        plan = self.plans.get(site.name)
        if plan is None:
            if site.rule.kind is OpKind.QUANTIZED:
                from quantlens.sites.tracer import user_source_location

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
        from quantlens.sites.tracer import user_source_location

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
            data = (x for pos, x in enumerate(leaves) if is_float_tensor(x) and pos != plan.bias_position
                    and pos not in plan.weight_fq)  # (torch.addmm(bias, x, w) passes the bias first)
            in_fq = first or next((self._mark(x) for x in data), None)
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
            src = next((x for x in tensor_leaves((inputs, kwargs)) if is_float_tensor(x)), None)
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
        leaves = [x for x in tensor_leaves((args, kwargs)) if is_float_tensor(x)]
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
        target = args[0] if args and is_inplace(func) and isinstance(args[0], torch.Tensor) else None
        raw = args, kwargs
        if target is not None and plan is not None and target.requires_grad and torch.is_grad_enabled():
            # the input fake quant saves its input for backward, and target.copy_ below overwrites target: it
            # quantizes a copy (x += y in QAT, DeBERTa's score += c2p; was "modified by an inplace operation")
            fresh = target.clone()
            if target in self.marks:
                self.marks.set(fresh, self._mark(target))
            args = (fresh, *args[1:])
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
            if out in self.marks:  # x now holds the result's values on the result's grid (in-place add: its own)
                self.marks.set(target, self._mark(out))
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


def tensor_leaves(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and type(value) is not tuple and not hasattr(value, "_fields"):
        return [x for x in value if isinstance(x, torch.Tensor)]  # torch.return_types
    return pytree.tree_leaves(value)


#: GEMM op types -> the channel dim of their output (None: per-tensor operands): the op set's GEMMs that lower to
#: one GEMM IR op (sdpa, a composite of two, is decomposed at prepare)
GEMM_CHANNEL_DIM = {d.name: d.channel_dim for d in OPS.values() if d.gemm and len(d.ir) == 1}


def emulator_for(state: QuantState) -> IntegerEmulator | None:
    """The integer rules run in QAT and VALIDATION forwards of a model prepared at consistency level 1-4 (never
    while export traces it: the qat IR keeps the float + fake-quant semantics, and convert the integer ones)."""
    config = getattr(state, "consistency", None)
    if config is None or not config.emulate_integer_rules or OpSiteTracer.annotate_sites:
        return None
    if state.fake_quant_state not in (FakeQuantState.QAT, FakeQuantState.VALIDATION):
        return None
    if export_tracing():
        return None
    validation = state.fake_quant_state is FakeQuantState.VALIDATION
    exact = config.exact_validation if validation else config.exact_training
    return IntegerEmulator(config.qpp, exact)
