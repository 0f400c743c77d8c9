"""The coverage sweep: every architecture of quantlens.zoo.architectures (transformers' own module code, tiny random
configs) and the real pretrained models of quantlens.zoo.third_party through every stage, with each stage's
agreement with the one before it; writes docs/coverage_zoo.md (``--auto``: every buildable transformers model class,
docs/coverage.md and docs/coverage.json).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_coverage.py [--jobs 2] [--models bert llama ...]
      [--out FILE] [--auto]

``--auto``: instead of the hand-picked list, every model class of transformers that builds from its own config
class with a tiny config (quantlens.zoo.auto_architectures); the models that cannot be built offline are listed
apart with why, and a summary per family leads.

Each model runs in its own process (``--jobs`` at a time, one torch thread each), so one model's crash or memory
cannot take the sweep down, and the figures do not depend on the order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from quantlens.zoo.architectures import ARCHITECTURES
from quantlens.zoo.coverage import (
    NOT_EXPORTABLE,
    ONNXRUNTIME_PAIR,
    PAIRS,
    THRESHOLDS,
    CoverageResult,
)

ROOT = Path(__file__).resolve().parent.parent
_CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
from quantlens.zoo.coverage import run_stages, third_party_case
from quantlens.zoo.architectures import ARCHITECTURES, build
name, qconfig = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["auto"]:
    from quantlens.zoo.auto_architectures import build_auto
    try:
        model, example, batches, held_out = build_auto(name)
    except Exception as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(json.dumps({"name": name, "qconfig": qconfig, "failed": "build", "error": why, "agreements": {},
                          "seconds": {}}))
        sys.exit(0)
    print("#built", flush=True)  # a crash from here on is a stage's, not the build's
elif name in ARCHITECTURES:
    model, example, batches, held_out = build(name)
else:
    model, example, batches, held_out = third_party_case(name)
r = run_stages(name, model, example, batches, held_out, qconfig)
print(json.dumps({"name": name, "qconfig": qconfig, "failed": r.failed_stage, "error": r.error,
                  "agreements": r.agreements, "seconds": r.seconds, "convert_worst_step": r.convert_worst_step,
                  "random_draws": r.random_draws, "pre_export_worst_step": r.pre_export_worst_step,
                  "onnxruntime_worst_step": r.onnxruntime_worst_step}))
"""


def _third_party_names() -> list[str]:
    from quantlens.zoo.third_party import THIRD_PARTY_MODELS
    from quantlens.zoo.third_party_more import MORE_THIRD_PARTY_MODELS

    return sorted({**THIRD_PARTY_MODELS, **MORE_THIRD_PARTY_MODELS})


def run_one(name: str, qconfig: str, timeout: float, auto: bool = False) -> dict:
    """One model in a child process; its result (a failure to even run is recorded as such). ``auto``: the model
    is built by quantlens.zoo.auto_architectures.build_auto."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, name, qconfig] + (["auto"] if auto else []),
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": name, "qconfig": qconfig, "failed": "timeout", "error": f"over {timeout:.0f} s",
                "agreements": {}, "seconds": {}}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        stage = "crash" if "#built" in done.stdout.splitlines() else "build"
        return {"name": name, "qconfig": qconfig, "failed": stage, "error": tail[0], "agreements": {},
                "seconds": {"total": time.perf_counter() - start}}
    return json.loads(lines[-1])


def _result(row: dict) -> CoverageResult:
    return CoverageResult(row["name"], row["qconfig"], row["failed"], row["error"], row["agreements"],
                          convert_worst_step=row.get("convert_worst_step"), random_draws=row.get("random_draws", False),
                          pre_export_worst_step=row.get("pre_export_worst_step"),
                          onnxruntime_worst_step=row.get("onnxruntime_worst_step"))


def _passed(row: dict) -> bool:
    """Every stage and every threshold, the convert pair by the criterion for random-weight nets."""
    return _result(row).passed


def _cell(row: dict, pair: str) -> str:
    value = row["agreements"].get(pair)
    if value is None:
        return "– (random draws)" if row.get("random_draws") and pair == ONNXRUNTIME_PAIR else "–"
    if value >= THRESHOLDS[pair] - 1e-9:
        return f"{value:.5f}"
    worst = _result(row).worst_step(pair)
    if pair not in _result(row).below() and worst is not None:  # the per-op criterion
        return f"{value:.5f} ({'tables' if pair == 'pre_export vs fake quant' else 'ops'} ≤ {worst:.2f} step)"
    return f"{value:.5f} ✗"


#: the convert criterion, as decided (issue #41) and as quantlens.zoo.coverage applies it
_CRITERION = ("**The convert criterion for random-weight nets.** Random weights make a network amplify rounding block "
              "after block, so its output cosine after convert says little about the kernels. The quantized IR "
              "passes when its output cosine to the qat IR is at least 0.998, or, where it is lower, when every op "
              "on the NPU is within one output step of the qat IR on the same input (the profiler's same-input run "
              "on the held-out batch; host ops are float and left out): the march then adds no more than its one "
              "documented rounding per op. Such cells show the worst op's steps. Trained models keep their task "
              "metrics (docs/remedies.md). The pre_export pair has the same criterion: where its cosine is below "
              "0.99, it passes when every lookup table is within one output step of the float op it replaces on the "
              "same input (quantization.pre_export.lut_errors); such cells show the worst table's steps. So does the "
              "onnxruntime pair: onnxruntime's own float kernels round differently, and where its cosine is below "
              "0.999 it passes when every stretch of the ONNX model between two fake quants, run by onnxruntime on "
              "the qat IR's own inputs, is within one output step (quantlens.zoo.onnx_same_input). A model "
              "that draws random numbers in forward (ViT-MAE's masking, a "
              "VAE's sample) runs every stage from one seed of torch's generator; onnxruntime draws from its own, so "
              "its pair reads '– (random draws)' and is not required.")


def write_markdown(rows: list[dict], path: Path, threads: int, jobs: int) -> None:
    """docs/coverage_zoo.md from the sweep's rows (the same rows give the same file)."""
    pairs = [p for p, _, _ in PAIRS]
    arch = [r for r in rows if r["name"] in ARCHITECTURES]
    real = [r for r in rows if r["name"] not in ARCHITECTURES]
    lines = ["# Coverage sweep", "",
             "Generated by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_coverage.py` "
             f"({jobs} model(s) at a time, {threads} torch thread each). Each model goes through prepare → "
             "calibration (4 batches) → pre_export → export → convert → save → load → to_onnx → onnxruntime at its "
             "default options; each column is the cosine of a stage's output against the stage it must keep, on one "
             "held-out batch (✗: under the threshold in the header). Why the models below \"quantized IR vs qat IR\" "
             "miss it (every op within one step of the qat IR on the same input): "
             "[coverage_floor.md](coverage_floor.md).", "", _CRITERION, ""]
    for title, group in (("transformers architectures (tiny random configs)", arch),
                         ("Real pretrained models from pip wheels", real)):
        if not group:
            continue
        ok = sum(_passed(r) for r in group)
        lines += [f"## {title}", "", f"**{ok} of {len(group)} pass every stage and every threshold "
                  f"({100.0 * ok / len(group):.0f} %).**", "",
                  "| model | family | qconfig | stopped at | " + " | ".join(
                      f"{p} (≥ {THRESHOLDS[p]})" for p in pairs) + " |",
                  "|" + "---|" * (4 + len(pairs))]
        for r in sorted(group, key=lambda r: (r["name"], r["qconfig"])):
            a = ARCHITECTURES.get(r["name"])
            family = f"{a.family} / {a.kind}" if a else "real"
            stopped = "—" if r["failed"] is None else f"**{r['failed']}**"
            lines.append(f"| {r['name']} | {family} | {r['qconfig']} | {stopped} | "
                         + " | ".join(_cell(r, p) for p in pairs) + " |")
        failures = [r for r in group if r["failed"] is not None]
        if failures:
            lines += ["", "Stopped:", ""]
            lines += [f"- **{r['name']}** ({r['qconfig']}) at {r['failed']}: {r['error'][:400]}" for r in failures]
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _family_summary(rows: list[dict], archs: dict, skipped: dict) -> list[str]:
    """The summary per family: enumerated, built, passed, and where the others stopped."""
    stats: dict[str, dict] = {}
    for r in rows:
        family = archs[r["name"]].family if r["name"] in archs else "?"
        s = stats.setdefault(family, {"names": set(), "built": set(), "passed": 0, "cases": 0, "stops": {}})
        s["names"].add(r["name"])
        if r["failed"] != "build":
            s["built"].add(r["name"])
            s["cases"] += 1
            s["passed"] += _passed(r)
            stop = r["failed"] or ("below a threshold" if not _passed(r) else None)
            if stop:
                s["stops"][stop] = s["stops"].get(stop, 0) + 1
    lines = ["| family | enumerated | built | passed every stage | stopped at |", "|---|---|---|---|---|"]
    for family in sorted(stats):
        s = stats[family]
        stops = ", ".join(f"{k} {v}" for k, v in sorted(s["stops"].items(), key=lambda kv: -kv[1])) or "—"
        lines.append(f"| {family} | {len(s['names'])} | {len(s['built'])} | {s['passed']} of {s['cases']} | {stops} |")
    lines.append(f"| not enumerated (not one input of one kind, a missing package) | {len(skipped)} | 0 | – | – |")
    return lines


def write_auto_markdown(rows: list[dict], archs: dict, skipped: dict, path: Path, jobs: int) -> None:
    """The ``--auto`` sweep's page: a summary per family, the built models through every stage, and the models
    not built (not enumerated, or failed to build / to run a float forward), each with why."""
    pairs = [p for p, _, _ in PAIRS]
    built = [r for r in rows if r["failed"] != "build"]
    ok = sum(_passed(r) for r in built)
    exportable = [r for r in built if r["failed"] != NOT_EXPORTABLE]
    names = {r["name"] for r in rows}
    lines = ["# Coverage sweep: every transformers model class with a tiny config", "",
             "Generated by `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_coverage.py --auto` "
             f"({jobs} model(s) at a time, 1 torch thread each): every base model class of transformers' auto "
             "mapping that takes one kind of input, built from its own config class with the sizes shrunk "
             "automatically (quantlens.zoo.auto_architectures), through the same stages as docs/coverage.md.", "",
             _CRITERION, "",
             "Each row was measured at the commit the JSON (docs/coverage.json) names for it: "
             + ", ".join(f"{c} ({n} rows)" for c, n in sorted(Counter(r.get("commit", "before commits were recorded")
                                                                        for r in rows).items())) + ".", "",
             f"**{len(names) + len(skipped)} model types; {len(names)} enumerated, "
             f"{len({r['name'] for r in built})} built, {ok} of {len(built)} runs pass every stage and every "
             f"threshold; of the {len(exportable)} that torch.export exports in float, "
             f"{100.0 * ok / max(len(exportable), 1):.1f} % pass.**", "",
             f"({len(built) - len(exportable)} built model(s) are refused by torch.export itself, in float, before "
             "quantlens does anything: 'not exportable' below, with torch's error.)", "", "## Summary per family", ""]
    lines += _family_summary(rows, archs, skipped)
    lines += ["", "## Built", "", "| model | family | qconfig | stopped at | " + " | ".join(
        f"{p} (≥ {THRESHOLDS[p]})" for p in pairs) + " |", "|" + "---|" * (4 + len(pairs))]
    for r in sorted(built, key=lambda r: (r["name"], r["qconfig"])):
        stopped = "—" if r["failed"] is None else f"**{r['failed']}**"
        lines.append(f"| {r['name']} | {archs[r['name']].family if r['name'] in archs else '?'} | {r['qconfig']} | "
                     f"{stopped} | " + " | ".join(_cell(r, p) for p in pairs) + " |")
    failures = [r for r in built if r["failed"] is not None]
    if failures:
        lines += ["", "Stopped:", ""]
        lines += [f"- **{r['name']}** ({r['qconfig']}) at {r['failed']}: {r['error'][:400]}" for r in failures]
    not_built = {r["name"]: ("build", r["error"]) for r in rows if r["failed"] == "build"}
    not_built.update({name: ("enumeration", why) for name, why in skipped.items()})
    lines += ["", "## Not built, with why", "", f"{len(not_built)} model types.", "", "| model | at | why |",
              "|---|---|---|"]
    lines += [f"| {name} | {at} | {why[:300].replace('|', '/')} |" for name, (at, why) in sorted(not_built.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main_auto(args) -> None:
    """``--auto``: the enumerated architectures (each built by build_auto in its child), the others apart."""
    from quantlens.zoo.auto_architectures import enumerate_architectures

    archs, skipped = enumerate_architectures()
    kept: list[dict] = []
    if args.update:  # re-run the named models into the sweep on disk; every other row is kept as it was measured
        if not args.models or not args.json.exists():
            raise SystemExit(f"--update re-runs --models into an existing {args.json}; name models, run the sweep first")
        kept = [r for r in json.loads(args.json.read_text(encoding="utf-8")) if r["name"] not in set(args.models)]
    elif args.models:  # the named ones only: those not enumerated go to the table apart
        skipped = {n: skipped.get(n, "not a model type of transformers' base-model mapping") for n in args.models
                   if n not in archs}
    names = [n for n in args.models or archs if n in archs]
    cases = [(n, q) for n in names for q in args.qconfigs]
    rows: list[dict] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, n, q, args.timeout, True) for n, q in cases]
        for future in as_completed(futures):
            r = future.result()
            r["commit"] = _commit()
            rows.append(r)
            status = "not built" if r["failed"] == "build" else "ok" if _passed(r) else (r["failed"] or "below")
            print(f"[{len(rows)}/{len(cases)}] {r['name']:<28} {r['qconfig']:<6} {status:<12} "
                  + (r["error"][:120] if r["failed"] else " ".join(f"{v:.5f}" for v in r["agreements"].values())),
                  flush=True)
            # after every model: a long sweep's partial result is on disk (the rows first: a rendering problem
            # must not lose the models measured so far)
            every = sorted(kept + rows, key=lambda r: (r["name"], r["qconfig"]))
            if args.json:
                args.json.write_text(json.dumps(every, indent=1, sort_keys=True), encoding="utf-8")
            write_auto_markdown(every, archs, skipped, args.out, args.jobs)
    print(f"wrote {args.out}")


def _commit() -> str:
    """The checkout's commit (with ``+`` when it has uncommitted changes): which code measured a row."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT)
    return (head.stdout.strip() or "unknown") + ("+" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, help="default: every architecture and real model")
    parser.add_argument("--qconfigs", nargs="*", default=["int8"], choices=["int8", "w8a16"],
                        help="for the architectures (the real models run at both)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: docs/coverage.md with --auto, docs/coverage_zoo.md without")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the rows as JSON (default with --auto: docs/coverage.json, which the test "
                             "suite's sample draws from)")
    parser.add_argument("--update", action="store_true",
                        help="with --auto and --models: re-run those models into the existing --json sweep and write "
                             "the page from all its rows (each row names the commit that measured it)")
    parser.add_argument("--auto", action="store_true",
                        help="every transformers model class that builds with a tiny config, not the hand-picked list")
    args = parser.parse_args()
    if args.out is None:
        args.out = ROOT / "docs" / ("coverage.md" if args.auto else "coverage_zoo.md")
    if args.auto and args.json is None:
        args.json = ROOT / "docs" / "coverage.json"
    if args.auto:
        main_auto(args)
        return
    names = args.models or list(ARCHITECTURES) + _third_party_names()
    # the real models run at int8 and w8a16 (their task metrics in docs/zoo.md are measured at both)
    cases = [(n, q) for n in names for q in (args.qconfigs if n in ARCHITECTURES else ("int8", "w8a16"))]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda c: run_one(c[0], c[1], args.timeout), cases))
    for r in rows:
        print(f"{r['name']:<20} {r['qconfig']:<6} {'ok' if _passed(r) else (r['failed'] or 'below'):<12} "
              + " ".join(f"{v:.5f}" for v in r["agreements"].values()), flush=True)
    write_markdown(rows, args.out, 1, args.jobs)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
