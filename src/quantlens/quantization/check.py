"""``check_qat_model``: what the prepared model really does, written to ``model_check_result.txt``.

Users' commonest complaint about quantization tools is a setting that silently did not apply; this report
shows the effective dtype of every op site, the observers, the fusions, shared modules, and warnings for any
setting that matched nothing.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quantlens._io import atomic_write_text, format_table
from quantlens.errors import QuantLensError
from quantlens.quantization.fake_quantize import FakeQuantize, nonfinite_sites
from quantlens.quantization.plan import OutputMode
from quantlens.quantization.queries import last_sites
from quantlens.quantization.state import is_prepared

__all__ = ["OpSiteCheck", "ModelCheckResult", "check_qat_model"]

CHECK_FILE = "model_check_result.txt"


@dataclass(frozen=True)
class OpSiteCheck:
    name: str
    op_type: str
    input_dtypes: str
    output_dtype: str
    observer: str
    weight: str
    fused: str
    source: str
    #: where the op runs: ``npu`` (the march's integer rule), or ``host`` (float, the march's partition)
    runs_on: str = "npu"


@dataclass
class ModelCheckResult:
    """The data behind ``model_check_result.txt``."""

    march: str
    setter: str
    fake_quant_state: str
    sites: list[OpSiteCheck]
    fused_groups: list[tuple[str, ...]]
    unfused: list[tuple[tuple[str, ...], str]]
    call_counts: dict[str, int]
    shared_modules: list[str]
    warnings: list[str] = field(default_factory=list)
    path: str | None = None
    #: op site -> roles of its fake quants (``output``, ``input 0``, ``weight``) whose observer saw NaN/Inf
    nonfinite: dict[str, list[str]] = field(default_factory=dict)
    #: scale groups of the consistency strategy's shared add/sub/cat scales (``scale_policy.ScaleGroup.describe``)
    scale_groups: list[str] = field(default_factory=list)
    #: where the float model inputs become integers: the QuantStub sites, or (a model without any) the op sites
    #: that quantize a model input themselves, as "site (input k)"
    boundary: list[str] = field(default_factory=list)
    implicit_boundary: bool = False
    #: op site -> why it runs on the host (no integer rule, no qconfig, values made inside forward ...)
    host: dict[str, str] = field(default_factory=dict)

    def site(self, name: str) -> OpSiteCheck:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_text(self) -> str:
        lines = [
            "quantlens model check",
            f"march: {self.march}",
            f"qconfig setter: {self.setter}",
            f"fake quant state: {self.fake_quant_state}",
            f"quantized op sites: {sum(1 for s in self.sites if s.output_dtype not in ('float', 'inherit'))} "
            f"of {len(self.sites)} op sites",
            "",
            "== Op sites (execution order) ==",
            format_table(
                ["op site", "op type", "runs on", "input dtypes", "output dtype", "output observer",
                 "weight qconfig", "fused", "source"],
                [[s.name, s.op_type, s.runs_on, s.input_dtypes, s.output_dtype, s.observer, s.weight, s.fused,
                  s.source] for s in self.sites],
            ),
            "",
            "== Fused groups (the last op carries the output fake quant) ==",
        ]
        lines += [" -> ".join(g) for g in self.fused_groups] or ["(none)"]
        lines += ["", "== Fusable patterns left unfused =="]
        lines += [f"{' -> '.join(m)}: {reason}" for m, reason in self.unfused] or ["(none)"]
        lines += ["", "== Module call counts (one forward) =="]
        lines.append(format_table(["module", "calls"], sorted(self.call_counts.items())) if self.call_counts
                     else "(none)")
        lines += ["", "== Modules called more than once (shared) =="]
        lines += self.shared_modules or ["(none)"]
        lines += ["", "== Scale groups (shared add/sub/cat scales; members use one scale) =="]
        lines += self.scale_groups or ["(none)"]
        lines += ["", "== Where the model inputs are quantized (the NPU boundary) =="]
        if self.implicit_boundary:
            lines.append("no QuantStub: each float model input is quantized at the first op site that reads it "
                         "(calibrated like a QuantStub); wrap the inputs in QuantStub (and the outputs in "
                         "DeQuantStub) to name the boundary and set its scale yourself:")
        lines += self.boundary or ["(no float model input is quantized)"]
        lines += ["", "== Op sites on the host (float; their integer inputs dequantized, their results quantized "
                  "where the integer region reads them) =="]
        lines += [f"{site}: {why}" for site, why in self.host.items()] or ["(none: every op runs on the NPU)"]
        lines += ["", "== Op sites whose observers saw NaN/Inf (left out of the statistics) =="]
        lines += [f"{site}: {', '.join(roles)}" for site, roles in self.nonfinite.items()] or ["(none)"]
        lines += ["", "== Please check these settings =="]
        lines += [f"WARNING: {w}" for w in self.warnings] or ["(no warnings)"]
        return "\n".join(lines) + "\n"


def _observer_text(fq: FakeQuantize | None) -> str:
    return "-" if fq is None else fq.spec_text


def check_qat_model(model: nn.Module, example_inputs: Any, out_dir: str | os.PathLike | None = ".") -> ModelCheckResult:
    """Check a prepared model on ``example_inputs``; write ``out_dir/model_check_result.txt`` (unless
    ``out_dir`` is None) and return the same content as data."""
    if not is_prepared(model):
        raise QuantLensError(
            f"check_qat_model expects a model returned by quantlens.quantization.prepare, got "
            f"{type(model).__name__}, which has no op site plans."
        )
    state = model._quantlens_state
    modules = dict(model.named_modules())
    # Count calls of leaf modules on a fresh forward without touching observers.
    visited = last_sites(state, example_inputs)
    calls = Counter()
    for name in visited:
        site = state.record.sites.get(name.split("@")[0])
        if site is not None and site.is_module:
            calls[site.module_name] += 1
    shared = sorted(f"{m} ({n} calls)" for m, n in calls.items() if n > 1)

    rows = []
    for plan in state.plans.values():
        site = state.record.sites[plan.name]
        out_fq = state.fq[plan.output_fq] if plan.output_fq else None
        module = modules.get(site.module_name) if site.is_module else None
        wfq = getattr(module, "weight_fake_quant", None)
        if wfq is None and plan.weight_fq:
            wfq = state.fq[next(iter(plan.weight_fq.values()))]
        observer = _observer_text(out_fq)
        if plan.output is OutputMode.HIGH_PRECISION:
            observer = "int32 high precision (no rounding)"
        elif plan.output is OutputMode.FUSED:
            observer = f"(in {plan.fused_into})"
        elif plan.output is OutputMode.INHERIT:
            observer = "(keeps input quantization)"
        elif plan.output is OutputMode.WEIGHT:
            observer = "(weight table)"
        in_text = ", ".join(plan.input_dtypes) if plan.input_dtypes else "-"
        if plan.input_fq:
            in_text += "  [quantized here]"
        if plan.notes:
            in_text += "  " + "; ".join(plan.notes)
        group = next((g for g in state.groups if plan.name in g.members), None)
        rows.append(
            OpSiteCheck(
                name=plan.name,
                op_type=plan.op_type,
                input_dtypes=in_text,
                output_dtype="inherit" if plan.output is OutputMode.INHERIT else plan.output_dtype,
                observer=observer,
                weight=_observer_text(wfq),
                fused="+".join(m.rsplit(".", 1)[-1] for m in group.members) if group else "",
                source=os.path.basename(site.source),
                runs_on="host" if plan.host else "npu",
            )
        )
    stubs = [p.name for p in state.plans.values() if state.record.sites[p.name].boundary == "input"]
    implicit = [f"{p.name} (input {i.position})" for p in state.plans.values() for i in state.record.sites[p.name].inputs
                if i.position in p.input_fq and i.from_input and state.record.sites[p.name].boundary != "input"]
    result = ModelCheckResult(
        march=state.march,
        setter=state.setter_name,
        fake_quant_state=state.fake_quant_state.value,
        sites=rows,
        fused_groups=[g.members for g in state.groups],
        unfused=[(u.members, u.reason) for u in state.unfused],
        call_counts=dict(calls),
        shared_modules=shared,
        warnings=list(state.warnings),
        nonfinite=nonfinite_sites(model),
        scale_groups=[g.describe() for g in getattr(state, "scale_groups", None) or ()],
        boundary=stubs + implicit if stubs else implicit, implicit_boundary=bool(implicit) and not stubs,
        host={p.name: p.host_reason for p in state.plans.values() if p.host},
    )
    if result.nonfinite:
        sites = list(result.nonfinite)
        result.warnings.append(
            f"the observers of {len(sites)} op site(s) saw NaN/Inf values ({', '.join(sites[:5])}"
            f"{' ...' if len(sites) > 5 else ''}; first in execution order: '{sites[0]}'): the model computes "
            "non-finite values there; see 'Op sites whose observers saw NaN/Inf' above."
        )
    if out_dir is not None:
        result.path = str(atomic_write_text(os.path.join(out_dir, CHECK_FILE), result.to_text()))
    return result
