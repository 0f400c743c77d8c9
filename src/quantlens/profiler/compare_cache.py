"""The per-layer comparison saved next to its report (``compare_per_layer.json``), so ``quantlens report`` re-renders
the reports in seconds: the rows are read back instead of recomputed from every traced tensor, as long as both
traces are the ones they were computed from (their ``trace.json`` digests are in the file; any other trace, or a
damaged or foreign file, is recomputed from the traces)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import fields
from pathlib import Path

from quantlens._io import atomic_write_text
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.report_files import COMPARISON_FILE
from quantlens.profiler.trace.format import TRACE_FILE
from quantlens.profiler.trace.reader import TraceReader

__all__ = ["COMPARISON_FILE", "trace_digest", "save_comparison", "load_comparison", "json_types", "json_valid",
           "encode", "decode"]

_FORMAT = 1
_ROW_FIELDS = {f.name for f in fields(LayerRow)}
_JSON_TYPES = {"float": (int, float), "int": (int,), "str": (str,), "bool": (bool,), "None": (type(None),)}


def json_types(cls) -> dict[str, tuple[type, ...]]:
    """Each field of the dataclass ``cls`` -> its allowed JSON value types, from its annotation ("float | None",
    "str", "bool | None", ...: the flat types only)."""
    return {f.name: tuple(t for part in str(f.type).split("|") for t in _JSON_TYPES[part.strip()])
            for f in fields(cls)}


def json_valid(kinds: tuple[type, ...], value) -> bool:
    """A saved value of one of the types ``kinds`` (a bool is no number; inf / nan come back as floats)."""
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


_ROW_TYPES = json_types(LayerRow)
_MAX_BYTES = 1 << 30  # a larger file is not ours (rows are a few hundred bytes each)


def trace_digest(trace: TraceReader) -> str:
    """The sha256 of the trace's ``trace.json`` (a trace folder holds one run: its tensors are named there)."""
    return hashlib.sha256((Path(trace.dir) / TRACE_FILE).read_bytes()).hexdigest()


def encode(value):
    """``value`` as JSON holds it (inf / nan as ``{"float": "inf"}``, tuples as lists); :func:`decode` reverses it."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # JSON has no inf / nan
    return list(value) if isinstance(value, tuple) else value


def decode(value):
    """The value :func:`encode` saved."""
    if isinstance(value, dict) and set(value) == {"float"} and value["float"] in ("inf", "-inf", "nan"):
        return float(value["float"])
    return value


def save_comparison(comparison: LayerComparison, path: str | os.PathLike, base: TraceReader,
                    analy: TraceReader) -> Path:
    """Write the rows and the sites on one side only, with the digests of the traces they were computed from."""
    data = {"format": _FORMAT, "traces": [trace_digest(base), trace_digest(analy)],
            "baseline": comparison.baseline, "analysis": comparison.analysis,
            "only_in_baseline": comparison.only_in_baseline, "only_in_analysis": comparison.only_in_analysis,
            "rows": [{k: encode(getattr(row, k)) for k in _ROW_TYPES} for row in comparison]}  # (flat: no asdict)
    return atomic_write_text(path, json.dumps(data, allow_nan=False, sort_keys=True) + "\n")


def load_comparison(path: str | os.PathLike, base: TraceReader, analy: TraceReader) -> LayerComparison | None:
    """The comparison saved at ``path`` when it was computed from these two traces, else None (no file, another
    trace, a damaged or foreign file: the caller recomputes it from the traces). Only a regular file is read."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT or \
                data.get("traces") != [trace_digest(base), trace_digest(analy)]:
            return None
        rows = []
        for raw in data["rows"]:
            if not isinstance(raw, dict) or set(raw) != _ROW_FIELDS:
                return None
            values = {k: decode(v) for k, v in raw.items()}
            if not all(json_valid(_ROW_TYPES[k], v) for k, v in values.items()):
                return None
            rows.append(LayerRow(**values))
        pairs = [[tuple(p) for p in data[k]] for k in ("only_in_baseline", "only_in_analysis")]
        if not all(isinstance(p, tuple) and len(p) == 2 for side in pairs for p in side):
            return None
        return LayerComparison(rows, str(data["baseline"]), str(data["analysis"]), *pairs)
    except (OSError, ValueError, KeyError, TypeError):
        return None
