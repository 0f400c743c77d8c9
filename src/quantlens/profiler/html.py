"""``profiler.html`` and ``badcase_report.html``: self-contained pages (inline CSS, inline SVG charts, inline JS).

No script, style sheet or font is loaded from anywhere: the pages work from a file on a machine without network
access. Charts are drawn in Python, as SVG (:mod:`.charts`); the inline script only adds behaviour: a tooltip with
a point's figures on hover, a jump to the point's table row on click, and table sorting (rows without a value
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
from typing import Any

import jinja2
from markupsafe import Markup

from quantlens._io import atomic_write_text
from quantlens.profiler.advisor.base import THRESHOLDS, Finding
from quantlens.profiler.charts import bar_chart, hist_buckets, histogram_chart, line_chart, lsb_histogram
from quantlens.profiler.compare import SAME_INPUT_SQNR_LIMIT, LayerComparison, LayerRow
from quantlens.profiler.formatting import fmt
from quantlens.profiler.report_files import PROFILER_HTML
from quantlens.profiler.short_names import short_name

__all__ = ["render_html", "write_html", "worst_ops", "worst_channel_ops", "TABLE_COLUMNS", "render_bad_case_html", "write_bad_case_html",
           "refresh_sensitivity", "sensitivity_tables", "row_id"]

_TEMPLATES = Path(__file__).parent / "templates"

#: (field, header) of the HTML table; the first column (op name) stays visible while the table scrolls sideways
TABLE_COLUMNS = (
    ("op_name", "op name"), ("index", "#"), ("op_type", "op type"), ("shape", "shape"),
    ("quant_dtype", "dtype"), ("scale", "scale"), ("Cosine", "Cosine"), ("SQNR", "SQNR"), ("Atol", "Atol"),
    ("atol_in_scale", "Atol/scale"), ("same_input_cosine", "same-in Cosine"), ("same_input_sqnr", "same-in SQNR"),
    ("same_input_in_scale", "same-in Atol/scale"), ("worst_channel_sqnr", "worst-ch SQNR"),
    ("same_input_worst_channel_sqnr", "same-in worst-ch SQNR"), ("channels_below", f"ch < {SAME_INPUT_SQNR_LIMIT:g} dB"),
    ("error_kind", "error kind"), ("clipped_ratio", "clipped"),
    ("base_min", "base min"), ("base_max", "base max"), ("analy_min", "analy min"), ("analy_max", "analy max"),
    ("note", "note"),
)

SENSITIVITY_TOP = 20  # bars per sensitivity chart
SENSITIVITY_LABEL = 40  # an op name's most characters on a sensitivity bar (the full name is in its tooltip)
SENSITIVITY_BEGIN, SENSITIVITY_END = "<!-- sensitivity:begin -->", "<!-- sensitivity:end -->"


def row_id(index: int) -> str:
    """The HTML id of the per-layer table's row of op site ``index`` (charts link to it)."""
    return f"row-{index}"


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
         [("same-input SQNR (dB)", "#d62728", col("same_input_sqnr")),
          ("same-input SQNR of the worst channel (dB)", "#e377c2", col("same_input_worst_channel_sqnr"))],
         "lower is worse; no point: no error"),
        ("Same-input error in output quantization steps",
         [("same-input Atol / scale", "#9467bd", col("same_input_in_scale"))], ""),
        # baseline blue, analysis orange (dark: min, light: max): the two models read apart at a glance
        ("Output ranges",
         [("baseline min", "#1f4e9c", col("base_min")), ("baseline max", "#6fa8dc", col("base_max")),
          ("analysis min", "#d95f02", col("analy_min")), ("analysis max", "#fdb863", col("analy_max"))], ""),
    ]
    return [line_chart(title, labels, series, y_label, ticks, anchors) for title, series, y_label in specs]


_VERDICT_COLORS = {"bit-exact": "#2ca02c", "within 1 LSB": "#98df8a", "within 4 LSB": "#ff7f0e",
                   "diverged": "#d62728", "": "#bbb"}


def _beyond_one_lsb(hist: str) -> str:
    """The sort key of an LSB histogram: the share of elements more than 1 LSB off."""
    buckets = hist_buckets(hist)
    total = sum(n for _, n in buckets)
    return repr(sum(n for label, n in buckets if label not in ("0", "1")) / total) if total else ""


def lsb_rows(comparison: LayerComparison) -> list[dict]:
    """The rows of the HTML's integer-comparison table (deployed stages)."""
    return [{"op_name": r.op_name, "op_type": r.op_type, "quant_dtype": r.quant_dtype,
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


def worst_channel_ops(comparison: LayerComparison, count: int) -> list[LayerRow]:
    """The ops whose worst channel (same input) loses the most, leaving out those that lose nothing."""
    ranked = comparison.ranked("same_input_worst_channel_sqnr")
    return [r for r in ranked if math.isfinite(r.same_input_worst_channel_sqnr)][:count]


#: columns whose cell is marked when below the same-input SQNR limit
_MARKED = ("same_input_sqnr", "same_input_worst_channel_sqnr")


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
        bars = [{"label": f"{short_name(str(r.get('op_name', '')), SENSITIVITY_LABEL)} ({r.get('sensitive_type', '')})",
                 "value": r.get("value"),
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
            '<p class="meta" id="rankings">What each ranking measures: the sensitivity ranking is the model '
            "output's loss when only that one quantizer (a weight's or an activation's) is on; the table "
            "<i>Ops that lose the most precision themselves</i> and the summary's worst op rank the op's own "
            "loss, its same-input SQNR on the baseline's input. A quantizer can move the output most while "
            "another op adds the most error of its own, so the two rankings can name different ops.</p>\n"
            + "\n".join(charts) + "\n" + SENSITIVITY_END)


def _rows_by_name(comparison: LayerComparison) -> dict[str, str]:
    return {r.op_name: row_id(r.index) for r in comparison}


def refresh_sensitivity(out_dir: str | os.PathLike) -> Path | None:
    """Update the sensitivity section of ``out_dir/profiler.html`` (if it exists) from the sensitivity files."""
    path = Path(out_dir) / PROFILER_HTML
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
        bad = key in _MARKED and isinstance(value, float) and value < SAME_INPUT_SQNR_LIMIT
        return {"text": fmt(value), "sort": _sort_key(value), "bad": bad}

    table = [(row_id(r.index), [cell(r, key) for key, _ in TABLE_COLUMNS]) for r in comparison]
    sensitivity = Markup(_sensitivity_section(_sensitivity_charts(out_dir, _rows_by_name(comparison))))
    return _env().get_template("profiler.html.j2").render(
        title=title, baseline=comparison.baseline, analysis=comparison.analysis,
        consistency=comparison.consistency.line() if getattr(comparison, "consistency", None) is not None else "",
        headers=[h for _, h in TABLE_COLUMNS], table=table, charts=_charts(compared), findings=findings,
        thresholds=THRESHOLDS, worst=worst_ops(comparison, 10), worst_channel=worst_channel_ops(comparison, 10),
        channel_limit=SAME_INPUT_SQNR_LIMIT, lsb=comparison.lsb_summary(),
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
