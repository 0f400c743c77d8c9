"""``quantlens report OUT_DIR``: re-render the text, CSV and HTML reports from saved traces, without models.

QuantAnalysis keeps both traces on disk (``baseline_model/``, ``analysis_model/``) and ``compare_per_layer``
only reads them, so the reports can be rebuilt from the folder alone: :func:`render_pair` does what
``compare_per_layer`` + ``advise`` do, from the traces and ``quantlens_pair.json`` (written by
``quantlens analyze``; for a folder written by your own QuantAnalysis, pass ``--type``).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from quantlens.cli._common import console, existing_dir, parent
from quantlens.cli.exits import EXIT_OK, EXIT_PROBLEMS, UsageError
from quantlens.cli.pipeline import PAIR_FILE, PAIRS, SUMMARY_FILE, PairResult, ort_note, summarize
from quantlens.errors import QuantLensError
from quantlens.profiler.report_files import ADVISOR_FILE, COMPARE_CSV, COMPARE_TEXT, PROFILER_HTML

__all__ = ["add_parser", "run", "render_pair", "pair_dirs", "read_pair_meta"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", parents=[parent()], help="re-render the reports of an earlier analyze run from its traces",
        description="Re-render compare_per_layer_out.txt/.csv, profiler.html and abnormal_layer_advisor.txt of "
        "every stage pair in OUT_DIR (a 'quantlens analyze' output folder, or one QuantAnalysis out_dir) from the "
        "saved traces, and index.html / summary.json: no model is run.",
        epilog="Exit codes: 0 no problem, 1 advisor findings or a diverged op, 2 no traces / bad input.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder written by 'quantlens analyze' (or a QuantAnalysis "
                   "out_dir with baseline_model/ and analysis_model/)")
    p.add_argument("--type", choices=list(PAIRS), default=None,
                   help="the analysis type of a folder without quantlens_pair.json (a QuantAnalysis out_dir)")
    p.add_argument("--prefix", action="append", default=None, help="keep op sites whose name starts with this "
                   "(repeatable)")
    p.set_defaults(func=run)


def _is_pair(folder: Path) -> bool:
    return (folder / "baseline_model" / "trace.json").is_file() and (folder / "analysis_model" / "trace.json").is_file()


def pair_dirs(root: Path) -> list[Path]:
    """``root`` itself when it holds both traces, else its subfolders that do (pipeline order first)."""
    if _is_pair(root):
        return [root]
    order = {k: i for i, k in enumerate(PAIRS)}
    found = [d for d in root.iterdir() if d.is_dir() and _is_pair(d)]
    return sorted(found, key=lambda d: (order.get(d.name, len(order)), d.name))


#: what ``quantlens_pair.json`` may hold (every field optional, None allowed unless marked ``!``) and each field's type
_PAIR_FIELDS = {"analysis_type": str, "baseline": str, "analysis": str, "fake_quant_state": str, "consistency": dict,
                "onnxruntime": dict}
_NESTED = {
    "consistency": {"level": int, "qpp": str, "known": bool, "source": str, "baseline_rules": str, "pair_note": str,
                    "march": str},
    "onnxruntime": {"optimization!": str, "form": str, "outputs_only!": bool, "output_check": dict},
    "output_check": {"level": str, "equal!": bool, "max_abs_diff!": (int, float)},
}


def _fields_problem(data, schema: dict, where: str, strict: bool) -> str | None:
    """What is wrong with the JSON object ``data`` against ``schema`` (see :data:`_PAIR_FIELDS`), or None."""
    if not isinstance(data, dict):
        return f"{where} is {type(data).__name__}, not an object"
    types = {k.rstrip("!"): t for k, t in schema.items()}
    for key in (k.rstrip("!") for k in schema if k.endswith("!")):
        if data.get(key) is None:
            return f"{where} lacks {key}"
    for key, value in data.items():
        kind = types.get(key)
        if kind is None and strict:
            return f"{where} has the unknown field {key!r}"
        if kind is None or value is None:
            continue
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            return f"{where}.{key} is {value!r}, not of type {getattr(kind, '__name__', 'number')}"
        if key in _NESTED:
            problem = _fields_problem(value, _NESTED[key], f"{where}.{key}", True)
            if problem:
                return problem
    return None


def read_pair_meta(folder: Path) -> dict:
    """``folder``'s ``quantlens_pair.json`` ({} where there is none), checked: a damaged one is refused, named."""
    path = folder / PAIR_FILE
    if not os.path.lexists(path):
        return {}
    try:
        if not path.is_file():  # (a FIFO would block the read)
            raise ValueError("it is not a regular file")
        meta = json.loads(path.read_text(encoding="utf-8"))
        problem = _fields_problem(meta, _PAIR_FIELDS, "the file", False)
        if problem is None and meta.get("analysis_type") not in (None, *PAIRS):
            problem = f"analysis_type {meta['analysis_type']!r} is not one of {', '.join(PAIRS)}"
    except (OSError, ValueError) as exc:
        problem = str(exc) or type(exc).__name__
    if problem:
        raise QuantLensError(f"{path} cannot be read: {problem}. It is written by 'quantlens analyze': run it again "
                             "into a fresh --out folder, or remove the file and pass --type.")
    return meta


def render_pair(folder: Path, analysis_type: str | None = None, prefixes=None) -> PairResult:
    """Rebuild one pair's per-layer comparison, advisor and HTML from its traces; returns its summary (the same
    verdict and worst op as ``quantlens analyze`` wrote, from the same rows)."""
    from quantlens.profiler.advisor import AdvisorContext, advise
    from quantlens.profiler.compare import compare_traces
    from quantlens.profiler.compare_cache import COMPARISON_FILE, load_comparison, save_comparison
    from quantlens.profiler.html import write_html
    from quantlens.profiler.model_access import ConsistencyInfo, parse_analysis_type
    from quantlens.profiler.pair_facts import find_facts
    from quantlens.profiler.reach import mark, reached_only
    from quantlens.profiler.report import write_advisor, write_compare_csv, write_compare_text
    from quantlens.profiler.trace.reader import TraceReader

    meta = read_pair_meta(folder)
    traces = [TraceReader(folder / f"{label}_model") for label in ("baseline", "analysis")]
    for trace, label in zip(traces, ("baseline", "analysis")):
        if trace.label != label:  # (a folder copied or linked over the other one)
            raise QuantLensError(f"{trace.dir} holds the trace of the {trace.label} model, not of the {label} model. "
                                 "Run the analysis again into a fresh out_dir.")
    # what the analysis knew besides the traces (the models' bias saturation, reach, consistency, its sensitivity
    # ranking), saved for these very traces: the reports come out as the analysis wrote them
    facts = find_facts(folder, *traces)
    kind = analysis_type or meta.get("analysis_type") or (facts.analysis_type if facts is not None else None)
    if kind is None:
        raise UsageError(f"{folder} has no {PAIR_FILE} (it was not written by 'quantlens analyze'): pass --type "
                         f"({', '.join(PAIRS)}).")
    atype = parse_analysis_type(kind)
    # the rows the analysis saved from these very traces (compare_per_layer.json): no tensor is read again
    comparison = load_comparison(folder / COMPARISON_FILE, *traces)
    if comparison is not None and prefixes:
        comparison.rows = [r for r in comparison.rows if any(r.op_name.startswith(p) for p in prefixes)]
    try:
        if comparison is None:
            comparison = compare_traces(*traces, prefixes, None, deployed=atype.deployed)
            if facts is not None and facts.reach is not None:  # (rows computed from the traces have no marks)
                comparison = mark(comparison, facts.reach)
            if not prefixes:  # the next report reads it back (only a speed-up: a folder in its place is left)
                with contextlib.suppress(IsADirectoryError, NotADirectoryError, PermissionError):
                    save_comparison(comparison, folder / COMPARISON_FILE, *traces)
    except QuantLensError as exc:  # (the op sites' match is checked without the folders' names)
        if str(folder) in str(exc):
            raise
        raise QuantLensError(f"The traces in {folder}: {exc}") from None
    if facts is not None:
        consistency, state = facts.consistency, facts.fake_quant_state
    else:  # a folder of an older analysis: what quantlens_pair.json kept
        consistency = ConsistencyInfo(**meta["consistency"]) if meta.get("consistency") else None
        state = meta.get("fake_quant_state")
    comparison.consistency = consistency
    ctx = AdvisorContext(reached_only(comparison), atype.value, state, consistency,
                         bias=facts.bias if facts is not None else {}, eager=facts.eager if facts is not None else None)
    findings = advise(ctx)
    write_advisor(findings, folder / ADVISOR_FILE, consistency)
    write_compare_text(comparison, folder / COMPARE_TEXT,
                       sensitivity=facts.sensitivity if facts is not None else None)
    write_compare_csv(comparison, folder / COMPARE_CSV)
    write_html(comparison, findings, folder / PROFILER_HTML)
    base, analy = PAIRS[atype.value]
    result = PairResult(atype.value, meta.get("baseline", base), meta.get("analysis", analy), folder.name,
                        findings=[asdict(f) for f in findings], lsb=comparison.lsb_summary(),
                        sensitivity_top=facts.sensitivity_top if facts is not None else [],
                        note=ort_note(meta.get("onnxruntime")))
    return summarize(result, comparison)


def run(args) -> int:
    from quantlens.cli.pipeline import print_losses, write_index, write_summary

    out = console()
    root = existing_dir(args.out_dir, "OUT_DIR")
    folders = pair_dirs(root)
    if not folders:
        raise UsageError(f"{root} holds no traces (baseline_model/trace.json and analysis_model/trace.json, in it "
                         "or in its subfolders). Run 'quantlens analyze CONFIG.py --out DIR' first.")
    if args.type and len(folders) > 1:
        raise UsageError("--type applies to one QuantAnalysis folder; this folder holds several pairs.")
    from quantlens._io import check_writable

    # a read-only folder, a full disk: said before any pair is rendered (nothing half-written)
    for folder in folders + ([root] if folders != [root] else []):
        check_writable(folder, "quantlens report", "make it writable, or copy OUT_DIR to a writable place and run "
                       "'quantlens report' on the copy (it rewrites the reports in place)")
    results = []
    for folder in folders:
        results.append(render_pair(folder, args.type, args.prefix))
        out.print(f"re-rendered {folder}: compare_per_layer_out.txt/.csv, profiler.html, abnormal_layer_advisor.txt")
    if folders != [root]:  # an analyze folder: its index and summary too
        from quantlens.cli.analyze import SUMMARY_EXTRAS, index_title

        extra = {}
        old = root / SUMMARY_FILE
        if old.is_file():
            try:  # what analyze knew besides the pairs (the rest of the summary is computed from the pairs)
                saved = json.loads(old.read_text(encoding="utf-8"))
                extra = {k: saved[k] for k in SUMMARY_EXTRAS if isinstance(saved, dict) and k in saved}
            except ValueError:
                extra = {}
        title = extra.get("title")
        if not isinstance(title, str):  # a summary of an older analyze: its title came from the CONFIG's name
            config = extra.get("config")
            title = index_title(Path(config)) if isinstance(config, str) else f"quantlens report {root.name}"
        metrics = extra.get("stage_metrics")  # (what analyze measured: kept in the index it re-renders)
        write_index(results, root, title, metrics=metrics if isinstance(metrics, list) else None)
        write_summary(results, root, extra)
        out.print(f"wrote {root / 'index.html'} and {root / SUMMARY_FILE}")
    print_losses(out, results)
    return EXIT_PROBLEMS if any(r.problems for r in results) else EXIT_OK
