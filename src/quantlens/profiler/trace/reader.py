"""Reading a trace back (:class:`TraceReader`): its index, and each op site's tensors loaded on demand with
references followed and integer codes turned back into their float values."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from quantlens.errors import QuantLensError
from quantlens.profiler.trace.format import ALIGN, OUTPUTS_FILE, TRACE_FILE, TensorStat, TracedSite, TraceIndex

__all__ = ["TraceReader", "SiteTensors"]


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class TraceReader:
    """Reads a trace written by :class:`~.writer.TraceWriter`; also the same-input source of the analysis run.

    An op site that ran several times in the forward (a recurrent layer's time steps) has one entry per run, its
    *occurrences*, in ``sites``; ``by_name`` and every lookup by name alone give the last one, and the lookups
    that take an ``occurrence`` give the others (``occurrence`` indexes the site's runs as a list does: 0 is the
    first, -1 the last, -2 the one before; None is the last)."""

    def __init__(self, directory: str | os.PathLike, held: Mapping[tuple[str, str], torch.Tensor] | None = None):
        """``held``: values of this trace's files still in memory (the writer's :attr:`~.writer.TraceWriter.held`,
        by ``(file, key)``), read there instead of from the files until :meth:`drop_held`."""
        self.dir = Path(directory)
        self._held: Mapping[tuple[str, str], torch.Tensor] = held or {}
        path = self.dir / TRACE_FILE
        if not path.is_file():
            raise QuantLensError(
                f"No complete trace in {self.dir} ({TRACE_FILE} is missing). Call QuantAnalysis.run() first "
                "(run(run_baseline_model=True) for the baseline trace), and let it finish."
            )
        try:
            real = self._open(TRACE_FILE)
            self._stamp = _stamp(real)  # (before reading: a file replaced meanwhile is never taken as this one)
            index = TraceIndex.read(Path(real))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged JSON or entries of the wrong type
            raise QuantLensError(
                f"The trace in {self.dir} is damaged: {TRACE_FILE} cannot be read ({type(exc).__name__}: {exc}). "
                "Re-run QuantAnalysis.run() to write it again.") from None
        for site in index.sites:  # every file the index names stays inside the folder
            for name in {site.file, *(f for f, _ in site.refs.values())}:
                self._inside(name)
        self.label: str = index.model
        self.description: str = index.description
        self.output_names: list[str] = index.outputs
        self.input_digest: str = index.input_digest
        self.model_digest: str = index.model_digest
        self.folded: dict[str, str] = index.folded
        self.sites: list[TracedSite] = index.sites
        self.by_name: dict[str, TracedSite] = {s.name: s for s in self.sites}
        #: every occurrence of each site, in execution order
        self.occurrences: dict[str, list[TracedSite]] = {}
        for s in self.sites:
            self.occurrences.setdefault(s.name, []).append(s)
        self._by_file: dict[str, TracedSite] = {s.file: s for s in self.sites}

    def _inside(self, name: Any) -> Path:
        """The trace file ``name`` of the index: a plain relative name inside the folder, or a refusal."""
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
            raise QuantLensError(
                f"The trace in {self.dir} names the file {name!r}, which is not inside its folder; a trace only "
                "names its own files. Re-run QuantAnalysis.run() to write it again.")
        return self.dir / name

    def _open(self, name: str) -> str:
        """The path of trace file ``name``, checked: inside the folder (links followed) and a regular file (a
        FIFO or a device would block or stream forever)."""
        path = self._inside(name)
        try:
            real = path.resolve(strict=True)
            inside = real.is_relative_to(self.dir.resolve())
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise QuantLensError(f"The trace in {self.dir} lacks {name} ({exc.strerror}). Re-run "
                                 "QuantAnalysis.run() to write it again.") from None
        if not inside or not stat.S_ISREG(mode):
            raise QuantLensError(
                f"The trace in {self.dir}: {name} is {'a link out of the folder' if not inside else 'not a regular file'}"
                "; quantlens opens only the regular files of a trace folder. Re-run QuantAnalysis.run().")
        return str(real)

    def unchanged(self) -> bool:
        """Whether the folder's ``trace.json`` is still the very file this reader read (its device, inode, size and
        modification time): a reader can then stand for a fresh one (the tensor files are read on demand anyway)."""
        try:
            return _stamp(self._open(TRACE_FILE)) == self._stamp
        except QuantLensError:
            return False

    def occurrence_count(self, name: str) -> int:
        """How many times the op site ran in the traced forward (0: not in the trace)."""
        return len(self.occurrences.get(name, ()))

    def occurrence(self, name: str, occurrence: int | None = None) -> TracedSite | None:
        """The site's entry for one of its runs (see the class docstring), or None where it has no such run."""
        runs = self.occurrences.get(name)
        if not runs:
            return None
        if occurrence is None:
            return runs[-1]
        return runs[occurrence] if -len(runs) <= occurrence < len(runs) else None

    def tensors(self, name: str, occurrence: int | None = None) -> "SiteTensors":
        """The site's tensors by key (``in<pos>``, ``out<i>``, ``weight``, ``same<i>``, ``samepre<i>``), a
        mapping that loads each one when it is read (references resolved); of its last run unless ``occurrence``
        says which."""
        site = self.occurrence(name, occurrence)
        if site is None:
            raise KeyError(f"{name} (occurrence {occurrence})" if name in self.occurrences else name)
        return SiteTensors(self, site)

    def drop_held(self) -> None:
        """Read every tensor from the files from now on (frees the values held in memory)."""
        self._held = {}

    def _load(self, site: TracedSite, keys: list[str], copy: bool = False) -> list[torch.Tensor]:
        """The tensors ``keys`` of ``site``, references followed, each file opened once. A value held in memory is
        returned as it is, or as a copy with ``copy`` (for a caller that may change it in place: every call then
        gets its own tensor, as from a file)."""
        where: dict[str, list[tuple[int, str]]] = {}
        out: list[Any] = [None] * len(keys)
        for i, key in enumerate(keys):
            file, stored = site.refs.get(key, (site.file, key))
            held = self._held.get((file, stored))
            if held is not None:  # (the very values the writer stored and took the statistics of: no check)
                out[i] = held.clone() if copy else held
            else:
                where.setdefault(file, []).append((i, stored))
        for file, items in where.items():
            owner = self._by_file.get(file)
            codes = owner.codes if owner is not None else {}
            missing = [stored for _, stored in items if owner is not None and stored in owner.stats_only]
            if missing == ["weight"]:
                raise QuantLensError(f"The trace in {self.dir} keeps only the statistics of the weight of op site "
                                     f"'{owner.name}' (a trace does not copy a model's weights): read the weight "
                                     "from the model itself, e.g. its state_dict().")
            if missing:
                where = (f"the site is fused into '{owner.fused_into}', whose output is the group's value. Read that "
                         "site's tensors instead." if owner.fused_into else
                         "the trace was made for a comparison with a model that fuses this op site into a larger "
                         "op, where nothing reads its value. Trace this model again for this comparison: "
                         "QuantAnalysis.run() (with run_baseline_model=True).")
                raise QuantLensError(f"The trace in {self.dir} keeps only the statistics of '{missing[0]}' at op site "
                                     f"'{owner.name}': {where}")
            try:
                handle = safe_open(self._open(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise QuantLensError(f"The trace in {self.dir}: {file} cannot be read ({exc}). Re-run "
                                     "QuantAnalysis.run() to write it again.") from None
            with handle as f:
                for i, stored in items:
                    try:
                        t = f.get_tensor(stored)
                    except (SafetensorError, KeyError) as exc:
                        raise QuantLensError(f"The trace in {self.dir}: {file} has no tensor '{stored}' ({exc}). "
                                             "Re-run QuantAnalysis.run() to write it again.") from None
                    if stored in codes:  # integer codes on the site's grid: exactly the float32 values stored
                        t = t.to(torch.float32).mul_(torch.tensor(codes[stored], dtype=torch.float32))
                    elif t.data_ptr() % ALIGN:
                        # the same alignment wherever the tensor lies in its file: a GEMM re-run on it (the
                        # same-input run) may round differently on differently aligned memory
                        t = t.clone()
                    self._check_recorded(t, site.stats.get(keys[i]), file, stored)
                    out[i] = t
        return out

    def _check_recorded(self, t: torch.Tensor, stat: TensorStat | None, file: str, stored: str) -> None:
        """Refuse a tensor that is not the one ``trace.json`` recorded: another shape or dtype, or other extremes
        (a file swapped with another site's, damaged data, a changed code scale); exact, as the writer computed
        the statistics from the very values it stored."""
        if stat is None:
            return
        found = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
        same = found == (stat.shape, stat.dtype)
        if same and t.is_floating_point() and t.numel() and stat.min is not None and not stat.nonfinite:
            lo, hi = torch.aminmax(t.reshape(-1))
            same = (float(lo), float(hi)) == (stat.min, stat.max)
            found = (*found, f"range [{float(lo)}, {float(hi)}]")
        if not same:
            raise QuantLensError(
                f"The trace in {self.dir}: {file} holds a tensor '{stored}' ({', '.join(map(str, found))}) other than "
                f"the one {TRACE_FILE} recorded ({stat.shape}, {stat.dtype}, range [{stat.min}, {stat.max}]): the "
                "file was damaged or does not belong to this trace. Re-run QuantAnalysis.run() to write it again.")

    def inputs(self, site: str, occurrence: int | None = None) -> dict[int, torch.Tensor] | None:
        """The site's incoming float and index tensors by leaf position (loads only those), of its last run unless
        ``occurrence`` says which; None for a site or run the trace does not have."""
        s = self.occurrence(site, occurrence)
        if s is None:
            return None
        keys = [k for k in s.stats if k.startswith("in") and not self._stats_only(s, k)]
        # (copies: the same-input run feeds them to the other model's op, which may work in place)
        return {int(k[2:]): t for k, t in zip(keys, self._load(s, keys, copy=True))}

    def _stats_only(self, site: TracedSite, key: str) -> bool:
        """Whether only the statistics of ``key`` are kept (references followed): an input a fused group's member
        takes from another member, in a baseline traced for a model that fuses them (see ``TracedSite``)."""
        file, stored = site.refs.get(key, (site.file, key))
        owner = self._by_file.get(file)
        return owner is not None and stored in owner.stats_only

    def outputs(self) -> dict[str, torch.Tensor]:
        try:
            return load_file(self._open(OUTPUTS_FILE))
        except (SafetensorError, OSError) as exc:
            raise QuantLensError(f"The trace in {self.dir}: {OUTPUTS_FILE} cannot be read ({exc}). Re-run "
                                 "QuantAnalysis.run() to write it again.") from None

    def site_outputs(self, site: str, occurrence: int | None = None) -> list[torch.Tensor] | None:
        """The site's output tensors (``out0``, ``out1`` ...) of its last run unless ``occurrence`` says which, or
        None for a site or run the trace does not have."""
        s = self.occurrence(site, occurrence)
        if s is None:
            return None
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
