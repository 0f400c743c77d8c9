"""``search_remedies``: from the profiler's findings to a measured fix (``docs/remedies.md``).

Every candidate is measured (``prepare`` -> ``calibrate`` -> ``evaluate`` on the caller's held-out metric) and
kept only when it helps; the remedies go cheapest first, so int16 is spent only on what the others leave:

1. **equalization** (free at run time, exact in float): cross-layer equalization and LayerNorm smoothing, each
   kept when the metric improves (:mod:`.equalize`); then **bias correction** (:mod:`.bias_correction`), kept
   when it improves the metric;
2. **ranges**: for the op sites the outputs are most sensitive to (the profiler's sensitivity on the current
   model), each range observer of :data:`~.observers.RANGE_OBSERVERS`; the best is kept per site when it improves
   the metric (:class:`~.observers.ObserverQconfigSetter`);
3. **precision**: if the target is not reached, ``search_mixed_precision`` promotes op sites to int16 on top of
   what 1-2 chose.

The result (:class:`RemedyResult`) is what ``prepare`` takes: the transformed float model and a qconfig setter, and
every trial with its measured value.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from quantlens._io import atomic_write_text
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.remedies.bias_correction import bias_correction
from quantlens.search.remedies.equalize import (
    cross_layer_equalization,
    find_cle_pairs,
    find_smoothing_pairs,
    smooth_activations,
)
from quantlens.search.remedies.observers import RANGE_OBSERVERS, ObserverQconfigSetter

__all__ = ["Trial", "RemedyResult", "search_remedies"]


@dataclass(frozen=True)
class Trial:
    """One measured candidate: the remedy (``kind``: "equalization", "weights", "range" or "int16"), where it
    applies, its value of the metric, and whether it was kept."""

    kind: str
    name: str
    site: str
    value: float
    kept: bool
    #: a kept remedy: the metric before it (its measured gain is ``value - before``)
    before: float | None = None


@dataclass(frozen=True)
class RemedyResult:
    """What the search chose: ``model`` (the float model after the kept transforms) and ``setter`` (ranges and
    int16 promotions on top of the base setter) go to ``prepare`` unchanged; ``value`` is their metric."""

    model: nn.Module
    setter: Any
    value: float
    base_value: float
    observers: dict[str, str]
    int16: tuple = ()
    trials: tuple[Trial, ...] = field(default_factory=tuple)

    def reached(self, target: float, higher_is_better: bool = True) -> bool:
        return self.value >= target if higher_is_better else self.value <= target


PROGRESS_FILE = "remedies_progress.json"


class _Measure:
    """Measures a configuration once: each value is written to ``out_dir/remedies_progress.json`` as it is
    measured, under a fingerprint of the search's inputs, so a search started again with the same inputs replays
    what it measured and continues."""

    def __init__(self, example, batches, evaluate, higher_is_better, path: Path, fingerprint: str):
        self.example, self.batches, self.evaluate, self.higher = example, batches, evaluate, higher_is_better
        self.path, self.fingerprint = path, fingerprint
        self.values: dict[str, float] = {}
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("fingerprint") == fingerprint:
                self.values = {k: float(v) for k, v in data.get("measurements", {}).items()}
        self.replayed = len(self.values)

    def __call__(self, model: nn.Module, setter: Any, key: str) -> float:
        if key in self.values:
            return self.values[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one prepare per candidate: its warnings would repeat
            prepared = calibrate(prepare(model, self.example, setter, check_result_dir=None), self.batches)
        with torch.no_grad():
            value = float(self.evaluate(prepared))
        self.values[key] = value
        atomic_write_text(self.path, json.dumps({"format": 1, "fingerprint": self.fingerprint,
                                                 "measurements": self.values}, indent=1, sort_keys=True))
        return value

    def better(self, a: float, b: float) -> bool:
        return a > b if self.higher else a < b


def _sensitive_sites(model, example, setter, measure: _Measure, count: int, out_dir: Path) -> list[str]:
    """The ``count`` op sites whose activation quantization the outputs are most sensitive to."""
    from quantlens.profiler import QuantAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, example, setter, check_result_dir=None), measure.batches)
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    sites: list[str] = []
    for row in qa.sensitivity()[0]:
        if row.sensitive_type == "activation" and row.op_name not in sites:
            sites.append(row.op_name)
    return sites[:count]


def search_remedies(model: nn.Module, example_inputs: Any, calibration_batches: Sequence[Any],
                    evaluate: Callable[[nn.Module], float], target: float, *,
                    base_setter: Any = default_calibration_qconfig_setter, range_sites: int = 8,
                    observers: Sequence[str] = tuple(RANGE_OBSERVERS), int16: bool = True,
                    higher_is_better: bool = True, out_dir: str | os.PathLike = "remedies",
                    int16_budget: int | None = None) -> RemedyResult:
    """Equalization, then per-site ranges, then int16 promotion, each candidate measured and kept only when it
    helps (see the module docstring); ``evaluate(prepared) -> float`` on a calibrated model, as for
    ``search_mixed_precision``. ``model`` is not changed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = list(calibration_batches)
    inputs_key = _fingerprint(model, example_inputs, batches, target, range_sites, observers, base_setter,
                             higher_is_better)
    measure = _Measure(example_inputs, batches, evaluate, higher_is_better, out / PROGRESS_FILE, inputs_key)
    trials: list[Trial] = []
    applied: list[str] = []  # the kept float transforms, in order: part of every later key

    def key(*parts: str) -> str:
        return "|".join(["+".join(applied)] + list(parts))

    best = base = measure(model, base_setter, key("base"))

    # 1. equalization: whole-model float transforms, exact
    current = model
    for name, find, apply in (
            ("cross_layer_equalization", find_cle_pairs, lambda m: cross_layer_equalization(m, example_inputs)[0]),
            ("smooth_activations", find_smoothing_pairs,
             lambda m: smooth_activations(m, example_inputs, measure.batches)[0])):
        if not find(current, example_inputs):
            continue
        candidate = apply(current)
        value = measure(candidate, base_setter, key(name))
        kept = measure.better(value, best)
        trials.append(Trial("equalization", name, "", value, kept, best if kept else None))
        if kept:
            current, best = candidate, value
            applied.append(name)

    # weights: bias correction under the base setter's weight quantization
    candidate, corrections = bias_correction(current, example_inputs, measure.batches, base_setter)
    if corrections:
        value = measure(candidate, base_setter, key("bias_correction"))
        kept = measure.better(value, best)
        trials.append(Trial("weights", "bias_correction", "", value, kept, best if kept else None))
        if kept:
            current, best = candidate, value
            applied.append("bias_correction")

    # 2. ranges, per site, for the sites the outputs are most sensitive to
    chosen: dict[str, str] = {}
    if range_sites and not _reached(best, target, higher_is_better):
        for site in _sensitive_sites(current, example_inputs, base_setter, measure, range_sites, out / "ranking"):
            site_best = None
            for name in observers:
                trial = {**chosen, site: name}
                value = measure(current, ObserverQconfigSetter(trial, base_setter),
                                key("ranges", *(f"{s}={o}" for s, o in sorted(trial.items()))))
                improves = measure.better(value, best) and (site_best is None or measure.better(value, site_best[1]))
                trials.append(Trial("range", name, site, value, False))
                if improves:
                    site_best = (name, value)
            if site_best is not None:
                chosen[site] = site_best[0]
                trials.append(Trial("range", site_best[0], site, site_best[1], True, best))
                best = site_best[1]
    setter = ObserverQconfigSetter(chosen, base_setter) if chosen else base_setter

    # 3. precision: int16 on top of what equalization and ranges left
    promotions: tuple = ()
    if int16 and not _reached(best, target, higher_is_better):
        from quantlens.search import search_mixed_precision

        mp = search_mixed_precision(current, example_inputs, measure.batches, evaluate, target, base_setter=setter,
                                    budget=int16_budget, out_dir=out / "int16", higher_is_better=higher_is_better,
                                    progress=False)
        promotions = tuple(mp.chosen)
        if promotions:
            setter = mp.setter()
            trials += _int16_trials(mp, best)
            best = mp.metric
    return RemedyResult(current, setter, best, base, chosen, promotions, tuple(trials))


def _int16_trials(mp, start: float) -> list[Trial]:
    """One kept trial per chosen promotion, with the metric the mixed-precision curve measured before and after
    the step that added it (a promotion the pruning pass kept; steps that only removed one are skipped)."""
    out, before = [], start
    chosen = set(mp.chosen)
    for point in mp.curve:
        if point.added is not None and point.added in chosen:
            out.append(Trial("int16", point.added.kind, point.added.site, point.metric, True, before))
        before = point.metric
    return out


def _reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def _fingerprint(model, example, batches, target, range_sites, observers, base_setter, higher_is_better) -> str:
    """What the measurements depend on: the model's weights, the data, and the search's settings."""
    from quantlens.search.progress import _hash_tree

    h = hashlib.sha256()
    _hash_tree(h, dict(model.state_dict()))
    _hash_tree(h, example)
    _hash_tree(h, batches)
    h.update(json.dumps({"target": float(target), "range_sites": range_sites, "observers": list(observers),
                         "base": getattr(base_setter, "name", repr(base_setter)), "higher": higher_is_better},
                        sort_keys=True).encode())
    return h.hexdigest()
