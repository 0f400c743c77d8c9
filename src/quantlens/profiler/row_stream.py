"""The rows of ``compare_per_layer()`` computed while the analysis model runs (issue #25).

``run()`` traces the baseline, then the analysis model; the analysis trace's writer thread stores each op site while
the forward goes on. A :class:`RowStream` is that writer's ``after_write`` hook: with the site's tensors still in
memory and the baseline's trace on disk, it computes the site's row with the very function ``compare_per_layer()``
uses (:func:`~quantlens.profiler.compare.site_row`), on the thread that is otherwise idle at one torch thread. So
most of the comparison's arithmetic is done by the time ``run()`` returns, and ``compare_per_layer()`` only reads
the rows back, as long as both traces are still the very files they came from: the same folders, the same
``trace.json`` bytes, and every tensor file as it was written (name, size, inode, mtime: a file replaced, damaged
or copied elsewhere is read again, and refused there when it is not a trace's).

A row reads the baseline's values of its op back from disk (float32, 4 bytes per element) and goes through both
sides a chunk at a time (:mod:`~quantlens.profiler.pair_sums`): no float64 copy of an activation. On the writer
thread that read-back adds to the forward's memory, so a site whose outputs would take more than :data:`ROW_BYTES`
to read back is left to ``compare_per_layer()``, which computes it after the forward, when the forward's memory is
free: tracing stays within a few layers' worth of memory however large the activations
(``benchmarks/bench_profiler.py``).

A site is also left to ``compare_per_layer()`` when a value its row reads is kept as statistics only, when its
name runs more than once (recurrent steps: the row is the last run's), or when computing it fails (the same call
then reports the error in ``compare_per_layer()``, on the caller's thread). An output held by an earlier site's
file (an identity op's) is read back from that file, as the comparison reads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from quantlens.errors import QuantLensError
from quantlens.profiler.compare import site_row
from quantlens.profiler.compare_cache import trace_digest
from quantlens.profiler.layer_row import LayerRow
from quantlens.profiler.trace.format import OUTPUTS_FILE, TENSORS_DIR, TracedSite
from quantlens.profiler.trace.reader import TraceReader

__all__ = ["RowStream", "ROW_BYTES"]

#: the most memory a row computed during the forward may read back (its baseline values: :data:`_ROW_BYTES_PER`
#: bytes per output element, 2 MiB: outputs of up to 512 Ki elements); a larger row is computed by
#: compare_per_layer() after the forward. Measured (docs/performance.md): on large activations the writer thread
#: is already the forward's bottleneck, so their rows cost run() what they save compare_per_layer(), and their
#: read-back adds to the forward's peak memory
ROW_BYTES = 2 * 1024 * 1024
_ROW_BYTES_PER = 4


class RowStream:
    """Computes each analysis site's row as the trace writer stores it (see the module docstring)."""

    def __init__(self, base: TraceReader, deployed: bool):
        self.base, self.deployed = base, deployed
        self._rows: dict[int, LayerRow] = {}  # by analysis site index
        self._heads: dict[str, TracedSite] = {}  # a fused group's last op -> its first member (compare_traces')
        self._seen: set[str] = set()
        self._written: tuple | None = None  # what the two finished traces are on disk (:func:`_on_disk`)

    def __call__(self, site: TracedSite, tensors: Mapping[str, torch.Tensor]) -> None:
        """The writer thread's hook: ``tensors`` are the site's values as its files hold them (see
        :attr:`~quantlens.profiler.trace.writer.TraceWriter.after_write`)."""
        if site.fused_into:
            self._heads.setdefault(site.fused_into, site)
        if site.name in self._seen:  # a repeated site: its row is its last run's, which compare computes
            return
        self._seen.add(site.name)
        b = self.base.by_name.get(site.name)
        if b is None or any(k not in tensors for k in site.stats if k.startswith(("out", "same"))):
            return
        if sum(t.numel() for k, t in tensors.items() if k.startswith("out")) * _ROW_BYTES_PER > ROW_BYTES:
            return  # too large to compute beside the forward (see the module docstring)
        try:
            self._rows[site.index] = site_row(self.base, b, site, tensors, self.deployed,
                                              self._heads.get(site.name, site))
        except (QuantLensError, RuntimeError, ValueError, KeyError):
            return  # compare_per_layer() computes this row again and reports the error there

    def seal(self, analysis: TraceReader) -> None:
        """Tie the rows to the two finished traces (called once the analysis trace is complete)."""
        self._written = (_on_disk(self.base), _on_disk(analysis))

    def rows_for(self, base: TraceReader, analysis: TraceReader) -> dict[int, LayerRow]:
        """The rows computed from these very trace files (none when either folder is another or changed since)."""
        if self._written is None or self._written != (_on_disk(base), _on_disk(analysis)):
            return {}
        return dict(self._rows)


def _on_disk(trace: TraceReader) -> tuple:
    """The trace as its files are: the folder, ``trace.json``'s digest, and each tensor file's name, type, size,
    inode and modification time (stat calls only: a file written again or swapped in differs)."""
    folder = Path(trace.dir).resolve()
    files = []
    try:
        for path in [folder / OUTPUTS_FILE, *sorted((folder / TENSORS_DIR).iterdir())]:
            st = os.lstat(path)
            files.append((path.name, st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns))
        return str(folder), trace_digest(trace), tuple(files)
    except OSError:  # a folder changed beyond reading: equal to nothing, so the comparison reads (and refuses) it
        return str(folder), object()
