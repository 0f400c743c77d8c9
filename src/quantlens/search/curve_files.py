"""The curve files of a search: ``mixed_precision_curve.csv`` and a self-contained ``mixed_precision_curve.html``
(inline SVG: the metric vs the number of int16 sites, and vs the latency estimate when measured)."""

from __future__ import annotations

import csv
import html
import math
import os
from pathlib import Path

from quantlens.search.result import CurvePoint, MixedPrecisionResult

__all__ = ["CSV_FILE", "HTML_FILE", "write_curve", "svg_plot"]

CSV_FILE = "mixed_precision_curve.csv"
HTML_FILE = "mixed_precision_curve.html"


def write_curve(result: MixedPrecisionResult, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``mixed_precision_curve.csv`` and ``mixed_precision_curve.html`` (inline SVG, no external file)."""
    out = Path(out_dir)
    csv_path, html_path = out / CSV_FILE, out / HTML_FILE
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "num_int16", "added_site", "added_kind", "removed_site", "removed_kind", "metric",
                    "latency_cycles", "tried"])
        for p in result.curve:
            w.writerow([p.step, p.num_int16, p.added.site if p.added else "", p.added.kind if p.added else "",
                        p.removed.site if p.removed else "", p.removed.kind if p.removed else "",
                        repr(p.metric), "" if p.latency_cycles is None else p.latency_cycles, p.tried])
    plots = [svg_plot([(p.num_int16, p.metric) for p in result.curve], "int16 op sites", result.target)]
    if all(p.latency_cycles is not None for p in result.curve):
        plots.append(svg_plot([(p.latency_cycles, p.metric) for p in result.curve], "latency estimate (cycles)",
                               result.target))
    rows = "".join(
        f"<tr><td>{p.step}</td><td>{p.num_int16}</td><td>{_change(p)}</td>"
        f"<td>{p.metric:.6f}</td><td>{'' if p.latency_cycles is None else p.latency_cycles}</td><td>{p.tried}</td></tr>"
        for p in result.curve)
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>mixed precision curve</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;font-size:13px}</style></head><body><h1>Mixed-precision search</h1>"
        f"<p>target {result.target}: {'reached' if result.reached else 'not reached'} with {result.num_int16} "
        f"int16 promotion(s); base metric {result.base_metric:.6f}, final {result.metric:.6f}; "
        f"{result.measurements} configurations measured; {len(result.candidates)} candidates.</p>"
        + "".join(plots)
        + "<table><tr><th>step</th><th>int16 sites</th><th>change</th><th>metric</th><th>latency (cycles)</th>"
          f"<th>tried</th></tr>{rows}</table></body></html>")
    html_path.write_text(page)
    return csv_path, html_path


def _change(point: CurvePoint) -> str:
    if point.added is not None and point.removed is not None:
        return html.escape(point.removed.label()) + " &rarr; " + html.escape(point.added.label()) + " (exchange)"
    if point.added is not None:
        return "+ " + html.escape(point.added.label())
    if point.removed is not None:
        return "&minus; " + html.escape(point.removed.label()) + " (pruned)"
    if point.back:
        return f"back to the best set measured: the first {point.num_int16} (the target was not reached)"
    if point.kept is not None:
        return f"the {point.kept} most needed sites (descend)"
    return "base"


def svg_plot(points: list[tuple[float, float]], xlabel: str, target: float) -> str:
    """A line plot of ``points`` with the target as a dashed line (inline SVG)."""
    w, h, pad = 640, 320, 55
    xs, ys = [p[0] for p in points], [p[1] for p in points] + [target]
    finite = [y for y in ys if math.isfinite(y)]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(finite), max(finite)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1e-3
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: E731
    sy = lambda y: h - pad + (y0 - (y if math.isfinite(y) else y0)) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    path = " ".join(f"{'M' if k == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for k, (x, y) in enumerate(points))
    dots = "".join(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='#1f77b4'><title>{x}: {y:.6f}</title>"
                   "</circle>" for x, y in points)
    ty = sy(target)
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' style='display:block;margin:1em 0'>"
        f"<rect x='{pad}' y='{pad}' width='{w - 2 * pad}' height='{h - 2 * pad}' fill='none' stroke='#999'/>"
        f"<line x1='{pad}' x2='{w - pad}' y1='{ty:.1f}' y2='{ty:.1f}' stroke='#d62728' stroke-dasharray='4'/>"
        f"<text x='{w - pad}' y='{ty - 4:.1f}' text-anchor='end' font-size='11' fill='#d62728'>target {target}</text>"
        f"<path d='{path}' fill='none' stroke='#1f77b4' stroke-width='2'/>{dots}"
        f"<text x='{w / 2}' y='{h - 12}' text-anchor='middle' font-size='12'>{html.escape(xlabel)}</text>"
        f"<text x='14' y='{h / 2}' font-size='12' transform='rotate(-90 14 {h / 2})' text-anchor='middle'>metric</text>"
        f"<text x='{pad}' y='{h - pad + 14}' font-size='10'>{x0:g}</text>"
        f"<text x='{w - pad}' y='{h - pad + 14}' font-size='10' text-anchor='end'>{x1:g}</text>"
        f"<text x='{pad - 4}' y='{h - pad}' font-size='10' text-anchor='end'>{y0:.4f}</text>"
        f"<text x='{pad - 4}' y='{pad + 4}' font-size='10' text-anchor='end'>{y1:.4f}</text></svg>")
