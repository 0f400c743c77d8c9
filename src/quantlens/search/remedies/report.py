"""The remedy search's report: ``remedies.csv`` (one row per measured candidate) and a self-contained
``remedies.html`` (per finding: the remedies that answer it, those tried at its op site with their measured
values, the chosen one and its gain; the whole-model remedies; the int16 curve), written from a
:class:`~.search.RemedyResult`. The page names the metric and its noise, the remedies that failed and were
skipped, and, with ``latency=True``, each kept remedy's latency estimate before and after it."""

from __future__ import annotations

import csv
import html
import io
from pathlib import Path
from typing import Any, Sequence

from quantlens._io import atomic_write_text
from quantlens.search.curve_files import svg_plot
from quantlens.search.remedies.catalog import remedies_for
from quantlens.search.remedies.result import RemedyResult, Trial

__all__ = ["CSV_FILE", "HTML_FILE", "write_remedy_report", "trial_rows", "latency_change", "metric_sentence",
           "step_time_rows"]

CSV_FILE = "remedies.csv"
HTML_FILE = "remedies.html"
_FIELDS = ["kind", "name", "site", "value", "before", "gain", "kept", "cycles_before", "cycles_after"]


def trial_rows(result: RemedyResult) -> list[dict[str, Any]]:
    """One row per measured candidate (a kept one once, with the metric before it, its gain and, when measured,
    the latency estimate before and after it)."""
    rows = []
    for t in result.trials:
        if not t.kept and any(k.kept and (k.kind, k.name, k.site) == (t.kind, t.name, t.site) for k in result.trials):
            continue  # the kept row of the same candidate carries its gain
        gain = None if t.before is None else t.value - t.before
        cycles = t.cycles or (None, None)
        rows.append({"kind": t.kind, "name": t.name, "site": t.site, "value": t.value, "before": t.before,
                     "gain": gain, "kept": t.kept, "cycles_before": cycles[0], "cycles_after": cycles[1]})
    return rows


def write_remedy_report(result: RemedyResult, out_dir: str | Path, findings: Sequence[Any] = ()) -> tuple[Path, Path]:
    """``out_dir/remedies.csv`` and ``out_dir/remedies.html``; returns their paths."""
    out = Path(out_dir)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, _FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in trial_rows(result):
        writer.writerow({k: ("" if v is None else repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    csv_path = atomic_write_text(out / CSV_FILE, buf.getvalue())
    html_path = atomic_write_text(out / HTML_FILE, _page(result, findings))
    return csv_path, html_path


def _f(v: float | None) -> str:
    return "" if v is None else f"{v:.6g}"


def latency_change(before: int | None, after: int | None) -> str:
    """``before -> after cycles (+x.x %)``, or "" when not measured."""
    if before is None or after is None:
        return ""
    pct = f" ({(after - before) / before:+.1%})" if before else ""
    return f"{before} -> {after} cycles{pct}"


def metric_sentence(result: RemedyResult) -> str:
    """What the metric is, which way is better, and its noise (the least gain the search keeps)."""
    way = "higher" if result.higher_is_better else "lower"
    return (f"metric: {result.metric} ({way} is better); noise {result.noise:.3g}: a remedy is kept only when it "
            "gains more")


def step_time_rows(result: RemedyResult) -> list[tuple[str, str, str]]:
    """``(step, seconds, measurements)`` of each step of the search, then the total: where its time went."""
    rows = [(t.step, f"{t.seconds:.1f}", str(t.measurements) if t.measurements else "") for t in result.step_times]
    total = sum(t.seconds for t in result.step_times)
    return rows + [("the search in all", f"{total:.1f}", str(sum(t.measurements for t in result.step_times)))] if rows else []


def _cycles(r: dict) -> str:
    return html.escape(latency_change(r["cycles_before"], r["cycles_after"]))


def _trial_cells(trials: list[Trial]) -> str:
    return ", ".join(f"{html.escape(t.kind)} {html.escape(t.name)}: {_f(t.value)}" for t in trials) or "—"


def _findings_table(result: RemedyResult, findings: Sequence[Any]) -> str:
    if not findings:
        return "<p>No findings were given (pass <code>findings=qa.advise()</code>).</p>"
    rows = []
    for f in findings:
        at = [t for t in result.trials if t.site and t.site == f.op_name]
        kept = [t for t in at if t.kept]
        answers = ", ".join(r.name for r in remedies_for(f)) or "—"
        chosen = "; ".join(f"{html.escape(t.kind)} {html.escape(t.name)}: {_f(t.before)} &rarr; {_f(t.value)} "
                           f"({t.value - t.before:+.4g})" for t in kept if t.before is not None) or "none kept"
        rows.append(f"<tr><td>{html.escape(f.rule)}</td><td>{html.escape(f.op_name)}</td>"
                    f"<td>{html.escape(answers)}</td><td>{_trial_cells([t for t in at if not t.kept])}</td>"
                    f"<td>{chosen}</td><td>{html.escape(f.advice)}</td></tr>")
    return ("<table><tr><th>finding</th><th>op site</th><th>remedies that answer it</th><th>tried here</th>"
            "<th>chosen (measured)</th><th>advice</th></tr>" + "".join(rows) + "</table>")


def _time_table(result: RemedyResult) -> str:
    rows = "".join(f"<tr><td>{html.escape(step)}</td><td>{sec}</td><td>{n}</td></tr>"
                   for step, sec, n in step_time_rows(result))
    return ("<h2>Time per step</h2><table><tr><th>step</th><th>seconds</th><th>configurations measured</th></tr>"
            f"{rows}</table>") if rows else ""


def _page(result: RemedyResult, findings: Sequence[Any]) -> str:
    reached = "" if result.target is None else (f"; target {result.target:g} "
                                                f"{'reached' if result.reached() else 'not reached'}")
    latency = ("" if result.latency_cycles is None else
               f"; latency estimate {html.escape(latency_change(*result.latency_cycles))}")
    skipped = "".join(f"<li>{html.escape(s.name)}: {html.escape(s.error)}</li>" for s in result.skipped)
    skipped = f"<h2>Skipped (the remedy failed)</h2><ul>{skipped}</ul>" if skipped else ""
    model_rows = "".join(
        f"<tr><td>{html.escape(r['kind'])}</td><td>{html.escape(r['name'])}</td><td>{_f(r['value'])}</td>"
        f"<td>{_f(r['gain'])}</td><td>{'kept' if r['kept'] else 'not kept'}</td><td>{_cycles(r)}</td></tr>"
        for r in trial_rows(result) if not r["site"])
    all_rows = "".join(
        f"<tr><td>{html.escape(r['kind'])}</td><td>{html.escape(r['name'])}</td><td>{html.escape(r['site'])}</td>"
        f"<td>{_f(r['value'])}</td><td>{_f(r['gain'])}</td><td>{'kept' if r['kept'] else ''}</td>"
        f"<td>{_cycles(r)}</td></tr>"
        for r in trial_rows(result))
    curve = result.int16_curve
    plots = ""
    if curve and result.target is not None:
        plots = svg_plot([(p.num_int16, p.metric) for p in curve], "int16 op sites (after the other remedies)",
                         result.target)
        if all(p.latency_cycles is not None for p in curve):
            plots += svg_plot([(p.latency_cycles, p.metric) for p in curve], "latency estimate (cycles)",
                              result.target)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>remedy search</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid "
        "#ccc;padding:2px 6px;font-size:13px;vertical-align:top}</style></head><body><h1>Remedy search</h1>"
        f"<p>{html.escape(metric_sentence(result))}.</p>"
        f"<p>metric {result.base_value:.6g} &rarr; {result.value:.6g}{reached}; kept transforms: "
        f"{html.escape(', '.join(result.transforms) or 'none')}; ranges at {len(result.observers)} op site(s); "
        f"{len(result.int16)} int16 promotion(s){latency}.</p>" + skipped
        + "<h2>Findings</h2>" + _findings_table(result, findings)
        + "<h2>Whole-model remedies</h2><table><tr><th>kind</th><th>remedy</th><th>metric</th><th>gain</th>"
          f"<th></th><th>latency estimate</th></tr>{model_rows or '<tr><td colspan=6>none applied</td></tr>'}"
          "</table>"
        + (f"<h2>int16 on top</h2>{plots}" if plots else "")
        + _time_table(result)
        + "<h2>Every measured candidate</h2><table><tr><th>kind</th><th>remedy</th><th>op site</th><th>metric</th>"
          f"<th>gain</th><th></th><th>latency estimate</th></tr>{all_rows}</table></body></html>")
