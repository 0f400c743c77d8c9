"""``profiler.html``: one self-contained page (inline CSS, inline SVG plots, inline JS table sorting).

No script, style sheet or font is loaded from anywhere: the page works from a file on a machine without
network access. Plots are drawn here, in Python, as SVG polylines.
"""

from __future__ import annotations

import html as _html
import math
import os
from pathlib import Path
from typing import Sequence

import jinja2
from markupsafe import Markup

from quantlens._io import atomic_write_text
from quantlens.profiler.advisor import SAME_INPUT_SQNR_LIMIT, THRESHOLDS, Finding
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.report import fmt

__all__ = ["line_chart", "render_html", "write_html", "worst_ops", "TABLE_COLUMNS"]

_TEMPLATES = Path(__file__).parent / "templates"

#: (field, header) of the HTML table
TABLE_COLUMNS = (
    ("index", "#"), ("op_name", "op name"), ("analy_op_type", "op type"), ("shape", "shape"),
    ("quant_dtype", "dtype"), ("scale", "scale"), ("Cosine", "Cosine"), ("SQNR", "SQNR"), ("Atol", "Atol"),
    ("atol_in_scale", "Atol/scale"), ("same_input_cosine", "same-in Cosine"), ("same_input_sqnr", "same-in SQNR"),
    ("same_input_in_scale", "same-in Atol/scale"), ("error_kind", "error kind"), ("clipped_ratio", "clipped"),
    ("base_min", "base min"), ("base_max", "base max"), ("analy_min", "analy min"), ("analy_max", "analy max"),
    ("note", "note"),
)

_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 900, 260, 70, 20, 30, 40


def _finite(v) -> float | None:
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi == lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def line_chart(title: str, labels: Sequence[str], series: Sequence[tuple[str, str, Sequence[float | None]]],
               y_label: str = "", ticks: Sequence[str] | None = None) -> Markup:
    """An SVG line chart: one x position per label, one polyline per ``(name, color, values)``.

    Missing or non-finite values break the line; every point has a tooltip (op name and value). ``ticks`` are
    the x-axis texts (default: the positions), e.g. the op sites' indices in the per-layer table.
    """
    ticks = list(ticks) if ticks is not None else [str(i) for i in range(len(labels))]
    values = [v for _, _, vals in series for v in vals if _finite(v) is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    n = max(len(labels), 2)
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B

    def x(i: int) -> float:
        return _PAD_L + plot_w * i / (n - 1)

    def y(v: float) -> float:
        return _PAD_T + plot_h * (1 - (v - lo) / (hi - lo))

    esc = _html.escape
    parts = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
             f'aria-label="{esc(title)}">',
             f'<text x="{_PAD_L}" y="18" class="title">{esc(title)}</text>',
             f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{plot_w}" height="{plot_h}" class="frame"/>']
    for t in _ticks(lo, hi):
        parts.append(f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{_PAD_L - 6}" y="{y(t) + 4:.1f}" class="tick" text-anchor="end">{t:.4g}</text>')
    step = max(1, len(labels) // 12)
    for i in range(0, len(labels), step):
        parts.append(f'<text x="{x(i):.1f}" y="{_H - _PAD_B + 14}" class="tick" text-anchor="middle">'
                     f'{esc(ticks[i])}</text>')
    parts.append(f'<text x="{_PAD_L + plot_w / 2:.1f}" y="{_H - 6}" class="axis" text-anchor="middle">'
                 f'op site (# in the per-layer table){" — " + esc(y_label) if y_label else ""}</text>')
    for k, (name, color, vals) in enumerate(series):
        segment: list[str] = []
        for i, v in enumerate(list(vals) + [None]):
            fv = _finite(v)
            if fv is None:
                if len(segment) > 1:
                    parts.append(f'<polyline points="{" ".join(segment)}" stroke="{color}" class="line"/>')
                segment = []
                continue
            segment.append(f"{x(i):.1f},{y(fv):.1f}")
            parts.append(f'<circle cx="{x(i):.1f}" cy="{y(fv):.1f}" r="2.5" fill="{color}">'
                         f'<title>{esc(labels[i])}: {esc(name)} = {esc(fmt(float(fv)))}</title></circle>')
        parts.append(f'<rect x="{_W - _PAD_R - 190}" y="{_PAD_T + 6 + 16 * k}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{_W - _PAD_R - 175}" y="{_PAD_T + 15 + 16 * k}" class="legend">{esc(name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _charts(rows: list[LayerRow]) -> list[Markup]:
    labels = [r.op_name for r in rows]
    ticks = [str(r.index) for r in rows]
    col = lambda name: [getattr(r, name) for r in rows]  # noqa: E731
    specs = [
        ("Cosine similarity along the network",
         [("accumulated", "#1f77b4", col("Cosine")), ("same input", "#ff7f0e", col("same_input_cosine"))], ""),
        ("Atol (max |baseline - analysis|) along the network",
         [("accumulated", "#1f77b4", col("Atol")), ("same input", "#ff7f0e", col("same_input_atol"))], ""),
        ("Same-input error: what each op adds",
         [("same-input SQNR (dB)", "#d62728", col("same_input_sqnr"))], "lower is worse; no point: no error"),
        ("Same-input error in output quantization steps",
         [("same-input Atol / scale", "#9467bd", col("same_input_in_scale"))], ""),
        ("Output ranges",
         [("baseline min", "#2ca02c", col("base_min")), ("baseline max", "#98df8a", col("base_max")),
          ("analysis min", "#8c564b", col("analy_min")), ("analysis max", "#c49c94", col("analy_max"))], ""),
    ]
    return [line_chart(title, labels, series, y_label, ticks) for title, series, y_label in specs]


_VERDICT_COLORS = {"bit-exact": "#2ca02c", "within 1 LSB": "#98df8a", "within 4 LSB": "#ff7f0e",
                   "diverged": "#d62728", "": "#bbb"}


def lsb_histogram(hist: str, width: int = 180, height: int = 34) -> Markup:
    """A small inline SVG bar chart of an ``lsb_hist`` string ("0:n|1:n|..."), log-scaled counts, with tooltips."""
    if not hist:
        return Markup("")
    buckets = [part.split(":") for part in hist.split("|")]
    counts = [int(n) for _, n in buckets]
    top = math.log1p(max(counts) or 1)
    bar = width / len(buckets)
    esc = _html.escape
    parts = [f'<svg class="hist" viewBox="0 0 {width} {height + 12}" width="{width}" height="{height + 12}">']
    for i, (label, n) in enumerate(buckets):
        h = 0 if int(n) == 0 else max(1.0, height * math.log1p(int(n)) / top)
        color = "#2ca02c" if label == "0" else "#98df8a" if label == "1" else "#ff7f0e" if label in ("2", "3-4") \
            else "#d62728"
        parts.append(f'<rect x="{i * bar + 1:.1f}" y="{height - h:.1f}" width="{bar - 2:.1f}" height="{h:.1f}" '
                     f'fill="{color}"><title>|diff| = {esc(label)} LSB: {esc(n)} elements</title></rect>')
        parts.append(f'<text x="{i * bar + bar / 2:.1f}" y="{height + 10}" class="tick" '
                     f'text-anchor="middle">{esc(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def lsb_rows(comparison: LayerComparison) -> list[dict]:
    """The rows of the HTML's integer-comparison table (deployed stages)."""
    return [{"op_name": r.op_name, "op_type": r.analy_op_type, "quant_dtype": r.quant_dtype,
             "verdict": r.lsb_verdict, "color": _VERDICT_COLORS.get(r.lsb_verdict, "#bbb"),
             "hist": lsb_histogram(r.lsb_hist), "same_verdict": r.same_input_lsb_verdict,
             "same_color": _VERDICT_COLORS.get(r.same_input_lsb_verdict, "#bbb"),
             "same_hist": lsb_histogram(r.same_input_lsb_hist)}
            for r in comparison if r.lsb_verdict or r.same_input_lsb_verdict]


def worst_ops(comparison: LayerComparison, count: int) -> list[LayerRow]:
    """The ops that add the most error themselves (same-input SQNR), leaving out those that add none."""
    return [r for r in comparison.ranked("same_input_sqnr") if math.isfinite(r.same_input_sqnr)][:count]


def _sort_key(value) -> str:
    """A string JavaScript's parseFloat reads (empty for non-numbers and NaN, so they sort after numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return ""
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(float(value))


def render_html(comparison: LayerComparison, findings: list[Finding], title: str = "quantlens profiler") -> str:
    """The page as a string (see the module docstring)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    compared = [r for r in comparison if r.compared]

    def cell(row: LayerRow, key: str) -> dict:
        value = getattr(row, key)
        bad = key == "same_input_sqnr" and isinstance(value, float) and value < SAME_INPUT_SQNR_LIMIT
        return {"text": fmt(value), "sort": _sort_key(value), "bad": bad}

    table = [[cell(r, key) for key, _ in TABLE_COLUMNS] for r in comparison]
    return env.get_template("profiler.html.j2").render(
        title=title, baseline=comparison.baseline, analysis=comparison.analysis,
        consistency=comparison.consistency.line() if getattr(comparison, "consistency", None) is not None else "",
        headers=[h for _, h in TABLE_COLUMNS], table=table, charts=_charts(compared), findings=findings,
        thresholds=THRESHOLDS, worst=worst_ops(comparison, 10), lsb=comparison.lsb_summary(),
        lsb_rows=lsb_rows(comparison), only_in_baseline=comparison.only_in_baseline,
        only_in_analysis=comparison.only_in_analysis,
    )


def write_html(comparison: LayerComparison, findings: list[Finding], path: str | os.PathLike) -> Path:
    return atomic_write_text(path, render_html(comparison, findings))
