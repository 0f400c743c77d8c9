"""The qconfig setter of a set of promotions: :class:`MixedPrecisionQconfigSetter`."""

from __future__ import annotations

from typing import Any, Iterable

from quantlens.march import QuantDType
from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
    unmatched_message,
)
from quantlens.search.promotion import as_promotion

__all__ = ["MixedPrecisionQconfigSetter"]


class MixedPrecisionQconfigSetter(QconfigSetter):
    """The base setter's qconfigs with the promotions applied on top: activation promotions get int16 outputs,
    weight promotions int16 weights and an int8 input (no int16 x int16 GEMM). Everything else is the base
    setter's (the promotions win over it). ``prepare`` takes it unchanged."""

    def __init__(self, promotions: Iterable[Any], base_setter: Any = default_calibration_qconfig_setter):
        self.promotions = tuple(as_promotion(p) for p in promotions)
        self.base_setter = base_setter
        base_name = (" > ".join(getattr(s, "name", repr(s)) for s in base_setter)
                     if isinstance(base_setter, (tuple, list)) else getattr(base_setter, "name", repr(base_setter)))
        self.name = f"mixed_precision({len(self.promotions)} int16) > {base_name}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        """The base setter's assignment with every promoted site's qconfig widened to int16."""
        base = resolve_qconfigs(self.base_setter, ctx)
        result = QconfigAssignment(warnings=list(base.warnings))
        acts = {p.site for p in self.promotions if p.kind == "activation"}
        weights = {p.site for p in self.promotions if p.kind == "weight"}
        for name in sorted(acts | weights, key=lambda n: list(ctx.record.sites).index(n)
                           if n in ctx.record.sites else -1):
            if name not in ctx.record.sites:
                result.unmatched.append(unmatched_message(self.name, name, ctx))
                continue
            qc = base.qconfigs.get(name)
            if qc is None or qc.output is None:
                result.warnings.append(f"{self.name}: '{name}' has no qconfig from the base setter; not promoted.")
                continue
            act = qc.output if qc.output.dtype is not QuantDType.qint32 else (qc.input or qc.output)
            changes: dict[str, Any] = {}
            if name in acts and qc.output.dtype is not QuantDType.qint32:
                changes["output"] = qc.output.with_dtype(QuantDType.qint16)
                changes["input"] = (qc.input or act).with_dtype(QuantDType.qint16)
            if name in weights and qc.weight is not None:
                changes["weight"] = qc.weight.with_dtype(QuantDType.qint16)
                changes["input"] = (qc.input or act).with_dtype(QuantDType.qint8)
            result.qconfigs[name] = qc.replace(**changes)
        for name, qc in base.qconfigs.items():
            result.qconfigs.setdefault(name, qc)
        return result
