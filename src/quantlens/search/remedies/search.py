"""``search_remedies``: from the profiler's findings to a measured fix (``docs/remedies.md``).

Every candidate is measured (``prepare`` -> ``calibrate`` -> ``evaluate`` on the caller's held-out metric) and
kept only when it helps; the remedies go cheapest first, so int16 is spent only on what the others leave:

1. **whole-model remedies**, in the order of the registry :data:`~.catalog.REMEDIES`: cross-layer equalization
   and LayerNorm smoothing (free at run time, exact in float, :mod:`.equalize`), per-channel weights where the
   setter has per-tensor ones (:mod:`.weights`), bias correction (:mod:`.bias_correction`), learned ranges
   (:mod:`.learned_ranges`), learned rounding (:mod:`.learned_rounding`); each measured on top of those kept so far
   and kept when the metric improves by more than its noise (:mod:`.noise`); a remedy that fails (a
   ``RuntimeError``, ``ValueError`` or ``QuantLensError`` while it is applied or measured) is skipped and recorded
   in ``RemedyResult.skipped``, and the search goes on;
2. **ranges**: for the op sites of the advisor's findings that a range answers, then those the outputs are most
   sensitive to (the profiler's sensitivity on the current model), each range observer of
   :data:`~.observers.RANGE_OBSERVERS`; the best is kept per site when it improves the metric by more than its
   noise (:class:`~.observers.ObserverQconfigSetter`);
3. **precision**: if the target is not reached, ``search_mixed_precision`` promotes op sites to int16 on top of
   what 1-2 chose.

The result (:class:`RemedyResult`) is what ``prepare`` takes: the transformed float model and a qconfig setter, and
every trial with its measured value.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from quantlens._io import atomic_write_text
from quantlens.errors import QuantLensError
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search.bar import SearchBar
from quantlens.search.clock import StepClock
from quantlens.search.evaluation import call_evaluate
from quantlens.search.progress_file import check_out_dir, is_number_map, read_progress
from quantlens.search.provenance import (
    evaluate_identity,
    float_model_digest,
    hash_tree,
    model_code_identity,
    setter_identity,
)
from quantlens.search.remedies.catalog import REMEDIES, QatOptions, RemedyContext, model_remedies
from quantlens.search.remedies.noise import measure_noise
from quantlens.search.remedies.observers import RANGE_OBSERVERS, ObserverQconfigSetter
from quantlens.search.remedies.qat_distill import QatBudget
from quantlens.search.remedies.result import RemedyResult, SkippedRemedy, Trial, level_now

__all__ = ["Trial", "SkippedRemedy", "RemedyResult", "search_remedies", "REMEDY_ERRORS"]

#: what a failing remedy raises and the search survives: torch's errors (autograd, shapes), a bad value, or the
#: toolchain's own refusal; anything else is a bug that should stop the search
REMEDY_ERRORS = (RuntimeError, ValueError, QuantLensError)


PROGRESS_FILE = "remedies_progress.json"
_FORMAT = 1


def _progress_problem(data: dict) -> str | None:
    """What is wrong with the fields of a remedies progress file (None: nothing)."""
    if not is_number_map(data.get("measurements")):
        return "'measurements' does not map configurations to finite numbers"
    return None


def _calibrated(model: nn.Module, example: Any, setter: Any, batches: Sequence[Any]) -> nn.Module:
    """``model`` prepared under ``setter`` and calibrated on ``batches``."""
    with warnings.catch_warnings():
        # one prepare per candidate: its warnings would repeat; a model without QuantStub was the user's choice
        # at their own prepare (allow_no_stubs), not refused again
        warnings.simplefilter("ignore")
        return calibrate(prepare(model, example, setter, check_result_dir=None, allow_no_stubs=True), batches)


def _described(key: str) -> str:
    """A measurement's key in words: the kept whole-model remedies, then what was measured on top."""
    applied, _, rest = key.partition("|")
    return f"{rest} after {applied.replace('+', ', ')}" if applied else rest


class _Measure:
    """Measures a configuration once: each value is written to ``out_dir/remedies_progress.json`` as it is
    measured, under a fingerprint of the search's inputs, so a search started again with the same inputs replays
    what it measured and continues (a damaged file is set aside, :mod:`~quantlens.search.progress_file`)."""

    def __init__(self, example, batches, evaluate, higher_is_better, path: Path, fingerprint: str):
        self.example, self.batches, self.evaluate, self.higher = example, batches, evaluate, higher_is_better
        self.path, self.fingerprint = path, fingerprint
        # stacklevel 3: the caller of search_remedies, which constructs this
        data = read_progress(path, fingerprint, _FORMAT, _progress_problem, stacklevel=3)
        self.values: dict[str, float] = {} if data is None else {k: float(v) for k, v in
                                                                 data["measurements"].items()}
        self.replayed = len(self.values)

    def __call__(self, model: nn.Module, setter: Any, key: str, batches: Sequence[Any] | None = None,
                 prepared: nn.Module | None = None) -> float:
        """The metric of ``model`` under ``setter``, calibrated on ``batches`` (default: all of them), or of
        ``prepared`` when already built."""
        if key in self.values:
            return self.values[key]
        if prepared is None:
            prepared = _calibrated(model, self.example, setter, self.batches if batches is None else batches)
        value = call_evaluate(self.evaluate, prepared, f"'{_described(key)}' of the remedy search")
        self.values[key] = value
        atomic_write_text(self.path, json.dumps({"format": _FORMAT, "fingerprint": self.fingerprint,
                                                 "measurements": self.values}, indent=1, sort_keys=True))
        return value

    def better(self, a: float, b: float, margin: float = 0.0) -> bool:
        """Whether ``a`` is better than ``b`` by more than ``margin``."""
        return a > b + margin if self.higher else a < b - margin


#: a deployed value below the fake quant's by less than this (relative) is the same value in float rounding
_SAME = 1e-6


def _sensitive_sites(model, example, setter, measure: _Measure, out_dir: Path) -> tuple[list[str], set[str]]:
    """The op sites whose activation quantization the outputs are most sensitive to, the most first, and the op
    sites whose output is quantized per channel (channel exponents): a range observer is per tensor."""
    from quantlens.profiler import QuantAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = calibrate(prepare(model, example, setter, check_result_dir=None,
                                     allow_no_stubs=True), measure.batches)
    state = prepared._quantlens_state
    per_channel = {plan.name for plan in state.plans.values()
                   if plan.output_fq in state.fq and state.fq[plan.output_fq].ch_axis is not None}
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out_dir, progress=False)
    qa.set_bad_case(example)
    sites: list[str] = []
    for row in qa.sensitivity()[0]:
        if row.sensitive_type == "activation" and row.op_name not in sites:
            sites.append(row.op_name)
    return sites, per_channel


def search_remedies(model: nn.Module, example_inputs: Any, calibration_batches: Sequence[Any],
                    evaluate: Callable[[nn.Module], float], target: float, *,
                    base_setter: Any = default_calibration_qconfig_setter, findings: Sequence[Any] = (),
                    range_sites: int = 8, observers: Sequence[str] = tuple(RANGE_OBSERVERS), int16: bool = True,
                    higher_is_better: bool = True, out_dir: str | os.PathLike = "remedies",
                    int16_budget: Any = None, latency: bool = False, progress: bool = True,
                    report: bool = True, metric: str = "evaluate(prepared)",
                    evaluation_key: str = "", qat: bool = False, qat_budget: QatBudget = QatBudget(),
                    train_qat: Callable[[nn.Module], None] | None = None,
                    deployed: Callable[[nn.Module, Any], float] | None = None) -> RemedyResult:
    """The whole-model remedies of :data:`~.catalog.REMEDIES`, then per-site ranges, then int16 promotion, each
    candidate measured and kept only when it helps (see the module docstring).

    Args:
        evaluate: ``evaluate(prepared) -> float`` on a calibrated model, as for ``search_mixed_precision``.
        findings: the advisor's findings (``QuantAnalysis.advise()``): the op sites of those a range answers are
            tried first, before the most sensitive ones.
        range_sites: how many op sites get the range search.
        int16_budget: the most int16 promotions (``int``) or ``MaxLatency(cycles)``.
        latency: also export -> convert the base, the configuration after each kept remedy and the result, and
            record their latency estimates (``RemedyResult.latency_cycles``, ``Trial.cycles`` of each kept one).
        report: write ``remedies.csv`` and ``remedies.html`` (per finding: remedies tried, measured gain, chosen;
            the int16 curve) to ``out_dir``.
        metric: what ``evaluate`` measures, in words, for the report.
        evaluation_key: what else decides ``evaluate``'s value that the search cannot see (a digest of the
            evaluation data it reads from disk): part of the resume key, with ``evaluate``'s own identity.
        qat: also try QAT as a remedy (``qat_distill``: distillation from the float model on the calibration
            batches, or ``train_qat(prepared)`` when given), after the other whole-model remedies, within
            ``qat_budget``; its checkpoint lives in ``out_dir`` (a resumed search continues it).
        deployed: ``deployed(model, setter) -> float | None``, the metric of the configuration's deployed model
            (the quantized IR: ``prepare`` -> calibrate -> export -> convert, then ``evaluate`` on it; None: it could
            not be measured, and the search goes on without it). Measured once the
            int16 phase is done; where it misses the target by more than the fake quant does (the integer rules
            round differently), the int16 phase runs again aiming that much higher (its measurements replay), and
            the deployed model is measured again: ``RemedyResult.deployed_value``, which ``reached()`` reads too.

    ``model`` is not changed; ``RemedyResult.model`` and ``RemedyResult.setter`` go to ``prepare``. ``evaluate``
    must return one finite number: anything else, or an error it raises, on the base configuration is an
    :class:`~quantlens.search.evaluation.EvaluateError` naming it (on a whole-model remedy's configuration, the
    remedy is skipped with that error). A resumed search replays only measurements made with the same model,
    data, setter, ``evaluate`` (and ``evaluation_key``) and settings.
    """
    out = Path(out_dir)
    check_out_dir(out, "search_remedies")
    batches = list(calibration_batches)
    clock = StepClock()
    with clock.step("base: prepare and calibrate"):
        base_prepared = _calibrated(model, example_inputs, base_setter, batches)
    inputs_key = _fingerprint(model, example_inputs, batches, target, range_sites, observers,
                              setter_identity(base_setter, base_prepared), higher_is_better,
                              evaluate_identity(evaluate) + "|" + evaluation_key)
    measure = _Measure(example_inputs, batches, evaluate, higher_is_better, out / PROGRESS_FILE, inputs_key)
    state = _State(measure, model, base_setter, clock)
    state.qat = QatOptions(qat_budget, train_qat, out, progress) if qat else None
    with clock.step("base: evaluate and the metric's noise", state.count):
        state.best = state.base = measure(model, base_setter, state.key("base"), prepared=base_prepared)
        state.noise = measure_noise(measure, model, base_setter, state.base, state.key("base"))
    base_noise = state.noise
    with SearchBar(len(model_remedies(qat)) + range_sites * len(observers), progress, label="remedies") as bar:
        _model_phase(state, example_inputs, bar)
        _range_phase(state, example_inputs, findings, range_sites, observers, out, target, bar)
    setter = ObserverQconfigSetter(state.chosen, state.setter) if state.chosen else state.setter

    # precision: int16 on top of what the other remedies left
    int16_phase = _Int16Phase(state, example_inputs, batches, evaluate, setter, int16_budget, higher_is_better,
                              progress, evaluation_key)
    if int16 and not _reached(state.best, target, higher_is_better):
        int16_phase.run(target, out / "int16", "int16: ")
    deployed_value = None
    if deployed is not None:
        with clock.step("deployed: export, convert and evaluate the quantized IR"):
            deployed_value = deployed(state.model, int16_phase.setter)
        gap = 0.0 if deployed_value is None else (
            (state.best - deployed_value) if higher_is_better else (deployed_value - state.best))
        if (int16 and gap > _SAME * max(1.0, abs(target)) and _reached(state.best, target, higher_is_better)
                and not _reached(deployed_value, target, higher_is_better)):
            # A higher aim, where the fake quant reached the first one (else the same greedy path ends where the
            # first ended) by more than float rounding (wav2vec2: a gap of 7e-9 repeated the whole phase). Another
            # aim is another search: its own folder, so each resumes its own measurements.
            int16_phase.run(target + gap if higher_is_better else target - gap, out / "int16_deployed",
                            f"int16 again, aiming at {target + gap if higher_is_better else target - gap:.6g}: ")
            with clock.step("deployed: export, convert and evaluate the quantized IR"):
                deployed_value = deployed(state.model, int16_phase.setter)
    setter, promotions, mp = int16_phase.setter, int16_phase.promotions, int16_phase.mp
    cycles = None
    if latency:
        from quantlens.search.remedies.costs import kept_cycles

        with clock.step("latency estimates: export and convert"):
            state.trials, cycles = kept_cycles(state.trials, state.configs, (model, base_setter), example_inputs,
                                               batches)
    result = RemedyResult(state.model, setter, state.best, state.base, dict(state.chosen), promotions,
                          tuple(state.trials), tuple(state.applied), target, higher_is_better,
                          mp.curve if mp is not None else (), cycles, metric, base_noise, tuple(state.skipped),
                          float_model_digest(model), tuple(clock.steps), deployed_value, level_now())
    if report:
        from quantlens.search.remedies.report import write_remedy_report  # (the page: jinja2, on use)

        write_remedy_report(result, out, findings)
    return result


class _Int16Phase:
    """The int16 phase on top of ``setter`` (the configuration the other remedies left); run again with a higher
    aim (the deployed model's gap), it starts from the same configuration and its result replaces the first's."""

    def __init__(self, state: "_State", example, batches, evaluate, setter, budget, higher_is_better: bool,
                 progress: bool, evaluation_key: str):
        self.state, self.example, self.batches, self.evaluate = state, example, batches, evaluate
        self.base, self.setter, self.budget = setter, setter, budget
        self.higher_is_better, self.progress, self.evaluation_key = higher_is_better, progress, evaluation_key
        self.promotions: tuple = ()
        self.mp = None
        self.best_before = state.best
        self.kept_before = (len(state.trials), len(state.configs))

    def run(self, aim: float, out: Path, label: str) -> None:
        from quantlens.search import search_mixed_precision

        state = self.state
        mp = search_mixed_precision(state.model, self.example, self.batches, self.evaluate, aim,
                                    base_setter=self.base, budget=self.budget, out_dir=out,
                                    higher_is_better=self.higher_is_better, progress=self.progress,
                                    evaluation_key=self.evaluation_key)
        self.mp, self.promotions = mp, tuple(mp.chosen)
        del state.trials[self.kept_before[0]:]  # a second run replaces the first's promotions
        del state.configs[self.kept_before[1]:]
        state.best = self.best_before
        if self.promotions:
            self.setter = mp.setter()
            _add_int16_trials(state, mp, self.setter)
            state.best = mp.metric
        state.clock.add(mp.step_times, label)


class _State:
    """The search so far: the float model and setter after the kept whole-model remedies, the chosen ranges, the
    best value, every trial."""

    def __init__(self, measure: _Measure, model: nn.Module, setter: Any, clock: StepClock):
        self.measure, self.model, self.setter, self.clock = measure, model, setter, clock
        self.applied: list[str] = []  # kept whole-model remedies, in order: part of every later key
        self.chosen: dict[str, str] = {}
        self.trials: list[Trial] = []
        self.best = self.base = float("nan")
        self.noise = 0.0
        self.skipped: list[SkippedRemedy] = []
        #: (model, setter) after each kept trial, in the order of the kept trials (their latency cost)
        self.configs: list[tuple[nn.Module, Any]] = []
        #: the QAT remedy's options (None: not tried)
        self.qat: QatOptions | None = None

    def count(self) -> int:
        """How many configurations have been measured (the step clock's counter)."""
        return len(self.measure.values)

    def key(self, *parts: str) -> str:
        return "|".join(["+".join(self.applied)] + list(parts))

    def better(self, value: float) -> bool:
        """Whether ``value`` gains more than the metric's noise over the best so far."""
        return self.measure.better(value, self.best, self.noise)


def _model_phase(state: _State, example: Any, bar: SearchBar) -> None:
    """Each whole-model remedy that applies, measured on top of those kept so far; kept when it helps."""
    for i, remedy in enumerate(model_remedies(state.qat is not None)):
        bar.show(remedy.name, completed=i)
        with state.clock.step(remedy.name, state.count):
            _try_remedy(state, remedy, example)


def _try_remedy(state: _State, remedy, example: Any) -> None:
    """One whole-model remedy on top of those kept so far: applied where it applies, measured, kept when it
    helps (then the metric's noise is measured again); a failure is recorded and skipped."""
    ctx = RemedyContext(state.model, example, state.measure.batches, state.setter, state.qat)
    try:
        if not remedy.applies(ctx):
            return
        model, setter = remedy.apply(ctx)
        value = state.measure(model, setter, state.key(remedy.name))
    except REMEDY_ERRORS as exc:
        # one remedy's failure (DeBERTa's learned ranges: an autograd error) is not the search's: skip it
        state.skipped.append(SkippedRemedy(remedy.name, _one_line(exc)))
        return
    kept = state.better(value)
    state.trials.append(Trial(remedy.kind.value, remedy.name, "", value, kept, state.best if kept else None,
                              noise=state.noise))
    if kept:
        key = state.key(remedy.name)
        state.model, state.setter, state.best = model, setter, value
        state.applied.append(remedy.name)
        state.configs.append((model, setter))
        state.noise = measure_noise(state.measure, model, setter, value, key)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _range_phase(state: _State, example, findings, count: int, observers, out: Path, target: float,
                 bar: SearchBar) -> None:
    """For the findings' op sites a range answers, then the most sensitive ones: each observer, the best kept per
    site when it improves the metric."""
    if not count or _reached(state.best, target, state.measure.higher):
        return
    answered = REMEDIES["range"].findings
    sites = [f.op_name for f in findings if f.rule in answered and f.op_name != "(model)"]
    with state.clock.step("ranges: the profiler's sensitivity"):
        sensitive, per_channel = _sensitive_sites(state.model, example, state.setter, state.measure,
                                                  out / "ranking")
    # (a site the kept channel exponents quantize per channel takes no per-tensor observer: not a candidate)
    sites = [s for s in dict.fromkeys(sites + sensitive) if s not in per_channel][:count]
    with state.clock.step(f"ranges: {len(sites)} op sites x {len(observers)} observers", state.count):
        _range_trials(state, sites, observers, bar)


def _range_trials(state: _State, sites: list[str], observers, bar: SearchBar) -> None:
    """Each observer at each op site on top of the ranges chosen so far; the best per site kept when it helps."""
    done = len(model_remedies())
    for site in sites:
        site_best = None
        for name in observers:
            bar.show(f"range {name} at {site}", completed=done)
            done += 1
            trial = {**state.chosen, site: name}
            key = state.key("ranges", *(f"{s}={o}" for s, o in sorted(trial.items())))
            try:
                value = state.measure(state.model, ObserverQconfigSetter(trial, state.setter), key)
            except REMEDY_ERRORS as exc:  # an observer this site cannot take (a per-tensor one, a per-channel site)
                state.skipped.append(SkippedRemedy(f"range {name} at {site}", _one_line(exc)))
                continue
            improves = state.better(value) and (site_best is None or state.measure.better(value, site_best[1]))
            state.trials.append(Trial("range", name, site, value, False, noise=state.noise))
            if improves:
                site_best = (name, value, key)
        if site_best is not None:
            state.chosen[site] = site_best[0]
            state.trials.append(Trial("range", site_best[0], site, site_best[1], True, state.best,
                                      noise=state.noise))
            state.best = site_best[1]
            setter = ObserverQconfigSetter(dict(state.chosen), state.setter)
            state.configs.append((state.model, setter))
            state.noise = measure_noise(state.measure, state.model, setter, state.best, site_best[2])


def _add_int16_trials(state: _State, mp, final_setter: Any) -> None:
    """One kept trial per chosen promotion, with the metric the mixed-precision curve measured before and after
    the step that added it (a promotion the pruning pass kept; steps that only removed one are skipped); its
    configuration: the promotions so far on the setter the int16 phase started from (the last: the result)."""
    from quantlens.search.setter import MixedPrecisionQconfigSetter

    before, so_far = state.best, []
    chosen = set(mp.chosen)
    for point in mp.curve:
        if point.added is not None and point.added in chosen:
            state.trials.append(Trial("int16", point.added.kind, point.added.site, point.metric, True, before))
            so_far.append(point.added)
            state.configs.append((state.model, MixedPrecisionQconfigSetter(tuple(so_far), mp.base_setter)))
        before = point.metric
    if so_far:
        state.configs[-1] = (state.model, final_setter)


def _reached(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def _fingerprint(model, example, batches, target, range_sites, observers, setter_id: str, higher_is_better,
                 evaluation: str) -> str:
    """What the measurements depend on: the model's weights and code, the data, the base setter's assignments,
    ``evaluate`` (:func:`~quantlens.search.provenance.evaluate_identity`) and the search's settings."""
    h = hashlib.sha256()
    hash_tree(h, dict(model.state_dict()))
    hash_tree(h, example)
    hash_tree(h, batches)
    h.update(json.dumps({"target": float(target), "range_sites": range_sites, "observers": list(observers),
                         "base": setter_id, "higher": higher_is_better, "evaluation": evaluation,
                         "code": model_code_identity(model)}, sort_keys=True).encode())
    return h.hexdigest()
