"""``quantlens fix CONFIG.py --target T``: search the remedies that bring the CONFIG's int8 model to a target.

It calibrates the CONFIG's model with its ``calibration_qconfig_setter``, asks the profiler's advisor for findings
(fake_quant pair, bad case from the evaluation data), then runs :func:`quantlens.search.remedies.search_remedies`
from those findings. The metric is the CONFIG's ``evaluate(model) -> float`` (``higher_is_better``, default
True) or, without one, the mean cosine of the first output against the float model on ``evaluation_data()``.
The console and the page name that metric and its noise (a remedy is kept only when it gains more); a remedy that
fails is skipped with a warning naming it and its error; ``--latency`` prints the latency estimate of the base and
of the result, and each kept remedy's estimate before and after it. An ``evaluate`` that raises or returns anything
but one finite number is a usage error (exit 2) naming it and the configuration; a search resumed in OUT replays
only measurements of the same CONFIG evaluate and evaluation data.
OUT gets ``remedies.html`` / ``remedies.csv`` (per finding: remedies tried, measured gain, chosen), the int16 curve,
and ``remedies.json`` (+ ``remedied_weights.safetensors`` when a transform changed weights), which
``load_remedies(float_model(), OUT, calibration_qconfig_setter)`` turns back into what ``prepare`` takes.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable

from quantlens.cli._common import console, esc, parent
from quantlens.cli.exits import EXIT_OK, EXIT_PROBLEMS, UsageError

__all__ = ["add_parser", "run", "output_cosine_metric", "metric_description"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fix", parents=[parent()], help="search the remedies that bring a CONFIG's quantized model to a target",
        description="Start from the advisor's findings on the CONFIG's calibrated model and try, measuring each on "
        "the CONFIG's metric: equalization, per-channel weights, bias correction, per-site ranges (percentile, KL, "
        "MSE), then int16 promotion for what is left. Writes OUT/remedies.html, remedies.csv, remedies.json.",
        epilog="Exit codes: 0 the target is reached, 1 it is not (the best found is still written), 2 usage or bad "
        "input. Re-run the flow with: model, setter = load_remedies(float_model(), OUT, calibration_qconfig_setter).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("config", metavar="CONFIG.py", help="the configuration file (quantlens analyze --gen writes one)")
    p.add_argument("--target", type=float, required=True, help="the metric to reach")
    p.add_argument("--range-sites", type=int, default=8, help="op sites that get the per-site range search")
    p.add_argument("--no-int16", action="store_true", help="do not promote op sites to int16")
    p.add_argument("--int16-budget", type=int, default=None, help="the most int16 promotions")
    p.add_argument("--latency", action="store_true", help="also estimate the latency (cycles, the march's cost "
                   "model) of the base, the result and each kept remedy")
    p.add_argument("--qat", action="store_true", help="also try QAT as a remedy: distillation from the float model on "
                   "the calibration data (the CONFIG's train_qat(model) when it has one), kept when it helps; at "
                   "consistency level 1 unless --consistency-level says otherwise")
    p.add_argument("--qat-steps", type=int, default=200, help="the QAT remedy's step budget")
    p.add_argument("--qat-seconds", type=float, default=300.0, help="the QAT remedy's time budget")
    p.add_argument("--consistency-level", default=None, choices=["off", "0", "1", "2", "3", "4"],
                   help="the consistency level the search's models are prepared at (docs/consistency.md): 0 converts "
                   "with the high-precision requantize, 1-4 emulate the integer rules in the fake quant, so QAT trains "
                   "the integer model (default: 1 with --qat, else off)")
    p.add_argument("--no-deployed", action="store_true", help="do not check the result's deployed model (export -> "
                   "convert, the metric on the quantized IR; where it misses the target, int16 aims that much higher)")
    p.add_argument("--out", default="quantlens_fix", help="output folder (resumes a search with the same inputs)")
    p.set_defaults(func=run)


def output_cosine_metric(float_model, batches: list) -> Callable[[Any], float]:
    """The default metric: the mean cosine of the first output tensor against ``float_model`` over ``batches``."""
    import torch

    from quantlens.profiler.outputs import named_outputs
    from quantlens.sites.record import call_model

    def call(model, batch):
        tensors = list(named_outputs(call_model(model, batch)).values())
        if not tensors:
            raise UsageError("the model returned no tensor: define evaluate(model) -> float in the CONFIG.")
        return tensors[0].detach().double().flatten(1) if tensors[0].dim() > 1 else tensors[0].double()[None]

    with torch.no_grad():
        refs = [call(float_model, b) for b in batches]

    def evaluate(model) -> float:
        with torch.no_grad():
            values = [torch.nn.functional.cosine_similarity(call(model, b), r, dim=1).mean()
                      for b, r in zip(batches, refs)]
        return float(torch.stack(values).mean())

    return evaluate


def metric_description(cfg) -> str:
    """What ``quantlens fix`` measures for ``cfg``, in words: its ``evaluate`` or the default cosine."""
    if cfg.evaluate is not None:
        return f"evaluate(model) of {Path(cfg.path).name}"
    data = "evaluation_data()" if cfg.evaluation_data is not None else "calibration_data() (no evaluation_data())"
    return f"mean cosine of the first output against the float model on {data} (the CONFIG has no evaluate())"


def _qat_budget(args):
    from quantlens.search.remedies.qat_distill import QatBudget

    if args.qat_steps < 1 or not args.qat_seconds > 0:
        raise UsageError(f"--qat-steps must be >= 1 and --qat-seconds > 0, got {args.qat_steps} and "
                         f"{args.qat_seconds}.")
    return QatBudget(steps=args.qat_steps, seconds=args.qat_seconds)


def run(args) -> int:
    from quantlens.quantization import ConsistencyStrategy

    before = ConsistencyStrategy.get_consistency_level()
    level = args.consistency_level or ("1" if args.qat else "off")  # QAT trains what the integer model computes
    ConsistencyStrategy.set_consistency_level(None if level == "off" else int(level))
    try:
        return _run(args)
    finally:  # (the CLI called in-process leaves the caller's level as it was)
        ConsistencyStrategy.set_consistency_level(before)


def _run(args) -> int:
    import time
    import warnings

    from rich.table import Table

    from quantlens import set_march
    from quantlens._io import writable_dir_problem
    from quantlens.cli.config import load_config
    from quantlens.quantization import ConsistencyStrategy
    from quantlens.search.evaluation import EvaluateError
    from quantlens.search.provenance import data_digest
    from quantlens.search.remedies import save_remedies, search_remedies
    from quantlens.search.remedies.report import latency_change, metric_sentence, step_time_rows

    out = console()
    cfg = load_config(args.config, debug=args.debug or args.sub_debug)
    if not math.isfinite(args.target):
        raise UsageError(f"--target must be a finite number, got {args.target}.")
    out_dir = Path(args.out)
    problem = writable_dir_problem(out_dir)
    if problem is not None:
        raise UsageError(f"--out {out_dir}: {problem}; give --out a folder that can be written.")
    if cfg.march is not None:
        set_march(cfg.march)
    model, example = cfg.float_model(), cfg.example_inputs()
    batches = list(cfg.calibration_data())
    held_out = list((cfg.evaluation_data or cfg.calibration_data)())
    if not batches or not held_out:
        raise UsageError(f"CONFIG {cfg.path}: calibration_data() and evaluation_data() must give at least one batch.")
    evaluate = cfg.evaluate or output_cosine_metric(model, held_out)
    deployed = None if args.no_deployed else DeployedMetric(cfg, example, batches, held_out, evaluate)
    began = time.perf_counter()
    with out.status("advisor findings on the calibrated model"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = _findings(model, example, batches, held_out, cfg, out_dir)
    advisor_seconds = time.perf_counter() - began
    try:
        # the evaluation data's digest keys the resume: another evaluation_data() must not replay old values
        result = search_remedies(model, example, batches, evaluate, args.target,
                                 base_setter=cfg.calibration_qconfig_setter, findings=findings,
                                 range_sites=args.range_sites, int16=not args.no_int16,
                                 higher_is_better=cfg.higher_is_better, out_dir=out_dir,
                                 int16_budget=args.int16_budget, latency=args.latency,
                                 metric=metric_description(cfg), evaluation_key=data_digest(held_out),
                                 qat=args.qat, qat_budget=_qat_budget(args), train_qat=cfg.train_qat,
                                 deployed=deployed)
    except EvaluateError as exc:
        raise UsageError(_evaluate_failed(cfg, exc)) from None
    save_remedies(result, out_dir)
    for skipped in result.skipped:
        out.print(f"warning: remedy {esc(skipped.name)} failed and was skipped: {esc(skipped.error)}")
    out.print(esc(metric_sentence(result)))
    level = ConsistencyStrategy.get_consistency_level()
    out.print(f"models prepared at consistency level {'off' if level is None else level} (--consistency-level)")
    if deployed is not None and deployed.problem:
        out.print(f"warning: the deployed model was not checked: {esc(deployed.problem)}")
    t = Table(title=f"remedies kept ({esc(result.base_value)} -> {esc(result.value)})")
    for col in ("remedy", "op site", "before", "after") + (("latency estimate",) if args.latency else ()):
        t.add_column(col)
    for trial in result.trials:
        if trial.kept:
            cost = (esc(latency_change(*(trial.cycles or (None, None)))),) if args.latency else ()
            t.add_row(esc(f"{trial.kind} {trial.name}"), esc(trial.site or "(model)"), f"{trial.before:.6g}",
                      f"{trial.value:.6g}", *cost)
    out.print(t)
    if result.latency_cycles is not None:
        out.print(f"latency estimate: {esc(latency_change(*result.latency_cycles))} (base -> result)")
    times = Table(title="time per step (seconds)")
    for col in ("step", "seconds", "configurations measured"):
        times.add_column(col)
    times.add_row("advisor findings (calibrate, profile)", f"{advisor_seconds:.1f}", "")
    for row in step_time_rows(result):
        times.add_row(*(esc(c) for c in row))
    out.print(times)
    for line in _closing_lines(result, args.target, out_dir):
        out.print(esc(line))
    return EXIT_OK if result.reached() else EXIT_PROBLEMS


def _closing_lines(result, target: float, out_dir: Path) -> list[str]:
    """The verdict, and how to deploy the configuration chosen: at the consistency level it was measured at."""
    lines = []
    shown = "" if result.deployed_value is None else (f" (fake quant {result.value:.6g}, deployed quantized IR "
                                                      f"{result.deployed_value:.6g})")
    level = result.consistency_level
    if level == "off" and any(s.step.startswith("int16 again") for s in result.step_times):
        lines.append("note: the deployed model rounds differently from the fake quant at consistency level off (the "
                     "cheap requantize profile), so int16 ran again; --consistency-level 0 converts with the "
                     "high-precision requantize, which the fake quant follows (MiniLM: 3 int16 sites instead of 6; "
                     "docs/remedies.md)")
    at = "" if level == "off" else (f" at consistency level {level} (ConsistencyStrategy.set_consistency_level("
                                    f"{level}) before prepare)")
    lines.append(f"target {target}: {'reached' if result.reached() else 'NOT reached'}{shown} with "
                 f"{len(result.int16)} int16 op site(s); report {out_dir / 'remedies.html'}; re-run the flow{at} "
                 f"with load_remedies(float_model(), {str(out_dir)!r}, calibration_qconfig_setter)")
    return lines


class DeployedMetric:
    """``deployed(model, setter)`` for the search: the CONFIG's flow up to the quantized IR (prepare, calibrate,
    pre_export, export, convert) and the metric on it. Exported with the CONFIG's ``dynamic_batch``; with a static
    batch the IR is exported at the first evaluation batch's shapes (the metric runs it on those batches). Where the
    flow or the metric fails, the value is None and ``problem`` says why (the search goes on without it)."""

    def __init__(self, cfg, example, batches: list, held_out: list, evaluate: Callable[[Any], float]):
        self.cfg, self.batches, self.evaluate = cfg, batches, evaluate
        self.example = example if cfg.dynamic_batch else held_out[0]
        self.problem = ""

    def __call__(self, model, setter) -> float | None:
        import warnings

        from quantlens.cli.stages import build_stages
        from quantlens.search.evaluation import EVALUATE_ERRORS, metric_value

        try:  # (the CONFIG's model and metric: any of the errors user code raises is reported, not raised)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stages = build_stages(model, self.example, lambda: self.batches, setter, upto="quantized_ir",
                                      dynamic_batch=self.cfg.dynamic_batch, allow_no_stubs=self.cfg.allow_no_stubs)
                value = metric_value(self.evaluate(stages.quantized_ir), "the deployed quantized IR")
        except EVALUATE_ERRORS as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.problem = (f"{type(exc).__name__}: {first[:300]} (check dynamic_batch in {self.cfg.path}: the "
                            "IR is exported with it; quantlens analyze on the CONFIG names the stage that fails)")
            return None
        self.problem = ""
        return value


def _evaluate_failed(cfg, exc) -> str:
    """The CONFIG's metric failed on a configuration of the search: what, where and how to fix it."""
    if cfg.evaluate is not None:
        return (f"CONFIG {cfg.path}: its evaluate(model) {exc.problem} on the configuration {exc.configuration}; "
                "it must return one finite number (a float, or a one-element tensor) for any stage's model. Fix "
                f"evaluate() in {cfg.path} (call it on a calibrated prepare() of float_model() to see why).")
    return (f"CONFIG {cfg.path}: the default metric ({metric_description(cfg)}) {exc.problem} on the configuration "
            f"{exc.configuration}; the quantized model's first output is not finite there. Define "
            f"evaluate(model) -> float in {cfg.path}, or check the model's outputs.")


def _findings(model, example, batches, held_out, cfg, out_dir: Path) -> list:
    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare

    prepared = calibrate(prepare(model, example, cfg.calibration_qconfig_setter, check_result_dir=None,
                                 allow_no_stubs=cfg.allow_no_stubs), batches)
    qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out_dir / "profiler", post_process=cfg.post_process,
                       progress=False)
    qa.auto_find_bad_case(held_out, num_steps=cfg.num_steps)
    qa.run()
    return list(qa.advise())
