"""Qconfig setters: which QConfig each op site of a model gets.

A setter is called with a :class:`QconfigContext` (the recorded op sites and their data flow) and returns a
:class:`QconfigAssignment`. Pass one setter, or a tuple of setters to ``prepare``: the first setter that assigns
a site wins, so put specific setters (``ModuleNameQconfigSetter``) before general templates.

For a fused group (conv-bn-relu, op-relu) a qconfig assigned to any member applies to the whole group.

The sensitivity table read by :func:`sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter` is a list of
rows, most sensitive first, each a mapping (or object) with at least ``op_name`` (an op site name) and
``sensitive_type`` (``"activation"`` or ``"weight"``); the profiler's ``sensitivity()`` writes exactly this.
"""

from __future__ import annotations

import math
import warnings as _warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from quantlens.errors import QuantLensError, QuantLensWarning
from quantlens.march import QuantDType
from quantlens.quantization.fuse import FusedGroup
from quantlens.quantization.observers import MinMaxObserver
from quantlens.quantization.qconfig import QConfig, QuantSpec
from quantlens.sites.op_rules import OpKind
from quantlens.sites.record import ModelRecord, OpSiteRecord

__all__ = [
    "QconfigContext",
    "QconfigAssignment",
    "QconfigSetter",
    "TemplateQconfigSetter",
    "ModuleNameQconfigSetter",
    "SensitiveOpQconfigSetter",
    "default_calibration_qconfig_setter",
    "default_qat_qconfig_setter",
    "calibration_8bit_weight_16bit_act_qconfig_setter",
    "qat_8bit_weight_16bit_act_qconfig_setter",
    "sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter",
    "sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter",
    "METRIC_HIGHER_IS_WORSE",
    "register_metric_direction",
    "metric_higher_is_worse",
]


@dataclass
class QconfigContext:
    """What a setter may look at: the recorded sites (execution order) and the fused groups."""

    record: ModelRecord
    groups: list[FusedGroup]

    @property
    def sites(self) -> list[OpSiteRecord]:
        return list(self.record.sites.values())

    def quantized_sites(self) -> list[OpSiteRecord]:
        return [s for s in self.record.sites.values() if s.kind is OpKind.QUANTIZED]

    def group_of(self, name: str) -> FusedGroup | None:
        for group in self.groups:
            if name in group.members:
                return group
        return None


@dataclass
class QconfigAssignment:
    """A setter's answer: qconfigs by op site name, plus warnings for the check report. ``unmatched``: the
    names the setter was given that match no op site (a typo), each with the closest op site names; ``prepare``
    warns about them (a silently ignored key would leave a site at another qconfig than the user chose)."""

    qconfigs: dict[str, QConfig] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)


def closest_sites(key: str, ctx: "QconfigContext", n: int = 3) -> list[str]:
    """The op site (or module) names closest to ``key`` (difflib), for "did you mean" hints."""
    import difflib

    names = sorted({s.name for s in ctx.sites} | {s.module_name for s in ctx.sites if s.module_name})
    return difflib.get_close_matches(key, names, n=n, cutoff=0.5)


def unmatched_message(setter: str, key: str, ctx: "QconfigContext") -> str:
    """``setter``'s key ``key`` matched no op site: the message, with the closest names."""
    close = closest_sites(key, ctx)
    hint = f" Closest op site names: {close}." if close else " Run prepare and read model_check_result.txt for the names."
    return f"{setter}: '{key}' matched no op site; its setting was not applied.{hint}"


class QconfigSetter:
    """Base class: subclasses implement :meth:`assign`."""

    name = "QconfigSetter"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        raise NotImplementedError

    def __call__(self, ctx: QconfigContext) -> QconfigAssignment:
        return self.assign(ctx)

    def __repr__(self) -> str:
        return self.name


class TemplateQconfigSetter(QconfigSetter):
    """Every quantized op site gets ``activation_dtype`` outputs and ``weight_dtype`` per-channel weights.

    With ``high_precision_output`` a conv/linear whose output only feeds DeQuantStubs keeps the march's int32
    output (no rounding of the final layer). Ops after a DeQuantStub (host post-processing) stay float.
    """

    def __init__(
        self,
        name: str,
        activation_dtype: QuantDType | str,
        weight_dtype: QuantDType | str,
        observer: Callable,
        high_precision_output: bool = True,
    ):
        self.name = name
        self.activation = QuantSpec(QuantDType.parse(activation_dtype), observer)
        self.weight = QuantSpec(QuantDType.parse(weight_dtype), MinMaxObserver, ch_axis=0)
        self.high_precision_output = high_precision_output

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        result = QconfigAssignment()
        base = QConfig(input=self.activation, weight=self.weight, output=self.activation)
        hp = base.replace(output=QuantSpec(QuantDType.qint32, self.activation.observer))
        for site in ctx.sites:
            if site.after_dequant:
                continue
            group = ctx.group_of(site.name)
            last = group.last if group is not None else site.name
            if (
                self.high_precision_output
                and site.gemm
                and site.is_module
                and last == site.name
                and ctx.record.feeds_only_dequant(site.name)
            ):
                result.qconfigs[site.name] = hp
            else:
                result.qconfigs[site.name] = base
        return result


def _calib_observer():
    return MinMaxObserver


def _qat_observer():
    return MinMaxObserver.with_args(averaging_constant=0.01)


default_calibration_qconfig_setter = TemplateQconfigSetter(
    "default_calibration_qconfig_setter", "qint8", "qint8", _calib_observer()
)
default_qat_qconfig_setter = TemplateQconfigSetter("default_qat_qconfig_setter", "qint8", "qint8", _qat_observer())
calibration_8bit_weight_16bit_act_qconfig_setter = TemplateQconfigSetter(
    "calibration_8bit_weight_16bit_act_qconfig_setter", "qint16", "qint8", _calib_observer()
)
qat_8bit_weight_16bit_act_qconfig_setter = TemplateQconfigSetter(
    "qat_8bit_weight_16bit_act_qconfig_setter", "qint16", "qint8", _qat_observer()
)


class ModuleNameQconfigSetter(QconfigSetter):
    """Set qconfigs by name: a key is an op site name (``"head.add_0"``) or a module name (``"backbone"``),
    which covers every op site inside that module. Keys that match nothing are reported as warnings.
    """

    name = "ModuleNameQconfigSetter"

    def __init__(self, mapping: Mapping[str, QConfig]):
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise QuantLensError(
                    f"ModuleNameQconfigSetter keys must be op site or module names (str), got {key!r} "
                    f"({type(key).__name__}). Use the dotted name, e.g. 'backbone.layer1.0.conv1'."
                )
            if not isinstance(value, QConfig):
                raise QuantLensError(f"ModuleNameQconfigSetter['{key}'] must be a QConfig, got {type(value).__name__}.")
        self.mapping = dict(mapping)

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        result = QconfigAssignment()
        for key, qconfig in self.mapping.items():
            matched = [
                s.name
                for s in ctx.sites
                if s.name == key or s.module_name == key or s.module_name.startswith(key + ".") or key == ""
            ]
            if not matched:
                result.unmatched.append(unmatched_message("ModuleNameQconfigSetter", key, ctx))
            for name in matched:
                result.qconfigs[name] = qconfig
        return result


# -- which way a sensitivity metric gets worse ------------------------------------------------------------------

#: Metric name -> whether a larger value is worse (``L1``: yes, ``SQNR``: no), for the ``metric`` field of
#: sensitivity rows. The built-in metrics are declared here, below the profiler, because the sensitive-op setters
#: must read a row's direction without importing the profiler: ``quantlens.profiler.metrics`` takes its built-ins'
#: direction from this table, and its ``register_metric`` records every metric it adds.
METRIC_HIGHER_IS_WORSE: dict[str, bool] = {"Cosine": False, "MSE": True, "L1": True, "KL": True, "SQNR": False,
                                           "Atol": True}


def register_metric_direction(name: str, higher_is_worse: bool) -> None:
    """Record which way metric ``name`` gets worse (``quantlens.profiler.register_metric`` calls this)."""
    METRIC_HIGHER_IS_WORSE[name] = bool(higher_is_worse)


def metric_higher_is_worse(metric: Any) -> bool | None:
    """Whether a larger value of ``metric`` is worse: a registered name (case-insensitive, the first match as
    ``get_metric`` finds it) or an object with a ``higher_is_worse`` flag (a profiler ``Metric``). None when
    unknown."""
    if isinstance(metric, str):
        for name, worse_up in METRIC_HIGHER_IS_WORSE.items():
            if name.lower() == metric.lower():
                return worse_up
        return None
    worse_up = getattr(metric, "higher_is_worse", None)
    return None if worse_up is None else bool(worse_up)


def _row_field(row: Any, key: str) -> Any:
    if isinstance(row, Mapping):
        return row.get(key)
    return getattr(row, key, None)


def _nonfinite_row(row: Any) -> bool:
    """Whether a sensitivity row's ``value`` is NaN, or infinitely bad (+inf for L1/MSE/..., -inf for SQNR):
    switching that quantizer on made the outputs non-finite, or the baseline was, so the value ranks nothing.
    +inf SQNR (outputs unchanged) is a finite verdict and is kept. Rows without a numeric value are kept."""
    value = _row_field(row, "value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:  # a 0-dim tensor
            value = float(value) if value is not None and getattr(value, "numel", lambda: 0)() == 1 else None
        except (TypeError, ValueError):
            value = None
    if value is None or math.isfinite(value):
        return False
    if math.isnan(value):
        return True
    worse_up = metric_higher_is_worse(_row_field(row, "metric"))
    if worse_up is None:  # an unknown (custom) metric: any infinity is suspect
        return True
    return (value > 0) == worse_up


class SensitiveOpQconfigSetter(QconfigSetter):
    """Promote the most sensitive ops of a sensitivity table to int16 (activation rows: the op's output;
    weight rows: the op's weight). Take the union of several tables; ``topk`` or ``ratio`` of each table."""

    def __init__(
        self,
        name: str,
        tables: Sequence[Sequence[Any]] | Sequence[Any],
        topk: int | None,
        ratio: float | None,
        observer: Callable,
    ):
        if (topk is None) == (ratio is None):
            raise QuantLensError(f"{name}: pass exactly one of topk= or ratio= (got topk={topk}, ratio={ratio}).")
        if ratio is not None and not 0 < ratio <= 1:
            raise QuantLensError(f"{name}: ratio must be in (0, 1], got {ratio}.")
        if topk is not None and topk < 0:
            raise QuantLensError(f"{name}: topk must be >= 0, got {topk}.")
        self.name = name
        tables = list(tables)
        if tables and (isinstance(tables[0], Mapping) or hasattr(tables[0], "op_name")):
            tables = [tables]
        self.selected: list[tuple[str, str]] = []
        #: rows left out because their value is NaN/Inf, as (op_name, sensitive_type, value)
        self.skipped: list[tuple[str, str, float]] = []
        for table in tables:
            rows = []
            for row in table:
                if _nonfinite_row(row):
                    self.skipped.append((_row_field(row, "op_name"), _row_field(row, "sensitive_type") or "activation",
                                         _row_field(row, "value")))
                else:
                    rows.append(row)
            count = topk if topk is not None else max(1, round(len(rows) * ratio))
            for row in rows[:count]:
                op_name, kind = _row_field(row, "op_name"), _row_field(row, "sensitive_type") or "activation"
                if op_name is None:
                    raise QuantLensError(
                        f"{name}: a table row has no 'op_name': {row!r}. Pass the table returned by "
                        "QuantAnalysis.sensitivity() (or rows with op_name and sensitive_type)."
                    )
                if (op_name, kind) not in self.selected:
                    self.selected.append((op_name, kind))
        self.nonfinite_warning = None
        if self.skipped:
            shown = ", ".join(f"{op} ({kind}: {value})" for op, kind, value in self.skipped[:5])
            more = f" and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
            self.nonfinite_warning = (
                f"{name}: {len(self.skipped)} sensitivity row(s) with a NaN/Inf value were not promoted: {shown}{more}. "
                "A non-finite value ranks nothing (the quantizer made the outputs NaN/Inf, or the baseline was "
                "non-finite); find the op site that produces them (compare_per_layer's nan_inf rule, "
                "quantlens.quantization.find_nonfinite) and re-run sensitivity()."
            )
            _warnings.warn(self.nonfinite_warning, stacklevel=3, category=QuantLensWarning)
        self.int16 = QuantSpec(QuantDType.qint16, observer)
        self.int8_weight = QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0)
        self.int16_weight = QuantSpec(QuantDType.qint16, MinMaxObserver, ch_axis=0)
        self.int8 = QuantSpec(QuantDType.qint8, observer)

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        result = QconfigAssignment()
        if self.nonfinite_warning:
            result.warnings.append(self.nonfinite_warning)  # listed in model_check_result.txt too
        promoted_outputs: set[str] = set()
        for op_name, kind in self.selected:  # most sensitive first
            if op_name not in ctx.record.sites:
                result.unmatched.append(unmatched_message(self.name, op_name, ctx))
                continue
            prev = result.qconfigs.get(op_name)
            if kind == "weight":
                # int16 weights need an int8 input (no int16 x int16 GEMM). If a more sensitive row already made
                # that input int16, demoting it again would undo the more important promotion: keep the weight.
                site = ctx.record.sites[op_name]
                origins = {ctx.record.origin(i.producer) for i in site.inputs if i.producer and not i.is_parameter}
                if origins & promoted_outputs:
                    result.warnings.append(
                        f"{self.name}: weight of '{op_name}' kept int8: its input comes from a more sensitive op "
                        "promoted to int16, and the march has no int16 x int16."
                    )
                    continue
                qc = QConfig(input=self.int8, weight=self.int16_weight, output=prev.output if prev else self.int8)
            else:
                qc = QConfig(input=self.int16, weight=prev.weight if prev else self.int8_weight, output=self.int16)
                group = ctx.group_of(op_name)
                promoted_outputs.update(group.members if group is not None else (op_name,))
            result.qconfigs[op_name] = qc
        return result


def sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(table, topk: int | None = None, ratio=None):
    """Int16 for the ``topk`` (or ``ratio``) most sensitive ops of ``table``; combine it with a base template,
    e.g. ``(sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(t, topk=3),
    default_calibration_qconfig_setter)``. Used alone, the base is the default int8 calibration template."""
    return _with_base(
        SensitiveOpQconfigSetter(
            "sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter", table, topk, ratio, _calib_observer()
        ),
        default_calibration_qconfig_setter,
    )


def sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter(table, topk: int | None = None, ratio=None):
    """QAT counterpart of :func:`sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter`."""
    return _with_base(
        SensitiveOpQconfigSetter(
            "sensitive_op_qat_8bit_weight_16bit_act_qconfig_setter", table, topk, ratio, _qat_observer()
        ),
        default_qat_qconfig_setter,
    )


class _ChainedSetter(QconfigSetter):
    def __init__(self, setters: Iterable[QconfigSetter]):
        self.setters = tuple(setters)
        self.name = " > ".join(getattr(s, "name", repr(s)) for s in self.setters)

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        return resolve_qconfigs(self.setters, ctx)


def _with_base(setter: QconfigSetter, base: QconfigSetter) -> QconfigSetter:
    return _ChainedSetter((setter, base))


def resolve_qconfigs(setters: Any, ctx: QconfigContext) -> QconfigAssignment:
    """Apply setters in priority order (first wins), spreading each assignment over fused groups."""
    if isinstance(setters, (tuple, list)):
        chain = list(setters)
    else:
        chain = [setters]
    final = QconfigAssignment()
    for setter in chain:
        if not callable(setter):
            raise QuantLensError(
                f"qconfig_setter entries must be qconfig setters (e.g. default_qat_qconfig_setter or "
                f"ModuleNameQconfigSetter({{...}})), got {setter!r}."
            )
        answer = setter(ctx)
        if not isinstance(answer, QconfigAssignment):
            raise QuantLensError(
                f"Qconfig setter {setter!r} returned {type(answer).__name__}; a setter must return a "
                "QconfigAssignment."
            )
        final.warnings.extend(answer.warnings)
        final.unmatched.extend(answer.unmatched)
        claimed: dict[str, QConfig] = {}
        for name, qconfig in answer.qconfigs.items():
            group = ctx.group_of(name)
            for member in group.members if group is not None else (name,):
                claimed[member] = qconfig  # later members of one group win within one setter
        for name, qconfig in claimed.items():
            final.qconfigs.setdefault(name, qconfig)
    return final
