"""Mixed-precision search: which op sites to promote to int16 so that a metric reaches a target.

:func:`search_mixed_precision` is a greedy search with re-measurement (``docs/mixed_precision.md``). Starting from
the base setter (int8 everywhere by default), each step tries the ``tries`` best-ranked remaining candidates, each
promoted on top of the current set, re-measures the metric for each (``prepare`` -> ``calibrate`` ->
``evaluate``), and keeps the best. The first ranking is the profiler's one-quantizer-at-a-time sensitivity
(``QuantAnalysis.sensitivity``) or a table you pass; after every step the candidates just measured are re-ranked
by what they measured (those that improved the metric first, by gain; then the graph neighbours of the site just
promoted, its producers and consumers, whose earlier "no gain" is stale because their gain depends on it; those
that did not improve it, after the unmeasured ones). It stops when the metric reaches ``target``, the budget is
spent, or no candidate is left.
A pruning pass then takes back every promotion the target no longer needs (backward elimination, smallest gain
first).

A candidate is an op site's output (``"activation"``) or its weight (``"weight"``). The march has no int16 x int16
GEMM, so the search never forms a set that needs prepare's resolution: an int16 weight is not combined with an
int16 output reaching that GEMM's data input, and at most one data input of an activation x activation GEMM
(matmul, attention) is int16. ``MixedPrecisionResult.int16x16_resolutions`` lists what prepare reported for the
chosen set (empty by construction).

Every measurement is written to ``out_dir/mixed_precision_progress.json`` as it finishes; a search started again
with the same inputs (model weights, data, candidates, ranking, target, budget) replays it and continues from
there, so an interrupted search ends with the result an uninterrupted one gives. ``out_dir`` also gets the curve
(metric vs number of int16 sites, and vs the latency estimate with ``latency=True``) as
``mixed_precision_curve.csv`` and a self-contained ``mixed_precision_curve.html`` (inline SVG).
"""

from __future__ import annotations

import csv
import hashlib
import html
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.march import QuantDType
from quantlens.quantization.fake_quantize import calibrate
from quantlens.quantization.op_rules import OpKind
from quantlens.quantization.prepare import prepare
from quantlens.quantization.qconfig_template import (
    QconfigAssignment,
    QconfigContext,
    QconfigSetter,
    default_calibration_qconfig_setter,
    resolve_qconfigs,
)

__all__ = [
    "Promotion",
    "CurvePoint",
    "MaxLatency",
    "MixedPrecisionResult",
    "MixedPrecisionQconfigSetter",
    "mixed_precision_candidates",
    "int16_conflicts",
    "search_mixed_precision",
]

PROGRESS_FILE = "mixed_precision_progress.json"
CSV_FILE = "mixed_precision_curve.csv"
HTML_FILE = "mixed_precision_curve.html"
_FORMAT = 1


@dataclass(frozen=True, order=True)
class Promotion:
    """One int16 promotion: ``kind`` is ``"activation"`` (the op site's output) or ``"weight"``."""

    site: str
    kind: str = "activation"

    def __post_init__(self):
        if self.kind not in ("activation", "weight"):
            raise QuantLensError(f"Promotion kind must be 'activation' or 'weight', got {self.kind!r}.")

    def label(self) -> str:
        return f"{self.site} ({self.kind})"


@dataclass(frozen=True)
class MaxLatency:
    """A budget on the march's latency estimate (``Module.latency_estimate().cycles`` of the quantized IR)."""

    cycles: int


@dataclass(frozen=True)
class CurvePoint:
    """The search after ``step`` steps (step 0: the base setter alone). A step adds one promotion (``added``) or,
    in the pruning pass after the target is reached, takes one back that the target no longer needs
    (``removed``); an exchange step does both (``removed`` swapped for ``added``)."""

    step: int
    num_int16: int
    added: Promotion | None
    metric: float
    latency_cycles: int | None
    tried: int
    removed: Promotion | None = None
    #: ``method="descend"``: the point keeps the ``kept`` most-needed op sites (no single promotion added)
    kept: int | None = None


def _as_promotion(item: Any) -> Promotion:
    if isinstance(item, Promotion):
        return item
    if isinstance(item, str):
        return Promotion(item, "activation")
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return Promotion(str(item[0]), str(item[1]))
    op_name = item.get("op_name") if isinstance(item, dict) else getattr(item, "op_name", None)
    kind = item.get("sensitive_type") if isinstance(item, dict) else getattr(item, "sensitive_type", None)
    if op_name is None:
        raise QuantLensError(f"Cannot read a candidate from {item!r}: pass Promotion(site, kind), a site name, "
                             "a (site, kind) pair or a sensitivity row.")
    return Promotion(op_name, kind or "activation")


# -- the qconfig setter ----------------------------------------------------------------------------------------


class MixedPrecisionQconfigSetter(QconfigSetter):
    """The base setter's qconfigs with the promotions applied on top: activation promotions get int16 outputs,
    weight promotions int16 weights and an int8 input (no int16 x int16 GEMM). Everything else is the base
    setter's (the promotions win over it). ``prepare`` takes it unchanged."""

    def __init__(self, promotions: Iterable[Any], base_setter: Any = default_calibration_qconfig_setter):
        self.promotions = tuple(_as_promotion(p) for p in promotions)
        self.base_setter = base_setter
        base_name = (" > ".join(getattr(s, "name", repr(s)) for s in base_setter)
                     if isinstance(base_setter, (tuple, list)) else getattr(base_setter, "name", repr(base_setter)))
        self.name = f"mixed_precision({len(self.promotions)} int16) > {base_name}"

    def assign(self, ctx: QconfigContext) -> QconfigAssignment:
        base = resolve_qconfigs(self.base_setter, ctx)
        result = QconfigAssignment(warnings=list(base.warnings))
        acts = {p.site for p in self.promotions if p.kind == "activation"}
        weights = {p.site for p in self.promotions if p.kind == "weight"}
        for name in sorted(acts | weights, key=lambda n: list(ctx.record.sites).index(n)
                           if n in ctx.record.sites else -1):
            if name not in ctx.record.sites:
                result.warnings.append(f"{self.name}: promoted '{name}' is not an op site of this model.")
                continue
            qc = base.qconfigs.get(name)
            if qc is None or qc.output is None:
                result.warnings.append(f"{self.name}: '{name}' has no qconfig from the base setter; not promoted.")
                continue
            act = qc.output if qc.output.dtype is not QuantDType.qint32 else (qc.input or qc.output)
            changes: dict[str, Any] = {}
            if name in acts and qc.output.dtype is not QuantDType.qint32:
                changes["output"] = qc.output.with_dtype(QuantDType.qint16)
                changes["input"] = (qc.input or act).with_dtype(QuantDType.qint16)
            if name in weights and qc.weight is not None:
                changes["weight"] = qc.weight.with_dtype(QuantDType.qint16)
                changes["input"] = (qc.input or act).with_dtype(QuantDType.qint8)
            result.qconfigs[name] = qc.replace(**changes)
        for name, qc in base.qconfigs.items():
            result.qconfigs.setdefault(name, qc)
        return result


# -- candidates and the int16 x int16 rule ---------------------------------------------------------------------


@dataclass
class _Graph:
    """What the search needs of a prepared base model: candidates and the data flow for the GEMM rule."""

    activations: list[str]
    weights: list[str]
    order: dict[str, int]
    #: GEMM site -> origins (computing sites) of its data inputs
    gemm_inputs: dict[str, list[str]]
    weighted_gemms: set[str]
    #: site -> the sites whose output dtype it sets (its fused group)
    group: dict[str, tuple[str, ...]]
    #: weight sites whose output is the (int16) weight itself (embeddings)
    output_from_weight: set[str]
    #: site -> the computing sites (fused groups named by their last op) it reads from or feeds
    neighbours: dict[str, set[str]] = field(default_factory=dict)


def _graph(prepared: nn.Module) -> _Graph:
    from quantlens.quantization.plan import OutputMode

    state = prepared._quantlens_state
    record = state.record
    group: dict[str, tuple[str, ...]] = {}
    for g in state.groups:
        for m in g.members:
            group[m] = tuple(g.members)
    activations, weights, gemm_inputs, weighted, ofw = [], [], {}, set(), set()
    module_map = dict(prepared.named_modules())
    for site in record.sites.values():
        plan = state.plans.get(site.name)
        if site.kind is not OpKind.QUANTIZED or site.after_dequant or plan is None or plan.qconfig is None:
            continue
        if plan.output is OutputMode.QUANTIZED and plan.output_fq is not None and (
                site.name not in group or group[site.name][-1] == site.name):
            activations.append(site.name)
        has_weight = bool(plan.weight_fq) or (
            site.is_module and isinstance(getattr(module_map.get(site.module_name), "weight", None), nn.Parameter)
            and (site.gemm or site.output_from_weight))
        if has_weight and plan.qconfig.weight is not None and plan.output is not OutputMode.FUSED:
            weights.append(site.name)
            if site.output_from_weight:
                ofw.add(site.name)
        if site.gemm:
            data = [i for i in site.inputs if not i.is_parameter and i.position not in site.bias_args]
            gemm_inputs[site.name] = [record.origin(i.producer) for i in data if i.producer is not None]
            if has_weight:
                weighted.add(site.name)
    order = {name: k for k, name in enumerate(record.sites)}
    rep = lambda n: group[n][-1] if n in group else n  # noqa: E731
    neighbours: dict[str, set[str]] = {}
    for site in record.sites.values():
        for i in site.inputs:
            if i.is_parameter or i.producer is None:
                continue
            src = record.origin(i.producer)
            if src is None or rep(src) == rep(site.name):
                continue
            neighbours.setdefault(rep(site.name), set()).add(rep(src))
            neighbours.setdefault(rep(src), set()).add(rep(site.name))
    return _Graph(activations, weights, order, gemm_inputs, weighted, group, ofw, neighbours)


def _int16_outputs(selection: Iterable[Promotion], g: _Graph) -> set[str]:
    out: set[str] = set()
    for p in selection:
        if p.kind == "activation" or p.site in g.output_from_weight:
            out.update(g.group.get(p.site, (p.site,)))
    return out


def _conflicts(selection: Sequence[Promotion], g: _Graph) -> list[str]:
    """Why ``selection`` would need an int16 x int16 GEMM (empty: it does not)."""
    int16_out = _int16_outputs(selection, g)
    int16_weight = {p.site for p in selection if p.kind == "weight"}
    problems = []
    for gemm, origins in g.gemm_inputs.items():
        hot = [o for o in origins if o in int16_out]
        if gemm in g.weighted_gemms:
            if gemm in int16_weight and hot:
                problems.append(f"'{gemm}': int16 weight and int16 input from {hot}")
        elif len(hot) > 1:
            problems.append(f"'{gemm}': int16 on more than one operand ({sorted(set(hot))})")
    return problems


def mixed_precision_candidates(prepared: nn.Module) -> list[Promotion]:
    """Every promotion the search may consider on a prepared model: each quantized op site's output, then each
    weight, in execution order."""
    g = _graph(prepared)
    return [Promotion(s, "activation") for s in g.activations] + [Promotion(s, "weight") for s in g.weights]


def int16_conflicts(prepared_base: nn.Module, promotions: Iterable[Any]) -> list[str]:
    """The int16 x int16 GEMMs that ``promotions`` would need on the model of ``prepared_base`` (empty: none)."""
    return _conflicts([_as_promotion(p) for p in promotions], _graph(prepared_base))


def _resolutions(prepared: nn.Module) -> list[str]:
    """Op sites where prepare requantized an input to int8 because of int16 x int16."""
    return [name for name, plan in prepared._quantlens_state.plans.items()
            if any("no int16 x int16" in note for note in plan.notes)]


# -- the result ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixedPrecisionResult:
    """The chosen promotions (in the order the search added them), the curve, and where the files are."""

    chosen: tuple[Promotion, ...]
    curve: tuple[CurvePoint, ...]
    target: float
    reached: bool
    base_metric: float
    metric: float
    candidates: tuple[Promotion, ...]
    measurements: int
    int16x16_resolutions: tuple[str, ...]
    csv_path: str = field(compare=False)
    html_path: str = field(compare=False)
    progress_path: str = field(compare=False)
    base_setter: Any = field(default=default_calibration_qconfig_setter, compare=False, repr=False)

    @property
    def num_int16(self) -> int:
        return len(self.chosen)

    def setter(self) -> MixedPrecisionQconfigSetter:
        """A qconfig setter that ``prepare`` takes unchanged: the chosen promotions, then the base setter."""
        return MixedPrecisionQconfigSetter(self.chosen, self.base_setter)


# -- fingerprints and the progress file ------------------------------------------------------------------------


def _hash_tree(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k!s}".encode())
            _hash_tree(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for item in obj:
            _hash_tree(h, item)
    else:
        h.update(repr(obj).encode())


def _fingerprint(model: nn.Module, example_inputs, batches, candidates, ranking, target, budget, tries,
                 base_name: str, higher_is_better: bool, method: str = "greedy", prune: bool = True,
                 exchange: int = 0) -> str:
    """What the chosen promotions depend on (not ``latency``: the latency estimates only annotate the curve)."""
    h = hashlib.sha256()
    _hash_tree(h, dict(model.state_dict()))
    _hash_tree(h, example_inputs)
    _hash_tree(h, list(batches))
    h.update(json.dumps({"candidates": [asdict(c) for c in candidates], "ranking": [asdict(c) for c in ranking],
                         "target": float(target), "budget": repr(budget), "tries": tries, "base": base_name,
                         "higher": higher_is_better, "method": method, "prune": prune,
                         **({"exchange": exchange} if exchange else {})}, sort_keys=True).encode())
    return h.hexdigest()


def _key(selection: Iterable[Promotion]) -> str:
    return ";".join(f"{p.site}|{p.kind}" for p in sorted(selection))


class _Progress:
    def __init__(self, path: Path, fingerprint: str, resume: bool):
        self.path = path
        self.data = {"format": _FORMAT, "fingerprint": fingerprint, "measurements": {}, "latency": {},
                     "steps": [], "done": False}
        if resume and path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError):
                old = None
            if old and old.get("format") == _FORMAT and old.get("fingerprint") == fingerprint:
                self.data = old
            elif old is not None:
                warnings.warn(f"{path}: written by a search with other inputs (model, data, candidates, target or "
                              "budget); starting afresh.", stacklevel=3)
        self.resumed_measurements = len(self.data["measurements"])

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


# -- the search ------------------------------------------------------------------------------------------------


def _initial_ranking(model, base_prepared, example_inputs, candidates, ranking, out_dir: Path) -> list[Promotion]:
    """Candidates in the order of ``ranking`` (a sensitivity table / result, or promotions); the rest after it in
    execution order. ``None``: the profiler's sensitivity of the base model on ``example_inputs``."""
    if ranking is None:
        from quantlens.profiler import QuantAnalysis

        qa = QuantAnalysis(model, base_prepared, "fake_quant", out_dir=str(out_dir / "sensitivity"))
        qa.set_bad_case(example_inputs)
        ranking = qa.sensitivity()
    tables = list(ranking)
    if tables and not (isinstance(tables[0], (Sequence,)) and not isinstance(tables[0], (str, tuple))):
        tables = [tables]
    best: dict[Promotion, tuple[int, int]] = {}
    for t, table in enumerate(tables):
        for rank, row in enumerate(table):
            kind = row.get("sensitive_type") if isinstance(row, dict) else getattr(row, "sensitive_type", None)
            if kind == "lut":
                continue
            p = _as_promotion(row)
            best[p] = min(best.get(p, (rank, t)), (rank, t))
    ranked = sorted((c for c in candidates if c in best), key=lambda c: best[c])
    return ranked + [c for c in candidates if c not in best]


def _within_budget(selection: Sequence[Promotion], budget) -> bool:
    return not (isinstance(budget, int) and not isinstance(budget, bool) and len(selection) > budget)


def search_mixed_precision(
    model: nn.Module,
    example_inputs: Any,
    calibration_batches: Sequence[Any],
    evaluate: Callable[[nn.Module], float],
    target: float,
    *,
    base_setter: Any = default_calibration_qconfig_setter,
    budget: int | MaxLatency | None = None,
    candidates: Iterable[Any] | None = None,
    out_dir: str | os.PathLike = "mixed_precision",
    resume: bool = True,
    ranking: Any = None,
    tries: int = 4,
    method: str = "greedy",
    higher_is_better: bool = True,
    latency: bool = False,
    prune: bool = True,
    exchange: int = 0,
    progress: bool = True,
) -> MixedPrecisionResult:
    """Greedy int16 promotion with re-measurement until ``evaluate`` reaches ``target``.

    Args:
        model: the float model (not modified).
        example_inputs: one call's inputs, as for ``prepare`` (also the profiler's bad case for the ranking).
        calibration_batches: the batches ``calibrate`` runs for every measured configuration.
        evaluate: ``evaluate(prepared_model) -> float`` on a calibrated model in VALIDATION state (e.g. the output
            cosine against the float model on held-out data); called without gradients.
        target: the metric to reach (``>=``, or ``<=`` with ``higher_is_better=False``).
        base_setter: the qconfig setter (or tuple) every configuration starts from.
        budget: the most promotions (``int``), or ``MaxLatency(cycles)``: configurations whose quantized IR's
            latency estimate exceeds it are not taken (implies ``latency``).
        candidates: promotions to consider (``Promotion``, site names = activations, ``(site, kind)`` pairs,
            sensitivity rows); default :func:`mixed_precision_candidates` of the base model.
        out_dir: progress file, curve CSV/HTML (and the profiler's sensitivity files when it ranks).
        resume: continue from ``out_dir``'s progress file when it was written by a search with the same inputs.
        ranking: first ranking (a sensitivity table/result, or promotions most promising first); default the
            profiler's sensitivity of the base model.
        tries: candidates measured per step.
        method: ``"greedy"`` (from the base up, one promotion per step) or ``"descend"``: first measure what
            each op site's output costs when it alone goes back to int8 from "every activation int16" (one
            measurement per site), keep the fewest most-needed sites that reach the target (bisection on that
            order), then continue greedily if needed; it sees interactions the one-at-a-time ranking misses (two
            sites that help only together are each needed once the other is int16). Both end with ``prune``.
        latency: also export -> convert every accepted configuration and record its latency estimate.
        prune: once the target is reached, take back each promotion the target no longer needs (smallest gain
            first, one measurement each): a promotion that helped early may be redundant once later ones are in.
        exchange: rounds of exchange after the pruning pass (0, the default, or ``prune=False``: none): the chosen
            promotion whose removal costs least is swapped for the outside candidate that does most in its place
            (one measurement per chosen site and one per candidate outside the set) when that beats the current
            set, and the pass prunes again; a round that improves nothing ends it. It can find a set one site
            smaller that backward elimination misses (two sites that do best together); each round costs about
            as many measurements as there are candidates.
        progress: show a rich progress bar.
    """
    out = Path(out_dir)
    if tries < 1:
        raise QuantLensError(f"search_mixed_precision: tries must be >= 1, got {tries}.")
    if isinstance(exchange, bool) or not isinstance(exchange, int) or exchange < 0:
        raise QuantLensError(f"search_mixed_precision: exchange must be an int >= 0 (rounds), got {exchange!r}.")
    if method not in ("greedy", "descend"):
        raise QuantLensError(f"search_mixed_precision: method must be 'greedy' or 'descend', got {method!r}.")
    if isinstance(budget, MaxLatency):
        latency = True
    elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise QuantLensError(f"search_mixed_precision: budget must be an int >= 0, MaxLatency(cycles) or None, "
                             f"got {budget!r}.")
    batches = list(calibration_batches)
    better = (lambda a, b: a > b) if higher_is_better else (lambda a, b: a < b)  # noqa: E731
    reached = (lambda m: m >= target) if higher_is_better else (lambda m: m <= target)  # noqa: E731

    def build(selection: Sequence[Promotion]) -> nn.Module:
        setter = MixedPrecisionQconfigSetter(selection, base_setter)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare(model, example_inputs, setter, check_result_dir=None)
            calibrate(prepared, batches)
        return prepared

    base_prepared = build(())
    graph = _graph(base_prepared)
    all_candidates = [Promotion(s, "activation") for s in graph.activations] + \
        [Promotion(s, "weight") for s in graph.weights]
    if candidates is None:
        cands = all_candidates
    else:
        cands = []
        for item in candidates:
            p = _as_promotion(item)
            if p not in all_candidates:
                raise QuantLensError(f"search_mixed_precision: candidate {p.label()} cannot be promoted on this "
                                     f"model (not a quantized op site with that {p.kind}).")
            if p not in cands:
                cands.append(p)
    out.mkdir(parents=True, exist_ok=True)
    order = graph.order
    given = None if ranking is None else _initial_ranking(model, base_prepared, example_inputs, cands, ranking, out)
    base_name = getattr(base_setter, "name", repr(base_setter))
    fp = _fingerprint(model, example_inputs, batches, cands, given or [], target, budget, tries, base_name,
                      higher_is_better, method, prune, exchange)
    prog = _Progress(out / PROGRESS_FILE, fp, resume)
    meas, lat = prog.data["measurements"], prog.data["latency"]
    if given is not None:
        ranked0 = given
    elif prog.data.get("ranking") is not None:  # the profiler's ranking of an earlier run with the same inputs
        ranked0 = [Promotion(**p) for p in prog.data["ranking"]]
    else:
        ranked0 = _initial_ranking(model, base_prepared, example_inputs, cands, None, out)
        prog.data["ranking"] = [asdict(p) for p in ranked0]
        prog.save()

    def measure(selection: Sequence[Promotion], prepared: nn.Module | None = None) -> float:
        key = _key(selection)
        if key not in meas:
            prepared = prepared if prepared is not None else build(selection)
            with torch.no_grad():
                value = float(evaluate(prepared))
            if not math.isfinite(value):
                value = -math.inf if higher_is_better else math.inf
            meas[key] = value
            prog.save()
        return meas[key]

    def latency_of(selection: Sequence[Promotion]) -> int | None:
        if not latency:
            return None
        key = _key(selection)
        if key not in lat:
            from quantlens.compiler import convert, export

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q_ir = convert(export(build(selection), example_inputs))
            lat[key] = int(q_ir.latency_estimate().cycles)
            prog.save()
        return lat[key]

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]mixed precision[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), disable=not progress, transient=False)
    selected: list[Promotion] = []
    ranking_now = list(ranked0)
    base_metric = measure((), base_prepared)
    curve = [CurvePoint(0, 0, None, base_metric, latency_of(()), 1)]
    metric = base_metric
    steps_done = prog.data["steps"]
    max_steps = len(cands) if not isinstance(budget, int) or isinstance(budget, bool) else min(budget, len(cands))
    with bar:
        task = bar.add_task("step 1", total=max_steps)
        step = 0
        if method == "descend" and not reached(metric):
            found = _descend(ranked0, graph, measure, reached, better, higher_is_better, max_steps,
                             lambda text: bar.update(task, description=text))
            if found is not None:
                # the configurations measured on the way, by size, then the chosen one (the curve ends there)
                for selection, value in found.points:
                    step += 1
                    curve.append(CurvePoint(step, len(selection), None, value, latency_of(selection), 1,
                                            kept=len(selection)))
                selected = list(found.chosen)
                metric = measure(selected)
                step += 1
                curve.append(CurvePoint(step, len(selected), None, metric, latency_of(selected), 1,
                                        kept=len(selected)))
                ranking_now = [c for c in ranking_now if c not in selected]
        while not reached(metric) and len(selected) < max_steps:
            step += 1
            bar.update(task, description=f"step {step}: metric {metric:.4f} -> {target}", completed=step - 1)
            allowed = [c for c in ranking_now if c not in selected and _within_budget(selected + [c], budget)
                       and not _conflicts(selected + [c], graph)]
            if isinstance(budget, MaxLatency):
                if latency_of(selected) > budget.cycles:  # the current set (the base at step 1) is already over
                    break
                allowed_lat = []
                for c in allowed:
                    if len(allowed_lat) >= tries:
                        break
                    if latency_of(selected + [c]) <= budget.cycles:
                        allowed_lat.append(c)
                allowed = allowed_lat
            # Half the pool (rounded down) follows the first ranking: the re-ranked candidates (those that helped,
            # the neighbours) would otherwise fill every slot and push back sites the ranking puts ahead (on
            # MiniLM the search then needed more promotions than the ranking's top-k).
            first = [c for c in ranked0 if c in allowed]
            pool = allowed[:tries - tries // 2]
            pool += [c for c in first if c not in pool][:tries - len(pool)]
            pool += [c for c in allowed if c not in pool][:tries - len(pool)]
            if not pool:
                break
            results = {}
            for c in pool:
                bar.update(task, description=f"step {step}: trying {c.label()}")
                results[c] = measure(selected + [c])
            best = pool[0]
            for c in pool[1:]:
                if better(results[c], results[best]):
                    best = c
            gains = {c: results[c] - metric if higher_is_better else metric - results[c] for c in pool if c != best}
            helped = sorted((c for c in gains if gains[c] > 0), key=lambda c: (-gains[c], order.get(c.site, 0)))
            idle = [c for c in pool if c != best and c not in helped]
            rest = [c for c in ranking_now if c not in pool and c not in selected]
            # The promoted site's graph neighbours (its producers and consumers, and its own other kind) are
            # measured next: their gain depends on it (an int16 add gains little while the linear feeding it
            # stays int8, and the other way round), so a "no gain" measured before this step is stale.
            near = graph.neighbours.get(graph.group.get(best.site, (best.site,))[-1], set()) | {best.site}
            is_near = lambda c: graph.group.get(c.site, (c.site,))[-1] in near  # noqa: E731
            fresh = [c for c in rest + idle if is_near(c)]
            selected.append(best)
            metric = results[best]
            ranking_now = helped + fresh + [c for c in rest if c not in fresh] + [c for c in idle if c not in fresh]
            curve.append(CurvePoint(step, len(selected), best, metric, latency_of(selected), len(pool)))
            record = {"step": step, "added": asdict(best), "metric": metric, "tried": [asdict(c) for c in pool]}
            if len(steps_done) < step:
                steps_done.append(record)
                prog.save()
        if prune and reached(metric) and len(selected) > 1:
            step = _prune(selected, curve, step, metric, reached, measure, latency_of, steps_done, prog,
                          lambda c: bar.update(task, description=f"pruning: without {c.label()}"))
            metric = curve[-1].metric
        if prune and exchange and reached(metric) and len(selected) > 1:
            step = _exchange(selected, cands, graph, budget, curve, step, reached, better, higher_is_better,
                             measure, latency_of,
                             steps_done, prog, exchange, lambda text: bar.update(task, description=text))
            metric = curve[-1].metric
        bar.update(task, completed=len(selected), description=f"done: {len(selected)} int16, metric {metric:.4f}")
    final = build(selected) if selected else base_prepared
    resolutions = tuple(_resolutions(final))
    prog.data["done"] = True
    prog.save()
    result = MixedPrecisionResult(
        chosen=tuple(selected), curve=tuple(curve), target=float(target), reached=bool(reached(metric)),
        base_metric=base_metric, metric=metric, candidates=tuple(cands), measurements=len(meas),
        int16x16_resolutions=resolutions, csv_path=str(out / CSV_FILE), html_path=str(out / HTML_FILE),
        progress_path=str(out / PROGRESS_FILE), base_setter=base_setter)
    write_curve(result, out)
    return result


@dataclass(frozen=True)
class _Descent:
    chosen: tuple[Promotion, ...]
    points: tuple[tuple[tuple[Promotion, ...], float], ...]  # every configuration measured on the way, by size


def _descend(ranked: Sequence[Promotion], graph: _Graph, measure, reached, better, higher_is_better: bool,
             max_sites: int, show) -> _Descent | None:
    """``method="descend"``: (1) every activation int16 (conflict-free, in ranking order) and the cost of
    sending each one back to int8 alone; (2) the fewest most-needed sites that reach the target (bisection on
    that order); (3) backward elimination with re-measurement from a few sites above (2)'s answer: each round
    measures every site's removal and drops the one that costs least while the target holds (the costs of (1)
    were measured with every other activation int16; near the answer the sites interact differently).
    ``None`` when even every activation int16 misses the target (the greedy search then starts from the base)."""
    top: list[Promotion] = []
    for c in ranked:
        if c.kind == "activation" and not _conflicts(top + [c], graph):
            top.append(c)
    show(f"descend: every activation int16 ({len(top)} sites)")
    if not top or not reached(measure(top)):
        return None
    full = measure(top)
    cost = {}
    for i, c in enumerate(top):
        show(f"descend: {c.label()} back to int8 ({i + 1}/{len(top)})")
        without = measure([x for x in top if x != c])
        cost[c] = (full - without) if higher_is_better else (without - full)
    order = sorted(top, key=lambda c: (-cost[c], top.index(c)))  # most needed first
    points: dict[int, tuple[tuple[Promotion, ...], float]] = {len(order): (tuple(order), full)}
    lo, hi = 0, min(len(order), max_sites)  # the smallest k with a reaching prefix lies in (lo, hi]
    if not reached(measure(order[:hi])):
        return None
    points[hi] = (tuple(order[:hi]), measure(order[:hi]))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        show(f"descend: the {mid} most needed sites")
        value = measure(order[:mid])
        points[mid] = (tuple(order[:mid]), value)
        if reached(value):
            hi = mid
        else:
            lo = mid
    chosen = list(order[:hi])
    start = min(len(order), hi + max(2, hi // 8))
    current = list(order[:start])
    if start > hi and reached(measure(current)):
        path = [(tuple(current), measure(current))]
        while len(current) > 1:
            best = None
            for k, c in enumerate(current):
                show(f"descend: {len(current)} sites, without {c.label()} ({k + 1}/{len(current)})")
                value = measure([x for x in current if x != c])
                if best is None or better(value, best[0]):
                    best = (value, c)
            if not reached(best[0]):
                break
            current.remove(best[1])
            path.append((tuple(current), best[0]))
        if len(current) < len(chosen):
            chosen = current
            for selection, value in path:
                points[len(selection)] = (selection, value)
    ordered = [points[k] for k in sorted(points) if points[k][0] != tuple(chosen)]
    return _Descent(tuple(chosen), tuple(ordered))


def _prune(selected: list[Promotion], curve: list[CurvePoint], step: int, metric: float, reached, measure,
           latency_of, steps_done: list, prog, show) -> int:
    """Backward elimination after a greedy forward pass: try each chosen promotion without it, smallest gain at
    the time it was added first; drop it when the rest still reaches the target. Changes ``selected`` and
    ``curve`` in place and returns the last step number."""
    gain = {}
    for before, point in zip(curve, curve[1:]):
        if point.added is not None:
            gain[point.added] = point.metric - before.metric
    # ties (``method="descend"`` adds no single promotion: no gains) go last-added first, the least needed
    for candidate in sorted(selected, key=lambda c: (abs(gain.get(c, 0.0)), -selected.index(c))):
        if len(selected) <= 1:
            break
        show(candidate)
        trial = [c for c in selected if c != candidate]  # fewer int16 sites: no new int16 x int16 pair
        value = measure(trial)
        if not reached(value):
            continue
        step += 1
        selected.remove(candidate)
        curve.append(CurvePoint(step, len(selected), None, value, latency_of(selected), 1, removed=candidate))
        if len(steps_done) < step:
            steps_done.append({"step": step, "removed": asdict(candidate), "metric": value})
            prog.save()
    return step


def _exchange(selected: list[Promotion], cands: Sequence[Promotion], graph: _Graph, budget, curve: list[CurvePoint],
              step: int, reached, better, higher_is_better: bool, measure, latency_of, steps_done: list, prog,
              rounds: int, show) -> int:
    """Exchange rounds once the target is reached (after ``_prune``): swap the chosen promotion whose removal
    costs least for the outside candidate that does most in its place, when that beats the current set, then
    prune again. A set just above the target can hold a better one of the same size after which a site can go
    (backward elimination alone never revisits a site it kept). Changes ``selected`` and ``curve`` in place and
    returns the last step number."""
    for r in range(rounds):
        if len(selected) <= 1:
            break
        current = curve[-1].metric
        drop, drop_value = None, None
        for k, s in enumerate(selected):
            show(f"exchange {r + 1}: without {s.label()} ({k + 1}/{len(selected)})")
            value = measure([x for x in selected if x != s])
            if drop is None or better(value, drop_value):
                drop, drop_value = s, value
        rest = [x for x in selected if x != drop]
        outside = [c for c in cands if c not in selected and _within_budget(rest + [c], budget)
                   and not _conflicts(rest + [c], graph)]
        trials = []
        for k, c in enumerate(outside):
            show(f"exchange {r + 1}: {drop.label()} -> {c.label()} ({k + 1}/{len(outside)})")
            trials.append((measure(rest + [c]), k, c))
        # best first; ties keep the candidates' order
        trials.sort(key=lambda t: (-t[0] if higher_is_better else t[0], t[1]))
        swap = None
        for value, _, c in trials:
            if not better(value, current):
                break
            if isinstance(budget, MaxLatency) and latency_of(rest + [c]) > budget.cycles:
                continue
            swap = (value, c)
            break
        if swap is None:
            break
        value, add = swap
        selected[:] = rest + [add]
        step += 1
        curve.append(CurvePoint(step, len(selected), add, value, latency_of(selected), len(outside), removed=drop))
        if len(steps_done) < step:
            steps_done.append({"step": step, "added": asdict(add), "removed": asdict(drop), "metric": value})
            prog.save()
        step = _prune(selected, curve, step, value, reached, measure, latency_of, steps_done, prog,
                      lambda c: show(f"exchange {r + 1}: pruning without {c.label()}"))
    return step


# -- the curve files -------------------------------------------------------------------------------------------


def write_curve(result: MixedPrecisionResult, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``mixed_precision_curve.csv`` and ``mixed_precision_curve.html`` (inline SVG, no external file)."""
    out = Path(out_dir)
    csv_path, html_path = out / CSV_FILE, out / HTML_FILE
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "num_int16", "added_site", "added_kind", "removed_site", "removed_kind", "metric",
                    "latency_cycles", "tried"])
        for p in result.curve:
            w.writerow([p.step, p.num_int16, p.added.site if p.added else "", p.added.kind if p.added else "",
                        p.removed.site if p.removed else "", p.removed.kind if p.removed else "",
                        repr(p.metric), "" if p.latency_cycles is None else p.latency_cycles, p.tried])
    plots = [_svg_plot([(p.num_int16, p.metric) for p in result.curve], "int16 op sites", result.target)]
    if all(p.latency_cycles is not None for p in result.curve):
        plots.append(_svg_plot([(p.latency_cycles, p.metric) for p in result.curve], "latency estimate (cycles)",
                               result.target))
    rows = "".join(
        f"<tr><td>{p.step}</td><td>{p.num_int16}</td><td>{_change(p)}</td>"
        f"<td>{p.metric:.6f}</td><td>{'' if p.latency_cycles is None else p.latency_cycles}</td><td>{p.tried}</td></tr>"
        for p in result.curve)
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>mixed precision curve</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;font-size:13px}</style></head><body><h1>Mixed-precision search</h1>"
        f"<p>target {result.target}: {'reached' if result.reached else 'not reached'} with {result.num_int16} "
        f"int16 promotion(s); base metric {result.base_metric:.6f}, final {result.metric:.6f}; "
        f"{result.measurements} configurations measured; {len(result.candidates)} candidates.</p>"
        + "".join(plots)
        + "<table><tr><th>step</th><th>int16 sites</th><th>change</th><th>metric</th><th>latency (cycles)</th>"
          f"<th>tried</th></tr>{rows}</table></body></html>")
    html_path.write_text(page)
    return csv_path, html_path


def _change(point: CurvePoint) -> str:
    if point.added is not None and point.removed is not None:
        return html.escape(point.removed.label()) + " &rarr; " + html.escape(point.added.label()) + " (exchange)"
    if point.added is not None:
        return "+ " + html.escape(point.added.label())
    if point.removed is not None:
        return "&minus; " + html.escape(point.removed.label()) + " (pruned)"
    if point.kept is not None:
        return f"the {point.kept} most needed sites (descend)"
    return "base"


def _svg_plot(points: list[tuple[float, float]], xlabel: str, target: float) -> str:
    w, h, pad = 640, 320, 55
    xs, ys = [p[0] for p in points], [p[1] for p in points] + [target]
    finite = [y for y in ys if math.isfinite(y)]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(finite), max(finite)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1e-3
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: E731
    sy = lambda y: h - pad + (y0 - (y if math.isfinite(y) else y0)) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    path = " ".join(f"{'M' if k == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for k, (x, y) in enumerate(points))
    dots = "".join(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='#1f77b4'><title>{x}: {y:.6f}</title>"
                   "</circle>" for x, y in points)
    ty = sy(target)
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' style='display:block;margin:1em 0'>"
        f"<rect x='{pad}' y='{pad}' width='{w - 2 * pad}' height='{h - 2 * pad}' fill='none' stroke='#999'/>"
        f"<line x1='{pad}' x2='{w - pad}' y1='{ty:.1f}' y2='{ty:.1f}' stroke='#d62728' stroke-dasharray='4'/>"
        f"<text x='{w - pad}' y='{ty - 4:.1f}' text-anchor='end' font-size='11' fill='#d62728'>target {target}</text>"
        f"<path d='{path}' fill='none' stroke='#1f77b4' stroke-width='2'/>{dots}"
        f"<text x='{w / 2}' y='{h - 12}' text-anchor='middle' font-size='12'>{html.escape(xlabel)}</text>"
        f"<text x='14' y='{h / 2}' font-size='12' transform='rotate(-90 14 {h / 2})' text-anchor='middle'>metric</text>"
        f"<text x='{pad}' y='{h - pad + 14}' font-size='10'>{x0:g}</text>"
        f"<text x='{w - pad}' y='{h - pad + 14}' font-size='10' text-anchor='end'>{x1:g}</text>"
        f"<text x='{pad - 4}' y='{h - pad}' font-size='10' text-anchor='end'>{y0:.4f}</text>"
        f"<text x='{pad - 4}' y='{pad + 4}' font-size='10' text-anchor='end'>{y1:.4f}</text></svg>")
