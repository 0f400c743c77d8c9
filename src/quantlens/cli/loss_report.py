"""Where precision is lost, as the console, ``index.html`` and ``summary.json`` say it: two separate answers,
where precision is first lost along the chain fake_quant -> pre_export -> export -> convert -> onnxruntime
(:func:`~quantlens.cli.pair_result.first_loss`) and where the most is lost
(:func:`~quantlens.cli.pair_result.ranked_losses`), then the verdict and worst op of every stage pair."""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from quantlens._io import atomic_write_text
from quantlens.cli.pair_result import PairResult, PairVerdict, first_loss, ranked_losses
from quantlens.profiler.report_files import INDEX_FILE, SUMMARY_FILE

__all__ = ["headline", "headline_lines", "write_summary", "write_index", "print_losses", "SUMMARY_FILE",
           "RANKINGS_NOTE"]


#: why the sensitivity ranking and the worst op can name different ops (both pages and the console say it)
RANKINGS_NOTE = ("The worst op is the op that loses the most precision itself: the lowest same-input SQNR, its "
                 "input taken from the baseline. The sensitivity ranking measures something else: the model "
                 "output's loss when only that one quantizer is on (a weight's or an activation's). An op can add "
                 "the most error of its own while another quantizer moves the output more, so the two can name "
                 "different ops.")


def _pair_text(r: PairResult) -> str:
    return f"{r.analysis_type}: {r.baseline} vs {r.analysis}"


def _first_line(r: PairResult) -> str:
    if r.verdict is PairVerdict.LOSSY:
        sqnr = "below 120 dB" if r.first_sqnr is None else f"{r.first_sqnr:.1f} dB"
        how = f"the first op there that loses precision itself, same-input SQNR {sqnr}"
    else:
        how = f"the first op there that is not bit-exact, {r.first_diff}, no same-input data"
    return f"precision is first lost in {r.analysis_type} ({r.baseline} vs {r.analysis}), at {r.first_op} ({how})"


def _most_line(top: PairResult) -> str:
    if top.verdict is PairVerdict.LOSSY and top.worst_sqnr is not None:
        how = f"same-input SQNR {top.worst_sqnr:.1f} dB, {top.worst_error_kind or 'error'}"
    elif top.verdict is PairVerdict.LOSSY:
        how = "same-input SQNR below 120 dB"
    else:
        how = f"{top.worst_diff}, no same-input data"
    return f"precision is lost most at {top.worst_op} ({_pair_text(top)}, {how})"


def _baseline_lines(results: list[PairResult]) -> list[str]:
    """A float baseline that computes another branch than the user's own run (the advisor's
    ``float_model_branch``) comes first: every figure after it is measured against the export branch."""
    for r in results:
        for f in r.findings:
            if f.get("rule") == "float_model_branch":
                return [f"{f['info']} (every pair compares the export branch: "
                        f"{r.analysis_type}/abnormal_layer_advisor.txt)"]
    return []


def headline_lines(results: list[PairResult]) -> list[str]:
    """The answer in plain text lines: a float model that computes differently as the user runs it, if so;
    where precision is first lost along the chain (the earliest stage pair that differs, at its first op that
    does), then where the most is lost (the worst op over the pairs); one line when nothing compared differs."""
    no_data = [r.analysis_type for r in results if r.verdict is PairVerdict.NO_DATA]
    tail = f"; no data (nothing compared): {', '.join(no_data)}" if no_data else ""
    first, ranked = first_loss(results), ranked_losses(results)
    if first is None or not ranked:
        return [*_baseline_lines(results), "no compared op differs in any stage pair" + tail]
    return [*_baseline_lines(results), _first_line(first), _most_line(ranked[0]) + tail]


def headline(results: list[PairResult]) -> str:
    """:func:`headline_lines` as one string (lines joined by "; ")."""
    return "; ".join(headline_lines(results))


def _loss(r: PairResult | None, op: str | None, sqnr: float | None, diff: str) -> dict | None:
    if r is None:
        return None
    return {"op": op, "analysis_type": r.analysis_type, "verdict": r.verdict.value, "same_input_sqnr": sqnr,
            "diff": diff}


def write_summary(results: list[PairResult], out_dir: Path, extra: dict | None = None) -> Path:
    """``summary.json``: ``first_loss`` (the earliest pair that differs and its first op that does),
    ``most_loss`` (the worst op over the pairs, see :func:`ranked_losses`; ``culprit`` is the same, the older
    key), ``headline`` (the console's lines) and every pair's :class:`PairResult`."""
    data = dict(extra or {})
    ranked, first = ranked_losses(results), first_loss(results)
    top = ranked[0] if ranked else None
    data["culprit"] = data["most_loss"] = _loss(top, top and top.worst_op, top and top.worst_sqnr,
                                                top.worst_diff if top else "")
    data["first_loss"] = _loss(first, first and first.first_op, first and first.first_sqnr,
                               first.first_diff if first else "")
    data["headline"] = headline_lines(results)
    data["pairs"] = [{**asdict(r), "verdict": r.verdict.value} for r in results]
    path = out_dir / SUMMARY_FILE
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False, default=str) + "\n")
    return path


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def _metric_rows(metrics: Sequence[Any]) -> list[tuple[str, float | None, str]]:
    """``(stage, value, error)`` of ``StageMetric``s, their ``summary.json`` dicts or ``(stage, value)`` pairs."""
    rows = []
    for m in metrics:
        if isinstance(m, dict):
            rows.append((str(m.get("stage")), m.get("value"), str(m.get("error") or "")))
        elif isinstance(m, (tuple, list)):
            rows.append((str(m[0]), m[1], str(m[2]) if len(m) > 2 else ""))
        else:
            rows.append((str(m.stage), m.value, str(getattr(m, "error", "") or "")))
    return rows


def metrics_html(metrics: Sequence[Any], label: str = "metric") -> str:
    """The stages' task metric as an HTML table: stage, value, change from the first (float) stage."""
    rows = _metric_rows(metrics)
    base = next((v for _, v, _ in rows if isinstance(v, (int, float))), None)
    body = []
    for stage, value, error in rows:
        if not isinstance(value, (int, float)):
            body.append(f"<tr><td>{html.escape(stage)}</td><td>-</td><td>failed: {html.escape(error)}</td></tr>")
            continue
        delta = "-" if base is None else f"{value - base:+.6g}"
        body.append(f"<tr><td>{html.escape(stage)}</td><td class=num>{value:.6g}</td><td class=num>{delta}</td></tr>")
    return (f'<table id="metrics"><thead><tr><th>stage</th><th>{html.escape(label)}</th><th>vs first stage</th>'
            f"</tr></thead><tbody>{''.join(body)}</tbody></table>")


def _sensitive_text(r: PairResult) -> str:
    if not r.sensitivity_top:
        return "-"
    name, kind, _ = r.sensitivity_top[0]
    return f"{name} ({kind})"


def write_index(results: list[PairResult], out_dir: Path, title: str = "quantlens analysis",
                intro: str = "", metrics: Sequence[Any] | None = None, metric_label: str = "metric") -> Path:
    """One self-contained ``index.html`` linking each pair's ``profiler.html`` (relative links). ``metrics``:
    the task metric per stage (``StageMetric``s, their dicts, or ``(stage, value)`` pairs), shown as a table."""
    rows = []
    for r in results:
        link = (f'<a href="{html.escape(r.folder)}/profiler.html">{html.escape(r.analysis_type)}</a>'
                if not r.skipped else html.escape(r.analysis_type))
        lsb = html.escape(str((r.lsb or {}).get("first_diverged") or "-")) if r.lsb else "-"
        rows.append(f"<tr><td>{link}</td><td>{html.escape(r.baseline)} vs {html.escape(r.analysis)}</td>"
                    f"<td>{html.escape(r.verdict_text)}</td><td>{html.escape(r.worst_text)}</td>"
                    f"<td>{_fmt(r.worst_sqnr, ' dB')}</td><td>{html.escape(r.worst_error_kind)}</td>"
                    f"<td>{html.escape(_sensitive_text(r))}</td>"
                    f"<td>{len(r.findings)}</td><td>{lsb}</td></tr>")
    notes = "".join(f"<li>{html.escape(r.analysis_type)}: {html.escape(r.note)}</li>" for r in results if r.note)
    answer = "".join(f"<li>{html.escape(line)}.</li>" for line in headline_lines(results))
    table = f"<h2>The task metric per stage</h2>\n{metrics_html(metrics, metric_label)}" if metrics else ""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}th{{background:#eee}}td.num{{text-align:right}}
.culprit{{font-size:1.1em}}p,ul{{max-width:60em}}</style>
</head><body><h1>{html.escape(title)}</h1>
{f"<p>{html.escape(intro)}</p>" if intro else ""}
<ul class=culprit>{answer}</ul>
<table id="pairs"><thead><tr><th>stage pair</th><th>models</th><th>verdict</th><th>worst op</th>
<th>same-input SQNR</th><th>error kind</th><th>most sensitive quantizer</th><th>advisor findings</th>
<th>first diverged (&gt;4 LSB)</th></tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
{table}
{f"<ul>{notes}</ul>" if notes else ""}
<p>Verdict: <i>exact</i> only when every compared op is bit-exact; <i>lossy</i>: an op loses precision of its own
(worst op: lowest same-input SQNR); <i>differs</i>: ops differ but none is measured losing precision on the same
input (worst op: highest LSB verdict, else lowest SQNR); <i>no data</i>: nothing was compared.
{html.escape(RANKINGS_NOTE)}
Each link opens that pair's <code>profiler.html</code>; the text and CSV reports are in the same folder.</p>
</body></html>
"""
    path = out_dir / INDEX_FILE
    atomic_write_text(path, page)
    return path


def print_losses(console, pairs: list[PairResult]) -> None:
    """The 'where precision is lost' summary: where it is first lost and where the most, then the verdict and
    worst op per stage pair (the worst overall first). Headers and short columns are never cut: the long ones
    (verdict, worst op) wrap within the console's width."""
    from rich.markup import escape as esc
    from rich.table import Table

    ranked = ranked_losses(pairs)
    for line in headline_lines(pairs):
        console.print(f"[bold red]{esc(line)}[/]" if ranked else esc(line))
    table = Table(title="where precision is lost: the verdict and worst op per stage pair, worst first")
    for col, just, wrap in (("stage pair", "left", False), ("verdict", "left", True), ("worst op", "left", True),
                            ("SQNR dB", "right", False), ("kind", "left", False), ("findings", "right", False)):
        # short columns keep their width; long op names fold inside their column instead of being cut
        table.add_column(col, justify=just, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis",
                         min_width=None if wrap else len(col))
    rest = [p for p in pairs if p not in ranked]
    for p in [*ranked, *rest]:
        table.add_row(p.analysis_type, esc(p.verdict_text), esc(p.worst_text),
                      "-" if p.worst_sqnr is None else f"{p.worst_sqnr:.1f}", p.worst_error_kind, str(len(p.findings)))
    console.print(table)
    for p in pairs:
        if p.note:
            console.print(f"{p.analysis_type}: {esc(p.note)}")
    console.print("verdict: exact only when every compared op is bit-exact; no data: nothing compared. SQNR: the "
                  "same-input SQNR of the worst op (what the op loses by itself; the sensitivity ranking instead "
                  "measures the output's loss with only one quantizer on). Stage pairs: "
                  + ", ".join(f"{p.analysis_type} = {p.baseline} vs {p.analysis}" for p in pairs))
