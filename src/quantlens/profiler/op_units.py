"""Ablation units of the joint sensitivity (:mod:`.joint_sensitivity`): one quantizer, or every quantizer one op
depends on as its integer kernel sees it.

An **op unit** (``fake_quant``) is one kernel: an op site, or a fused group (conv-bn-relu runs as one kernel),
with

* its own quantizers: each member's activation quantization (input fake quants, output fake quant, the fake
  quants inside its override) and weight quantization;
* the quantizers that put its inputs on their integer grid: for each data input, the activation quantizer of
  the op site whose output fake quant rounds that value (through pass-through ops such as ``reshape`` or a
  DeQuantStub-free chain, and through a fused group to its last op; an embedding's output is its weight's grid);
  an input the op quantizes itself (its own input fake quant) needs nothing more.

With all of them on, the op computes as the kernel does: in particular a conv/linear bias becomes int32 at
``s_in * s_w[c]`` only when the input's fake quant and the weight's are both on (``fake_quantize.int32_bias``,
``docs/march.md`` §7.2), which no single quantizer switches. A producer's activation unit comes whole (its own
input fake quants too, where it has any: those exist only where a float or int32 value enters the integer
region).

For the other analysis types there is one quantizer per op site already (``pre_export``: one lookup table;
``export``/``convert``: one IR site), so the op units are the quantizers themselves (grouped by op site).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantlens.profiler.model_access import AnalysisType, ModelAccess, Quantizer
from quantlens.quantization.plan import OutputMode

__all__ = ["AblationUnit", "quantizer_units", "op_units"]


@dataclass(frozen=True)
class AblationUnit:
    """A set of quantizers switched on together (indices into the quantizer list, ascending)."""

    kind: str  # "quantizer" or "op"
    op_name: str
    sensitive_type: str  # the quantizer's ("activation", "weight", "lut") or "op"
    op_type: str
    quant_dtype: str
    members: tuple[int, ...]

    @property
    def label(self) -> str:
        """``conv1:weight`` (one quantizer), ``conv1:op`` (one op)."""
        return f"{self.op_name}:{self.sensitive_type}"


def quantizer_units(quantizers: list[Quantizer]) -> list[AblationUnit]:
    """One unit per quantizer, in execution order."""
    return [AblationUnit("quantizer", q.op_name, q.sensitive_type, q.op_type, q.quant_dtype, (i,))
            for i, q in enumerate(quantizers)]


def op_units(analysis: ModelAccess, analysis_type: AnalysisType, quantizers: list[Quantizer]) -> list[AblationUnit]:
    """The op units (see the module docstring), in execution order of each op's first quantizer."""
    state = getattr(analysis, "state", None)
    if analysis_type is AnalysisType.FAKE_QUANT and state is not None and hasattr(state, "plans"):
        return _kernel_units(state, quantizers)
    by_site: dict[str, list[int]] = {}
    for i, q in enumerate(quantizers):
        by_site.setdefault(q.op_name, []).append(i)
    return [AblationUnit("op", name, "op", quantizers[idx[0]].op_type, quantizers[idx[-1]].quant_dtype, tuple(idx))
            for name, idx in by_site.items()]


def _kernel_units(state, quantizers: list[Quantizer]) -> list[AblationUnit]:
    index = {(q.op_name, q.sensitive_type): i for i, q in enumerate(quantizers)}
    group_of = {m: tuple(g.members) for g in state.groups for m in g.members}
    units: list[tuple[int, AblationUnit]] = []
    done: set[tuple[str, ...]] = set()
    for name in state.plans:
        members = group_of.get(name, (name,))
        if members in done:
            continue
        done.add(members)
        own = [index[(s, kind)] for s in members for kind in ("activation", "weight") if (s, kind) in index]
        if not own:
            continue
        inside = set(members)
        feeding: set[int] = set()
        for s in members:
            for producer in _unquantized_inputs(state, s):
                if producer not in inside:
                    feeding |= _grid_owners(state, index, producer, set())
        head = state.plans[members[0]]
        tail = next((i for i in reversed(own) if quantizers[i].sensitive_type == "activation"), own[-1])
        units.append((min(own), AblationUnit("op", members[0], "op", head.op_type, quantizers[tail].quant_dtype,
                                             tuple(sorted(set(own) | feeding)))))
    units.sort(key=lambda item: item[0])  # execution order of each op's own first quantizer
    return [unit for _, unit in units]


def _unquantized_inputs(state, name: str) -> list[str]:
    """The producers of the site's data inputs that the site does not quantize itself (no input fake quant)."""
    site = state.record.sites.get(name)
    plan = state.plans.get(name)
    if site is None or plan is None:
        return []
    skip = set(plan.input_fq) | set(plan.weight_fq) | {plan.bias_position}
    return [inp.producer for inp in site.inputs
            if inp.producer is not None and not inp.is_parameter and inp.position not in skip]


def _grid_owners(state, index: dict, name: str, seen: set[str]) -> set[int]:
    """The quantizers whose fake quant puts site ``name``'s output on its integer grid."""
    if name in seen:
        return set()
    seen.add(name)
    plan = state.plans.get(name)
    if plan is None:
        return set()
    if plan.output is OutputMode.FUSED and plan.fused_into:
        return _grid_owners(state, index, plan.fused_into, seen)
    if plan.output is OutputMode.QUANTIZED:
        return {index[(name, "activation")]} if (name, "activation") in index else set()
    if plan.output is OutputMode.WEIGHT:  # an embedding's rows are its weight's values
        return {index[(name, "weight")]} if (name, "weight") in index else set()
    if plan.output is OutputMode.INHERIT:  # pass-through: the grid of what it moves
        out = {index[(name, "activation")]} if plan.input_fq and (name, "activation") in index else set()
        for producer in _unquantized_inputs(state, name):
            out |= _grid_owners(state, index, producer, seen)
        return out
    return set()  # float or int32 (high precision): the consumer quantizes it with its own input fake quant
