"""The trace's on-disk format, declared once: the file names, the format version, the alignment of tensor data
and the fields of ``trace.json`` (:class:`TraceIndex`, one :class:`TracedSite` per op site, one
:class:`TensorStat` per tensor). The writer (:mod:`.writer`) and the reader (:mod:`.reader`) both read it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from quantlens.errors import QuantLensError
from quantlens.profiler.model_access import IntegerStats, QuantErrorStats

__all__ = ["TRACE_FILE", "OUTPUTS_FILE", "STATISTIC_FILE", "TENSORS_DIR", "TRACE_FORMAT", "ALIGN", "tensor_file",
           "TensorStat", "TracedSite", "TraceIndex"]

TRACE_FILE = "trace.json"
OUTPUTS_FILE = "outputs.safetensors"
#: the statistics as a table (written next to the trace, see ``report.write_statistic``)
STATISTIC_FILE = "statistic.txt"
#: the folder of the per-site tensor files
TENSORS_DIR = "tensors"
#: the on-disk layout's version (see :mod:`quantlens.profiler.trace`); TraceReader reads this one only
TRACE_FORMAT = 2
#: tensor data starts at multiples of this many bytes, in the files and in the writer's buffers (a GEMM re-run
#: on differently aligned memory may round differently)
ALIGN = 64


def tensor_file(index: int) -> str:
    """The file of the op site executed ``index``-th, relative to the trace folder."""
    return f"{TENSORS_DIR}/{index:05d}.safetensors"


@dataclass(frozen=True)
class TensorStat:
    """Statistics of one tensor (over its finite values; counts of NaN and Inf separately). ``mean`` and ``var``
    are None for an empty tensor, and for a same-input value (``same<i>``, ``samepre<i>``), of which only the
    extremes and the NaN/Inf counts are read."""

    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    var: float | None
    nan: int = 0
    inf: int = 0

    @property
    def absmax(self) -> float | None:
        return None if self.min is None else max(abs(self.min), abs(self.max))

    @property
    def nonfinite(self) -> bool:
        return self.nan > 0 or self.inf > 0


@dataclass
class TracedSite:
    """One executed op site, as stored in ``trace.json``."""

    index: int
    name: str
    op_type: str
    module_type: str | None
    file: str
    quant_dtype: str = "float"
    scale: float | list[float] | None = None
    weight_scale: float | list[float] | None = None
    input_dtypes: list[str] = field(default_factory=list)
    boundary: str = ""
    fused_into: str | None = None
    producer: str | None = None
    index_producer: str | None = None  # the op site that made its index input (absent from older traces)
    index_producing: bool = False
    stats: dict[str, TensorStat] = field(default_factory=dict)
    quant_error: QuantErrorStats | None = None
    same_input_note: str = ""
    int_stats: IntegerStats | None = None  # IR sites (see IntegerStats); absent from older traces
    scale_axis: int | None = None  # channel axis of a per-channel ``scale``
    #: keys not stored in ``file`` but in an earlier site's: key -> ``[file, key]`` (format 2)
    refs: dict[str, list[str]] = field(default_factory=dict)
    #: keys stored as integer codes: key -> the float32 scale; the tensor is ``codes.float() * scale``, exactly
    #: (format 2; a value on the per-tensor grid of qint8/qint16, checked when written)
    codes: dict[str, float] = field(default_factory=dict)
    #: keys whose statistics are kept but not their values: the outputs of a member of a fused group in a trace
    #: made with a same-input source (the analysis trace). Such a value exists only inside the fused op on the
    #: device and the comparison reads the group's last op; storing it was a sixth of a CNN trace's bytes
    stats_only: list[str] = field(default_factory=list)

    @property
    def per_tensor_scale(self) -> float | None:
        return self.scale if isinstance(self.scale, float) else None

    def outputs(self) -> list[str]:
        return sorted((k for k in self.stats if k.startswith("out")), key=lambda k: int(k[3:]))

    def float_outputs(self) -> list[str]:
        return [k for k in self.outputs() if self.stats[k].dtype.startswith(("float", "bfloat"))]

    @classmethod
    def from_json(cls, data: dict) -> "TracedSite":
        data = dict(data)
        data["stats"] = {k: TensorStat(**{**v, "shape": tuple(v["shape"])}) for k, v in data["stats"].items()}
        if data.get("quant_error") is not None:
            data["quant_error"] = QuantErrorStats(**data["quant_error"])
        if data.get("int_stats") is not None:
            data["int_stats"] = IntegerStats(**data["int_stats"])
        return cls(**data)


@dataclass
class TraceIndex:
    """The fields of ``trace.json`` (besides ``"format"``, :data:`TRACE_FORMAT`): the model's label and
    description, the fingerprint of the bad case it ran on, its output names and its op sites."""

    model: str
    description: str
    input_digest: str
    outputs: list[str]
    sites: list[TracedSite]
    #: the fingerprint of the model traced (``profiler.fingerprint.model_digest``; "" in traces made before it)
    model_digest: str = ""
    #: op sites the model computes inside another site's value, with that site (a quantized IR writes a conv
    #: straight to its fused ReLU's grid): such a site has no value of its own here
    folded: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        """The text of ``trace.json``."""
        data = {
            "format": TRACE_FORMAT,
            "model": self.model,
            "description": self.description,
            "input_digest": self.input_digest,
            "model_digest": self.model_digest,
            "outputs": list(self.outputs),
            "folded": dict(self.folded),
            "sites": [vars(s) for s in self.sites],
        }
        # (vars + default=vars: the JSON of dataclasses.asdict, without its deep copies)
        # (no indent: json's C encoder, 3-4x faster than the indented pure-Python one on a large model's index)
        return json.dumps(data, allow_nan=True, default=vars) + "\n"

    @classmethod
    def read(cls, path: Path) -> "TraceIndex":
        """``trace.json`` at ``path``; a trace of another format is refused with a message to re-run ``run()``, an
        entry of the wrong type or range (a damaged or edited index) with a ``ValueError`` naming the entry."""
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != TRACE_FORMAT:
            raise QuantLensError(
                f"{path} has trace format {data.get('format')!r}; this version of quantlens reads format "
                f"{TRACE_FORMAT} only (format 2 stores a tensor another op site already stored as a reference to "
                "it). Re-run QuantAnalysis.run() to write the trace again.")
        if not isinstance(data["sites"], list):
            raise ValueError(f"sites is {type(data['sites']).__name__}, not a list")
        index = cls(model=data["model"], description=data["description"],
                    input_digest=data.get("input_digest", ""), outputs=data["outputs"],
                    sites=[TracedSite.from_json(s) for s in data["sites"]],
                    model_digest=data.get("model_digest", ""), folded=data.get("folded", {}))
        _check_index(index)
        return index


# -- what a readable trace.json holds: each field's type and range, checked when read (an edited or damaged index
# is refused there, not by a TypeError deep in a comparison) ----------------------------------------------------
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


#: the types JSON gives numbers (a bool is neither)
_NUMBER_TYPES = frozenset({int, float})


def _scale(v) -> bool:
    # (a per-channel list is checked by C-level loops: a transformer's trace holds hundreds of thousands of scales,
    # and element by element in Python the check took most of the time to open a trace)
    return v is None or (_number(v) and math.isfinite(v) and v >= 0) or \
        (isinstance(v, list) and len(v) > 0 and {type(x) for x in v} <= _NUMBER_TYPES
         and all(map(math.isfinite, v)) and min(v) >= 0)


def _opt(check):
    return lambda v: v is None or check(v)


_STR = lambda v: isinstance(v, str)  # noqa: E731
#: a tensor's key in a site: in<pos>, out<i>, weight, same<i>, samepre<i>
_KEY = re.compile(r"(in|out|same|samepre)\d+|weight")
_SITE_CHECKS = {
    "index": _count, "name": _STR, "op_type": _STR, "module_type": _opt(_STR), "file": _STR, "quant_dtype": _STR,
    "scale": _scale, "weight_scale": _scale, "input_dtypes": _str_list, "boundary": _STR, "fused_into": _opt(_STR),
    "producer": _opt(_STR), "index_producer": _opt(_STR), "index_producing": lambda v: isinstance(v, bool), "same_input_note": _STR,
    "scale_axis": _opt(lambda v: isinstance(v, int) and not isinstance(v, bool)), "stats_only": _str_list,
    "refs": lambda v: isinstance(v, dict) and all(_STR(k) and isinstance(r, list) and len(r) == 2 and
                                                  all(map(_STR, r)) for k, r in v.items()),
    "codes": lambda v: isinstance(v, dict) and all(_STR(k) and _number(c) and math.isfinite(c) and c > 0
                                                   for k, c in v.items()),
}
_STAT_CHECKS = {"shape": lambda v: all(map(_count, v)), "dtype": _STR, "min": _opt(_number), "max": _opt(_number),
                "mean": _opt(_number), "var": _opt(_number), "nan": _count, "inf": _count}


def _check_fields(obj, checks: dict, where: str) -> None:
    for name, check in checks.items():
        value = getattr(obj, name)
        if not check(value):
            raise ValueError(f"{where}.{name} is {value!r}, not a value of its type and range")


def _check_index(index: TraceIndex) -> None:
    """Raise ``ValueError`` naming the first entry of ``index`` of the wrong type or range."""
    _check_fields(index, {"model": _STR, "description": _STR, "input_digest": _STR, "model_digest": _STR,
                          "outputs": _str_list, "folded": lambda v: isinstance(v, dict) and all(
                              _STR(k) and _STR(t) for k, t in v.items())}, "trace")
    for i, site in enumerate(index.sites):
        where = f"sites[{i}]"
        _check_fields(site, _SITE_CHECKS, where)
        for key, stat in site.stats.items():
            if not _KEY.fullmatch(key):
                raise ValueError(f"{where}.stats has the key {key!r}, not a tensor key of a site")
            _check_fields(stat, _STAT_CHECKS, f"{where}.stats[{key!r}]")
        for part, check in ((site.quant_error, _number), (site.int_stats, _count)):
            if part is not None:
                _check_fields(part, {f.name: check for f in fields(part)}, f"{where}.{type(part).__name__}")
        if isinstance(site.quant_error, QuantErrorStats) and not (_count(site.quant_error.numel) and
                                                                  _count(site.quant_error.clipped)):
            raise ValueError(f"{where}.quant_error has a negative or fractional count")
