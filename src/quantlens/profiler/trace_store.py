"""The on-disk trace of one model's forward on the bad case, written while the model runs.

Layout of ``out_dir/<baseline|analysis>_model/``::

    tensors/00000.safetensors   one file per executed op site: in<pos>, out<i>, weight, same<i>, samepre<i>
    outputs.safetensors         the model outputs by name (and the post_process outputs)
    trace.json                  one entry per op site: names, quantization, tensor statistics
    statistic.txt               the statistics as a table (see report.write_statistic)

Every op site's tensors are copied as soon as the op has run and handed to a writer thread, which computes
their statistics and writes them to disk while the model runs on; the copies waiting for it are bounded
(:data:`QUEUE_BYTES`), so tracing needs a few layers' worth of extra memory, not the network's. ``trace.json``
is written last: a trace without it is incomplete and is refused by :class:`TraceReader`.

**Format 2** (``trace.json``'s ``"format"``): a tensor that is the very tensor an earlier op site of the same
trace already stored (an op's input that is its producer's output, an identity op's output, a shared weight),
unchanged since, is not stored again: the site's ``refs`` maps its key to ``[file, key]`` of the stored copy,
and :class:`TraceReader` resolves it (``tensors``, ``inputs``, ``site_outputs``; the statistics are the stored
copy's). A fused group's member may keep its statistics only (``TracedSite.stats_only``: in the analysis trace,
and in a baseline traced for an analysis model that fuses it, see ``docs/profiler.md``). The tensor files are
plain safetensors files. Traces of format 1 (before references) are refused with
a message to re-run ``run()``.

A new trace is written into the sibling folder ``.<name>.partial/`` and moved into place when complete, so an
interrupted run leaves the previous complete trace as it was. Only the files named above are ever removed or
replaced; anything else in the folder (a user's notes, ``tensors/README``) stays.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import struct
import tempfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils import _pytree as pytree

from quantlens._io import atomic_write, atomic_write_text
from quantlens.errors import QuantLensError
from quantlens.profiler._sums import CHUNK, chunks, sum64
from quantlens.profiler.model_access import IntegerStats, QuantErrorStats, SiteEvent

__all__ = ["TensorStat", "TracedSite", "TraceWriter", "TraceReader", "tensor_stat", "input_digest", "TRACE_FILE",
           "TRACE_FORMAT", "QUEUE_BYTES"]

TRACE_FILE = "trace.json"
OUTPUTS_FILE = "outputs.safetensors"
#: the on-disk layout's version (see the module docstring); TraceReader reads this one only
TRACE_FORMAT = 2
_FORMAT = TRACE_FORMAT
#: the most bytes of tensor copies waiting for the writer thread; the traced forward waits when it is reached
#: (one item larger than this is still taken, alone)
QUEUE_BYTES = 24 * 1024 * 1024


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


def tensor_stat(t: torch.Tensor, scratch: Callable[[int], torch.Tensor] | None = None) -> TensorStat:
    """``scratch(nbytes)``, when given, lends a byte buffer for the variance pass's temporary (the writer
    thread reuses one instead of allocating an activation-sized tensor per call)."""
    x = t.detach()
    shape, dtype = tuple(x.shape), str(x.dtype).replace("torch.", "")
    if x.numel() == 0:
        return TensorStat(shape, dtype, None, None, None, None)
    nan = inf = 0
    x = x.reshape(-1)
    lo = hi = None
    if x.is_floating_point():
        # one pass decides finiteness: aminmax propagates NaN, and an Inf is one of the extremes
        lo, hi = torch.aminmax(x)
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            x = x[torch.isfinite(x)]
            lo = hi = None
            if x.numel() == 0:
                return TensorStat(shape, dtype, None, None, None, None, nan, inf)
    # A few cheap passes with float64 accumulation, and no float64 copy of a large activation.
    if x.dtype not in (torch.float32, torch.float64):
        x, lo, hi = x.double(), None, None
    if lo is None:
        lo, hi = torch.aminmax(x)
    mean = sum64(x) / x.numel()
    if scratch is not None and x.is_contiguous():
        # chunk by chunk: the writer thread's temporary is one chunk (a few activations' temporaries would be
        # a tenth of a traced run's memory)
        buf = scratch(min(x.numel(), CHUNK) * x.element_size()).view(x.dtype)
        var = sum(sum64(torch.sub(c, mean, out=buf[:c.numel()]).square_()) for c in chunks(x)) / x.numel()
    else:
        var = sum64((x - mean).square_()) / x.numel()
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


def _scale_value(scale: torch.Tensor | None) -> float | list[float] | None:
    if scale is None:
        return None
    values = [float(v) for v in scale.detach().reshape(-1)]
    return values[0] if len(values) == 1 and scale.dim() == 0 else values


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                     ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def _dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` that nothing else holds (the model may change ``t`` in place later)."""
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def _write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Write contiguous CPU tensors as a safetensors file, straight from their memory (no serialised copy);
    dtypes safetensors has no code for go through ``safetensors.torch.save_file``."""
    if any(t.dtype not in _ST_DTYPES or not t.is_contiguous() or t.device.type != "cpu" for t in tensors.values()):
        save_file({k: _dense_copy(t) for k, t in tensors.items()}, str(path))
        return
    header, offset = {}, 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % _ALIGN)  # the first tensor's data starts 64-byte aligned in the file
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file written through a temporary name (never a half-written file)."""
    payload, seen = {}, set()
    for key, value in tensors.items():
        t = value.detach().cpu()
        storage = t.untyped_storage()
        # dense, unshared storage only: copy views and shared tensors (an identity op's output is its input)
        if not t.is_contiguous() or storage.nbytes() != t.nbytes or storage.data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        payload[key] = t
    atomic_write(path, lambda tmp: _write_safetensors(tmp, payload))


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None where torch keeps none: inference tensors)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


@dataclass
class _Job:
    """One op site's copies on their way to disk (see :class:`TraceWriter`)."""

    site: "TracedSite"
    tensors: dict[str, torch.Tensor]  # the copies to store, by key
    order: list[str]  # every key of the site, stored or referenced, in the trace's order
    nbytes: int
    quant_error: Callable[[], Any] | None = None  # computed by the writer thread (see torch_probe)
    stats: dict[str, TensorStat] = field(default_factory=dict)
    encode: dict[str, tuple[float, int, int, torch.dtype]] = field(default_factory=dict)  # key -> grid
    buffer: torch.Tensor | None = None  # the pool buffer holding the copies
    stats_only: frozenset[str] = frozenset()  # keys whose statistics are computed but which are not written


_ALIGN = 64
_CODE_DTYPES = {"qint8": (-128, 127, torch.int8), "qint16": (-32768, 32767, torch.int16)}


class _Pool:
    """Byte buffers for the copies waiting for the writer thread, reused from site to site (fresh
    activation-sized allocations are page faults, and they dominate a traced forward otherwise). At most
    ``limit`` bytes are handed out at once; one request larger than that is served alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.free: list[torch.Tensor] = []
        self.out = 0  # bytes handed out
        self.cond = threading.Condition()

    def take(self, nbytes: int, failed: Callable[[], bool], held: int = 0) -> torch.Tensor:
        """A buffer of at least ``nbytes``; ``held`` more bytes (tensors queued without a copy) count against
        the limit too, until :meth:`give`."""
        with self.cond:
            while self.out and self.out + nbytes + held > self.limit and not failed():
                self.cond.wait(0.5)
            self.out += held
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]  # (by index: == compares values)
            if fits:
                buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            else:
                self.free.sort(key=torch.Tensor.numel)
                while self.free and sum(b.numel() for b in self.free) + self.out + nbytes > self.limit:
                    self.free.pop(0)  # too small for what comes now: let the smallest go
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.out += nbytes
            return buf

    def give(self, buf: torch.Tensor, nbytes: int) -> None:
        with self.cond:
            self.out -= nbytes
            self.free.append(buf)
            self.cond.notify_all()

    def clear(self) -> None:
        with self.cond:
            self.free = []


def _copy_into(buf: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense copies of ``tensors`` laid out in the byte buffer ``buf`` (see :func:`_layout`)."""
    out, offset = {}, 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if t.dtype not in _ST_DTYPES or t.is_complex():
            out[key] = _dense_copy(t)
            continue
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        out[key] = view
        offset += -(-n // _ALIGN) * _ALIGN
    return out


def _layout(tensors: dict[str, torch.Tensor]) -> int:
    return sum(-(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN for t in tensors.values()
               if t.dtype in _ST_DTYPES)


def _encode(x: torch.Tensor, scale: float, qmin: int, qmax: int, dtype: torch.dtype,
            scratch: Callable[[int], torch.Tensor], codes_buf: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
    """Integer codes ``c`` with ``c.float() * scale == x`` elementwise (value equality: -0.0 comes back as 0.0),
    or None where ``x`` is not exactly on that grid (NaN, Inf, off-grid values, out of range)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() == 0:
        return None
    s = torch.tensor(scale, dtype=torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    codes = codes_buf(x.numel() * size).view(dtype)[:x.numel()]
    buf = scratch(min(x.numel(), CHUNK) * 4).view(torch.float32)
    done = 0
    for c in chunks(x):  # (a chunk's temporary, not an activation's)
        q = torch.div(c, s, out=buf[:c.numel()]).round_()
        lo, hi = torch.aminmax(q)
        if not (bool(lo >= qmin) and bool(hi <= qmax)):  # NaN fails both
            return None
        codes[done:done + c.numel()].copy_(q)
        if not torch.equal(q.mul_(s), c):
            return None
        done += c.numel()
    return codes.view(x.shape)


class TraceWriter:
    """A trace sink that streams every op site to ``directory`` (see the module docstring).

    :meth:`on_site` runs in the traced forward: it copies the site's tensors that are not already stored
    (references, see the module docstring) and queues them; a writer thread computes their statistics (and a
    deferred output quantization split) and writes the site's file. The forward waits only when the copies
    waiting reach :data:`QUEUE_BYTES`. :meth:`finish` waits for the thread and writes the index; :meth:`close`
    stops it without finishing (after an error). A writer-thread error is raised in the forward's thread.
    """

    #: the probes hand the output quantization split over as a callable for the writer thread to compute
    deferred_quant_error = True

    def __init__(self, directory: str | os.PathLike, label: str, description: str, save_inputs: bool = True,
                 queue_bytes: int = QUEUE_BYTES, values_not_needed: frozenset[str] = frozenset()):
        #: where the trace ends up; it is written to the sibling staging folder :attr:`dir` and moved here by
        #: :meth:`finish`, so until then ``target`` keeps the previous complete trace (an interrupted run
        #: changes nothing there)
        self.target = Path(directory)
        self.dir = _staging_dir(self.target)
        #: inputs are what the same-input run of the *other* model needs; without it only model inputs
        #: (QuantStub inputs) are kept, the rest are the previous ops' outputs anyway
        self.save_inputs = save_inputs
        #: op sites whose outputs are kept as statistics only: the other model's fused-group internals
        #: (``ModelAccess.group_internal_sites``), which its comparison and same-input run never read
        self.values_not_needed = values_not_needed
        self.label = label
        self.description = description
        self.sites: list[TracedSite] = []
        (self.dir / "tensors").mkdir(parents=True, exist_ok=True)
        self.queue_bytes = queue_bytes
        #: id(tensor) -> (weak reference, version, file, key) of every tensor stored so far
        self._stored: dict[int, tuple[Any, int, str, str]] = {}
        self._jobs: list[_Job] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = _Pool(queue_bytes)
        self._scratch: dict[str, torch.Tensor] = {}  # the writer thread's reusable temporaries
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the forward's side ---------------------------------------------------------------------------------
    def _ref(self, t: torch.Tensor) -> list[str] | None:
        entry = self._stored.get(id(t))
        if entry is None:
            return None
        wref, version, file, key = entry
        if wref() is not t or _version(t) != version:
            return None
        return [file, key]

    def _remember(self, t: torch.Tensor, file: str, key: str) -> None:
        version = _version(t)
        if version is None:
            return
        try:
            wref = weakref.ref(t)
        except TypeError:
            return
        self._stored[id(t)] = (wref, version, file, key)

    def on_site(self, event: SiteEvent) -> None:
        self._raise_error()
        inputs = event.inputs if self.save_inputs or event.boundary == "input" else {}
        tensors: dict[str, torch.Tensor] = {f"in{pos}": t for pos, t in inputs.items()}
        tensors.update({f"out{i}": t for i, t in enumerate(event.outputs)})
        if event.weight is not None:
            tensors["weight"] = event.weight
        for i, t in enumerate(event.same_input or []):
            tensors[f"same{i}"] = t
        for i, t in enumerate(event.same_input_pre or []):
            tensors[f"samepre{i}"] = t
        owned = {k for k in tensors if k.startswith("same")} if event.same_input_owned else set()
        file = f"tensors/{event.index:05d}.safetensors"
        refs: dict[str, list[str]] = {}
        stored: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}  # within the site: the same tensor under two keys is stored once
        for key, t in tensors.items():
            ref = self._ref(t)
            if ref is None and id(t) in seen:
                ref = [file, seen[id(t)]]
            if ref is not None:
                refs[key] = ref
            else:
                stored[key] = t
                seen[id(t)] = key
        quant_error = event.quant_error
        site = TracedSite(
            index=event.index, name=event.name, op_type=event.op_type, module_type=event.module_type, file=file,
            quant_dtype=event.quant_dtype, scale=_scale_value(event.scale),
            weight_scale=_scale_value(event.weight_scale), input_dtypes=list(event.input_dtypes),
            boundary=event.boundary, fused_into=event.fused_into, producer=event.producer,
            index_producing=event.index_producing, stats={},
            quant_error=None if callable(quant_error) else quant_error, same_input_note=event.same_input_note,
            int_stats=event.int_stats, scale_axis=event.scale_axis, refs=refs,
        )
        # a deferred output quantization split holds the op's value before its fake quant: copied like the rest
        qerr_tensor = getattr(quant_error, "tensor", None) if callable(quant_error) else None
        if isinstance(qerr_tensor, torch.Tensor):
            stored["\0qerr"] = qerr_tensor
        keep = {k: t.detach() for k, t in stored.items() if k in owned}  # queued as they are (see SiteEvent)
        to_copy = {k: t for k, t in stored.items() if k not in owned}
        nbytes, held = _layout(to_copy), sum(t.numel() * t.element_size() for t in keep.values())
        buffer = self._pool.take(nbytes, lambda: self._error is not None, held)
        self._raise_error()
        copied = _copy_into(buffer, to_copy)
        copies = {k: copied[k] if k in copied else keep[k] for k in stored}  # the site's key order
        nbytes += held
        if isinstance(qerr_tensor, torch.Tensor):
            quant_error.tensor = copies.pop("\0qerr")
            del stored["\0qerr"]
        # (a fused member's value is not needed by the comparison, and nothing reads an analysis trace's inputs)
        fused_member = bool(event.fused_into) and not self.save_inputs
        stats_only = frozenset(k for k in stored if k.startswith(("out", "same"))) \
            if fused_member or event.name in self.values_not_needed else frozenset()
        site.stats_only = sorted(stats_only)
        for key, t in stored.items():
            # An analysis trace's fused member: a later site holding the same tensor stores it itself (that site
            # may be compared). A value only the other model's fused ops hold is read by nothing, and neither is
            # a later key holding it (a group member's input): that key refers to these statistics.
            if key not in stats_only or not fused_member:
                self._remember(t, file, key)
        job = _Job(site, copies, list(tensors), nbytes, quant_error if callable(quant_error) else None,
                   buffer=buffer, stats_only=stats_only)
        grid = _CODE_DTYPES.get(event.quant_dtype)
        if grid is not None and site.per_tensor_scale is not None and not event.fused_into:
            # the site's values on its output grid go to disk as integer codes (checked exactly when written)
            job.encode = {k: (site.per_tensor_scale, *grid) for k in copies if k.startswith(("out", "same"))
                          and not k.startswith("samepre")}
        self.sites.append(site)
        self._jobs.append(job)
        self._start()
        self._queue.put(job)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.close()
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise error
            # (a QuantLensError, so that the forward's callers do not take it for the model's own error)
            raise QuantLensError(f"Writing the {self.label} trace to {self.dir} failed: {type(error).__name__}: "
                                 f"{error}") from error

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"quantlens-trace-{self.label}", daemon=True)
            self._thread.start()

    # -- the writer thread ----------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self._error is None and not self._closed:
                    self._write_job(job)
            except BaseException as exc:  # handed to the forward's thread
                self._error = exc
            finally:
                job.tensors, job.quant_error = {}, None
                if job.buffer is not None:
                    self._pool.give(job.buffer, job.nbytes)
                    job.buffer = None

    def _scratch_of(self, name: str) -> Callable[[int], torch.Tensor]:
        def get(nbytes: int) -> torch.Tensor:
            buf = self._scratch.get(name)
            if buf is None or buf.numel() < nbytes:
                buf = self._scratch[name] = torch.empty(-(-max(nbytes, 1) // _ALIGN) * _ALIGN, dtype=torch.uint8)
            return buf
        return get

    def _write_job(self, job: _Job) -> None:
        stat_scratch = self._scratch_of("stat")
        job.stats = {k: tensor_stat(v, stat_scratch) for k, v in job.tensors.items()}
        payload = {k: v for k, v in job.tensors.items() if k not in job.stats_only}
        for key, (scale, qmin, qmax, dtype) in job.encode.items():
            codes = _encode(payload[key], scale, qmin, qmax, dtype, stat_scratch, self._scratch_of(f"codes:{key}"))
            if codes is not None:
                payload[key] = codes
                job.site.codes[key] = scale
        _write_safetensors(self.dir / job.site.file, payload)
        if job.quant_error is not None:
            job.site.quant_error = job.quant_error()

    def _drain(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the writer thread (queued sites are dropped); the staging folder keeps what was written."""
        self._closed = True
        self._drain()
        self._pool.clear()
        self._scratch = {}

    def finish(self, outputs: dict[str, torch.Tensor], input_digest: str = "") -> Path:
        """Save the model outputs and the index; the trace is complete once this returns."""
        self._drain()
        self._raise_error()
        stats: dict[str, dict[str, TensorStat]] = {job.site.file: job.stats for job in self._jobs}
        for job in self._jobs:  # the statistics in the trace's key order, references' from their stored copy
            job.site.stats = {k: (stats[job.site.refs[k][0]][job.site.refs[k][1]] if k in job.site.refs
                                  else job.stats[k]) for k in job.order}
        self._jobs, self._stored, self._scratch = [], {}, {}
        self._pool.clear()
        _save_tensors(outputs, self.dir / OUTPUTS_FILE)
        data = {
            "format": _FORMAT,
            "model": self.label,
            "description": self.description,
            "input_digest": input_digest,
            "outputs": list(outputs),
            "sites": [vars(s) for s in self.sites],
        }
        # (vars + default=vars: the JSON of dataclasses.asdict, without its deep copies)
        atomic_write_text(self.dir / TRACE_FILE, json.dumps(data, indent=1, allow_nan=True, default=vars) + "\n")
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
            raise QuantLensError(
                f"{path} has trace format {data.get('format')!r}; this version of quantlens reads format {_FORMAT} "
                "only (format 2 stores a tensor another op site already stored as a reference to it). Re-run "
                "QuantAnalysis.run() to write the trace again.")
        self.label: str = data["model"]
        self.description: str = data["description"]
        self.output_names: list[str] = data["outputs"]
        self.input_digest: str = data.get("input_digest", "")
        self.sites: list[TracedSite] = [TracedSite.from_json(s) for s in data["sites"]]
        self.by_name: dict[str, TracedSite] = {s.name: s for s in self.sites}
        self._by_file: dict[str, TracedSite] = {s.file: s for s in self.sites}

    def tensors(self, name: str) -> "SiteTensors":
        """The site's tensors by key (``in<pos>``, ``out<i>``, ``weight``, ``same<i>``, ``samepre<i>``), a
        mapping that loads each one when it is read (references resolved)."""
        return SiteTensors(self, self.by_name[name])

    def _load(self, site: TracedSite, keys: list[str]) -> list[torch.Tensor]:
        """The tensors ``keys`` of ``site``, references followed, each file opened once."""
        where: dict[str, list[tuple[int, str]]] = {}
        for i, key in enumerate(keys):
            file, stored = site.refs.get(key, (site.file, key))
            where.setdefault(file, []).append((i, stored))
        out: list[Any] = [None] * len(keys)
        for file, items in where.items():
            owner = self._by_file.get(file)
            codes = owner.codes if owner is not None else {}
            missing = [stored for _, stored in items if owner is not None and stored in owner.stats_only]
            if missing:
                where = (f"the site is fused into '{owner.fused_into}', whose output is the group's value. Read that "
                         "site's tensors instead." if owner.fused_into else
                         "the trace was made for a comparison with a model that fuses this op site into a larger "
                         "op, where nothing reads its value. Trace this model again for this comparison: "
                         "QuantAnalysis.run() (with run_baseline_model=True).")
                raise QuantLensError(f"The trace in {self.dir} keeps only the statistics of '{missing[0]}' at op site "
                                     f"'{owner.name}': {where}")
            with safe_open(str(self.dir / file), framework="pt") as f:
                for i, stored in items:
                    t = f.get_tensor(stored)
                    if stored in codes:  # integer codes on the site's grid: exactly the float32 values stored
                        t = t.to(torch.float32).mul_(torch.tensor(codes[stored], dtype=torch.float32))
                    elif t.data_ptr() % _ALIGN:
                        # the same alignment wherever the tensor lies in its file: a GEMM re-run on it (the
                        # same-input run) may round differently on differently aligned memory
                        t = t.clone()
                    out[i] = t
        return out

    def inputs(self, site: str) -> dict[int, torch.Tensor] | None:
        """The site's incoming float tensors by leaf position (loads only those)."""
        if site not in self.by_name:
            return None
        s = self.by_name[site]
        keys = [k for k in s.stats if k.startswith("in") and not self._stats_only(s, k)]
        return {int(k[2:]): t for k, t in zip(keys, self._load(s, keys))}

    def _stats_only(self, site: TracedSite, key: str) -> bool:
        """Whether only the statistics of ``key`` are kept (references followed): an input a fused group's member
        takes from another member, in a baseline traced for a model that fuses them (see ``TracedSite``)."""
        file, stored = site.refs.get(key, (site.file, key))
        owner = self._by_file.get(file)
        return owner is not None and stored in owner.stats_only

    def outputs(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.dir / OUTPUTS_FILE))

    def site_outputs(self, site: str) -> list[torch.Tensor] | None:
        """The site's output tensors (``out0``, ``out1`` ...), or None for a site the trace does not have."""
        if site not in self.by_name:
            return None
        s = self.by_name[site]
        return self._load(s, s.outputs())

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


class SiteTensors(Mapping):
    """One traced site's tensors by key, each loaded from disk when it is read (see :meth:`TraceReader.tensors`)."""

    def __init__(self, reader: TraceReader, site: TracedSite):
        self._reader, self._site = reader, site
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._site.stats:
            raise KeyError(key)
        if key not in self._cache:
            self._cache[key] = self._reader._load(self._site, [key])[0]
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._site.stats)

    def __len__(self) -> int:
        return len(self._site.stats)

    def __contains__(self, key: object) -> bool:
        return key in self._site.stats
