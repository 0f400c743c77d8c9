"""``profiler.html`` and ``badcase_report.html``: self-contained pages (inline CSS, inline SVG charts, inline JS).

No script, style sheet or font is loaded from anywhere: the pages work from a file on a machine without network
access. Charts are drawn here, in Python, as SVG; the inline script only adds behaviour: a tooltip with a
point's figures on hover, a jump to the point's table row on click, and table sorting (rows without a value
stay last in both directions). Same inputs give the same bytes.

The per-layer page also shows the sensitivity ranking as bar charts when :meth:`QuantAnalysis.sensitivity` ran:
the ``output_*_sensitive_ops.pt`` files of the folder are read when the page is written, and
:func:`refresh_sensitivity` (called after each of those files is written) updates an existing page.
"""

from __future__ import annotations

import functools

import html as _html
import math
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Sequence

import jinja2
from markupsafe import Markup

from quantlens._io import atomic_write_text
from quantlens.profiler.advisor import SAME_INPUT_SQNR_LIMIT, THRESHOLDS, Finding
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.report import fmt

__all__ = ["line_chart", "bar_chart", "histogram_chart", "nice_ticks", "tick_text", "render_html", "write_html",
           "worst_ops", "TABLE_COLUMNS", "render_bad_case_html", "write_bad_case_html", "refresh_sensitivity",
           "sensitivity_tables", "row_id"]

_TEMPLATES = Path(__file__).parent / "templates"

#: (field, header) of the HTML table; the first column (op name) stays visible while the table scrolls sideways
TABLE_COLUMNS = (
    ("op_name", "op name"), ("index", "#"), ("analy_op_type", "op type"), ("shape", "shape"),
    ("quant_dtype", "dtype"), ("scale", "scale"), ("Cosine", "Cosine"), ("SQNR", "SQNR"), ("Atol", "Atol"),
    ("atol_in_scale", "Atol/scale"), ("same_input_cosine", "same-in Cosine"), ("same_input_sqnr", "same-in SQNR"),
    ("same_input_in_scale", "same-in Atol/scale"), ("error_kind", "error kind"), ("clipped_ratio", "clipped"),
    ("base_min", "base min"), ("base_max", "base max"), ("analy_min", "analy min"), ("analy_max", "analy max"),
    ("note", "note"),
)

_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 900, 300, 70, 20, 30, 90
_MAX_X_LABELS = 45  # op-name labels on a chart's x axis; every point names its op in its tooltip
SENSITIVITY_TOP = 20  # bars per sensitivity chart
SENSITIVITY_BEGIN, SENSITIVITY_END = "<!-- sensitivity:begin -->", "<!-- sensitivity:end -->"

esc = _html.escape
_DASH = " \u2014 "


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def row_id(index: int) -> str:
    """The HTML id of the per-layer table's row of op site ``index`` (charts link to it)."""
    return f"row-{index}"


# -- axes ---------------------------------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """Round axis ticks covering ``[lo, hi]``: steps of 1, 2 or 5 times a power of ten, about ``n`` ticks, the
    first at or below ``lo`` and the last at or above ``hi``. ``integer``: steps of at least 1 (counts)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"nice_ticks needs finite bounds, got {lo!r}, {hi!r}")
    lo, hi = min(lo, hi), max(lo, hi)
    if hi == lo:
        pad = abs(lo) * 0.1 or (0.5 if not integer else 1.0)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(n - 1, 1)
    exp = math.floor(math.log10(raw))

    def count(step: float) -> int:
        return math.ceil(hi / step - 1e-9) - math.floor(lo / step + 1e-9) + 1

    # the smallest 1-2-5 step that gives at most n + 2 ticks
    candidates = [m * 10.0 ** e for e in (exp - 1, exp, exp + 1, exp + 2) for m in (1, 2, 5)]
    if integer:
        candidates = [c for c in candidates if c >= 1] or [1.0]
    step = next(c for c in candidates if count(c) <= n + 2 or c == candidates[-1])
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [round(k * step, decimals) for k in range(first, last + 1)]
    return [0.0 if t == 0 else t for t in ticks]  # no "-0"


def tick_text(t: float) -> str:
    """An axis tick's text: the rounded value in its shortest form (``0.2``, ``1500``, ``1e-05``)."""
    return f"{t:g}"


def _label(text: str, limit: int = 22) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


# -- charts -------------------------------------------------------------------------------------------------
def line_chart(title: str, labels: Sequence[str], series: Sequence[tuple[str, str, Sequence[float | None]]],
               y_label: str = "", ticks: Sequence[str] | None = None, anchors: Sequence[str] | None = None) -> Markup:
    """An SVG line chart: one x position per op site (``labels``: their names, the x axis), one polyline per
    ``(name, color, values)``; missing or non-finite values break the line.

    Every x position has a hover target (``rect.hit``) whose tooltip lists the op site, its number (``ticks``,
    e.g. the per-layer table's ``#``) and every series' value there; a click on it jumps to ``anchors[i]``
    (the id of its table row). Points are ``circle.pt`` elements."""
    labels = list(labels)
    ticks = list(ticks) if ticks is not None else [str(i) for i in range(len(labels))]
    values = [fv for _, _, vals in series for v in vals if (fv := _finite(v)) is not None]
    y_ticks = nice_ticks(min(values), max(values)) if values else [0.0, 1.0]
    lo, hi = y_ticks[0], y_ticks[-1]
    n = max(len(labels), 2)
    plot_w, plot_h = _W - _PAD_L - _PAD_R, _H - _PAD_T - _PAD_B
    slot = plot_w / (n - 1) if len(labels) > 1 else plot_w

    def x(i: int) -> float:
        return _PAD_L + plot_w * i / (n - 1) if len(labels) > 1 else _PAD_L + plot_w / 2

    def y(v: float) -> float:
        return _PAD_T + plot_h * (1 - (v - lo) / (hi - lo))

    parts = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
             f'aria-label="{esc(title)}" data-points="{len(labels)}">',
             f'<text x="{_PAD_L}" y="18" class="title">{esc(title)}</text>',
             f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{plot_w}" height="{plot_h}" class="frame"/>']
    for t in y_ticks:
        parts.append(f'<line x1="{_PAD_L}" x2="{_W - _PAD_R}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{_PAD_L - 6}" y="{y(t) + 4:.1f}" class="tick" text-anchor="end">'
                     f'{esc(tick_text(t))}</text>')
    step = max(1, math.ceil(len(labels) / _MAX_X_LABELS))
    base = _H - _PAD_B + 12
    for i in range(0, len(labels), step):
        parts.append(f'<text x="{x(i):.1f}" y="{base}" class="tick xlabel" text-anchor="end" '
                     f'transform="rotate(-40 {x(i):.1f} {base})">{esc(_label(labels[i]))}</text>')
    parts.append(f'<text x="{_PAD_L + plot_w / 2:.1f}" y="{_H - 4}" class="axis" text-anchor="middle">'
                 f'op site{" (every " + str(step) + "th named; hover for all)" if step > 1 else ""}'
                 f'{_DASH + esc(y_label) if y_label else ""}</text>')
    for k, (name, color, vals) in enumerate(series):
        segment: list[str] = []
        points: list[str] = []
        for i, v in enumerate(list(vals) + [None]):
            fv = _finite(v)
            if fv is None:
                if len(segment) > 1:
                    parts.append(f'<polyline points="{" ".join(segment)}" stroke="{color}" class="line"/>')
                segment = []
                continue
            segment.append(f"{x(i):.1f},{y(fv):.1f}")
            points.append(f'<circle class="pt" cx="{x(i):.1f}" cy="{y(fv):.1f}" r="2.5" fill="{color}"/>')
        parts.extend(points)
        parts.append(f'<rect x="{_W - _PAD_R - 190}" y="{_PAD_T + 6 + 16 * k}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{_W - _PAD_R - 175}" y="{_PAD_T + 15 + 16 * k}" class="legend">{esc(name)}</text>')
    for i, label in enumerate(labels):  # hover / click targets, one per op site, on top of everything
        tip = "\n".join([f"{label} (#{ticks[i]})"] + [f"{name}: {fmt(vals[i]) or '-'}" for name, _, vals in series])
        link = f' data-row="{esc(anchors[i])}"' if anchors is not None else ""
        parts.append(f'<rect class="hit" x="{x(i) - slot / 2:.1f}" y="{_PAD_T}" width="{slot:.1f}" '
                     f'height="{plot_h}" data-tip="{esc(tip)}"{link}/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(title: str, bars: Sequence[dict], value_label: str = "") -> Markup:
    """A horizontal SVG bar chart, one ``rect.bar`` per item of ``bars`` (dicts with ``label``, ``value``,
    ``tip`` and optionally ``row``, the id of a table row a click jumps to), in the given order. A non-finite
    value gets a full-length red bar labelled with its value."""
    bar_h, gap, pad_l, pad_r, pad_t, pad_b = 16, 4, 250, 70, 30, 34
    height = pad_t + pad_b + len(bars) * (bar_h + gap)
    values = [fv for b in bars if (fv := _finite(b["value"])) is not None]
    lo_v, hi_v = (min(values), max(values)) if values else (0.0, 1.0)
    if lo_v >= 0 and lo_v <= 0.5 * hi_v:
        lo_v = 0.0  # a ratio scale when the values are spread: bars from zero
    ticks = nice_ticks(lo_v, hi_v)
    lo, hi = ticks[0], ticks[-1]
    plot_w = _W - pad_l - pad_r

    def x(v: float) -> float:
        return pad_l + plot_w * (v - lo) / (hi - lo)

    parts = [f'<svg class="chart bars" viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" role="img" '
             f'aria-label="{esc(title)}" data-bars="{len(bars)}">',
             f'<text x="10" y="18" class="title">{esc(title)}</text>']
    bottom = height - pad_b
    for t in ticks:
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{pad_t}" y2="{bottom}" class="grid"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{bottom + 14}" class="tick" text-anchor="middle">'
                     f'{esc(tick_text(t))}</text>')
    if value_label:
        parts.append(f'<text x="{pad_l + plot_w / 2:.1f}" y="{height - 4}" class="axis" text-anchor="middle">'
                     f'{esc(value_label)}</text>')
    for i, b in enumerate(bars):
        top = pad_t + i * (bar_h + gap)
        fv = _finite(b["value"])
        width = plot_w if fv is None else max(1.0, x(fv) - pad_l)
        color = "#d62728" if fv is None else "#1f77b4"
        link = f' data-row="{esc(b["row"])}"' if b.get("row") else ""
        parts.append(f'<text x="{pad_l - 6}" y="{top + 12}" class="tick" text-anchor="end">'
                     f'{esc(_label(b["label"], 40))}</text>')
        parts.append(f'<rect class="bar" x="{pad_l}" y="{top}" width="{width:.1f}" height="{bar_h}" fill="{color}" '
                     f'data-tip="{esc(b["tip"])}"{link}/>')
        parts.append(f'<text x="{pad_l + width + 4:.1f}" y="{top + 12}" class="tick">{esc(fmt(b["value"]))}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram_chart(title: str, values: Sequence[float], marks: Sequence[tuple[str, int]] = (),
                    width: int = 420, height: int = 200) -> Markup:
    """An SVG histogram of ``values`` (one per sample, in sample order) on round bin edges: one ``rect.bar``
    per bin (``data-count``: its samples), plus a red "non-finite" bar when some values are NaN/Inf.
    ``marks``: ``(name, sample index)`` drawn as vertical lines at those samples' values."""
    finite = [(i, fv) for i, v in enumerate(values) if (fv := _finite(v)) is not None]
    bad = [i for i, v in enumerate(values) if _finite(v) is None]
    pad_l, pad_r, pad_t, pad_b = 40, 28, 26, 34
    plot_w, plot_h = width - pad_l - pad_r, height - pad_t - pad_b
    edges = nice_ticks(min(v for _, v in finite), max(v for _, v in finite),
                       n=min(11, max(3, round(math.sqrt(len(finite))) + 1))) if finite else []
    bins: list[list[int]] = [[] for _ in range(max(len(edges) - 1, 0))]
    for i, v in finite:
        k = next((j for j in range(len(bins)) if v < edges[j + 1]), len(bins) - 1)
        bins[k].append(i)
    groups = [(f"[{tick_text(edges[j])}, {tick_text(edges[j + 1])}{']' if j == len(bins) - 1 else ')'}", b, "#1f77b4")
              for j, b in enumerate(bins)]
    if bad:
        groups.append(("NaN / Inf", bad, "#d62728"))
    count_ticks = nice_ticks(0, max([len(b) for _, b, _ in groups] + [1]), n=4, integer=True)
    top = count_ticks[-1]
    slot = plot_w / max(len(groups), 1)
    parts = [f'<svg class="chart hist-chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'role="img" aria-label="{esc(title)}" data-bars="{len(groups)}" data-samples="{len(values)}">',
             f'<text x="{pad_l}" y="16" class="title">{esc(title)}</text>',
             f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" class="frame"/>']
    for t in count_ticks:
        yt = pad_t + plot_h * (1 - t / top)
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + plot_w}" y1="{yt:.1f}" y2="{yt:.1f}" class="grid"/>')
        parts.append(f'<text x="{pad_l - 4}" y="{yt + 4:.1f}" class="tick" text-anchor="end">{tick_text(t)}</text>')
    for j, (label, members, color) in enumerate(groups):
        h = plot_h * len(members) / top
        shown = ", ".join(map(str, members[:20])) + (", ..." if len(members) > 20 else "")
        tip = f"{label}: {len(members)} sample{'s' if len(members) != 1 else ''}" + (f" ({shown})" if members else "")
        parts.append(f'<rect class="bar" x="{pad_l + j * slot + 1:.1f}" y="{pad_t + plot_h - h:.1f}" '
                     f'width="{max(slot - 2, 1):.1f}" height="{h:.1f}" fill="{color}" data-count="{len(members)}" '
                     f'data-tip="{esc(tip)}"/>')
    for j in range(len(edges)):
        if j % max(1, math.ceil(len(edges) / 6)) == 0 or j == len(edges) - 1:
            parts.append(f'<text x="{pad_l + j * slot:.1f}" y="{pad_t + plot_h + 14}" class="tick" '
                         f'text-anchor="middle">{esc(tick_text(edges[j]))}</text>')
    if bad:
        parts.append(f'<text x="{pad_l + (len(groups) - 0.5) * slot:.1f}" y="{pad_t + plot_h + 14}" class="tick" '
                     f'text-anchor="middle">NaN/Inf</text>')
    for k, (name, index) in enumerate(marks):
        fv = _finite(values[index]) if 0 <= index < len(values) else None
        if fv is None or not bins:
            continue
        xm = pad_l + plot_w * (len(bins) / len(groups)) * (fv - edges[0]) / (edges[-1] - edges[0])
        right = xm > pad_l + plot_w / 2  # the label on the side with room
        parts.append(f'<line class="mark" x1="{xm:.1f}" x2="{xm:.1f}" y1="{pad_t}" y2="{pad_t + plot_h}"/>'
                     f'<text x="{xm - 3 if right else xm + 3:.1f}" y="{pad_t + 10 + 11 * k}" class="tick mark-label" '
                     f'text-anchor="{"end" if right else "start"}">{esc(name)} (sample {index})</text>')
    parts.append(f'<text x="{pad_l + plot_w / 2:.1f}" y="{height - 4}" class="axis" text-anchor="middle">'
                 f'value over {len(values)} samples</text></svg>')
    return Markup("".join(parts))


def _charts(rows: list[LayerRow]) -> list[Markup]:
    labels = [r.op_name for r in rows]
    ticks = [str(r.index) for r in rows]
    anchors = [row_id(r.index) for r in rows]
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
    return [line_chart(title, labels, series, y_label, ticks, anchors) for title, series, y_label in specs]


_VERDICT_COLORS = {"bit-exact": "#2ca02c", "within 1 LSB": "#98df8a", "within 4 LSB": "#ff7f0e",
                   "diverged": "#d62728", "": "#bbb"}


def _hist_buckets(hist: str) -> list[tuple[str, int]]:
    return [(label, int(n)) for label, n in (part.split(":") for part in hist.split("|"))] if hist else []


def lsb_histogram(hist: str, width: int = 180, height: int = 34) -> Markup:
    """A small inline SVG bar chart of an ``lsb_hist`` string ("0:n|1:n|..."), log-scaled counts: one
    ``rect.bar`` per bucket, its element count and share in its tooltip."""
    buckets = _hist_buckets(hist)
    if not buckets:
        return Markup("")
    counts = [n for _, n in buckets]
    total = sum(counts) or 1
    top = math.log1p(max(counts) or 1)
    bar = width / len(buckets)
    parts = [f'<svg class="hist" viewBox="0 0 {width} {height + 12}" width="{width}" height="{height + 12}" '
             f'data-bars="{len(buckets)}">']
    for i, (label, n) in enumerate(buckets):
        h = 0 if n == 0 else max(1.0, height * math.log1p(n) / top)
        color = "#2ca02c" if label == "0" else "#98df8a" if label == "1" else "#ff7f0e" if label in ("2", "3-4") \
            else "#d62728"
        tip = f"|diff| = {label} LSB: {n} elements ({100 * n / total:.3g}%)"
        parts.append(f'<rect class="bar" x="{i * bar + 1:.1f}" y="{height - h:.1f}" width="{bar - 2:.1f}" '
                     f'height="{h:.1f}" fill="{color}" data-count="{n}" data-tip="{esc(tip)}"/>')
        parts.append(f'<text x="{i * bar + bar / 2:.1f}" y="{height + 10}" class="tick" '
                     f'text-anchor="middle">{esc(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _beyond_one_lsb(hist: str) -> str:
    """The sort key of an LSB histogram: the share of elements more than 1 LSB off."""
    buckets = _hist_buckets(hist)
    total = sum(n for _, n in buckets)
    return repr(sum(n for label, n in buckets if label not in ("0", "1")) / total) if total else ""


def lsb_rows(comparison: LayerComparison) -> list[dict]:
    """The rows of the HTML's integer-comparison table (deployed stages)."""
    return [{"op_name": r.op_name, "op_type": r.analy_op_type, "quant_dtype": r.quant_dtype,
             "verdict": r.lsb_verdict, "color": _VERDICT_COLORS.get(r.lsb_verdict, "#bbb"),
             "hist": lsb_histogram(r.lsb_hist), "hist_sort": _beyond_one_lsb(r.lsb_hist),
             "same_verdict": r.same_input_lsb_verdict,
             "same_color": _VERDICT_COLORS.get(r.same_input_lsb_verdict, "#bbb"),
             "same_hist": lsb_histogram(r.same_input_lsb_hist),
             "same_hist_sort": _beyond_one_lsb(r.same_input_lsb_hist), "row": row_id(r.index)}
            for r in comparison if r.lsb_verdict or r.same_input_lsb_verdict]


def worst_ops(comparison: LayerComparison, count: int) -> list[LayerRow]:
    """The ops that add the most error themselves (same-input SQNR), leaving out those that add none."""
    return [r for r in comparison.ranked("same_input_sqnr") if math.isfinite(r.same_input_sqnr)][:count]


def _sort_key(value) -> str:
    """A string JavaScript's parseFloat reads (empty for non-numbers and NaN: the cell sorts by its text,
    and a cell without text sorts last)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return ""
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(float(value))


# -- sensitivity ------------------------------------------------------------------------------------------
_SENS_FILE = re.compile(r"^output_(?P<name>.+)_sensitive_ops\.pt$")


def sensitivity_tables(out_dir: str | os.PathLike) -> list[tuple[str, str, list[dict]]]:
    """``(output, metric, rows)`` of every ``output_<name>_<metric>_sensitive_ops.pt`` in ``out_dir``, by file
    name (rows as written by ``write_sensitivity``: most sensitive first, or least with ``reverse``)."""
    import torch

    tables = []
    for path in sorted(Path(out_dir).glob("output_*_sensitive_ops.pt"), key=lambda p: p.name):
        match = _SENS_FILE.match(path.name)
        if not match:
            continue
        try:
            rows = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - not ours or half-written by something else: leave it out
            continue
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            continue
        name = match["name"]
        metric = rows[0].get("metric", "") if rows else name.rsplit("_", 1)[-1]
        output = name[: -len(metric) - 1] if metric and name.endswith("_" + metric) else name
        tables.append((urllib.parse.unquote(output), str(metric), rows))
    return tables


def _sensitivity_charts(out_dir: str | os.PathLike | None, rows_by_name: dict[str, str]) -> list[Markup]:
    if out_dir is None:
        return []
    charts = []
    for output, metric, rows in sensitivity_tables(out_dir):
        bars = [{"label": f"{r.get('op_name', '')} ({r.get('sensitive_type', '')})", "value": r.get("value"),
                 "tip": f"{r.get('op_name', '')}\n{r.get('sensitive_type', '')} quantization of "
                        f"{r.get('op_type', '')} ({r.get('quant_dtype', '')})\n{metric} of output '{output}' with "
                        f"it alone: {fmt(r.get('value'))}\nrank {k + 1} of {len(rows)}",
                 "row": rows_by_name.get(str(r.get("op_name", "")), "")}
                for k, r in enumerate(rows[:SENSITIVITY_TOP])]
        title = (f"output '{output}', {metric}: the {len(bars)} top-ranked quantizers of {len(rows)} "
                 "(each alone on)")
        charts.append(bar_chart(title, bars, f"{metric} of the output with only that quantizer on"))
    return charts


def _sensitivity_section(charts: list[Markup]) -> str:
    if not charts:
        return SENSITIVITY_BEGIN + SENSITIVITY_END
    return (SENSITIVITY_BEGIN + '\n<h2 id="sensitivity">Sensitivity ranking</h2>\n<p class="meta">One chart per '
            "model output and metric (<code>sensitivity()</code>): the output's metric against the baseline with "
            "only that quantizer on, in the ranking's order. Click a bar for its op's row.</p>\n"
            + "\n".join(charts) + "\n" + SENSITIVITY_END)


def _rows_by_name(comparison: LayerComparison) -> dict[str, str]:
    return {r.op_name: row_id(r.index) for r in comparison}


def refresh_sensitivity(out_dir: str | os.PathLike) -> Path | None:
    """Update the sensitivity section of ``out_dir/profiler.html`` (if it exists) from the sensitivity files."""
    path = Path(out_dir) / "profiler.html"
    if not path.is_file():
        return None
    page = path.read_text(encoding="utf-8")
    start, end = page.find(SENSITIVITY_BEGIN), page.find(SENSITIVITY_END)
    if start < 0 or end < start:
        return None
    rows_by_name = dict(re.findall(r'<tr id="(row-\d+)"><td data-sort="">([^<]*)</td>', page))
    rows_by_name = {_html.unescape(name): rid for rid, name in rows_by_name.items()}
    section = _sensitivity_section(_sensitivity_charts(out_dir, rows_by_name))
    new = page[:start] + section + page[end + len(SENSITIVITY_END):]
    return atomic_write_text(path, new) if new != page else path


# -- pages ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    # one environment per process: jinja2 keeps the compiled templates in it (compiling them is most of a small
    # net's report time)
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def render_html(comparison: LayerComparison, findings: list[Finding], title: str = "quantlens profiler",
                out_dir: str | os.PathLike | None = None) -> str:
    """The page as a string (see the module docstring); ``out_dir``: where to look for sensitivity files."""
    compared = [r for r in comparison if r.compared]

    def cell(row: LayerRow, key: str) -> dict:
        value = getattr(row, key)
        bad = key == "same_input_sqnr" and isinstance(value, float) and value < SAME_INPUT_SQNR_LIMIT
        return {"text": fmt(value), "sort": _sort_key(value), "bad": bad}

    table = [(row_id(r.index), [cell(r, key) for key, _ in TABLE_COLUMNS]) for r in comparison]
    sensitivity = Markup(_sensitivity_section(_sensitivity_charts(out_dir, _rows_by_name(comparison))))
    return _env().get_template("profiler.html.j2").render(
        title=title, baseline=comparison.baseline, analysis=comparison.analysis,
        consistency=comparison.consistency.line() if getattr(comparison, "consistency", None) is not None else "",
        headers=[h for _, h in TABLE_COLUMNS], table=table, charts=_charts(compared), findings=findings,
        thresholds=THRESHOLDS, worst=worst_ops(comparison, 10), lsb=comparison.lsb_summary(),
        lsb_rows=lsb_rows(comparison), only_in_baseline=comparison.only_in_baseline,
        only_in_analysis=comparison.only_in_analysis, sensitivity=sensitivity, rows_by_name=_rows_by_name(comparison),
    )


def write_html(comparison: LayerComparison, findings: list[Finding], path: str | os.PathLike) -> Path:
    return atomic_write_text(path, render_html(comparison, findings, out_dir=Path(path).parent))


def render_bad_case_html(result: Any, title: str = "quantlens bad case search") -> str:
    """``badcase_report.html``: per model output, a histogram of each metric over the searched samples (with
    the bad case and that metric's worst sample marked), then the tables of ``badcase.txt``."""
    values = getattr(result, "values", None) or {}
    bad = result.bad_case_index
    outputs = []
    for out in result.outputs:
        charts = []
        for m in result.metrics:
            vals = values.get(out, {}).get(m)
            if vals is None:
                continue
            worst = result.worst_index[out][m]
            marks = [("bad case", bad)] + ([(f"worst {m}", worst)] if worst != bad else [])
            charts.append(histogram_chart(f"{m} of output '{out}'", vals, marks))
        outputs.append({"name": out, "charts": charts})
    worst_rows = [[o] + [(result.worst_index[o][m], fmt(result.worst_value[o][m])) for m in result.metrics]
                  for o in result.outputs]
    overall = [(m, *result.overall[m][:2], fmt(result.overall[m][2])) for m in result.metrics]
    return _env().get_template("badcase_report.html.j2").render(
        title=title, num_samples=result.num_samples, bad_case=bad, metric=result.metric, metrics=result.metrics,
        outputs=outputs, worst_rows=worst_rows, overall=overall, has_values=bool(values),
        sort_key=lambda s: _sort_key(float(s)) if s not in ("", None) else "",
    )


def write_bad_case_html(result: Any, path: str | os.PathLike) -> Path:
    return atomic_write_text(path, render_bad_case_html(result))
