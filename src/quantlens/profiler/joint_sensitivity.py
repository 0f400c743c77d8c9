"""``joint_sensitivity``: sensitivity beyond one quantizer at a time: one op at a time, pairs, and how much of the
model's error the top rows explain.

``sensitivity()`` switches one quantizer on with all others off, so it cannot see a cause that needs two at once:
a conv/linear bias is int32 at ``s_in * s_w[c]`` only when the input's fake quant and the weight's are both on
(an overflowing bias never shows in either row), and two changes that are each harmless can be severe together
(a ReLU's dead zone hides either shift, not both). Every value below is one forward of the analysis model with a
set of quantizers on and every other one off, compared with the baseline by the metric, per output:

* **quantizer rows**: one quantizer, exactly ``sensitivity()``'s values (the same ablation forwards);
* **op rows** (``sensitive_type="op"``): every quantizer one op depends on as its integer kernel sees it, on
  together (:mod:`.op_units`: its activation and weight quantizers, those of its fused group, and the output
  quantizers of the ops that feed it, so the bias is quantized as in the kernel). ``pre_export``/``export``/
  ``convert`` have one quantizer per op: their op rows are the quantizer rows, reused;
* **pair rows** (``sensitive_type="pair"``): for each output, the candidates are the top ``pairs`` rows of its
  quantizer ranking and of its op ranking (the same quantizer set once), and every two candidates with no
  quantizer in common run together (at most ``C(2 * pairs, 2)`` forwards per output; each table lists every pair
  that ran). A pair row holds the joint value, the two single values and the **interaction**.

**Effect, interaction, share.** ``r`` is the metric with every quantizer off (the all-off value: about 0 for L1,
1 for Cosine). A value ``v``'s *effect* is how much worse than ``r`` it is: ``v - r`` for a metric where higher is
worse, ``r - v`` where lower is (Cosine, SQNR). Then

    interaction(a, b) = effect(a + b) - effect(a) - effect(b)

positive when the pair does more harm than its two parts added, negative when their errors cancel. (For L1 with
``r = 0`` it is ``joint - single_a - single_b``.) The model's **total** is the value with every quantizer on (the
analysis model as is); a row's **share** is ``effect(row) / effect(total)`` (None where the total effect is not
positive or a value is not finite: SQNR's all-off value is +inf when the all-off model equals the baseline, so
use L1, MSE or Cosine here). Shares need not add up to 1, and a share may pass 1 (other quantizers' errors cancel
part of a row's): the metrics are not additive. Under MSE uncorrelated errors add, so two independent quantizers
interact by about 0; under L1 they interact slightly negatively (``|e1 + e2| <= |e1| + |e2|``): a clearly
positive interaction is the signal either way.

**The flag.** Each table reports the share of its top quantizer row, op row and pair row. When the best single
row (one quantizer or one op) explains less than ``share_threshold`` (default 0.5) of the total, ``small_share``
is set and ``warning`` says so: the error comes from several quantizers together; see the pair rows.
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantlens._io import atomic_write_text
from quantlens.errors import QuantLensError
from quantlens.profiler.formatting import fmt
from quantlens.profiler.keyed_tables import KeyedTables
from quantlens.profiler.metrics import Metric, get_metric
from quantlens.profiler.model_access import AnalysisType, ModelAccess
from quantlens.profiler.op_units import AblationUnit, op_units, quantizer_units
from quantlens.profiler.outputs import PostProcess, float_outputs
from quantlens.profiler.progress import progress_iter
from quantlens.profiler.report import TEXT_WIDTH, safe_name, save_pt, wrap_table
from quantlens.profiler.sensitivity import (
    AblationPlan,
    SensitivityResult,
    ablation_runner,
    build_result,
    sensitivity_setup,
)

__all__ = ["JointRow", "JointTable", "JointSensitivityResult", "run_joint_sensitivity", "write_joint_sensitivity"]


@dataclass(frozen=True)
class JointRow:
    """One ablation unit's (or pair's) effect on one output."""

    op_name: str  # the op site; a pair: "<first label> + <second label>"
    sensitive_type: str  # "activation", "weight", "lut" (one quantizer), "op" or "pair"
    op_type: str
    metric: str
    value: float  # the metric with the unit's quantizers on and every other one off
    effect: float  # how much worse than the all-off value (see the module docstring)
    share: float | None  # effect / the total effect
    #: the quantizers switched on, as "<op site>:<sensitive_type>"
    members: tuple[str, ...]
    quant_dtype: str = ""
    #: pair rows: the two units ("conv1:weight", "conv1:op"), their own values, and the interaction
    first: str = ""
    second: str = ""
    value_first: float | None = None
    value_second: float | None = None
    interaction: float | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["members"] = list(self.members)
        return out


@dataclass(frozen=True)
class JointTable:
    """The joint sensitivity of one model output under one metric: its three rankings, most sensitive first."""

    output: str
    metric: str
    reference: float  # every quantizer off
    total: float  # every quantizer on
    total_effect: float
    quantizer_rows: tuple[JointRow, ...]
    op_rows: tuple[JointRow, ...]
    pair_rows: tuple[JointRow, ...]
    #: the share of the model's error the top row of each ranking explains (None: not defined, no rows)
    quantizer_share: float | None
    op_share: float | None
    pair_share: float | None
    #: the best single row's share (the larger of quantizer_share and op_share), and whether it is small
    explained_share: float | None
    small_share: bool
    warning: str  # "" unless small_share
    op_note: str = ""  # set where the op rows are the quantizer rows (one quantizer per op)

    @property
    def key(self) -> str:
        return f"{self.output}_{self.metric}"

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.endswith("_rows")}
        for kind in ("quantizer_rows", "op_rows", "pair_rows"):
            out[kind] = [r.to_dict() for r in getattr(self, kind)]
        return out


@dataclass(frozen=True)
class JointSensitivityResult(KeyedTables):
    """One :class:`JointTable` per model output (index by position or ``"<output>_<metric>"``), and the plain
    per-quantizer tables (``sensitivity``: what ``sensitivity()`` returns, for the sensitive-op setters)."""

    tables: tuple[JointTable, ...]
    sensitivity: SensitivityResult
    pairs: int
    share_threshold: float


class _SetRunner:
    """Forwards with a set of quantizers on (every other one off): from the ablation cache's forward with several
    quantizers on where there is one (``run_shared``), else a full forward."""

    def __init__(self, analysis: ModelAccess, enable, runner, quantizers: list, example: Any,
                 post_process: PostProcess, recorder, base: dict, m: Metric):
        self.analysis, self.enable, self.runner, self.quantizers = analysis, enable, runner, quantizers
        self.example, self.post_process, self.recorder, self.base, self.m = example, post_process, recorder, base, m

    def __call__(self, members: frozenset[int], full: bool = False) -> dict[str, float]:
        from quantlens.profiler.ablation.base import CacheUnusable

        qs = [self.quantizers[i] for i in sorted(members)]
        for q in qs:
            self.enable(q, True)
        try:
            raw = None
            inner = getattr(self.runner, "inner", None) if not full else None
            if inner is not None and qs:
                try:
                    raw = inner.run_shared(qs) if len(qs) > 1 else inner.run(qs[0])
                except CacheUnusable:
                    self.runner.inner = None  # as the single ablations do: full forwards from now on
            if raw is None:
                raw = self.analysis.run(self.example, indices=self.recorder.indices)
            out = float_outputs(self.post_process.outputs(raw))
        finally:
            for q in qs:
                self.enable(q, False)
        missing = [name for name in self.base if name not in out]
        if missing:
            what = ", ".join(f"{q.sensitive_type} of '{q.op_name}'" for q in qs[:4]) or "no quantizer"
            raise QuantLensError(f"joint_sensitivity(): output(s) {missing} disappeared with {what} switched on; "
                                 "both models must return the same outputs.")
        return {name: self.m(self.base[name], out[name]) for name in self.base}


def run_joint_sensitivity(
    baseline: ModelAccess,
    analysis: ModelAccess,
    analysis_type: AnalysisType,
    example: Any,
    post_process: PostProcess,
    metric: str = "L1",
    pairs: int = 6,
    share_threshold: float = 0.5,
    progress: bool = True,
) -> JointSensitivityResult:
    """The quantizer, op and pair rankings of every output, with the shares of the model's error they explain
    (see the module docstring). Forwards: one per quantizer (as ``sensitivity()``), one per op of more than one
    quantizer, one per pair of candidates, and two more (every quantizer off, every quantizer on)."""
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 0:
        raise QuantLensError(f"joint_sensitivity(): pairs must be an int >= 0 (candidates per ranking), got {pairs!r}.")
    if not 0 < share_threshold <= 1:
        raise QuantLensError(f"joint_sensitivity(): share_threshold must be in (0, 1], got {share_threshold!r}.")
    m = get_metric(metric)
    base, recorder, quantizers = sensitivity_setup(baseline, analysis, analysis_type, example, post_process)
    singles = quantizer_units(quantizers)
    ops = op_units(analysis, analysis_type, quantizers)
    values: dict[frozenset[int], dict[str, float]] = {}
    with analysis.ablation(analysis_type) as enable:
        runner = ablation_runner(analysis, analysis_type, example, recorder)
        run = _SetRunner(analysis, enable, runner, quantizers, example, post_process, recorder, base, m)
        reference = run(frozenset(), full=True)
        plan = AblationPlan(analysis, enable, runner, quantizers, range(len(quantizers)), example, post_process,
                            recorder, base, m)
        for group in progress_iter(plan.groups, f"joint sensitivity: quantizers ({m.name})", total=len(quantizers),
                                   enabled=progress, steps=len):
            for i, v in plan.ablate(group).items():
                values[frozenset((i,))] = v
        todo = list(dict.fromkeys(frozenset(u.members) for u in ops if frozenset(u.members) not in values))
        for key in progress_iter(todo, f"joint sensitivity: ops ({m.name})", enabled=progress):
            values[key] = run(key)
        pair_units = _pairs(singles, ops, values, list(base), m, pairs)
        todo = list(dict.fromkeys(frozenset(a.members + b.members) for a, b in pair_units))
        for key in progress_iter([k for k in todo if k not in values], f"joint sensitivity: pairs ({m.name})",
                                 enabled=progress):
            values[key] = run(key)
        total = run(frozenset(range(len(quantizers))), full=True)
    plain = build_result(quantizers, {name: [values[frozenset((i,))][name] for i in range(len(quantizers))]
                                      for name in base}, m, False, recorder.table_errors)
    note = "" if analysis_type is AnalysisType.FAKE_QUANT else (
        f"{analysis_type.value} has one quantizer per op: the op rows are the quantizer rows")
    tables = tuple(_table(name, m, quantizers, singles, ops, pair_units, values, reference[name], total[name],
                          share_threshold, note) for name in base)
    return JointSensitivityResult(tables, plain, pairs, share_threshold)


def _pairs(singles: list[AblationUnit], ops: list[AblationUnit], values: dict, outputs: list[str], m: Metric,
           k: int) -> list[tuple[AblationUnit, AblationUnit]]:
    """Per output, the top ``k`` units of the quantizer and of the op ranking (each quantizer set once); every two
    of them with no quantizer in common. The union over the outputs, in order of first appearance."""
    found: dict[frozenset, tuple[AblationUnit, AblationUnit]] = {}
    for name in outputs:
        chosen: dict[frozenset[int], AblationUnit] = {}
        for units in (singles, ops):
            ranked = sorted(units, key=lambda u: m.sort_key(values[frozenset(u.members)][name]))  # stable
            for unit in ranked[:k]:
                chosen.setdefault(frozenset(unit.members), unit)
        candidates = list(chosen.values())
        for n, a in enumerate(candidates):
            for b in candidates[n + 1:]:
                if not set(a.members) & set(b.members):
                    found.setdefault(frozenset((frozenset(a.members), frozenset(b.members))), (a, b))
    return list(found.values())


def _table(name: str, m: Metric, quantizers: list, singles: list[AblationUnit], ops: list[AblationUnit],
           pair_units: list, values: dict, reference: float, total: float, threshold: float,
           note: str) -> JointTable:
    def effect(v: float) -> float:
        return v - reference if m.higher_is_worse else reference - v

    total_effect = effect(total)

    def share(v: float) -> float | None:
        e = effect(v)
        ok = math.isfinite(e) and math.isfinite(total_effect) and total_effect > 0
        return e / total_effect if ok else None

    def labels(members) -> tuple[str, ...]:
        return tuple(f"{quantizers[i].op_name}:{quantizers[i].sensitive_type}" for i in sorted(members))

    def unit_row(u: AblationUnit) -> JointRow:
        v = values[frozenset(u.members)][name]
        return JointRow(u.op_name, u.sensitive_type, u.op_type, m.name, v, effect(v), share(v), labels(u.members),
                        u.quant_dtype)

    def pair_row(a: AblationUnit, b: AblationUnit) -> JointRow:
        v = values[frozenset(a.members + b.members)][name]
        va, vb = values[frozenset(a.members)][name], values[frozenset(b.members)][name]
        return JointRow(f"{a.label} + {b.label}", "pair", f"{a.op_type} + {b.op_type}", m.name, v, effect(v),
                        share(v), labels(a.members + b.members), "", a.label, b.label, va, vb,
                        effect(v) - effect(va) - effect(vb))

    def ranked(rows: list[JointRow]) -> tuple[JointRow, ...]:
        return tuple(sorted(rows, key=lambda r: m.sort_key(r.value)))  # stable: ties keep execution order

    q_rows, o_rows = ranked([unit_row(u) for u in singles]), ranked([unit_row(u) for u in ops])
    p_rows = ranked([pair_row(a, b) for a, b in pair_units])
    q_share, o_share, p_share = (rows[0].share if rows else None for rows in (q_rows, o_rows, p_rows))
    known = [s for s in (q_share, o_share) if s is not None]
    best = max(known) if known else None
    small = best is not None and best < threshold
    warning = ""
    if small:
        warning = (f"the best single row (one quantizer or one op) explains only {best:.0%} of the model's error "
                   f"({m.name} {fmt(total)} with every quantizer on, {fmt(reference)} with none): the error comes "
                   "from several quantizers together; see the pair rows")
        if p_rows and p_share is not None:
            warning += (f" (the top pair, {p_rows[0].op_name}, explains {p_share:.0%}; interaction "
                        f"{fmt(p_rows[0].interaction)})")
        elif not p_rows:
            warning += " (none ran: pass pairs=k > 0)"
    return JointTable(name, m.name, reference, total, total_effect, q_rows, o_rows, p_rows, q_share, o_share,
                      p_share, best, small, warning, note)


def write_joint_sensitivity(table: JointTable, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``output_<name>_<metric>_joint_sensitivity.txt`` (the three rankings) and ``.pt`` (the table as a dict)."""
    def pct(share: float | None) -> str:
        return "" if share is None else f"{share:.0%}"

    stem = f"output_{safe_name(table.output)}_{table.metric}_joint_sensitivity"
    lines = [f"quantlens joint sensitivity: output '{table.output}', metric {table.metric}",
             f"every quantizer off: {fmt(table.reference)}; every quantizer on (the model's error): {fmt(table.total)}",
             f"share of the model's error explained by the top row: quantizer {pct(table.quantizer_share) or '-'}, "
             f"op {pct(table.op_share) or '-'}, pair {pct(table.pair_share) or '-'}"]
    if table.warning:
        lines.append(textwrap.fill(f"WARNING: {table.warning}", TEXT_WIDTH, subsequent_indent="  "))
    lines += ["", "== One quantizer at a time ==",
              wrap_table(["op_name", "sensitive_type", "op_type", table.metric, "effect", "share", "quant_dtype"],
                         [[r.op_name, r.sensitive_type, r.op_type, fmt(r.value), fmt(r.effect), pct(r.share),
                           r.quant_dtype] for r in table.quantizer_rows]),
              "", "== One op at a time (its quantizers as the integer kernel sees them) ==" +
              (f" [{table.op_note}]" if table.op_note else ""),
              wrap_table(["op_name", "op_type", table.metric, "effect", "share", "quantizers on"],
                         [[r.op_name, r.op_type, fmt(r.value), fmt(r.effect), pct(r.share), ", ".join(r.members)]
                          for r in table.op_rows]),
              "", "== Pairs (interaction = effect(joint) - effect(first) - effect(second)) =="]
    if table.pair_rows:
        lines.append(wrap_table(["first", "second", table.metric, "first alone", "second alone", "interaction",
                                 "share"],
                                [[r.first, r.second, fmt(r.value), fmt(r.value_first), fmt(r.value_second),
                                  fmt(r.interaction), pct(r.share)] for r in table.pair_rows], keys=(0, 1)))
    else:
        lines.append("(no pairs ran)")
    txt = atomic_write_text(Path(out_dir) / f"{stem}.txt", "\n".join(lines) + "\n")
    pt = save_pt(table.to_dict(), Path(out_dir) / f"{stem}.pt")
    return txt, pt
