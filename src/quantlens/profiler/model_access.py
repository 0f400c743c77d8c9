"""The profiler's one backend seam: how it runs, traces and ablates a model.

Everything else in :mod:`quantlens.profiler` (bad-case search, per-layer comparison, sensitivity, the advisor)
talks to models only through :class:`ModelAccess`, so a later backend (the exported IR of the ``export`` and
``convert`` analysis types) plugs in by implementing this class; :func:`~.access_factory.make_access` is the
factory.

A traced forward hands every executed op site to a :class:`TraceSink` as a :class:`SiteEvent`: the incoming
float tensors, the outputs, the quantization the model applied there, and, when asked, the **same-input
output** (the analysis op re-run on the baseline's input for that site).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

import torch

from quantlens.errors import QuantLensError

__all__ = [
    "AnalysisType",
    "SiteEvent",
    "QuantErrorStats",
    "IntegerStats",
    "Quantizer",
    "TraceSink",
    "SameInputSource",
    "ModelAccess",
    "ConsistencyInfo",
    "parse_analysis_type",
]


class AnalysisType(str, Enum):
    """What is compared with what (the seed article's four debug scenarios)."""

    FAKE_QUANT = "fake_quant"  # float (or a good calibration) vs calibration / QAT model
    PRE_EXPORT = "pre_export"  # QAT model vs pre_export model (nonlinear ops as integer lookup tables)
    EXPORT = "export"  # pre_export model vs the qat IR (export)
    CONVERT = "convert"  # qat IR (or pre_export model) vs the quantized IR (convert)
    ONNXRUNTIME = "onnxruntime"  # qat IR vs its ONNX model (to_onnx) run by onnxruntime

    @property
    def deployed(self) -> bool:
        """The analysis model is an IR or a runtime (its sites may be several nodes; values compare in LSB)."""
        return self in (AnalysisType.EXPORT, AnalysisType.CONVERT, AnalysisType.ONNXRUNTIME)


def parse_analysis_type(value: Any) -> AnalysisType:
    """Validate an analysis type string."""
    try:
        return AnalysisType(value)
    except ValueError:
        raise QuantLensError(
            f"Unknown analysis_model_type {value!r}. Expected one of {[t.value for t in AnalysisType]}: "
            "'fake_quant' (float vs calibration/QAT), 'pre_export' (QAT vs pre_export), 'export' (pre_export vs "
            "the qat IR), 'convert' (qat IR vs the quantized IR) or 'onnxruntime' (qat IR vs its ONNX model in "
            "onnxruntime)."
        ) from None


@dataclass
class QuantErrorStats:
    """What an output fake quant did to the value it rounded (computed before the fake quant).

    ``clip_sq_err`` sums the squared error of elements beyond the representable range by more than half a
    step (they saturate); ``round_sq_err`` the rest (they only round). Comparing them tells a
    clipping-dominated layer (scale too small) from a rounding-dominated one (resolution too coarse).
    """

    raw_min: float
    raw_max: float
    numel: int
    clipped: int
    clip_sq_err: float
    round_sq_err: float
    qmin: int
    qmax: int

    @property
    def clipped_ratio(self) -> float:
        return self.clipped / self.numel if self.numel else 0.0

    @property
    def dominant(self) -> str:
        """``"clipping"`` or ``"rounding"``: which part of the quantization error is larger."""
        return "clipping" if self.clip_sq_err > self.round_sq_err else "rounding"


@dataclass
class IntegerStats:
    """What the integer arithmetic of an IR did at one op site (counted while the IR ran; no tensors kept).

    * ``acc_saturated`` of ``acc_numel``: GEMM accumulator elements (conv, transposed conv, linear, matmul of the
      quantized IR) whose exact sum, bias included, lies outside int32, so ``docs/march.md`` §6 saturates them;
    * ``table_clipped`` of ``table_numel``: input codes of a lookup table (``lut``/``segment_lut``) at the limit of
      the input type where the table is not flat (the real input was clipped to the table's input range, and
      the function still changes there);
    * ``nonfinite``: NaN/Inf float values the quantized IR turned into integers at this site (model inputs at a
      quantize node, baseline values handed to the site's same-input run): NaN becomes an arbitrary code, ±Inf
      the type's limit.
    """

    acc_saturated: int = 0
    acc_numel: int = 0
    table_clipped: int = 0
    table_numel: int = 0
    nonfinite: int = 0

    @property
    def acc_saturated_ratio(self) -> float | None:
        return self.acc_saturated / self.acc_numel if self.acc_numel else None

    @property
    def table_clipped_ratio(self) -> float | None:
        return self.table_clipped / self.table_numel if self.table_numel else None


@dataclass
class SiteEvent:
    """One executed op site of a traced forward."""

    index: int  # execution order in this forward
    name: str  # the op site name (stable across float / prepared models)
    op_type: str
    module_type: str | None
    #: incoming float tensors that are not parameters, by leaf position in the flattened (args, kwargs)
    inputs: dict[int, torch.Tensor]
    #: every tensor leaf of the output (index outputs of topk/sort/max included)
    outputs: list[torch.Tensor]
    quant_dtype: str = "float"  # qint8 / qint16 / qint32 / float / (fused)
    scale: torch.Tensor | None = None  # the output's scale (per tensor or per channel)
    input_dtypes: list[str] = field(default_factory=list)  # quantization of each incoming float tensor
    weight: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    #: or a callable returning it, for sinks with ``deferred_quant_error = True`` (computed off the forward)
    quant_error: QuantErrorStats | Any | None = None
    same_input: list[torch.Tensor] | None = None  # analysis op re-run on the baseline's inputs
    same_input_pre: list[torch.Tensor] | None = None  # the same, before the site's output fake quant
    same_input_note: str = ""  # why there is no same-input output, when there is none
    #: the same-input tensors are the event's own (computed for it, held by nothing else): a sink may keep them
    #: without a copy
    same_input_owned: bool = False
    index_producing: bool = False
    boundary: str = ""  # "input" (QuantStub), "output" (DeQuantStub) or ""
    fused_into: str | None = None  # the fused group's last op, for the other members
    producer: str | None = None  # the op site that computed the (first) input, through passthrough ops
    #: the op site that made its (first) index input, through integer ops (``profiler.index_origins``)
    index_producer: str | None = None
    int_stats: IntegerStats | None = None  # IR sites: accumulator / table-input saturation, non-finite inputs
    scale_axis: int | None = None  # the channel axis of a per-channel scale (int32 high-precision outputs)

    def __post_init__(self):
        # a host op's complex result (an FFT) is compared as its real view (a trailing dim of 2: real, imaginary),
        # which every figure and file of a trace takes
        self.outputs = real_views(self.outputs)
        self.same_input = real_views(self.same_input)
        self.same_input_pre = real_views(self.same_input_pre)

    def set_same_input(self, same: list | None, pre: list | None, note: str) -> None:
        """The same-input outputs (as their real views, like the outputs) and why there are none."""
        self.same_input, self.same_input_pre, self.same_input_note = real_views(same), real_views(pre), note


def real_views(tensors):
    """``tensors`` with each complex one replaced by its real view (``torch.view_as_real``)."""
    if not tensors or not any(isinstance(t, torch.Tensor) and t.is_complex() for t in tensors):
        return tensors
    return [torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t for t in tensors]


class TraceSink(Protocol):
    """Receives the events of a traced forward (e.g. the streaming trace writer)."""

    def on_site(self, event: SiteEvent) -> None: ...


class SameInputSource(Protocol):
    """Gives the baseline's incoming float and index tensors of an op site (leaf position -> tensor), or None."""

    def inputs(self, site: str) -> dict[int, torch.Tensor] | None: ...


@dataclass(frozen=True)
class Quantizer:
    """One ablation unit of :meth:`ModelAccess.ablation`: the activation, weight or lookup-table quantization
    of one op site. ``op_name`` and ``sensitive_type`` are the sensitivity table's key fields."""

    op_name: str
    sensitive_type: str  # "activation", "weight" or "lut"
    op_type: str
    quant_dtype: str


@dataclass(frozen=True)
class ConsistencyInfo:
    """The consistency level a model was built with (``quantlens.quantization.ConsistencyStrategy``), as the
    reports show it: read from a prepared model's state or an IR's meta (``consistency_level``,
    ``high_precision_qpp``, ``qpp``). ``known`` is False where the model does not carry it (an ONNX model)."""

    level: int | None = None  # None: the strategy was off (or, with known=False, not known)
    qpp: str = "default"  # the requantize precision profile: "default" or "high_precision"
    known: bool = True
    source: str = ""  # where it was read: "analysis model (quantized IR meta)", ...
    #: what the pair's baseline computes of the level's integer rules (levels 1-4; :meth:`ModelAccess.
    #: computed_rules`): "none" (float + fake quant: a qat IR, or the ``export`` pair's pre_export model run as
    #: export traces it), "rounded" (a QAT forward below level 4: GEMMs rounded from float32), "exact"; None:
    #: not a pair, or no rules at this level
    baseline_rules: str | None = None
    #: what the pair compares at this level, for the report line (set by :meth:`of_pair`)
    pair_note: str = ""
    #: the march the model was built for (an IR's meta ``march``; "" where not recorded): the levels are QL1's
    march: str = ""

    @property
    def needs_retraining(self) -> bool:
        return self.level is not None and self.level >= 1

    def describe(self) -> str:
        """``consistency level: off``, ``consistency level 2 (qpp default; emulate integer rules, ...)``."""
        if not self.known:
            return "consistency level: unknown"
        if self.level is None:
            return "consistency level: off" + (f" (qpp {self.qpp})" if self.qpp != "default" else "")
        from quantlens.quantization.consistency import ConsistencyConfig

        try:
            config = ConsistencyConfig.for_level(self.level)
        except QuantLensError:  # a level this version does not know: show it as it is
            return f"consistency level {self.level} (qpp {self.qpp})"
        switches = config.switches_on()
        rest = f"; {', '.join(switches)}" if switches else ""
        return f"consistency level {self.level} (qpp {self.qpp}{rest})"

    def line(self) -> str:
        """The report header line: the description and where it was read."""
        return self.describe() + (f" [from the {self.source}]" if self.source else "") + \
            (f"; {self.pair_note}" if self.pair_note else "")

    @classmethod
    def from_config(cls, config: Any, source: str = "") -> "ConsistencyInfo":
        """From a prepared model's ``QuantState.consistency`` (a ``ConsistencyConfig``; None: off)."""
        if config is None:
            return cls(source=source)
        qpp = getattr(getattr(config, "qpp", None), "value", None) or "default"
        return cls(level=config.level, qpp=qpp, source=source)

    @classmethod
    def from_meta(cls, meta: dict, source: str = "") -> "ConsistencyInfo":
        """From an IR's meta: ``consistency_level`` (absent in IRs made before the strategy: off),
        ``qpp`` (the quantized IR's profile) or else ``high_precision_qpp``."""
        level = meta.get("consistency_level")
        qpp = meta.get("qpp")
        if qpp not in ("default", "high_precision"):
            qpp = "high_precision" if meta.get("high_precision_qpp") else "default"
        return cls(level=level if isinstance(level, int) and not isinstance(level, bool) else None, qpp=qpp,
                   source=source, march=str(meta.get("march", "")))

    @staticmethod
    def of_pair(baseline: "ModelAccess", analysis: "ModelAccess") -> "ConsistencyInfo | None":
        """What an analysis reports: the analysis model's level where it carries one, else the baseline's (an
        ONNX model is analysed against the qat IR it was written from)."""
        infos = [info for info in (analysis.consistency(), baseline.consistency()) if info is not None]
        info = next((info for info in infos if info.known), infos[0] if infos else None)
        rules = getattr(baseline, "computed_rules", lambda: None)()
        if info is None or rules is None:
            return info
        return replace(info, baseline_rules=rules, pair_note=_pair_note(info.level, rules,
                                                                        getattr(analysis, "kind", None)))


def _pair_note(level: int | None, rules: str, analysis_kind: str | None) -> str:
    """What a deployed pair compares at consistency level 1-4, given what its baseline computes of the rules."""
    if rules != "none" or analysis_kind not in ("qat", "quantized"):
        return ""
    if analysis_kind == "qat":
        return (f"baseline run as export traces it: float + fake quant, without the integer rules of level {level} "
                "(the qat IR computes that at every level)")
    # (no quote marks: the line is compared with its HTML rendering)
    return (f"baseline: the qat IR, float + fake quant at every level: the integer rules of level {level} (which "
            "the QAT model and the quantized IR compute) show here as same-input differences, not faults; the "
            "pre_export model as baseline checks the quantized IR bit for bit")


class ModelAccess(ABC):
    """A model as the profiler sees it.

    Implementations must keep op site names identical to the other model of the analysis, run without
    changing the model (no observer updates, no BatchNorm statistics), and be deterministic.
    """

    label: str = "model"

    @abstractmethod
    def run(
        self,
        example: Any,
        sink: TraceSink | None = None,
        same_input: SameInputSource | None = None,
        indices: dict[str, list[torch.Tensor]] | None = None,
        override: Any = None,
    ) -> Any:
        """One forward on ``example`` (a tuple is positional arguments, anything else the single argument).

        With ``sink`` every op site is reported; with ``same_input`` each event also carries the same-input
        output; with ``indices`` (op site -> the baseline's index outputs), index-producing ops take those
        indices instead of their own (sensitivity, so index flips do not swamp the metric); with ``override``
        (:class:`~.ir_access.SiteOverride`) every site's value is shown to it as it completes and chosen sites
        take the value it returns (sensitivity of the deployed stages: one site computed by the IR).
        """

    @abstractmethod
    def quantizers(self, analysis_type: AnalysisType) -> list[Quantizer]:
        """The ablation units for ``analysis_type``, in execution order."""

    @abstractmethod
    def ablation(self, analysis_type: AnalysisType) -> AbstractContextManager:
        """A context in which every quantizer of ``analysis_type`` is off; it yields ``enable(q, on)``, and
        restores the model when it exits."""

    def describe(self) -> str:
        """One line for report headers (model class, stage)."""
        return self.label

    @property
    def folded(self) -> dict[str, str]:
        """Op sites this model computes inside another site's value, with that site (none by default)."""
        return {}

    def host_sites(self) -> frozenset[str]:
        """Op sites this model runs on the host, in float (the march's partition, ``docs/march.md`` §12.1): no LSB
        verdict applies to them, and the reports label them (none by default)."""
        return frozenset()

    def group_internal_sites(self) -> frozenset[str]:
        """Op sites whose values exist only inside one of this model's fused ops and that feed nothing outside it
        (a conv and a BatchNorm before their ReLU): the other model's trace need not keep their values for a
        comparison with this one (the comparison reads the group's last op, the same-input run the group's own
        values)."""
        return frozenset()

    @property
    def quantized(self) -> bool:
        """Whether the model carries quantizers (a calibration/QAT/pre_export model, a quantized IR)."""
        return True

    @property
    def fake_quant_state(self) -> str | None:
        """The fake quant state of a prepared torch model (None where it does not apply)."""
        return None

    def consistency(self) -> "ConsistencyInfo | None":
        """The consistency level the model was built with (``ConsistencyStrategy``); None where no level applies
        (a float model)."""
        return None

    def computed_rules(self) -> str | None:
        """What this model's forwards compute of its consistency level's integer rules (levels 1-4): ``"none"``
        (float + fake quant: the qat IR at every level), ``"rounded"`` (the rules, GEMMs rounded from a float32
        sum: a QAT forward below level 4), ``"exact"`` (the rules bit for bit: VALIDATION, the quantized IR);
        None where no rule applies (strategy off, level 0, a float or ONNX model)."""
        return None
