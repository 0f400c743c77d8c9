"""Site plans: for every op site, which tensors are fake-quantized, with which dtype, and where.

The plan is computed once by ``prepare`` from the recorded data flow, the fused groups and the resolved
qconfigs; the runtime only follows it. Keeping decisions here (and not in the runtime) means the check report
describes exactly what the prepared model does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from quantlens.march import QuantDType, get_march
from quantlens.march.opset import op_def
from quantlens.quantization.fuse import FusedGroup
from quantlens.quantization.qconfig import QConfig, QuantSpec
from quantlens.sites.op_rules import OpKind
from quantlens.sites.record import ModelRecord, OpSiteRecord

__all__ = ["OutputMode", "SitePlan", "FakeQuantRequest", "build_plans", "march_lacks_rule"]


class OutputMode(str, Enum):
    QUANTIZED = "quantized"  # an output fake quant at this site
    HIGH_PRECISION = "high_precision"  # int32 output of a final conv/linear: no rounding
    FUSED = "fused"  # inside a fused group; the group's last op quantizes
    WEIGHT = "weight"  # the output is a row of the quantized weight (embedding)
    INHERIT = "inherit"  # passthrough: keeps the input's quantization
    FLOAT = "float"  # no qconfig: the op stays float


@dataclass(frozen=True)
class FakeQuantRequest:
    key: str
    spec: QuantSpec
    fixed_scale: float | None = None
    is_weight: bool = False


@dataclass
class SitePlan:
    name: str
    op_type: str
    kind: OpKind
    output: OutputMode
    #: leaf position (in the flattened (args, kwargs)) -> fake quant key
    input_fq: dict[int, str] = field(default_factory=dict)
    weight_fq: dict[int, str] = field(default_factory=dict)
    #: leaf position of a functional call's bias, quantized to int32 at s_in * s_w at run time
    bias_position: int | None = None
    output_fq: str | None = None
    fused_into: str | None = None
    qconfig: QConfig | None = None
    input_dtypes: list[str] = field(default_factory=list)
    output_dtype: str = "float"
    notes: list[str] = field(default_factory=list)
    #: key of a SiteOverride in QuantState.overrides that computes this site instead of the torch op
    override: str | None = None
    #: op type the prepared model runs at this site (a folded BatchNorm becomes an identity).
    runtime_op_type: str = ""
    #: the site runs on the host, in float, at every stage (the march's partition): its op has no integer rule
    #: in the march, it has no qconfig, or it follows the DeQuantStub. It reads its integer inputs dequantized and
    #: hands its result back through the consumer's input quantize; ``host_reason`` says which of these.
    host: bool = False
    host_reason: str = ""

    def __post_init__(self):
        self.runtime_op_type = self.runtime_op_type or self.op_type


def fq_key(site: str, role: str) -> str:
    # ModuleDict keys may not contain "."; "/" keeps names readable in state_dict keys.
    return f"{site.replace('.', '/')}|{role}"


def _activation_spec(qc: QConfig) -> QuantSpec:
    if qc.input is not None:
        return qc.input
    out = qc.output
    if out.dtype is QuantDType.qint32:
        return out.with_dtype(QuantDType.qint8)
    return out


def build_plans(
    record: ModelRecord,
    groups: list[FusedGroup],
    qconfigs: dict[str, QConfig],
    fixed_scales: dict[str, float],
    module_weight_dtypes: dict[str, QuantDType],
) -> tuple[dict[str, SitePlan], list[FakeQuantRequest], list[str]]:
    """Plans for every recorded site, the fake quants they need, and warnings for the check report."""
    group_of = {m: g for g in groups for m in g.members}
    out_dtype: dict[str, QuantDType | None] = {}
    plans: dict[str, SitePlan] = {}
    requests: list[FakeQuantRequest] = []
    warnings: list[str] = []
    # the partition first: a movement op quantizes a float input only for a consumer in the integer region
    reasons = {site.name: _host_reason(site, qconfigs.get(site.name)) for site in record.sites.values()}

    for site in record.sites.values():
        group = group_of.get(site.name)
        is_head = group is not None and site.name == group.head
        is_tail = group is not None and site.name == group.last
        qc = qconfigs.get(site.name)
        data_inputs = [i for i in _activation_inputs(site) if not _is_weight_input(site, i)]
        in_dtypes = [out_dtype.get(i.producer) if i.producer else None for i in data_inputs]

        if group is not None and not is_head and not is_tail:  # e.g. the BatchNorm of conv-bn-relu
            plans[site.name] = SitePlan(
                site.name, site.op_type, site.kind, OutputMode.FUSED, fused_into=group.last, qconfig=qc,
                input_dtypes=["(fused)"], output_dtype="(fused)",
            )
            out_dtype[site.name] = None
            continue

        if site.kind is OpKind.PASSTHROUGH and not is_tail and not (reasons[site.name] and march_lacks_rule(site)):
            plans[site.name], out_dtype[site.name] = _movement_plan(record, site, qc, data_inputs, in_dtypes,
                                                                    reasons, requests)
            continue

        reason = reasons[site.name]
        if reason:
            out_dtype[site.name] = None
            plans[site.name] = SitePlan(
                site.name, site.op_type, site.kind, OutputMode.FLOAT,
                input_dtypes=[_dt(d) for d in in_dtypes], output_dtype="float",
                host=site.kind is OpKind.QUANTIZED or site.after_dequant or march_lacks_rule(site),
                host_reason=reason,
            )
            if reason == _NO_QCONFIG:
                warnings.append(f"Op site '{site.name}' ({site.op_type}) has no qconfig and runs on the host in "
                                "float.")
            continue

        plan = SitePlan(site.name, site.op_type, site.kind, OutputMode.QUANTIZED, qconfig=qc)
        if is_tail:
            plan.input_dtypes = ["(fused)"]
        elif site.boundary:
            plan.input_dtypes = [_dt(d) for d in in_dtypes] or ["float"]
        else:
            _plan_inputs(site, plan, qc, data_inputs, in_dtypes, module_weight_dtypes, requests, warnings)

        head = record.sites[group.head] if group is not None else site
        if is_head:
            plan.output, plan.fused_into, plan.output_dtype = OutputMode.FUSED, group.last, "(fused)"
            out_dtype[site.name] = None
        elif head.output_from_weight:
            plan.output = OutputMode.WEIGHT
            weight = module_weight_dtypes.get(head.name) or (qc.weight.dtype if qc.weight else None)
            out_dtype[site.name] = weight
            plan.output_dtype = _dt(weight)
        elif qc.high_precision_output and head.gemm:
            plan.output = OutputMode.HIGH_PRECISION
            out_dtype[site.name] = QuantDType.qint32
            plan.output_dtype = QuantDType.qint32.value
        else:
            out_spec = qc.output if qc.output.dtype is not QuantDType.qint32 else _activation_spec(qc)
            key = fq_key(site.name, "out")
            plan.output_fq = key
            requests.append(FakeQuantRequest(key, out_spec, fixed_scales.get(site.name)))
            out_dtype[site.name] = out_spec.dtype
            plan.output_dtype = out_spec.dtype.value
        if site.after_dequant:  # post-processing a user's qconfig quantizes: fake quants in the qat IR, on the host
            plan.host, plan.host_reason = True, _AFTER_DEQUANT
        plans[site.name] = plan
    for group in groups:
        if group.bn is not None:
            plans[group.bn].runtime_op_type = "identity"
    return plans, requests, warnings


_NO_QCONFIG = "no qconfig"
_AFTER_DEQUANT = "after the DeQuantStub"
_MADE_INSIDE = "computes only on values made inside forward (constants, masks, positions)"


def march_lacks_rule(site: OpSiteRecord) -> bool:
    """Whether the march has no integer rule for the op a site computes (its op type is not in the op set, or
    convert cannot lower it: a movement op with no IR form, such as ``roll``, too): such a site runs on the host.
    Adding the rule to the op set moves it to the NPU."""
    if site.kind not in (OpKind.QUANTIZED, OpKind.PASSTHROUGH) or site.boundary:
        return False
    op = op_def(site.op_type)
    if op is None:
        return not site.known  # a module op the op set does not list (the stubs) is the march's own
    return not op.on_npu


def _host_reason(site: OpSiteRecord, qc: QConfig | None) -> str:
    """Why a site stays float (``""``: it does not). Passthrough sites never do on their own: they move what they
    are given, so they follow their input (a float input keeps them on the host)."""
    if site.after_dequant and (qc is None or qc.output is None):
        return _AFTER_DEQUANT
    if march_lacks_rule(site) and site.kind is OpKind.PASSTHROUGH:
        return f"no integer form for '{site.op_type}' in march {get_march().spec.name}"
    if site.kind is OpKind.PASSTHROUGH:
        return ""
    if site.made_inside and site.kind is OpKind.QUANTIZED and not site.boundary:
        return _MADE_INSIDE
    if march_lacks_rule(site):
        return f"no integer rule for '{site.op_type}' in march {get_march().spec.name}"
    if qc is None or qc.output is None:
        return _NO_QCONFIG
    return ""


def _plan_inputs(site, plan, qc, data_inputs, in_dtypes, module_weight_dtypes, requests, warnings) -> None:
    """Input fake quants: quantize what arrives float or int32; enforce the march's no-int16xint16 GEMM rule."""
    spec = get_march().spec
    act = _activation_spec(qc)
    weight_dtype = module_weight_dtypes.get(site.name)
    if weight_dtype is None and qc.weight is not None and site.weight_args:
        weight_dtype = qc.weight.dtype
    final_dtypes: list[QuantDType | None] = []
    for ordinal, (inp, dtype) in enumerate(zip(data_inputs, in_dtypes)):
        need = act if dtype is None or dtype is QuantDType.qint32 else None
        effective = need.dtype if need is not None else dtype
        other_int16 = weight_dtype is QuantDType.qint16 or (
            weight_dtype is None and ordinal >= 1 and QuantDType.qint16 in final_dtypes
        )
        if site.gemm and not spec.allow_int16_x_int16_gemm and effective is QuantDType.qint16 and other_int16:
            need = act.with_dtype(QuantDType.qint8)
            warnings.append(
                f"Op site '{site.name}' ({site.op_type}): int16 x int16 is not supported by march "
                f"{spec.name}; input {ordinal} is requantized to int8."
            )
            plan.notes.append(f"input {ordinal} requantized to int8 (no int16 x int16)")
        if need is not None:
            key = fq_key(site.name, f"in{inp.position}")
            plan.input_fq[inp.position] = key
            requests.append(FakeQuantRequest(key, need))
            final_dtypes.append(need.dtype)
        else:
            final_dtypes.append(dtype)
    plan.input_dtypes = [_dt(d) for d in final_dtypes]
    # Weights passed to functional ops (F.linear(x, self.weight)) get a weight fake quant at the site.
    if qc.weight is not None:
        for inp in site.inputs:
            # the bias next to a functional weight is quantized to int32 at run time (bias_position), not here
            if _is_weight_input(site, inp) and inp.position not in site.bias_args:
                key = fq_key(site.name, f"w{inp.position}")
                plan.weight_fq[inp.position] = key
                per_tensor = site.output_from_weight  # embedding tables: one scale (rows are outputs)
                wspec = QuantSpec(qc.weight.dtype, qc.weight.observer) if per_tensor else qc.weight
                if site.op_type in ("conv_transpose1d", "conv_transpose2d") and wspec.ch_axis is not None \
                        and inp.position in site.weight_args:
                    # weight [in, out, k...]: the output channels are axis 1 (groups = 1)
                    wspec = QuantSpec(wspec.dtype, wspec.observer, ch_axis=1)
                requests.append(FakeQuantRequest(key, wspec, is_weight=True))
        plan.bias_position = next((i.position for i in site.inputs if i.position in site.bias_args
                                   and plan.weight_fq), None)


def _movement_plan(record, site, qc, data_inputs, in_dtypes, reasons, requests) -> tuple[SitePlan, QuantDType | None]:
    """A passthrough site's plan (its output inherits its first input's grid) and that output's dtype."""
    plan = SitePlan(site.name, site.op_type, site.kind, OutputMode.INHERIT)
    if _quantizes_float_input(record, site, qc, in_dtypes, reasons):
        in_dtypes = _quantize_float_inputs(site, plan, qc, data_inputs, in_dtypes, requests)
    inherited = in_dtypes[0] if in_dtypes else None
    plan.input_dtypes, plan.output_dtype = [_dt(d) for d in in_dtypes], _dt(inherited)
    return plan, inherited


def _quantizes_float_input(record: ModelRecord, site: OpSiteRecord, qc: QConfig | None, in_dtypes: list,
                           reasons: dict[str, str]) -> bool:
    """Whether a data-movement site quantizes a float input itself: a float value (a model input, a constant, a
    float site's output) is quantized where the integer region first consumes it, whatever op that is. A pad,
    view or getitem that takes the network's float input is that place when its values reach a quantized op
    (otherwise the op that follows would quantize a value the movement op already moved in float: the qat IR
    would run a movement op on a float tensor, which has no integer form)."""
    if qc is None or qc.output is None or site.boundary or site.after_dequant or None not in in_dtypes:
        return False
    if _feeds_weights(record, site):  # a view of a weight: its consumer's weight fake quant quantizes it
        return False
    if site.calls > 1:  # a recurrent cell's steps: its state enters through the quantizers the steps share
        return False
    stack, seen = record.consumers(site.name), {site.name}
    while stack:  # through movement ops, to a quantized op with a qconfig
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        consumer = record.sites[name]
        if consumer.kind is OpKind.PASSTHROUGH and not consumer.boundary:
            stack.extend(record.consumers(name))
        elif consumer.kind is OpKind.QUANTIZED and not consumer.boundary and not reasons[name]:
            return True
    return False


def _feeds_weights(record: ModelRecord, site: OpSiteRecord) -> bool:
    """A movement op on parameters whose every consumer reads it at a weight position (``F.conv1d(x,
    self.weight.unsqueeze(1), bias)``)."""
    if not site.inputs or not all(i.is_parameter for i in site.inputs):
        return False
    uses = [(c, i) for c in record.consumers(site.name) for i in record.sites[c].inputs if i.producer == site.name]
    return bool(uses) and all(i.position in record.sites[c].weight_args for c, i in uses)


def _quantize_float_inputs(site, plan, qc, data_inputs, in_dtypes, requests) -> list:
    """Input fake quants at a data-movement site for its float inputs; returns the inputs' dtypes after them."""
    act = _activation_spec(qc)
    dtypes = []
    for inp, dtype in zip(data_inputs, in_dtypes):
        if dtype is None:
            key = fq_key(site.name, f"in{inp.position}")
            plan.input_fq[inp.position] = key
            requests.append(FakeQuantRequest(key, act))
            dtype = act.dtype
        dtypes.append(dtype)
    return dtypes


def _activation_inputs(site: OpSiteRecord) -> list:
    """The float tensor inputs that carry activations. A function call of an op whose integer rule reads its later
    tensors as constants (batch_norm's statistics and affine, layer_norm's gamma/beta: the op set's
    ``OpDef.activation_inputs``) has only its first ones; the others get no fake quant."""
    op = op_def(site.op_type)
    count = op.activation_inputs if op is not None and not site.is_module else 0
    return site.inputs[:count] if count else site.inputs


def _is_weight_input(site: OpSiteRecord, inp) -> bool:
    """Weights (and the bias next to them) of a functional conv/linear/embedding are not activations."""
    return (inp.is_parameter and inp.position in site.weight_args) or (
        inp.position in site.bias_args and any(i.is_parameter and i.position in site.weight_args for i in site.inputs)
    )


def _dt(dtype: QuantDType | None) -> str:
    return "float" if dtype is None else dtype.value
