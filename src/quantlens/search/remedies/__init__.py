"""Remedies beyond int16 promotion (issue #24, ``docs/remedies.md``): each a way to make the integer model agree
with the float one, applied to the float model or to the qconfig before ``prepare``.

* :mod:`.catalog`: :data:`REMEDIES`, the one registry: each remedy's kind, where it applies, its latency cost,
  whether QAT keeps it, the findings it answers;
* :mod:`.equalize`: exact float transforms that move range between an op and the weights that consume its output:
  cross-layer equalization (conv/linear -> ReLU -> conv/linear) and activation smoothing (LayerNorm -> linears);
* :mod:`.weights`: per-channel weights where a setter gives per-tensor ones;
* :mod:`.bias_correction`: the mean output shift of weight rounding taken out of each conv/linear bias;
* :mod:`.learned_ranges`, :mod:`.learned_rounding`: activation ranges and weight rounding trained jointly to the
  float outputs;
* :mod:`.observers`: ranges chosen per op site (percentile, KL, MSE clipping instead of min/max);
* :mod:`.search`: :func:`search_remedies`, which measures each remedy, keeps what helps, and leaves int16 for what
  the others cannot fix;
* :mod:`.gains`: the advisor's findings with the gain the search measured at their op site;
* :mod:`.report`: ``remedies.csv`` and ``remedies.html``; :mod:`.saved`: the result on disk and back.
"""

from quantlens.search.remedies.bias_correction import BiasCorrection, bias_correction
from quantlens.search.remedies.catalog import REMEDIES, Remedy, RemedyContext, RemedyKind, register_remedy, remedies_for
from quantlens.search.remedies.equalize import (
    EqualizationPair,
    activation_absmax,
    cross_layer_equalization,
    find_cle_pairs,
    find_smoothing_pairs,
    smooth_activations,
)
from quantlens.search.remedies.gains import MeasuredFinding, findings_with_gains
from quantlens.search.remedies.observers import RANGE_OBSERVERS, ObserverQconfigSetter
from quantlens.search.remedies.report import write_remedy_report
from quantlens.search.remedies.saved import load_remedies, save_remedies
from quantlens.search.remedies.search import RemedyResult, Trial, search_remedies
from quantlens.search.remedies.weights import PerChannelWeightQconfigSetter, per_tensor_weight_sites

__all__ = ["BiasCorrection", "bias_correction", "EqualizationPair", "activation_absmax", "cross_layer_equalization",
           "find_cle_pairs", "find_smoothing_pairs", "smooth_activations", "RANGE_OBSERVERS",
           "ObserverQconfigSetter", "RemedyResult", "Trial", "search_remedies", "MeasuredFinding",
           "findings_with_gains", "REMEDIES", "Remedy", "RemedyContext", "RemedyKind", "register_remedy",
           "remedies_for", "write_remedy_report", "load_remedies", "save_remedies", "PerChannelWeightQconfigSetter",
           "per_tensor_weight_sites"]
