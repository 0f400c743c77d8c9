"""The on-disk trace of one model's forward on the bad case, written while the model runs.

Layout of ``out_dir/<baseline|analysis>_model/``::

    tensors/00000.safetensors   one file per executed op site: in<pos>, out<i>, weight, same<i>, samepre<i>
    outputs.safetensors         the model outputs by name (and the post_process outputs)
    trace.json                  one entry per op site: names, quantization, tensor statistics
    statistic.txt               the statistics as a table (see report.write_statistic)

Every op site's tensors go to disk as soon as the op has run and only small statistics stay in memory, so
tracing needs about one layer's worth of extra memory, not the network's. ``trace.json`` is written last:
a trace without it is incomplete and is refused by :class:`TraceReader`.

A new trace is written into the sibling folder ``.<name>.partial/`` and moved into place when complete, so an
interrupted run leaves the previous complete trace as it was. Only the files named above are ever removed or
replaced; anything else in the folder (a user's notes, ``tensors/README``) stays.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils import _pytree as pytree

from quantlens._io import atomic_write, atomic_write_text
from quantlens.errors import QuantLensError
from quantlens.profiler.model_access import IntegerStats, QuantErrorStats, SiteEvent

__all__ = ["TensorStat", "TracedSite", "TraceWriter", "TraceReader", "tensor_stat", "input_digest", "TRACE_FILE"]

TRACE_FILE = "trace.json"
OUTPUTS_FILE = "outputs.safetensors"
_FORMAT = 1


@dataclass(frozen=True)
class TensorStat:
    """Statistics of one tensor (over its finite values; counts of NaN and Inf separately)."""

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


def tensor_stat(t: torch.Tensor) -> TensorStat:
    x = t.detach()
    shape, dtype = tuple(x.shape), str(x.dtype).replace("torch.", "")
    if x.numel() == 0:
        return TensorStat(shape, dtype, None, None, None, None)
    nan = inf = 0
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return TensorStat(shape, dtype, None, None, None, None, nan, inf)
    # A few cheap passes with float64 accumulation, and no float64 copy of a large activation.
    x = x.reshape(-1) if x.dtype in (torch.float32, torch.float64) else x.reshape(-1).double()
    lo, hi = torch.aminmax(x)
    mean = float(x.sum(dtype=torch.float64)) / x.numel()
    var = float((x - mean).square_().sum(dtype=torch.float64)) / x.numel()
    return TensorStat(shape, dtype, float(lo), float(hi), mean, var, nan, inf)


def input_digest(example: Any) -> str:
    """A fingerprint of the tensors of one call's inputs (values, shapes, dtypes), to tell whether two traces
    were made on the same bad case."""
    h = hashlib.sha256()
    for leaf in pytree.tree_leaves(example):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


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
    index_producing: bool = False
    stats: dict[str, TensorStat] = field(default_factory=dict)
    quant_error: QuantErrorStats | None = None
    same_input_note: str = ""
    int_stats: IntegerStats | None = None  # IR sites (see IntegerStats); absent from older traces
    scale_axis: int | None = None  # channel axis of a per-channel ``scale``

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


def _scale_value(scale: torch.Tensor | None) -> float | list[float] | None:
    if scale is None:
        return None
    values = [float(v) for v in scale.detach().reshape(-1)]
    return values[0] if len(values) == 1 and scale.dim() == 0 else values


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written through a temporary name (never a half-written file)."""
    payload, seen = {}, set()
    for key, value in tensors.items():
        t = value.detach().cpu()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory and writes dense storage only: copy views and shared
        # tensors (an identity op's output is its input), pass the rest without a copy.
        if not t.is_contiguous() or storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        payload[key] = t
    atomic_write(path, lambda tmp: save_file(payload, tmp))


class TraceWriter:
    """A trace sink that streams every op site to ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, label: str, description: str, save_inputs: bool = True):
        #: where the trace ends up; it is written to the sibling staging folder :attr:`dir` and moved here by
        #: :meth:`finish`, so until then ``target`` keeps the previous complete trace (an interrupted run
        #: changes nothing there)
        self.target = Path(directory)
        self.dir = _staging_dir(self.target)
        #: inputs are what the same-input run of the *other* model needs; without it only model inputs
        #: (QuantStub inputs) are kept, the rest are the previous ops' outputs anyway
        self.save_inputs = save_inputs
        self.label = label
        self.description = description
        self.sites: list[TracedSite] = []
        (self.dir / "tensors").mkdir(parents=True, exist_ok=True)

    def on_site(self, event: SiteEvent) -> None:
        inputs = event.inputs if self.save_inputs or event.boundary == "input" else {}
        tensors: dict[str, torch.Tensor] = {f"in{pos}": t for pos, t in inputs.items()}
        tensors.update({f"out{i}": t for i, t in enumerate(event.outputs)})
        if event.weight is not None:
            tensors["weight"] = event.weight
        for i, t in enumerate(event.same_input or []):
            tensors[f"same{i}"] = t
        for i, t in enumerate(event.same_input_pre or []):
            tensors[f"samepre{i}"] = t
        file = f"tensors/{event.index:05d}.safetensors"
        _save_tensors(tensors, self.dir / file)
        self.sites.append(TracedSite(
            index=event.index, name=event.name, op_type=event.op_type, module_type=event.module_type, file=file,
            quant_dtype=event.quant_dtype, scale=_scale_value(event.scale),
            weight_scale=_scale_value(event.weight_scale), input_dtypes=list(event.input_dtypes),
            boundary=event.boundary, fused_into=event.fused_into, producer=event.producer,
            index_producing=event.index_producing, stats={k: tensor_stat(v) for k, v in tensors.items()},
            quant_error=event.quant_error, same_input_note=event.same_input_note, int_stats=event.int_stats,
            scale_axis=event.scale_axis,
        ))

    def finish(self, outputs: dict[str, torch.Tensor], input_digest: str = "") -> Path:
        """Save the model outputs and the index; the trace is complete once this returns."""
        _save_tensors(outputs, self.dir / OUTPUTS_FILE)
        data = {
            "format": _FORMAT,
            "model": self.label,
            "description": self.description,
            "input_digest": input_digest,
            "outputs": list(outputs),
            "sites": [asdict(s) for s in self.sites],
        }
        atomic_write_text(self.dir / TRACE_FILE, json.dumps(data, indent=1, allow_nan=True) + "\n")
        _swap_in(self.dir, self.target)
        return self.target / TRACE_FILE


#: the names a trace folder's writers give their files; nothing else in the folder is ever removed
_OWN_TOP = {TRACE_FILE, OUTPUTS_FILE, "statistic.txt"}
_OWN_TENSOR = re.compile(r"\d{5,}\.safetensors")
_OWN_TEMP = re.compile(r"\.(\d{5,}\.safetensors|trace\.json|outputs\.safetensors|statistic\.txt)\.\w+\.tmp")


def _own_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(files written by quantlens, other entries) of a trace folder, ``tensors/`` looked into."""
    own, foreign = [], []
    if not folder.is_dir():
        return own, foreign
    for entry in folder.iterdir():
        if entry.name == "tensors" and entry.is_dir() and not entry.is_symlink():
            for inner in entry.iterdir():
                ours = inner.is_file() and (_OWN_TENSOR.fullmatch(inner.name) or _OWN_TEMP.fullmatch(inner.name))
                (own if ours else foreign).append(inner)
        elif entry.is_file() and (entry.name in _OWN_TOP or _OWN_TEMP.fullmatch(entry.name)):
            own.append(entry)
        else:
            foreign.append(entry)
    return own, foreign


def _remove_own(folder: Path) -> bool:
    """Remove quantlens' files from a trace folder (and the folders left empty); True when it is gone."""
    own, foreign = _own_files(folder)
    for path in own:
        path.unlink(missing_ok=True)
    for path in (folder / "tensors", folder):
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    return not folder.exists()


def _staging_dir(target: Path) -> Path:
    """An empty sibling folder for a trace being written (a leftover of an interrupted run is cleared of
    quantlens' own files; one holding anything else is left alone and another name is used)."""
    if target.exists() and not target.is_dir():
        raise QuantLensError(f"{target} is a file, not a folder; a trace is a folder there. Move the file away or "
                             "pass another out_dir.")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial"
    if staging.is_symlink() or (staging.exists() and not _remove_own(staging)):
        return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    staging.mkdir()
    return staging


def _swap_in(staging: Path, target: Path) -> None:
    """Move the complete trace in ``staging`` to ``target``. A target holding only quantlens' files is replaced
    by two renames; one with other files too gets the new files moved in (the old index is removed first and
    the new one moved last, so the folder never holds a trace mixed from two runs) and keeps the others."""
    own, foreign = _own_files(target)
    if not target.exists() or (not foreign and target.is_dir() and not target.is_symlink()):
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            old.rmdir()
            os.replace(target, old)
        os.replace(staging, target)
        if old is not None:
            _remove_own(old)
        return
    (target / TRACE_FILE).unlink(missing_ok=True)
    new_names = set()
    (target / "tensors").mkdir(exist_ok=True)
    for path in sorted((staging / "tensors").iterdir()):
        new_names.add(path.name)
        os.replace(path, target / "tensors" / path.name)
    for path in own:  # the previous trace's files that the new one does not overwrite
        in_tensors = path.parent != target
        if (in_tensors and path.name not in new_names) or path.name == "statistic.txt" or _OWN_TEMP.fullmatch(path.name):
            path.unlink(missing_ok=True)
    os.replace(staging / OUTPUTS_FILE, target / OUTPUTS_FILE)
    os.replace(staging / TRACE_FILE, target / TRACE_FILE)
    _remove_own(staging)


class TraceReader:
    """Reads a trace written by :class:`TraceWriter`; also the same-input source of the analysis run."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        path = self.dir / TRACE_FILE
        if not path.is_file():
            raise QuantLensError(
                f"No complete trace in {self.dir} ({TRACE_FILE} is missing). Call QuantAnalysis.run() first "
                "(run(run_baseline_model=True) for the baseline trace), and let it finish."
            )
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT:
            raise QuantLensError(f"{path} has trace format {data.get('format')!r}; expected {_FORMAT}. Re-run run().")
        self.label: str = data["model"]
        self.description: str = data["description"]
        self.output_names: list[str] = data["outputs"]
        self.input_digest: str = data.get("input_digest", "")
        self.sites: list[TracedSite] = [TracedSite.from_json(s) for s in data["sites"]]
        self.by_name: dict[str, TracedSite] = {s.name: s for s in self.sites}

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.dir / self.by_name[name].file))

    def inputs(self, site: str) -> dict[int, torch.Tensor] | None:
        """The site's incoming float tensors by leaf position (loads only those from the file)."""
        if site not in self.by_name:
            return None
        with safe_open(str(self.dir / self.by_name[site].file), framework="pt") as f:
            return {int(k[2:]): f.get_tensor(k) for k in f.keys() if k.startswith("in")}

    def outputs(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.dir / OUTPUTS_FILE))

    def site_outputs(self, site: str) -> list[torch.Tensor] | None:
        """The site's output tensors (``out0``, ``out1`` ...), or None for a site the trace does not have."""
        if site not in self.by_name:
            return None
        keys = self.by_name[site].outputs()
        with safe_open(str(self.dir / self.by_name[site].file), framework="pt") as f:
            return [f.get_tensor(k) for k in keys]

    def fused_members(self, site: str) -> set[str]:
        """The sites fused into ``site`` (a conv and BatchNorm before their ReLU), transitively."""
        out, todo = set(), [site]
        while todo:
            tail = todo.pop()
            for s in self.sites:
                if s.fused_into == tail and s.name not in out:
                    out.add(s.name)
                    todo.append(s.name)
        return out
