"""The remedies as objects: one declaration each of what it does, where it applies, what it costs in the march's
latency model, whether QAT keeps it, and which advisor findings it answers (``docs/remedies.md``).

:data:`REMEDIES` is the one registry. Whole-model remedies (``apply`` set) are tried by the search in registry
order, each measured and kept when it helps; the per-site ones (``range``, ``int16_*``) are searched site by site by
their own phases of :func:`~quantlens.search.remedies.search.search_remedies`; ``consistency_level`` is advice only
(it is chosen before ``prepare`` and measured at convert). :func:`remedies_for` lists the remedies of a finding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from quantlens.errors import QuantLensError
from quantlens.search.remedies.bias_correction import bias_correction, has_correctable_layers
from quantlens.search.remedies.channel_exponents import ChannelExponentQconfigSetter, has_stream_sites
from quantlens.search.remedies.equalize import (
    cross_layer_equalization,
    find_cle_pairs,
    find_smoothing_pairs,
    smooth_activations,
)
from quantlens.search.remedies.learned_ranges import FixedRangeQconfigSetter, learn_ranges
from quantlens.search.remedies.learned_rounding import has_roundable_layers, learn_rounding
from quantlens.search.remedies.qat_distill import QatBudget, qat_distill
from quantlens.search.remedies.weights import PerChannelWeightQconfigSetter, per_tensor_weight_sites
from quantlens.sites.record import record_model

__all__ = ["RemedyKind", "RemedyContext", "QatOptions", "Remedy", "REMEDIES", "register_remedy", "model_remedies",
           "remedies_for"]


class RemedyKind(str, enum.Enum):
    PRECISION = "precision"
    RANGE = "range"
    EQUALIZATION = "equalization"
    WEIGHTS = "weights"
    CONSISTENCY = "consistency"
    TRAINING = "training"


@dataclass(frozen=True)
class QatOptions:
    """The search's QAT remedy (``search_remedies(..., qat=True)``): its budget, the CONFIG's own ``train_qat``
    (None: distillation), and the folder of its checkpoint."""

    budget: QatBudget = QatBudget()
    train_qat: Callable[[nn.Module], None] | None = None
    out_dir: Any = None
    progress: bool = False


@dataclass(frozen=True)
class RemedyContext:
    """What a whole-model remedy sees: the float model so far, the data, and the qconfig setter so far; ``qat``:
    set when the search runs the QAT remedy."""

    model: nn.Module
    example: Any
    batches: Sequence[Any]
    setter: Any
    qat: QatOptions | None = None


@dataclass(frozen=True)
class Remedy:
    """One remedy. ``applies(ctx)`` and ``apply(ctx) -> (model, setter)`` are set for the whole-model remedies the
    search tries; ``apply`` returns new objects and leaves ``ctx``'s as they were."""

    name: str
    kind: RemedyKind
    summary: str
    where: str
    #: its cost in the march's latency model (the search measures the chosen set's estimate with ``latency=True``)
    latency: str
    #: whether QAT keeps it: a float transform is in the weights QAT starts from; a range is the observer's start,
    #: which QAT's learned scales may move; int16 stays int16
    qat_keeps: bool
    #: the advisor rules (``Finding.rule``) it answers
    findings: frozenset[str]
    applies: Callable[[RemedyContext], bool] | None = None
    apply: Callable[[RemedyContext], tuple[nn.Module, Any]] | None = None
    #: trains the model (QAT): tried only when the search is asked to (``search_remedies(..., qat=True)``)
    needs_qat: bool = False

    @property
    def searched_per_model(self) -> bool:
        return self.apply is not None


#: the one registry, in the order the search tries the whole-model remedies
REMEDIES: dict[str, Remedy] = {}


def register_remedy(remedy: Remedy) -> Remedy:
    """Add ``remedy`` to :data:`REMEDIES` (a name is declared once)."""
    if remedy.name in REMEDIES:
        raise QuantLensError(f"register_remedy: a remedy named {remedy.name!r} is already registered.")
    if (remedy.applies is None) != (remedy.apply is None):
        raise QuantLensError(f"register_remedy({remedy.name!r}): give both applies and apply, or neither.")
    REMEDIES[remedy.name] = remedy
    return remedy


def model_remedies(qat: bool = False) -> list[Remedy]:
    """The whole-model remedies, in the order the search tries them (the QAT ones only with ``qat``)."""
    return [r for r in REMEDIES.values() if r.searched_per_model and (qat or not r.needs_qat)]


def remedies_for(finding: Any) -> list[Remedy]:
    """The remedies that answer an advisor finding (anything with a ``rule``), registry order."""
    rule = getattr(finding, "rule", finding)
    return [r for r in REMEDIES.values() if rule in r.findings]


_RANGE_RULES = frozenset({"scale_coverage", "op_error", "range_too_large", "int8_range_needs_int16",
                          "input_range_int8", "table_input_clipped", "requant_saturation"})

register_remedy(Remedy(
    "cross_layer_equalization", RemedyKind.EQUALIZATION,
    "per-channel scale moved between two chained conv/linear layers' weights (exact in float)",
    "conv/linear -> ReLU/LeakyReLU/nothing -> conv/linear, groups 1, the first output read by nothing else",
    "none: weight values change, the graph does not", True,
    frozenset({"per_tensor_weight_channels", "op_error", "range_too_large"}),
    applies=lambda c: bool(find_cle_pairs(c.model, c.example)),
    apply=lambda c: (cross_layer_equalization(c.model, c.example)[0], c.setter)))

register_remedy(Remedy(
    "smooth_activations", RemedyKind.EQUALIZATION,
    "activation outliers after a LayerNorm moved into the consuming linears' weights (SmoothQuant-style, exact)",
    "LayerNorm whose output feeds only linears (pre-LN blocks)",
    "none: weight values change, the graph does not", True,
    frozenset({"range_too_large", "op_error", "int8_range_needs_int16"}),
    applies=lambda c: bool(find_smoothing_pairs(c.model, c.example)),
    apply=lambda c: (smooth_activations(c.model, c.example, c.batches)[0], c.setter)))

register_remedy(Remedy(
    "per_channel_weights", RemedyKind.WEIGHTS,
    "one weight scale per output channel where the setter gives one per tensor",
    "op sites with per-tensor weights (a grouped conv stays per tensor)",
    "a per-channel requantize costs its most expensive channel", True,
    frozenset({"per_tensor_weight_channels"}),
    applies=lambda c: bool(per_tensor_weight_sites(c.model, c.example, c.setter)),
    apply=lambda c: (c.model, PerChannelWeightQconfigSetter(None, c.setter))))

register_remedy(Remedy(
    "channel_exponents", RemedyKind.RANGE,
    "a residual stream's sum quantized int8 per channel in channel-exponent form s·2**-k (docs/march.md §3.1): its "
    "few outlier channels no longer set every channel's step",
    "add / sub op sites read only by sums and norms (a transformer's residual stream), on a march that has them",
    "one shift pass per reader (onto an int16 grid): the readers' integer ops take int16 codes", True,
    frozenset({"range_too_large", "int8_range_needs_int16", "op_error"}),
    applies=lambda c: has_stream_sites(record_model(c.model.eval(), [c.example])),
    apply=lambda c: (c.model, ChannelExponentQconfigSetter(None, c.setter))))

register_remedy(Remedy(
    "bias_correction", RemedyKind.WEIGHTS,
    "the mean output shift of weight rounding (dW E[x]) taken out of each bias",
    "conv/linear with groups 1 and no folded BatchNorm",
    "none: bias values change", False,  # QAT retrains the bias with the quantized weights in the loop
    frozenset({"op_error", "per_tensor_weight_channels"}),
    applies=lambda c: has_correctable_layers(c.model),
    apply=lambda c: (bias_correction(c.model, c.example, c.batches, c.setter)[0], c.setter)))

register_remedy(Remedy(
    "learned_ranges", RemedyKind.RANGE,
    "every activation op site's clipping range trained jointly to the float outputs (LSQ, weights frozen), "
    "given to prepare as fixed ranges",
    "per-tensor activation outputs whose scale is not shared (add, cat) or a power of two, outside decomposed ops",
    "none in cycles (a requantize class may change with the scale)", True,  # QAT's learned scales start there
    _RANGE_RULES,
    applies=lambda c: True,
    apply=lambda c: (c.model, FixedRangeQconfigSetter(learn_ranges(c.model, c.example, c.batches, c.setter),
                                                      c.setter))))

register_remedy(Remedy(
    "learned_rounding", RemedyKind.WEIGHTS,
    "each conv/linear weight rounded down or up as trained jointly to the float outputs (AdaRound-style), the "
    "float model's weights set on their int8 levels (exact)",
    "conv/linear layers with per-tensor or axis-0 per-channel weights, no folded BatchNorm",
    "none: weight values change", False,  # QAT retrains the weights
    frozenset({"op_error", "per_tensor_weight_channels"}),
    applies=lambda c: has_roundable_layers(c.model),
    apply=lambda c: (learn_rounding(c.model, c.example, c.batches, c.setter)[0], c.setter)))

register_remedy(Remedy(
    "qat_distill", RemedyKind.TRAINING,
    "a short QAT against the float model's own outputs and hidden states on the calibration inputs (no labels): "
    "weights, biases, norms and activation scales (LSQ) trained together; the CONFIG's train_qat when given",
    "every quantized op site (the weights of every layer, the ranges of every per-tensor activation)",
    "none: weight values and ranges change, the graph does not", True,
    frozenset({"op_error", "range_too_large", "int8_range_needs_int16", "scale_coverage"}),
    applies=lambda c: c.qat is not None,
    apply=lambda c: qat_distill(c.model, c.example, c.batches, c.setter, budget=c.qat.budget,
                                train_qat=c.qat.train_qat, out_dir=c.qat.out_dir, progress=c.qat.progress),
    needs_qat=True))

register_remedy(Remedy(
    "range", RemedyKind.RANGE,
    "an op site's output range chosen by percentile, KL or MSE clipping instead of min/max",
    "every quantized op site's output",
    "none in cycles (a requantize class may change with the scale)", False,
    _RANGE_RULES))

register_remedy(Remedy(
    "int16_activation", RemedyKind.PRECISION,
    "an op site's output quantized to int16",
    "every quantized op site's output (at most one int16 data input per activation x activation GEMM)",
    "the consuming GEMMs run at the int8 x int16 rate; measured by the latency estimate", True,
    frozenset({"int8_range_needs_int16", "input_range_int8", "op_error", "table_error", "scale_coverage",
               "range_too_large"})))

register_remedy(Remedy(
    "int16_weight", RemedyKind.PRECISION,
    "an op's weight quantized to int16 (its data input stays int8: no int16 x int16 GEMM)",
    "conv/linear/GEMM weights",
    "the GEMM runs at the int8 x int16 rate; measured by the latency estimate", True,
    frozenset({"op_error", "per_tensor_weight_channels"})))

register_remedy(Remedy(
    "consistency_level", RemedyKind.CONSISTENCY,
    "ConsistencyStrategy level set before prepare, so the trained model computes what the integer model does",
    "a train/deploy mismatch (the qat IR and the quantized IR differ on the same input)",
    "level 0 adds a high-precision requantize pass where chosen; the others none", True,
    frozenset({"consistency_level", "export_path_differs", "integer_op_differs", "requant_saturation"})))
