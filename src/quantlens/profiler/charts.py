"""The reports' SVG charts, drawn in Python (no script or style sheet loaded from anywhere): line charts along
the network, bar charts, histograms and the small LSB histograms of the integer comparison. Each chart carries
its figures in ``data-tip`` attributes (the page's inline script shows them on hover) and, where a chart point
belongs to an op site, the id of its table row (``data-row``, a click jumps there). Same inputs give the same
bytes."""

from __future__ import annotations

import html as _html
import math
from typing import Sequence

from markupsafe import Markup

from quantlens.profiler.formatting import fmt
from quantlens.profiler.short_names import short_names

__all__ = ["line_chart", "bar_chart", "histogram_chart", "lsb_histogram", "hist_buckets", "nice_ticks",
           "tick_text", "tick_texts", "value_ticks"]

#: the charts' drawing width (SVG user units); the page scales a chart to its width (about 1 unit per CSS pixel in
#: a 1400 px window), so the layout below is in units of the 11 px tick font
_W, _PAD_L, _PAD_R, _PAD_T = 1300, 70, 20, 30
_PLOT_H = 190  # a line chart's plot height; the x labels get their own band below it
_TICK_CHAR = 7.0  # an upper bound of a tick character's width (11 px font): label bands never fall short
_XLABEL_ANGLE = 60  # degrees the x labels are turned (counter-clockwise)
_XLABEL_GAP = 19  # the least distance between two x labels' anchors: their text boxes never touch
_XLABEL_CHARS = 30  # an x label's most characters (see short_names)

_esc = _html.escape
_DASH = " \u2014 "


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# -- axes ---------------------------------------------------------------------------------------------------
def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """Round axis ticks covering ``[lo, hi]``: steps of 1, 2 or 5 times a power of ten, about ``n`` ticks, the
    first at or below ``lo`` and the last at or above ``hi``. ``integer``: steps of at least 1 (counts)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"nice_ticks needs finite bounds, got {lo!r}, {hi!r}")
    lo, hi = min(lo, hi), max(lo, hi)
    # a span at float rounding's scale (a cosine of 1 +- 2e-16) has no round ticks of its own: one value
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi)):
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


def tick_texts(ticks: Sequence[float]) -> list[str]:
    """The texts of an axis' ticks, each distinct: as short as :func:`tick_text` where that tells them apart,
    else with as many significant digits as it takes (ticks 0.99998, 0.99999, 1 never read "1, 1, 1")."""
    for digits in range(6, 18):
        texts = [f"{t:.{digits}g}" for t in ticks]
        if len(set(texts)) == len(texts):
            return texts
    return [repr(float(t)) for t in ticks]


#: values spread less than this (relative to their size) differ by float64 noise only: drawn as one flat line
_NOISE = 1e-9


def value_ticks(values: Sequence[float]) -> list[float]:
    """The y ticks of a line chart over ``values``: :func:`nice_ticks` of their range, where a range of float
    noise (a bit-exact pair's cosines 0.9999999999999998 .. 1.0000000000000016) is a flat line at their mean,
    not an axis zoomed into the noise."""
    if not values:
        return [0.0, 1.0]
    lo, hi = min(values), max(values)
    if hi - lo <= _NOISE * max(1.0, abs(lo), abs(hi)):
        mid = round((lo + hi) / 2, 9)
        return nice_ticks(mid, mid)
    return nice_ticks(lo, hi)


def _nth(k: int) -> str:
    return f"{k}{'st' if k % 10 == 1 and k % 100 != 11 else 'nd' if k % 10 == 2 and k % 100 != 12 else 'rd' if k % 10 == 3 and k % 100 != 13 else 'th'}"


def _x_labels(texts: Sequence[str], right: float) -> tuple[list[int], float]:
    """Which x positions get a label (every k-th, k the smallest step that keeps the anchors
    :data:`_XLABEL_GAP` apart) and the plot's left edge: far enough right that the first labels, turned and
    hanging down to the left of their anchors, stay inside the chart."""
    n = len(texts)
    if n == 0:
        return [], _PAD_L
    cos = math.cos(math.radians(_XLABEL_ANGLE))
    pad_l = float(_PAD_L)

    def layout(left: float) -> tuple[list[int], float]:
        gap = (right - left) / (n - 1) if n > 1 else right - left
        shown = list(range(0, n, max(1, math.ceil(_XLABEL_GAP / gap))))
        return shown, max([float(_PAD_L)] + [_TICK_CHAR * len(texts[i]) * cos + 10 - gap * i for i in shown])

    for _ in range(4):  # the left edge and the spacing depend on each other: a few rounds settle them
        shown, need = layout(pad_l)
        pad_l = max(pad_l, need)
    return shown, math.ceil(pad_l)


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
    y_ticks = value_ticks(values)
    lo, hi = y_ticks[0], y_ticks[-1]
    n = max(len(labels), 2)
    pad_t = _PAD_T + _LEGEND_ROW  # the legend has its own row above the plot: it never covers a line
    texts, prefix = short_names(labels, _XLABEL_CHARS)
    shown, pad_l = _x_labels(texts, _W - _PAD_R)
    plot_w, plot_h = _W - pad_l - _PAD_R, _PLOT_H
    slot = plot_w / (n - 1) if len(labels) > 1 else plot_w
    base = pad_t + plot_h + 16  # the x labels' anchors: below the plot, clear of the lowest y tick
    drop = max((_TICK_CHAR * len(texts[i]) for i in shown), default=0) * math.sin(math.radians(_XLABEL_ANGLE))
    height = math.ceil(base + drop + 8 + 16)  # the labels' band, then the axis title's own line

    def x(i: int) -> float:
        return pad_l + plot_w * i / (n - 1) if len(labels) > 1 else pad_l + plot_w / 2

    def y(v: float) -> float:
        return pad_t + plot_h * (1 - (v - lo) / (hi - lo))

    parts = [f'<svg class="chart" viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" role="img" '
             f'aria-label="{_esc(title)}" data-points="{len(labels)}">',
             f'<text x="{pad_l}" y="18" class="title">{_esc(title)}</text>',
             f'<rect x="{pad_l}" y="{pad_t}" width="{plot_w}" height="{plot_h}" class="frame"/>']
    for t, text in zip(y_ticks, tick_texts(y_ticks)):
        parts.append(f'<line x1="{pad_l}" x2="{_W - _PAD_R}" y1="{y(t):.1f}" y2="{y(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{pad_l - 6}" y="{y(t) + 4:.1f}" class="tick" text-anchor="end">{_esc(text)}</text>')
    for i in shown:
        parts.append(f'<text x="{x(i):.1f}" y="{base}" class="tick xlabel" text-anchor="end" '
                     f'transform="rotate(-{_XLABEL_ANGLE} {x(i):.1f} {base})" '
                     f'data-tip="{_esc(labels[i])} (#{_esc(ticks[i])})">{_esc(texts[i])}</text>')
    step = shown[1] - shown[0] if len(shown) > 1 else 1
    notes = ([f"every {_nth(step)} named"] if step > 1 else []) + \
        ([f"names without their common prefix '{prefix}'"] if prefix else []) + ["hover for full names"]
    parts.append(f'<text x="{pad_l + plot_w / 2:.1f}" y="{height - 4}" class="axis" text-anchor="middle">'
                 f'op site ({_esc("; ".join(notes))}){_DASH + _esc(y_label) if y_label else ""}</text>')
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
    parts.extend(_legend([(name, color) for name, color, _ in series], _PAD_L, _PAD_T + _LEGEND_ROW - 6))
    for i, label in enumerate(labels):  # hover / click targets, one per op site, on top of everything
        tip = "\n".join([f"{label} (#{ticks[i]})"] + [f"{name}: {fmt(vals[i]) or '-'}" for name, _, vals in series])
        link = f' data-row="{_esc(anchors[i])}"' if anchors is not None else ""
        parts.append(f'<rect class="hit" x="{x(i) - slot / 2:.1f}" y="{pad_t}" width="{slot:.1f}" '
                     f'height="{plot_h}" data-tip="{_esc(tip)}"{link}/>')
    parts.append("</svg>")
    return Markup("".join(parts))


_LEGEND_ROW = 16  # a line chart's legend row, between its title and its plot
_CHAR_W = 7.0  # the width of a legend character at the charts' 12 px font, for laying the entries out in a row


def _legend(entries: Sequence[tuple[str, str]], x0: float, baseline: float) -> list[str]:
    """A legend in one row from ``x0`` at ``baseline`` (outside the plot): a colour box and the name per entry."""
    parts, x = [], x0
    for name, color in entries:
        parts.append(f'<rect class="legend-box" x="{x:.1f}" y="{baseline - 9}" width="10" height="10" '
                     f'fill="{color}"/>')
        parts.append(f'<text x="{x + 14:.1f}" y="{baseline}" class="legend">{_esc(name)}</text>')
        x += 14 + _CHAR_W * len(name) + 18
    return parts


def bar_chart(title: str, bars: Sequence[dict], value_label: str = "") -> Markup:
    """A horizontal SVG bar chart, one ``rect.bar`` per item of ``bars`` (dicts with ``label``, ``value``,
    ``tip`` and optionally ``row``, the id of a table row a click jumps to), in the given order. A non-finite
    value gets a full-length red bar labelled with its value."""
    # the right margin holds the longest value label after its bar (it is never clipped nor drawn over a bar)
    pad_r = max([70.0] + [_CHAR_W * len(fmt(b["value"])) + 10 for b in bars])
    # the left margin holds the longest label whole (labels come shortened: see short_names)
    pad_l = min(_W // 2, max([120.0] + [_TICK_CHAR * len(b["label"]) + 12 for b in bars]))
    bar_h, gap, pad_t, pad_b = 16, 4, 30, 34
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
             f'aria-label="{_esc(title)}" data-bars="{len(bars)}">',
             f'<text x="10" y="18" class="title">{_esc(title)}</text>']
    bottom = height - pad_b
    for t in ticks:
        parts.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{pad_t}" y2="{bottom}" class="grid"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{bottom + 14}" class="tick" text-anchor="middle">'
                     f'{_esc(tick_text(t))}</text>')
    if value_label:
        parts.append(f'<text x="{pad_l + plot_w / 2:.1f}" y="{height - 4}" class="axis" text-anchor="middle">'
                     f'{_esc(value_label)}</text>')
    for i, b in enumerate(bars):
        top = pad_t + i * (bar_h + gap)
        fv = _finite(b["value"])
        width = plot_w if fv is None else max(1.0, x(fv) - pad_l)
        color = "#d62728" if fv is None else "#1f77b4"
        link = f' data-row="{_esc(b["row"])}"' if b.get("row") else ""
        parts.append(f'<text x="{pad_l - 6}" y="{top + 12}" class="tick" text-anchor="end">'
                     f'{_esc(b["label"])}</text>')
        parts.append(f'<rect class="bar" x="{pad_l}" y="{top}" width="{width:.1f}" height="{bar_h}" fill="{color}" '
                     f'data-tip="{_esc(b["tip"])}"{link}/>')
        parts.append(f'<text x="{pad_l + width + 4:.1f}" y="{top + 12}" class="tick">{_esc(fmt(b["value"]))}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram_chart(title: str, values: Sequence[float], marks: Sequence[tuple[str, int]] = (),
                    width: int = 420, height: int = 200) -> Markup:
    """An SVG histogram of ``values`` (one per sample, in sample order) on round bin edges: one ``rect.bar``
    per bin (``data-count``: its samples), plus a red "non-finite" bar when some values are NaN/Inf.
    ``marks``: ``(name, sample index)`` drawn as vertical lines at those samples' values."""
    finite = [(i, fv) for i, v in enumerate(values) if (fv := _finite(v)) is not None]
    bad = [i for i, v in enumerate(values) if _finite(v) is None]
    drawn = [(name, i) for name, i in marks if 0 <= i < len(values) and _finite(values[i]) is not None]
    # the marks' labels get their own band above the plot (one line each): they never sit on a bar
    pad_l, pad_r, pad_t, pad_b = 40, 28, 26 + (11 * len(drawn) + 6 if drawn else 0), 34
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
             f'role="img" aria-label="{_esc(title)}" data-bars="{len(groups)}" data-samples="{len(values)}">',
             f'<text x="{pad_l}" y="16" class="title">{_esc(title)}</text>',
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
                     f'data-tip="{_esc(tip)}"/>')
    for j in range(len(edges)):
        if j % max(1, math.ceil(len(edges) / 6)) == 0 or j == len(edges) - 1:
            parts.append(f'<text x="{pad_l + j * slot:.1f}" y="{pad_t + plot_h + 14}" class="tick" '
                         f'text-anchor="middle">{_esc(tick_text(edges[j]))}</text>')
    if bad:
        parts.append(f'<text x="{pad_l + (len(groups) - 0.5) * slot:.1f}" y="{pad_t + plot_h + 14}" class="tick" '
                     f'text-anchor="middle">NaN/Inf</text>')
    for k, (name, index) in enumerate(drawn):
        if not bins:
            break
        fv = _finite(values[index])
        xm = pad_l + plot_w * (len(bins) / len(groups)) * (fv - edges[0]) / (edges[-1] - edges[0])
        right = xm > pad_l + plot_w / 2  # the label on the side with room
        label_y = 26 + 9 + 11 * k
        parts.append(f'<line class="mark" x1="{xm:.1f}" x2="{xm:.1f}" y1="{pad_t}" y2="{pad_t + plot_h}"/>'
                     f'<text x="{xm - 3 if right else xm + 3:.1f}" y="{label_y}" class="tick mark-label" '
                     f'text-anchor="{"end" if right else "start"}">{_esc(name)} (sample {index})</text>')
    parts.append(f'<text x="{pad_l + plot_w / 2:.1f}" y="{height - 4}" class="axis" text-anchor="middle">'
                 f'value over {len(values)} samples</text></svg>')
    return Markup("".join(parts))


def hist_buckets(hist: str) -> list[tuple[str, int]]:
    """The ``(bucket label, element count)`` pairs of an ``lsb_hist`` string ("0:n|1:n|...")."""
    return [(label, int(n)) for label, n in (part.split(":") for part in hist.split("|"))] if hist else []


def lsb_histogram(hist: str, width: int = 180, height: int = 34) -> Markup:
    """A small inline SVG bar chart of an ``lsb_hist`` string ("0:n|1:n|..."), log-scaled counts: one
    ``rect.bar`` per bucket, its element count and share in its tooltip."""
    buckets = hist_buckets(hist)
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
                     f'height="{h:.1f}" fill="{color}" data-count="{n}" data-tip="{_esc(tip)}"/>')
        parts.append(f'<text x="{i * bar + bar / 2:.1f}" y="{height + 10}" class="tick" '
                     f'text-anchor="middle">{_esc(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
