"""What a pair's reports read besides the traces, saved next to them (``pair_facts.json``), so that whoever renders
the reports of a folder later (``quantlens report``, a new ``QuantAnalysis`` over the saved traces) writes the same
bytes as the analysis that made them.

The per-layer rows come from the traces (and ``compare_per_layer.json``, :mod:`.compare_cache`); every other input
of a column or an advisor rule comes from the models or from later calls, and is kept here:

* ``analysis_type``, the analysis model's ``fake_quant_state`` and the pair's consistency level (the advisor's
  rules and the reports' header lines);
* the int32 bias saturation of the analysis model (:mod:`.bias_check`: the ``bias_saturation`` rule);
* which op sites reach a compared output and which are host-side (:mod:`.reach`: needs the models and the bad case);
* the sensitivity ranking the per-layer text leads with (``QuantAnalysis.sensitivity()``);
* whether the float baseline, run as the user runs it, parts from its traced forward (:mod:`.eager_check`: the
  ``float_model_branch`` rule).

The file names the ``trace.json`` digests of the two traces the facts belong to: facts saved for other traces (a
later run, a folder copied over another one) are ignored, never trusted, and so is a damaged or foreign file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from quantlens._io import atomic_write_text
from quantlens.profiler.bias_check import BiasSaturation
from quantlens.profiler.compare_cache import decode, encode, json_types, json_valid, trace_digest
from quantlens.profiler.eager_check import EagerDivergence
from quantlens.profiler.model_access import ConsistencyInfo
from quantlens.profiler.reach import SiteReach
from quantlens.profiler.report_files import FACTS_FILE
from quantlens.profiler.sensitivity import SensitivityResult, SensitivityRow, SensitivityTable
from quantlens.profiler.trace.reader import TraceReader

__all__ = ["FACTS_FILE", "PairFacts", "save_facts", "load_facts", "find_facts", "with_sensitivity"]

_FORMAT = 1
_MAX_BYTES = 1 << 28  # a larger file is not ours (a few entries per op site)


@dataclass
class PairFacts:
    """One pair's report inputs that the traces do not hold (see the module docstring)."""

    analysis_type: str
    fake_quant_state: str | None = None
    consistency: ConsistencyInfo | None = None
    #: op site -> its int32 bias's saturation, in the order the advisor lists them
    bias: dict[str, BiasSaturation] = field(default_factory=dict)
    #: None: not known (the reports then claim nothing about reach)
    reach: SiteReach | None = None
    #: the ranking the per-layer text leads with; None: no sensitivity shown
    sensitivity: SensitivityResult | None = None
    #: where the float baseline as the user runs it parts from its traced forward; None: it does not (or unknown)
    eager: EagerDivergence | None = None

    @property
    def sensitivity_top(self) -> list[tuple[str, str, float]]:
        """The first table's three most sensitive quantizers (``summary.json``'s ``sensitivity_top``)."""
        if not self.sensitivity:
            return []
        return [(r.op_name, r.sensitive_type, float(r.value)) for r in self.sensitivity[0][:3]]


def _flat(obj) -> dict:
    return {k: encode(v) for k, v in asdict(obj).items()}


def _unflat(cls, raw):
    """The dataclass ``cls`` from its :func:`_flat` form; ValueError when it is not that."""
    types = json_types(cls)
    if not isinstance(raw, dict) or set(raw) != set(types):
        raise ValueError(f"not a {cls.__name__}")
    values = {k: decode(v) for k, v in raw.items()}
    if not all(json_valid(types[k], v) for k, v in values.items()):
        raise ValueError(f"a {cls.__name__} field of another type")
    return cls(**values)


def _names(raw) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise ValueError("not a list of op sites")
    return frozenset(raw)


def _digests(base: TraceReader, analy: TraceReader) -> list[str]:
    return [trace_digest(base), trace_digest(analy)]


def save_facts(facts: PairFacts, path: str | os.PathLike, base: TraceReader, analy: TraceReader) -> Path:
    """Write ``facts`` to ``path`` with the digests of the traces they belong to."""
    reach = None if facts.reach is None else {
        "reaching": None if facts.reach.reaching is None else sorted(facts.reach.reaching),
        "host_side": sorted(facts.reach.host_side)}
    sensitivity = None if facts.sensitivity is None else [
        {"output": t.output, "metric": t.metric, "rows": [_flat(r) for r in t]} for t in facts.sensitivity]
    data = {"format": _FORMAT, "traces": _digests(base, analy), "analysis_type": facts.analysis_type,
            "fake_quant_state": facts.fake_quant_state,
            "consistency": None if facts.consistency is None else _flat(facts.consistency),
            "bias": [_flat(entry) for entry in facts.bias.values()], "reach": reach, "sensitivity": sensitivity,
            "eager": None if facts.eager is None else _flat(facts.eager)}
    return atomic_write_text(path, json.dumps(data, allow_nan=False, indent=1) + "\n")


def _parse(data: Any) -> PairFacts:
    """The facts of a loaded file (its digests already checked); ValueError / KeyError / TypeError when damaged."""
    if not isinstance(data["analysis_type"], str) or not isinstance(data["fake_quant_state"], (str, type(None))):
        raise ValueError("analysis_type / fake_quant_state")
    consistency = None if data["consistency"] is None else _unflat(ConsistencyInfo, data["consistency"])
    bias = {}
    for raw in data["bias"]:
        entry = _unflat(BiasSaturation, raw)
        bias[entry.op_name] = entry
    reach = data["reach"]
    if reach is not None:
        reach = SiteReach(None if reach["reaching"] is None else _names(reach["reaching"]), _names(reach["host_side"]))
    sensitivity = data["sensitivity"]
    if sensitivity is not None:
        tables = []
        for raw in sensitivity:
            if not isinstance(raw["output"], str) or not isinstance(raw["metric"], str):
                raise ValueError("a sensitivity table's output / metric")
            tables.append(SensitivityTable(raw["output"], raw["metric"],
                                           [_unflat(SensitivityRow, r) for r in raw["rows"]]))
        sensitivity = SensitivityResult(tables)
    eager = None if data.get("eager") is None else _unflat(EagerDivergence, data["eager"])
    return PairFacts(data["analysis_type"], data["fake_quant_state"], consistency, bias, reach, sensitivity, eager)


def load_facts(path: str | os.PathLike, base: TraceReader, analy: TraceReader) -> PairFacts | None:
    """The facts saved at ``path`` for these two traces, else None (no file, facts of other traces, a damaged or
    foreign file). Only a regular file is read."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("traces") != _digests(base, analy):
            return None
        return _parse(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_facts(out_dir: str | os.PathLike, base: TraceReader, analy: TraceReader) -> PairFacts | None:
    """The facts of these traces in ``out_dir``, else in the folder holding the baseline trace's folder (traces
    compared from another run's out_dir: ``QuantAnalysis.set_model_profiler_dir``)."""
    seen = []
    for folder in (Path(out_dir), Path(base.dir).parent):
        path = (folder / FACTS_FILE).resolve()
        if path in seen:
            continue
        seen.append(path)
        facts = load_facts(path, base, analy)
        if facts is not None:
            return facts
    return None


def with_sensitivity(out_dir: str | os.PathLike, base: TraceReader, analy: TraceReader,
                     sensitivity: SensitivityResult, case_digest: str) -> Path | None:
    """Record ``sensitivity`` (computed on the bad case of digest ``case_digest``) as the ranking the per-layer
    text of these traces now leads with, in the facts saved in ``out_dir`` for them. Nothing is written for a
    ranking of another bad case than the traces' (it is not theirs), nor without saved facts (the next
    ``compare_per_layer`` saves them)."""
    if base.input_digest != case_digest:
        return None
    path = Path(out_dir) / FACTS_FILE
    facts = load_facts(path, base, analy)
    if facts is None:
        return None
    return save_facts(replace(facts, sensitivity=sensitivity), path, base, analy)
