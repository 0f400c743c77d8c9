"""``quantlens analyze CONFIG.py``: run the stages and the stage-pair analyses, write the reports.

``quantlens analyze --gen CONFIG.py`` writes a commented CONFIG template for the bundled digits CNN.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape

from quantlens.cli._common import console, parent
from quantlens.cli.exits import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, UsageError
from quantlens.cli.pair_result import pair_stages
from quantlens.cli.pipeline import PAIRS, STAGE_CHOICES, onnxruntime_available

__all__ = ["add_parser", "run", "kinds_for", "index_title", "SUMMARY_EXTRAS"]

#: what ``summary.json`` holds besides what is computed from the pairs (``quantlens report`` keeps these as they
#: are, in this order, and recomputes the rest from the pairs' reports)
SUMMARY_EXTRAS = ("config", "title", "failed_stage", "stage_metrics")

#: the last stage each analysis type needs
UPTO = {"fake_quant": "calibration", "pre_export": "pre_export", "export": "qat_ir", "convert": "quantized_ir",
         "onnxruntime": "onnx"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "analyze", parents=[parent()], help="run the stages and the stage-pair analyses of a CONFIG file",
        description="Build the stages a CONFIG.py file defines (float -> calibration -> QAT -> pre_export -> qat IR "
        "-> quantized IR [-> ONNX]) and compare each chosen pair of neighbouring stages with QuantAnalysis: bad "
        "case, per-layer comparison, advisor, sensitivity. Each pair writes its reports into OUT/<stage>/; "
        "OUT/index.html links every pair's profiler.html and OUT/summary.json names the worst op per pair.",
        epilog="Exit codes: 0 no problem found, 1 the advisor reported abnormal layers (advice alone does not "
        "count) or a deployed op diverged (more than 4 LSB), 2 usage or bad input (CONFIG missing or failing).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("config", metavar="CONFIG.py", help="the configuration file (see --gen)")
    p.add_argument("--gen", action="store_true",
                   help="write a commented CONFIG template for the bundled digits CNN to CONFIG.py and exit")
    p.add_argument("--force", action="store_true", help="with --gen: overwrite an existing file")
    p.add_argument("--stage", choices=STAGE_CHOICES, default="all",
                   help="which stage pair to analyse (analysis type); 'all' runs every pair")
    p.add_argument("--out", default="quantlens_analysis", help="output folder")
    p.add_argument("--no-sensitivity", action="store_true", help="skip the per-quantizer sensitivity tables")
    p.set_defaults(func=run)


def kinds_for(stage: str) -> list[str]:
    return list(PAIRS) if stage == "all" else [stage]


def index_title(config: Path) -> str:
    """The title of the ``index.html`` of an analysis of ``config`` (kept in ``summary.json``)."""
    return f"quantlens analyze {config.name}"


def run(args) -> int:
    out = console()
    path = Path(args.config)
    if args.gen:
        from quantlens._io import atomic_write_text
        from quantlens.cli.config import TEMPLATE

        if path.exists() and not args.force:
            raise UsageError(f"{path} exists; pass --force to overwrite it.")
        if path.suffix != ".py":
            raise UsageError(f"the template must be written to a .py file, got {str(path)!r}.")
        atomic_write_text(path, TEMPLATE)
        out.print(f"wrote {path}: run it with 'quantlens analyze {path}'")
        return EXIT_OK
    from quantlens.cli.config import load_config

    debug = args.debug or args.sub_debug
    cfg = load_config(path, debug=debug)
    kinds = kinds_for(args.stage)
    if args.stage == "onnxruntime" and not onnxruntime_available():
        raise UsageError("--stage onnxruntime needs onnx and onnxruntime: pip install 'quantlens[onnx]'.")
    return analyze_config(cfg, kinds, Path(args.out), sensitivity=not args.no_sensitivity, console=out)


def analyze_config(cfg, kinds: list[str], out_dir: Path, *, sensitivity: bool = True, console=None,
                   progress: bool = True) -> int:
    """Build the stages ``kinds`` need, analyse each pair, write index.html and summary.json; the exit code."""
    from quantlens import set_march
    from quantlens.cli.pipeline import analyze_pairs, build_stages, print_losses, write_index, write_summary

    order = list(UPTO.values())
    upto = max((UPTO[k] for k in kinds), key=order.index)
    if cfg.march is not None:
        set_march(cfg.march)
    out_dir.mkdir(parents=True, exist_ok=True)
    example = cfg.example_inputs()
    data = cfg.evaluation_data or cfg.calibration_data
    done: dict[str, Any] = {}

    def analyse(stages, ready: list[str]) -> None:
        done.update(zip(ready, analyze_pairs(stages, ready, out_dir, data, example, post_process=cfg.post_process,
                                             num_steps=cfg.num_steps, sensitivity=sensitivity, progress=progress,
                                             step=lambda s: console.rule(f"[bold]{s}"))))

    with console.status("building the stages") as status:
        def built(stage: str, stages) -> None:
            # each pair is analysed (its reports written) as soon as its two models exist: a later stage that is
            # slow or fails does not hold back what is already known
            ready = [k for k in kinds if k not in done and all(getattr(stages, n) is not None
                                                                for n in pair_stages(k, stages))]
            if ready:
                status.stop()  # one live display at a time: the analyses show their own progress
                analyse(stages, ready)
                status.start()

        stages = build_stages(cfg.float_model(), example, cfg.calibration_data, cfg.calibration_qconfig_setter,
                              qat_qconfig_setter=cfg.qat_qconfig_setter, train_qat=cfg.train_qat, upto=upto,
                              out_dir=out_dir, dynamic_batch=cfg.dynamic_batch, allow_no_stubs=cfg.allow_no_stubs,
                              step=lambda s: status.update(f"building the stages: {s}"), keep_going=True,
                              built=built)
    analyse(stages, [k for k in kinds if k not in done])  # the pairs never built: reported as skipped, with why
    results = [done[k] for k in kinds]
    for f in stages.files:
        console.print(f"wrote {f}")
    metrics = []
    if cfg.evaluate is not None:  # the task metric per stage
        from quantlens.cli.stage_metrics import metrics_table, stage_metrics

        with console.status("evaluate(model) on every stage"):
            metrics = stage_metrics(stages, cfg.evaluate)
        console.print(metrics_table(metrics, cfg.higher_is_better))
    title = index_title(cfg.path)
    index = write_index(results, out_dir, title, metrics=metrics)
    extra = {"config": str(cfg.path), "title": title}
    if stages.failed:
        extra["failed_stage"] = {"stage": stages.failed, "error": stages.error}
    if metrics:
        extra["stage_metrics"] = [{"stage": m.stage, "value": m.value, "error": m.error} for m in metrics]
    summary = write_summary(results, out_dir, extra)
    print_losses(console, results)
    for r in results:
        if r.skipped:
            console.print(f"[yellow]skipped {r.analysis_type}[/]: {r.skipped}")
        elif r.findings:
            advice = len(r.findings) - len(r.problem_findings)
            console.print(f"{r.analysis_type}: {len(r.findings)} advisor finding(s)"
                          f"{f' ({advice} advice only)' if advice else ''}, see "
                          f"{out_dir / r.folder / 'abnormal_layer_advisor.txt'}")
    console.print(f"wrote {index} and {summary}")
    if stages.failed:  # the pairs before it are analysed and written; the failure is the exit code
        from rich.console import Console

        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"[bold red]error:[/] stage {stages.failed} failed: {escape(stages.error)} (the pairs built before it "
            "are reported above; run the Python flow up to that stage for the traceback)")
        return EXIT_USAGE
    return EXIT_PROBLEMS if any(r.problems for r in results) else EXIT_OK
