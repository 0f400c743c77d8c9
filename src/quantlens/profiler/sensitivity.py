"""``sensitivity``: rank the quantized ops by how much each one alone changes each model output.

* ``fake_quant``: every fake quant of the analysis model is switched off (it computes the float model), then
  each op site's activation quantization (its input and output fake quants), and separately its weight
  quantization, is switched on alone; the outputs are compared with the baseline's.
* ``pre_export``: every lookup table is switched off, then one at a time on. Each table's row also carries its
  own error: the table run on the baseline's inputs to that table on the bad case, against the baseline's output
  there, in output quantization steps (``table_error_max_steps``, ``table_error_hist``:
  ``0:n|1:n|2:n|3-4:n|5-8:n|>8:n``).

During the ablation, index-producing ops (``topk``, ``sort``, ``max``/``min`` with a dim, ``argmax``...) take the
baseline's indices (:mod:`.index_ops`), so that an index flip does not swamp the metric.

Non-finite values: a baseline whose outputs hold NaN/Inf on the bad case is refused (a ``QuantLensError`` naming
the outputs and the first op sites whose baseline output is non-finite). A quantizer that alone makes the
analysis outputs non-finite keeps its row, with the metric's NaN/Inf value, sorted first (NaN sorts as most
sensitive); the sensitive-op qconfig setters skip such rows with a warning.

**Shared ablations.** On a model with several outputs (multi-task heads, detection branches), quantizers whose
effects reach disjoint sets of outputs are switched on together in one cached forward: each output is reached by
at most one of them, so it takes that quantizer's value and the other quantizers of the forward get the all-off
value there, exactly what their own forwards would give. The grouping is planned from the reference forward's
data flow (:meth:`.ablation.torch_cache.TorchAblationCache.reached`); every shared forward then tracks which
quantizers actually reached each output (:meth:`~.ablation.torch_cache.TorchAblationCache.taint`), and where
one was reached by two of them, or by what cannot be told, its quantizers run one by one. The tables are those of
one forward per quantizer.

The result is a sequence of tables, one per (output, metric), most sensitive first. It is exactly the
sensitivity-table format of ``docs/quantization.md``: pass it (or one table of it) unchanged to
``sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(table, topk=k)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from quantlens._finite import all_finite
from quantlens.errors import QuantLensError
from quantlens.profiler.keyed_tables import KeyedTables
from quantlens.profiler.lsb import LSB_BUCKETS
from quantlens.profiler.metrics import get_metric
from quantlens.profiler.model_access import AnalysisType, ModelAccess, SiteEvent
from quantlens.profiler.outputs import PostProcess, float_outputs, named_outputs
from quantlens.profiler.progress import progress_iter

__all__ = ["SensitivityRow", "SensitivityTable", "SensitivityResult", "IndexRecorder", "run_sensitivity",
           "sensitivity_setup", "ablate_one", "ablation_runner", "build_result"]

#: private switch: False runs every ablation as one full forward (the old path; the cache tests compare with it)
_USE_CACHE = True


@dataclass(frozen=True)
class SensitivityRow:
    """One quantizer's effect on one output (the fields of the sensitivity-table format)."""

    op_name: str
    sensitive_type: str  # "activation", "weight" or "lut"
    op_type: str
    metric: str
    value: float
    quant_dtype: str
    #: ``pre_export`` (``lut`` rows): the table's own error on the bad case's inputs to it, ``|baseline output -
    #: table output| / output scale`` rounded to whole steps: its maximum and its histogram
    #: ``0:n|1:n|2:n|3-4:n|5-8:n|>8:n`` (None / "" where not measured: other types, a table without a
    #: per-tensor output scale)
    table_error_max_steps: float | None = None
    table_error_hist: str = ""

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.sensitive_type != "lut":  # the sensitivity-table format of the other types is unchanged
            del out["table_error_max_steps"], out["table_error_hist"]
        return out


class SensitivityTable(Sequence[SensitivityRow]):
    """Rows for one model output under one metric, most sensitive first (or least, with ``reverse``)."""

    def __init__(self, output: str, metric: str, rows: list[SensitivityRow]):
        self.output = output
        self.metric = metric
        self.rows = rows

    @property
    def key(self) -> str:
        return f"{self.output}_{self.metric}"

    def __getitem__(self, item):
        return self.rows[item]

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"SensitivityTable(output={self.output!r}, metric={self.metric!r}, rows={len(self.rows)})"


class SensitivityResult(KeyedTables, Sequence[SensitivityTable]):
    """One :class:`SensitivityTable` per model output; index by position or by ``"<output>_<metric>"``.

    Being a sequence of tables, it is also a valid "list of tables" for the sensitive-op qconfig setters
    (the union of each table's top rows is promoted).
    """

    def __init__(self, tables: list[SensitivityTable]):
        self.tables = tables


class IndexRecorder:
    """A trace sink that keeps the integer outputs of index-producing ops (the baseline's choices), and the op
    sites whose float output holds NaN/Inf (``nonfinite``, in execution order)."""

    wants_index_ops = True

    def __init__(self, keep_inputs: frozenset[str] = frozenset()):
        self.indices: dict[str, list[torch.Tensor]] = {}
        self.nonfinite: list[str] = []
        #: the sites whose incoming float tensors and outputs are kept (``pre_export``'s tables)
        self.keep_inputs = keep_inputs
        self.site_inputs: dict[str, dict[int, torch.Tensor]] = {}
        self.site_outputs: dict[str, list[torch.Tensor]] = {}
        #: op site -> (max steps, histogram) of a table's own error (filled by :func:`sensitivity_setup`)
        self.table_errors: dict[str, tuple[float | None, str]] = {}

    def inputs(self, site: str) -> dict[int, torch.Tensor] | None:  # a SameInputSource for the kept sites
        return self.site_inputs.get(site)

    def on_site(self, event: SiteEvent) -> None:
        if event.name not in self.nonfinite and not all(all_finite(t) for t in event.outputs):
            self.nonfinite.append(event.name)
        if event.index_producing:
            self.indices[event.name] = [t.detach().clone() for t in event.outputs if not t.is_floating_point()]
        if event.name in self.keep_inputs and event.name not in self.site_inputs:
            self.site_inputs[event.name] = {k: t.detach().clone() for k, t in event.inputs.items()}
            self.site_outputs[event.name] = [t.detach().clone() for t in event.outputs]


class _TableErrors:
    """Sink of the analysis (pre_export) forward whose tables run on the baseline's inputs: each table's own
    error in output steps."""

    def __init__(self, recorder: IndexRecorder):
        self.recorder = recorder

    def on_site(self, event: SiteEvent) -> None:
        rec = self.recorder
        if event.name not in rec.keep_inputs or event.name in rec.table_errors:
            return
        base = [t for t in rec.site_outputs.get(event.name, []) if t.is_floating_point()]
        same = [t for t in (event.same_input or []) if t.is_floating_point()]
        scale = event.scale
        if not base or len(base) != len(same) or scale is None or scale.numel() != 1 or float(scale) <= 0 or \
                any(x.shape != y.shape for x, y in zip(base, same)):
            rec.table_errors[event.name] = (None, "")
            return
        x = torch.cat([t.detach().double().reshape(-1) for t in base])
        y = torch.cat([t.detach().double().reshape(-1) for t in same])
        if not (all_finite(x) and all_finite(y)):
            rec.table_errors[event.name] = (math.nan, "")
            return
        steps = torch.round((x - y).abs() / float(scale))
        counts = [int(((steps >= lo) & (steps <= hi)).sum()) for _, lo, hi in LSB_BUCKETS]
        rec.table_errors[event.name] = (float(steps.max()) if steps.numel() else 0.0,
                                        "|".join(f"{label}:{n}" for (label, _, _), n in zip(LSB_BUCKETS, counts)))


def _refuse_nonfinite_baseline(base: dict[str, torch.Tensor], sites: list[str]) -> None:
    """A baseline output with NaN/Inf makes every metric NaN: no ranking can be read from it, so refuse."""
    bad = [name for name, t in base.items() if not all_finite(t)]
    if not bad:
        return
    where = (f" The first op site whose output is non-finite in the baseline is '{sites[0]}'"
             + (f" (then {', '.join(repr(s) for s in sites[1:4])}{' ...' if len(sites) > 4 else ''})" if sites[1:]
                else "") + "." if sites else
             " No op site output is non-finite, so the post-processing (or the model's own output code) makes it.")
    raise QuantLensError(
        f"sensitivity(): the baseline model's output(s) {bad} hold NaN/Inf on the bad case, so every quantizer's "
        f"metric would be NaN and the ranking meaningless.{where} Fix the baseline model or pick a bad case on which "
        "it is finite (qa.set_bad_case(...)); run() + compare_per_layer() still trace the non-finite values (the "
        "nan_inf advisor rule names the op where they appear)."
    )


def run_sensitivity(
    baseline: ModelAccess,
    analysis: ModelAccess,
    analysis_type: AnalysisType,
    example: Any,
    post_process: PostProcess,
    metric: str = "L1",
    reverse: bool = False,
    progress: bool = True,
) -> SensitivityResult:
    """One ablation forward per quantizer, from the ablation cache where the model allows (:mod:`.ablation`:
    only the op sites that depend on the quantizer are computed); see the module docstring."""
    m = get_metric(metric)
    base, recorder, quantizers = sensitivity_setup(baseline, analysis, analysis_type, example, post_process)
    per_quantizer: dict[int, dict[str, float]] = {}
    with analysis.ablation(analysis_type) as enable:
        runner = ablation_runner(analysis, analysis_type, example, recorder)
        plan = AblationPlan(analysis, enable, runner, quantizers, range(len(quantizers)), example, post_process,
                            recorder, base, m)
        for group in progress_iter(plan.groups, f"sensitivity ({m.name})", total=len(quantizers),
                                   enabled=progress, steps=len):
            per_quantizer.update(plan.ablate(group))
    values = {name: [per_quantizer[i][name] for i in range(len(quantizers))] for name in base}
    return build_result(quantizers, values, m, reverse, recorder.table_errors)


class AblationPlan:
    """The ablation forwards of some of the quantizers (``indices``, in execution order): ``groups`` of indices
    that share one forward (:class:`_Shared`: their effects reach disjoint outputs) or run alone, and
    ``ablate(group)``, each one's values per output. The single-process and the sharded sensitivity both run
    their quantizers through it (a shard plans over its own quantizers)."""

    def __init__(self, analysis, enable, runner, quantizers: list, indices, example: Any,
                 post_process: PostProcess, recorder: IndexRecorder, base: dict[str, torch.Tensor], m):
        self.analysis, self.enable, self.runner, self.example = analysis, enable, runner, example
        self.post_process, self.recorder, self.base, self.m = post_process, recorder, base, m
        self.indices = list(indices)
        self.quantizers = [quantizers[i] for i in self.indices]
        self.shared = _Shared.plan(runner, self.quantizers, post_process, base, m) if self.indices else None
        local = self.shared.groups if self.shared is not None else [[k] for k in range(len(self.indices))]
        self.groups = [[self.indices[k] for k in group] for group in local]
        self._local = {i: k for k, i in enumerate(self.indices)}

    def ablate(self, group: list[int]) -> dict[int, dict[str, float]]:
        local = [self._local[i] for i in group]
        done = self.shared.ablate(self.enable, local, self.post_process, self.base) if len(local) > 1 else None
        if done is None:
            done = {k: ablate_one(self.analysis, self.enable, self.quantizers[k], self.example, self.post_process,
                                  self.recorder, self.base, self.m, self.runner) for k in local}
        return {self.indices[k]: values for k, values in done.items()}


#: at most this many quantizers share one ablation forward
MAX_SHARED = 8


class _Shared:
    """Shared ablation forwards (see the module docstring): the plan, and one group's forward with its check."""

    def __init__(self, runner, quantizers: list, groups: list[list[int]], reference: dict[str, float], m):
        self.runner, self.quantizers, self.groups, self.reference, self.m = runner, quantizers, groups, reference, m

    @classmethod
    def plan(cls, runner, quantizers: list, post_process: PostProcess, base: dict[str, torch.Tensor], m):
        """Groups of quantizer indices whose planned output sets are disjoint (execution order kept within a
        group), or None where the ablations cannot share (no cached runner, one output)."""
        inner = getattr(runner, "inner", None)
        if inner is None or not hasattr(inner, "run_shared") or len(base) < 2:
            return None
        named = float_outputs(post_process.outputs(inner.reference))
        model_named = named_outputs(inner.reference)
        producers = {name: (inner.producer(t) if model_named.get(name) is t else None) for name, t in named.items()}
        if set(named) != set(base):
            return None
        every = frozenset(named)
        reach = []
        for q in quantizers:
            keys = inner.reached(q)
            reach.append(frozenset(n for n, p in producers.items() if p is None or p in keys) if keys else every)
        groups: list[list[int]] = []
        used: list[set[str]] = []
        for i, outs in enumerate(reach):
            slot = next((g for g, u in enumerate(used) if len(groups[g]) < MAX_SHARED and not (u & outs)), None) \
                if outs != every else None
            if slot is None:
                groups.append([i])
                used.append(set(outs))
            else:
                groups[slot].append(i)
                used[slot] |= outs
        if all(len(g) == 1 for g in groups):
            return None
        with torch.no_grad():
            reference = {name: m(base[name], t) for name, t in named.items()}
        return cls(runner, quantizers, groups, reference, m)

    def ablate(self, enable, group: list[int], post_process: PostProcess,
               base: dict[str, torch.Tensor]) -> dict[int, dict[str, float]] | None:
        """The group's values per quantizer from one forward, or None (run them one by one): the cache gave
        up, or an output was reached by two of them or by what cannot be told."""
        from quantlens.profiler.ablation.base import CacheUnusable

        inner = self.runner.inner
        if inner is None:
            return None
        qs = [self.quantizers[i] for i in group]
        for q in qs:
            enable(q, True)
        try:
            try:
                raw = inner.run_shared(qs)
            except CacheUnusable:
                self.runner.inner = None  # as _Runner does: full forwards from now on
                return None
            named = float_outputs(post_process.outputs(raw))
            model_named = named_outputs(raw)
            leaves = [inner.taint(t) for t in model_named.values()]
            everything = None if any(t is None for t in leaves) else frozenset().union(*leaves)
            taints = {name: inner.taint(t) if model_named.get(name) is t else everything
                      for name, t in named.items()}
        finally:
            for q in qs:
                enable(q, False)
        if set(named) != set(base) or any(t is None or len(t) > 1 for t in taints.values()):
            return None
        out = {}
        for pos, i in enumerate(group):
            out[i] = {name: (self.m(base[name], named[name]) if taints[name] == {pos} else self.reference[name])
                      for name in base}
        return out


def sensitivity_setup(baseline: ModelAccess, analysis: ModelAccess, analysis_type: AnalysisType, example: Any,
                      post_process: PostProcess) -> tuple[dict[str, torch.Tensor], IndexRecorder, list]:
    """The baseline's outputs (refused when non-finite), its index recorder and the analysis quantizers. For
    ``pre_export`` the recorder also holds each table's own error (``table_errors``): one more analysis forward,
    every table on (as in its ablation), in which every table site runs on the baseline's inputs to it."""
    quantizers = analysis.quantizers(analysis_type)
    if not quantizers:
        what = "lookup tables" if analysis_type is AnalysisType.PRE_EXPORT else "fake quants"
        raise QuantLensError(f"sensitivity(): the analysis model has no {what} to rank.")
    tables = frozenset(q.op_name for q in quantizers if q.sensitive_type == "lut")
    recorder = IndexRecorder(tables if analysis_type is AnalysisType.PRE_EXPORT else frozenset())
    base = float_outputs(post_process.outputs(baseline.run(example, sink=recorder)))
    _refuse_nonfinite_baseline(base, recorder.nonfinite)
    if recorder.keep_inputs:
        # every table on, as each is in its ablation (one the user switched off too); restored on exit
        with analysis.ablation(analysis_type) as enable:
            for q in quantizers:
                enable(q, True)
            try:
                analysis.run(example, sink=_TableErrors(recorder), same_input=recorder)
            finally:
                for q in quantizers:
                    enable(q, False)
        recorder.site_inputs.clear()  # only the small histograms stay
        recorder.site_outputs.clear()
    return base, recorder, quantizers


def ablation_runner(analysis: ModelAccess, analysis_type: AnalysisType, example: Any, recorder: IndexRecorder):
    """The cached ablation forwards (:mod:`.ablation`) of the analysis model, or None (every ablation a full
    forward). Call it inside ``analysis.ablation(...)`` before any quantizer is switched on: it runs the reference
    forward. A ``run`` replaced on the access instance (a wrapper that counts or interrupts forwards) keeps every
    ablation going through it: no cache then."""
    if not _USE_CACHE or "run" in vars(analysis):
        return None
    factory = getattr(analysis, "ablation_cache", None)
    return _Runner(factory(analysis_type, example, recorder.indices)) if factory is not None else None


class _Runner:
    """Runs ablations from the cache until it reports a cached value changed in place (then full forwards)."""

    def __init__(self, inner):
        self.inner = inner

    def run(self, q, full):
        if self.inner is not None:
            from quantlens.profiler.ablation.base import CacheUnusable

            try:
                return self.inner.run(q)
            except CacheUnusable:
                self.inner = None
        return full()


def ablate_one(analysis: ModelAccess, enable, q, example: Any, post_process: PostProcess, recorder: IndexRecorder,
               base: dict[str, torch.Tensor], m, runner: "_Runner | None" = None) -> dict[str, float]:
    """Switch quantizer ``q`` on alone, run the analysis model once (from ``runner``'s cache when given), and
    return the metric value per output."""
    enable(q, True)
    try:
        def full():
            return analysis.run(example, indices=recorder.indices)

        raw = runner.run(q, full) if runner is not None else full()
        out = float_outputs(post_process.outputs(raw))
    finally:
        enable(q, False)
    values = {}
    for name in base:
        if name not in out:
            raise QuantLensError(
                f"sensitivity(): output '{name}' disappeared when {q.sensitive_type} quantization of "
                f"'{q.op_name}' was switched on; both models must return the same outputs."
            )
        values[name] = m(base[name], out[name])
    return values


def build_result(quantizers: list, values: dict[str, list[float]], m, reverse: bool,
                 table_errors: dict[str, tuple[float | None, str]] | None = None) -> SensitivityResult:
    """One table per output from the values in quantizer (execution) order; ``table_errors`` (op site ->
    (max steps, histogram)) fills the ``lut`` rows' table error columns."""
    table_errors = table_errors or {}
    tables = []
    for name, vals in values.items():
        # Stable sort: ties keep execution order, so the table is deterministic.
        order = sorted(range(len(quantizers)), key=lambda i: m.sort_key(vals[i]))
        if reverse:
            order.reverse()
        rows = [SensitivityRow(quantizers[i].op_name, quantizers[i].sensitive_type, quantizers[i].op_type,
                               m.name, vals[i], quantizers[i].quant_dtype,
                               *(table_errors.get(quantizers[i].op_name, (None, ""))
                                 if quantizers[i].sensitive_type == "lut" else (None, ""))) for i in order]
        tables.append(SensitivityTable(name, m.name, rows))
    return SensitivityResult(tables)
