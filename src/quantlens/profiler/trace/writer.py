"""The trace writer: a trace sink that streams every op site of a traced forward to disk (see
:mod:`quantlens.profiler.trace` for the folder's layout).

Every op site's tensors are copied as soon as the op has run and handed to a writer thread, which computes
their statistics and writes them to disk while the model runs on; the copies waiting for it are bounded
(:data:`QUEUE_BYTES`), so tracing needs a few layers' worth of extra memory, not the network's. ``trace.json`` is
written last: a trace without it is incomplete and is refused by the reader.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open

from quantlens._io import atomic_write_text, write_error
from quantlens.errors import QuantLensError
from quantlens.profiler.index_origins import is_index_tensor
from quantlens.profiler.model_access import SiteEvent
from quantlens.profiler.trace._codes import CODE_DTYPES
from quantlens.profiler.trace._codes import encode as _encode
from quantlens.profiler.trace._files import save_tensors, write_safetensors
from quantlens.profiler.trace._folder import remove_staging, staging_dir, swap_in
from quantlens.profiler.trace._job import Job as _Job
from quantlens.profiler.trace._job import scale_value as _scale_value
from quantlens.profiler.trace._job import version as _version
from quantlens.profiler.trace._pool import BufferPool, copy_into, layout_bytes
from quantlens.profiler.trace.format import (
    ALIGN,
    OUTPUTS_FILE,
    TENSORS_DIR,
    TRACE_FILE,
    TensorStat,
    TracedSite,
    TraceIndex,
    tensor_file,
)
from quantlens.profiler.trace.stats import tensor_stat

__all__ = ["TraceWriter", "QUEUE_BYTES", "QUEUE_SITES", "QUEUE_FLOOR", "HOLD_BYTES", "HOLD_SITE_BYTES"]

#: the most bytes of tensor copies waiting for the writer thread; the traced forward waits when it is reached
#: (one item larger than this is still taken, alone)
QUEUE_BYTES = 24 * 1024 * 1024
#: the queue's budget follows the sites' size: at most this many times the largest site queued so far (and at least
#: :data:`QUEUE_FLOOR`), up to :data:`QUEUE_BYTES`. A model of many small sites whose writer lags (its rows are
#: computed there) filled all 24 MB: 204 sites of 0.5 MB activations kept 55 MB beyond the forward, 35 with this
#: (``benchmarks/bench_run_many_sites.py``); large activations still get the whole budget
QUEUE_SITES = 4
QUEUE_FLOOR = 2 * 1024 * 1024
#: the most bytes of a baseline trace's copies kept in memory after they are written (:attr:`TraceWriter.held`), for
#: the analysis run that follows: its same-input runs and rows read them there instead of from the files. Small
#: enough that a run's peak memory stays within 1.2x a plain forward's on large activations
#: (``benchmarks/bench_profiler.py``); a small net's whole baseline fits.
HOLD_BYTES = 16 * 1024 * 1024
#: the largest site held (its copies' bytes). Holding saves a file's fixed costs (open, header, mapping), which
#: dominate small tensors; a large one reads back from the page cache for about what its copy costs, and holding
#: it raised ``bench_profiler``'s peak from 1.17x to 1.21x a plain forward at 128x128 (8 MB activations)
HOLD_SITE_BYTES = 1024 * 1024


def _weight_changed(site: str) -> QuantLensError:
    return QuantLensError(
        f"The weight of op site {site!r} was changed in place while the model ran: the trace's statistics of it "
        "would depend on when the writer thread read it. Expected a forward that leaves its weights as they are "
        "(no in-place weight updates inside forward()).")


class TraceWriter:
    """A trace sink that streams every op site to ``directory`` (see :mod:`quantlens.profiler.trace`).

    :meth:`on_site` runs in the traced forward: it copies the site's tensors that are not already stored
    (references, format 2) and queues them; a writer thread computes their statistics (and a
    deferred output quantization split) and writes the site's file. The forward waits only when the copies
    waiting reach :data:`QUEUE_BYTES`. :meth:`finish` waits for the thread and writes the index; :meth:`close`
    stops it without finishing (after an error). A writer-thread error is raised in the forward's thread.
    """

    #: the probes hand the output quantization split over as a callable for the writer thread to compute
    deferred_quant_error = True

    def __init__(self, directory: str | os.PathLike, label: str, description: str, save_inputs: bool = True,
                 queue_bytes: int | None = None, values_not_needed: frozenset[str] = frozenset(),
                 after_write: Callable[[TracedSite, Mapping[str, torch.Tensor]], None] | None = None,
                 hold_bytes: int = 0):
        #: where the trace ends up; it is written to the sibling staging folder :attr:`dir` and moved here by
        #: :meth:`finish`, so until then ``target`` keeps the previous complete trace (an interrupted run
        #: changes nothing there)
        self.target = Path(directory)
        try:
            self.dir = staging_dir(self.target)
            (self.dir / TENSORS_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only disk, a file in the way, a full disk: in words, before the forward
            raise (write_error(exc, self.target / TRACE_FILE) or exc) from None
        #: inputs are what the same-input run of the *other* model needs; without it only model inputs
        #: (QuantStub inputs) are kept, the rest are the previous ops' outputs anyway
        self.save_inputs = save_inputs
        #: op sites whose outputs are kept as statistics only: the other model's fused-group internals
        #: (``ModelAccess.group_internal_sites``), which its comparison and same-input run never read
        self.values_not_needed = values_not_needed
        #: called on the writer thread once a site is written, with the site (its statistics complete) and its
        #: tensors as the file holds them (the values read back, codes decoded): its own file's still in memory,
        #: its outputs held by an earlier site's file (an identity op's) read back from there
        self.after_write = after_write
        #: (file, key) -> the value written there, kept in memory (each site's copies whole, while they fit in
        #: ``hold_bytes``); the reader of this trace takes them instead of reading the file (TraceReader(held=))
        self.held: dict[tuple[str, str], torch.Tensor] = {}
        self.hold_bytes = hold_bytes
        self._held_bytes = 0
        self._stats_by_file: dict[str, dict[str, TensorStat]] = {}  # (the writer thread's)
        self._site_by_file: dict[str, TracedSite] = {}  # (the writer thread's)
        self.label = label
        self.description = description
        self.sites: list[TracedSite] = []
        self.queue_bytes = QUEUE_BYTES if queue_bytes is None else queue_bytes
        #: id(tensor) -> (weak reference, version, file, key) of every tensor stored so far
        self._stored: dict[int, tuple[Any, int, str, str]] = {}
        self._jobs: list[_Job] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = BufferPool(self.queue_bytes)
        self._largest = 0  # the largest site queued so far, in bytes (the queue's budget follows it)
        self._scratch: dict[tuple[int, str], torch.Tensor] = {}  # each thread's reusable temporaries
        self._lock = threading.Lock()  # guards the jobs' claims and :attr:`_unclaimed`
        self._unclaimed: list[_Job] = []  # queued jobs no thread computes yet, oldest first
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
        # a baseline keeps every input (the other model's same-input run reads them), any trace its index inputs
        keep = self.save_inputs or event.boundary == "input"
        inputs = {pos: t for pos, t in event.inputs.items() if keep or is_index_tensor(t)}
        tensors: dict[str, torch.Tensor] = {f"in{pos}": t for pos, t in inputs.items()}
        tensors.update({f"out{i}": t for i, t in enumerate(event.outputs)})
        if event.weight is not None:
            tensors["weight"] = event.weight
        for i, t in enumerate(event.same_input or []):
            tensors[f"same{i}"] = t
        for i, t in enumerate(event.same_input_pre or []):
            tensors[f"samepre{i}"] = t
        owned = {k for k in tensors if k.startswith("same")} if event.same_input_owned else set()
        file = tensor_file(event.index)
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
        # A weight is kept as statistics only, of the tensor the op read (no copy queued): its values are the
        # model's own (its state_dict), and copying and writing them every run cost a third of a traced
        # transformer's writing. Nothing reads a trace's weight values. Its statistics are computed with the
        # site's others, off the forward's path (a sentence transformer's took 0.2 s of each run there); the
        # forward changes no weight, and _compute refuses one changed in place meanwhile.
        weight = stored.pop("weight", None)
        quant_error = event.quant_error
        site = TracedSite(
            index=event.index, name=event.name, op_type=event.op_type, module_type=event.module_type, file=file,
            quant_dtype=event.quant_dtype, scale=_scale_value(event.scale),
            weight_scale=_scale_value(event.weight_scale), input_dtypes=list(event.input_dtypes),
            boundary=event.boundary, fused_into=event.fused_into, producer=event.producer,
            index_producer=event.index_producer, index_producing=event.index_producing, stats={},
            quant_error=None if callable(quant_error) else quant_error, same_input_note=event.same_input_note,
            int_stats=event.int_stats, scale_axis=event.scale_axis, refs=refs,
        )
        # a deferred output quantization split holds the op's value before its fake quant: copied like the rest
        qerr_tensor = getattr(quant_error, "tensor", None) if callable(quant_error) else None
        if isinstance(qerr_tensor, torch.Tensor):
            stored["\0qerr"] = qerr_tensor
        keep = {k: t.detach() for k, t in stored.items() if k in owned}  # queued as they are (see SiteEvent)
        to_copy = {k: t for k, t in stored.items() if k not in owned}
        nbytes, held = layout_bytes(to_copy), sum(t.numel() * t.element_size() for t in keep.values())
        if isinstance(qerr_tensor, torch.Tensor) and nbytes + held > self.queue_bytes:
            # A site that alone exceeds the queue's budget is queued alone, and its split's copy of the value would
            # add an activation to the run's peak (bench_profiler's 8 MB activations: the peak was there): computed
            # now from the value itself.
            with torch._C.DisableTorchFunction():  # (as on the writer thread: outside the forward's modes)
                site.quant_error, quant_error = quant_error(), None
            del stored["\0qerr"], to_copy["\0qerr"]
            qerr_tensor, nbytes = None, layout_bytes(to_copy)
        buffer = self._pool.take(self._follow_site_size(nbytes, held), lambda: self._error is not None, held, helper=self._help)
        self._raise_error()
        copied = copy_into(buffer, to_copy)
        copies = {k: copied[k] if k in copied else keep[k] for k in stored}  # the site's key order
        nbytes += held
        if isinstance(qerr_tensor, torch.Tensor):
            quant_error.tensor = copies.pop("\0qerr")
            del stored["\0qerr"]
        # (a fused member's value is not needed by the comparison, and nothing reads an analysis trace's inputs)
        fused_member = bool(event.fused_into) and not self.save_inputs
        stats_only = frozenset(k for k in stored if k.startswith(("out", "same"))) \
            if fused_member or event.name in self.values_not_needed else frozenset()
        stats_only |= frozenset({"weight"} if weight is not None else ())
        site.stats_only = sorted(stats_only)
        for key, t in stored.items():
            # An analysis trace's fused member: a later site holding the same tensor stores it itself (that site
            # may be compared). A value only the other model's fused ops hold is read by nothing, and neither is
            # a later key holding it (a group member's input): that key refers to these statistics.
            if key not in stats_only or not fused_member:
                self._remember(t, file, key)
        job = _Job(site, copies, list(tensors), nbytes, quant_error if callable(quant_error) else None,
                   buffer=buffer, stats_only=stats_only,
                   weight=None if weight is None else (weight, _version(weight)))
        grid = CODE_DTYPES.get(event.quant_dtype)
        if grid is not None and site.per_tensor_scale is not None and not event.fused_into:
            # the site's values on its output grid go to disk as integer codes (checked exactly when written)
            job.encode = {k: (site.per_tensor_scale, *grid) for k in copies if k.startswith(("out", "same"))
                          and not k.startswith("samepre")}
        self.sites.append(site)
        self._jobs.append(job)
        self._start()
        with self._lock:
            self._unclaimed.append(job)
        self._queue.put(job)

    def _follow_site_size(self, nbytes: int, held: int) -> int:
        """Set the queue's budget for a site of ``nbytes`` copies and ``held`` bytes queued as they are, and return
        ``nbytes``: :data:`QUEUE_SITES` times the largest site so far, within [:data:`QUEUE_FLOOR`,
        ``queue_bytes``], so what run() holds beyond the forward follows the model's sites, not their number."""
        self._largest = max(self._largest, nbytes + held)
        self._pool.limit = min(self.queue_bytes, max(QUEUE_FLOOR, QUEUE_SITES * self._largest))
        return nbytes

    @property
    def queue_peak(self) -> int:
        """The most bytes of copies that waited for the writer thread at once (one site over budget included)."""
        return self._pool.peak

    def _help(self) -> bool:
        """Compute the newest queued site's statistics, codes and file on the calling thread, which would wait
        for the writer otherwise (the writer records it in its turn); False when there is none to take.

        On two cores that scale, the forward's thread waited for the writer for a third of a sentence
        transformer's run (docs/performance.md); the writer thread starts on the oldest site, so the two rarely
        meet on one."""
        # (the calling thread may be inside the forward, under the model's torch function modes and ours: the work
        # is the writer's, done as on its thread, where none applies; under a dispatch mode it is left to the writer)
        if self._error is not None or self._closed or torch._C._len_torch_dispatch_stack():
            return False
        job = None
        try:
            with self._lock:
                if not self._unclaimed:
                    return False
                job = self._unclaimed[-1]
                job.claimed = True
                self._unclaimed.pop()
            with torch._C.DisableTorchFunction():
                self._compute(job)
        except BaseException as exc:  # handed to the writer thread, which records the site and raises it
            if job is None:
                raise
            job.error = exc
        finally:
            if job is not None:  # (whatever happened: the writer thread waits for this before freeing its copies)
                job.computed.set()
        return True

    def _claim(self, job: _Job) -> bool:
        """Whether the writer thread computes ``job`` itself (False: a helping thread has taken it)."""
        with self._lock:
            if job.claimed:
                return False
            job.claimed = True
            if job in self._unclaimed:  # (by identity: eq=False)
                self._unclaimed.remove(job)
            return True

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.close()
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise error
            worded = write_error(error, Path(getattr(error, "filename", None) or self.target / TENSORS_DIR))
            if worded is not None:  # a full disk, a folder made read-only meanwhile
                raise worded from error
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
            mine = self._claim(job)
            try:
                if self._error is None and not self._closed:
                    if mine:
                        self._compute(job)
                    else:
                        job.computed.wait()
                    if job.error is not None:
                        raise job.error
                    self._record(job)
            except BaseException as exc:  # handed to the forward's thread
                self._error = exc
            finally:
                if not mine:  # (its copies stay in the pool's buffer until the helping thread is done)
                    job.computed.wait()
                job.tensors, job.quant_error, job.payload, job.error = {}, None, None, None
                if job.buffer is not None:
                    self._pool.give(job.buffer, job.nbytes)
                job.buffer = None

    def _scratch_of(self, name: str) -> Callable[[int], torch.Tensor]:
        """The calling thread's reusable byte buffer ``name``."""
        key = (threading.get_ident(), name)

        def get(nbytes: int) -> torch.Tensor:
            buf = self._scratch.get(key)
            if buf is None or buf.numel() < nbytes:
                buf = self._scratch[key] = torch.empty(-(-max(nbytes, 1) // ALIGN) * ALIGN, dtype=torch.uint8)
            return buf
        return get

    def _compute(self, job: _Job) -> None:
        """The part of storing a site that depends on that site alone: its statistics, its codes, its file and
        its deferred output quantization split (any thread, any order)."""
        stat_scratch = self._scratch_of("stat")
        if job.weight is not None:
            weight, version = job.weight
            if _version(weight) != version:
                raise _weight_changed(job.site.name)
            job.stats["weight"] = tensor_stat(weight)
        # (a same-input value's mean and variance are read by nothing: its extremes and NaN/Inf counts are)
        job.stats.update({k: tensor_stat(v, stat_scratch, moments=not k.startswith("same"))
                          for k, v in job.tensors.items()})
        payload = {k: v for k, v in job.tensors.items() if k not in job.stats_only}
        for key, (scale, qmin, qmax, dtype) in job.encode.items():
            codes = _encode(payload[key], scale, qmin, qmax, dtype, stat_scratch, self._scratch_of(f"codes:{key}"))
            if codes is not None:
                payload[key] = codes
                job.site.codes[key] = scale
        write_safetensors(self.dir / job.site.file, payload)
        # (codes live in a thread's scratch buffer, reused by its next site: only code-free payloads are held)
        job.payload = None if job.site.codes else payload
        if job.quant_error is not None:
            job.site.quant_error = job.quant_error()

    def _record(self, job: _Job) -> None:
        """The part of storing a site that later sites depend on, in queue order on the writer thread: the
        values held, the statistics that references read, the row stream's hook."""
        if job.payload is not None:
            self._hold(job, job.payload)
        self._stats_by_file[job.site.file] = job.stats
        self._site_by_file[job.site.file] = job.site
        if self.after_write is not None:
            job.site.stats = self._site_stats(job)  # (finish() sets the same again)
            values = {}
            for key in job.order:
                file, stored = job.site.refs.get(key, (job.site.file, key))
                if file == job.site.file and stored not in job.stats_only:
                    values[key] = job.tensors[stored]
                elif file != job.site.file and key.startswith("out"):
                    value = self._read_back(file, stored)
                    if value is not None:
                        values[key] = value
            self.after_write(job.site, values)

    def _hold(self, job: _Job, payload: dict[str, torch.Tensor]) -> None:
        """Keep the site's copies (as the file holds them: float values, no codes) while they fit in
        :attr:`hold_bytes`, if the site is small (:data:`HOLD_SITE_BYTES`)."""
        if not payload or job.site.codes or job.nbytes > HOLD_SITE_BYTES \
                or job.nbytes + self._held_bytes > self.hold_bytes \
                or any(payload[k] is not job.tensors[k] for k in payload):
            return
        self._held_bytes += job.nbytes
        # (copies of their own: the pool's buffer may be an earlier, larger site's, which holding would pin)
        self.held.update({(job.site.file, k): t.clone() for k, t in payload.items()})

    def _read_back(self, file: str, key: str) -> torch.Tensor | None:
        """Tensor ``key`` of an earlier site's file, as the reader returns it (codes decoded); None where only
        its statistics were kept."""
        site = self._site_by_file.get(file)
        if site is None or key in site.stats_only:
            return None
        with safe_open(str(self.dir / file), framework="pt") as f:
            t = f.get_tensor(key)
        if key in site.codes:
            t = t.to(torch.float32).mul_(torch.tensor(site.codes[key], dtype=torch.float32))
        return t

    def _site_stats(self, job: _Job) -> dict[str, TensorStat]:
        """The site's statistics in the trace's key order, references' from their stored copy."""
        stats = self._stats_by_file
        return {k: (stats[job.site.refs[k][0]][job.site.refs[k][1]] if k in job.site.refs else job.stats[k])
                for k in job.order}

    def _drain(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the writer thread (queued sites are dropped) and remove the staging folder's files: nothing
        half-written is left (the previous complete trace stays as it was)."""
        self._closed = True
        self._drain()
        self._pool.clear()
        self._scratch = {}
        remove_staging(self.dir)

    def finish(self, outputs: dict[str, torch.Tensor], input_digest: str = "", model_digest: str = "",
               folded: dict[str, str] | None = None) -> Path:
        """Save the model outputs and the index (``folded``: :attr:`TraceIndex.folded`); the trace is complete
        once this returns."""
        while self._help():  # (the forward is over: this thread computes queued sites instead of waiting)
            pass
        self._drain()
        self._raise_error()
        # (checked here as well, so that a weight changed after its op always fails, however early it was read)
        changed = next((job.site.name for job in self._jobs if job.weight is not None
                        and _version(job.weight[0]) != job.weight[1]), None)
        if changed is not None:
            self.close()
            raise _weight_changed(changed)
        self._stats_by_file = {job.site.file: job.stats for job in self._jobs}
        for job in self._jobs:
            job.site.stats = self._site_stats(job)
        self._jobs, self._stored, self._scratch, self._stats_by_file, self._site_by_file = [], {}, {}, {}, {}
        self._pool.clear()
        save_tensors(outputs, self.dir / OUTPUTS_FILE)
        index = TraceIndex(self.label, self.description, input_digest, list(outputs), self.sites, model_digest,
                           dict(folded or {}))
        try:
            atomic_write_text(self.dir / TRACE_FILE, index.to_json())
            swap_in(self.dir, self.target)
        except OSError as exc:  # (DiskFullError and NotWritableError are OSErrors too: the staging files go)
            remove_staging(self.dir)
            raise (write_error(exc, self.target / TRACE_FILE) or exc) from None
        return self.target / TRACE_FILE
