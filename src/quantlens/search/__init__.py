"""Searches over qconfigs that measure every configuration they consider (``docs/mixed_precision.md``).

The layer above the profiler: a search prepares, calibrates and evaluates configurations (quantization), ranks
candidates with the profiler's sensitivity and estimates latency through the compiler.

**Mixed precision.** :func:`search_mixed_precision` chooses which op sites to promote to int16 so that a metric
reaches a target: a greedy search with re-measurement. Starting from the base setter (int8 everywhere by
default), each step tries the ``tries`` best-ranked remaining candidates, each promoted on top of the current
set, re-measures the metric for each (``prepare`` -> ``calibrate`` -> ``evaluate``), and keeps the best. The first
ranking is the profiler's one-quantizer-at-a-time sensitivity (``QuantAnalysis.sensitivity``) or a table you
pass; after every step the candidates just measured are re-ranked by what they measured (those that improved
the metric first, by gain; then the graph neighbours of the site just promoted, its producers and consumers,
whose earlier "no gain" is stale because their gain depends on it; those that did not improve it, after the
unmeasured ones). It stops when the metric reaches ``target``, the budget is spent, or no candidate is left. A
pruning pass then takes back every promotion the target no longer needs (backward elimination, smallest gain
first).

A candidate is an op site's output (``"activation"``) or its weight (``"weight"``). The march has no int16 x int16
GEMM, so the search never forms a set that needs prepare's resolution: an int16 weight is not combined with an
int16 output reaching that GEMM's data input, and at most one data input of an activation x activation GEMM
(matmul, attention) is int16. ``MixedPrecisionResult.int16x16_resolutions`` lists what prepare reported for the
chosen set (empty by construction).

Every measurement is written to ``out_dir/mixed_precision_progress.json`` as it finishes; a search started again
with the same inputs (model weights and code, data, candidates, ranking, target, budget, and ``evaluate``: its
code, its file, the tensors it reads, ``evaluation_key``) replays it and continues from there, so an interrupted
search ends with the result an uninterrupted one gives; a damaged progress file is set aside. ``evaluate`` must
return one finite number, else an ``EvaluateError`` names the configuration. ``out_dir`` also gets the curve
(metric vs number of int16 sites, and vs the latency estimate with ``latency=True``) as
``mixed_precision_curve.csv`` and a self-contained ``mixed_precision_curve.html`` (inline SVG).

Modules: ``mixed_precision`` (the entry point), ``promotion``, ``setter``, ``graph`` (candidates, the
int16 x int16 rule), ``ranking``, ``measure``, ``progress`` (the progress file), ``greedy``, ``descend``,
``refine`` (pruning, exchange), ``result``, ``curve_files``; shared with the remedy search: ``evaluation`` (the
rule for what ``evaluate`` returns), ``provenance`` (what a measurement depends on), ``progress_file`` (reading a
progress file back, the output folder's check).
"""

from quantlens.search.graph import int16_conflicts, mixed_precision_candidates
from quantlens.search.mixed_precision import search_mixed_precision
from quantlens.search.promotion import MaxLatency, Promotion
from quantlens.search.result import CurvePoint, MixedPrecisionResult
from quantlens.search.setter import MixedPrecisionQconfigSetter

__all__ = [
    "search_mixed_precision",
    "MixedPrecisionResult",
    "MixedPrecisionQconfigSetter",
    "Promotion",
    "MaxLatency",
    "CurvePoint",
    "mixed_precision_candidates",
    "int16_conflicts",
]
