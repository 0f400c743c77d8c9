"""Text, CSV and ``.pt`` writers. Every writer takes data returned by the analysis and writes its file
atomically; none computes anything. Reports carry no timestamps, so the same inputs give the same files.
Text tables stay within :data:`TEXT_WIDTH` columns (:func:`wrap_table`). ``write_bad_case`` also writes
``badcase_report.html`` and ``write_sensitivity`` refreshes ``profiler.html``'s sensitivity charts
(:mod:`.html`)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import math
import os
import textwrap
import urllib.parse
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from quantlens._io import atomic_write, atomic_write_text, format_table
from quantlens.errors import DiskFullError
from quantlens.profiler.advisor.base import THRESHOLDS, Finding
from quantlens.profiler.bad_case import BadCaseResult
from quantlens.profiler.compare import COLUMNS, SAME_INPUT_SQNR_LIMIT, LayerComparison
from quantlens.profiler.compare_cache import COMPARISON_FILE, save_comparison
from quantlens.profiler.formatting import fmt
from quantlens.profiler.html import refresh_sensitivity, write_bad_case_html, write_html
from quantlens.profiler.report_files import BAD_CASE_HTML, COMPARE_CSV, COMPARE_TEXT, PROFILER_HTML, sensitivity_stem
from quantlens.profiler.sensitivity import SensitivityTable
from quantlens.profiler.trace.reader import TraceReader

__all__ = [
    "keeping",
    "write_comparison",
    "write_bad_case", "write_statistic", "write_compare_text", "write_compare_csv", "write_advisor",
    "write_sensitivity", "safe_name", "save_pt", "wrap_table", "TEXT_WIDTH",
]

#: text reports keep their lines within this many columns (wider tables are split, long cells wrapped)
TEXT_WIDTH = 120


def _render_table(headers: Sequence[str], rows: Sequence[Sequence[list[str]]]) -> list[str]:
    """``format_table``'s layout for cells of one or more lines (a row takes as many lines as its tallest cell)."""
    cells = [[[h] for h in headers]] + [list(r) for r in rows]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(headers))]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [sep]
    for k, row in enumerate(cells):
        for j in range(max(len(c) for c in row)):
            out.append("| " + " | ".join((c[j] if j < len(c) else "").ljust(w) for c, w in zip(row, widths)) + " |")
        if k == 0:
            out.append(sep)
    return out + [sep]


def _wrap_cell(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def wrap_table(headers: Sequence[str], rows: Sequence[Sequence[object]], width: int = TEXT_WIDTH,
               keys: Sequence[int] = (0,)) -> str:
    """``format_table``, kept within ``width`` columns: a table that fits is exactly ``format_table``'s; a
    wider one is split into column groups printed one after another, each repeating the ``keys`` columns (the
    ones that name a row, e.g. index and op name), and a cell too long for any group is wrapped onto more lines."""
    text = format_table(headers, rows)
    if max(len(line) for line in text.splitlines()) <= width:
        return text
    head = [str(h) for h in headers]
    body = [["" if c is None else str(c) for c in row] for row in rows]
    n = len(head)
    keys = [k for k in keys if 0 <= k < n][: max(n - 1, 0)] or ([0] if n > 1 else [])
    natural = [max(len(r[i]) for r in [head] + body) for i in range(n)]
    col_w = list(natural)
    while keys and sum(col_w[k] + 3 for k in keys) > width // 2 and max(col_w[k] for k in keys) > 8:
        widest = max(keys, key=lambda k: col_w[k])  # the row names take at most half the width
        col_w[widest] -= 1
    key_total = sum(col_w[k] + 3 for k in keys)
    cap = max(8, width - 1 - key_total - 3)
    col_w = [w if i in keys else min(w, cap) for i, w in enumerate(col_w)]
    groups: list[list[int]] = []
    for i in (i for i in range(n) if i not in keys):
        if groups and 1 + key_total + sum(col_w[j] + 3 for j in groups[-1]) + col_w[i] + 3 <= width:
            groups[-1].append(i)
        else:
            groups.append([i])
    parts = []
    for g, group in enumerate(groups):
        cols = sorted(list(keys) + group)
        title = [] if len(groups) == 1 else [f"(columns {g + 1}/{len(groups)})"]
        parts.append("\n".join(title + _render_table(
            [head[c] for c in cols], [[_wrap_cell(r[c], col_w[c]) for c in cols] for r in body])))
    return "\n\n".join(parts)


#: the longest output-name part of a file name: file systems allow 255 bytes for the whole name
_NAME_BYTES = 120


def safe_name(name: str) -> str:
    """An output name usable in a file name, distinct for distinct names: ASCII letters, digits and ``._-~``
    stay, every other byte is percent-encoded (``"cls/score"`` -> ``cls%2Fscore``, ``"cls_score"`` stays). A
    name longer than 120 bytes encoded keeps its first 100 and a digest of the whole name (stable, still
    distinct), so a file name never exceeds the file system's limit."""
    quoted = urllib.parse.quote(name, safe="._-~") or "output"
    if len(quoted) <= _NAME_BYTES:
        return quoted
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
    return f"{quoted[:100]}~{digest}"


def write_bad_case(result: BadCaseResult, path: str | os.PathLike) -> Path:
    metrics = result.metrics
    lines = [
        "quantlens bad case search",
        f"samples: {result.num_samples}",
        f"bad case (used by run()): sample {result.bad_case_index}, the worst under {result.metric}",
        "worst: largest L1/MSE/KL/Atol, smallest Cosine/SQNR",
        "",
        "== Worst sample index per output and metric ==",
        wrap_table(["output"] + metrics, [[o] + [result.worst_index[o][m] for m in metrics] for o in result.outputs]),
        "",
        "== Metric value at that sample ==",
        wrap_table(["output"] + metrics,
                   [[o] + [fmt(result.worst_value[o][m]) for m in metrics] for o in result.outputs]),
        "",
        "== Worst sample per metric over all outputs ==",
        wrap_table(["metric", "sample", "output", "value"],
                   [[m, *result.overall[m][:2], fmt(result.overall[m][2])] for m in metrics]),
    ]
    k = getattr(result, "k", 1)
    if k > 1:  # auto_find_bad_case(..., topk=k): the k worst samples, rank 1 = the worst (set_bad_case(rank=r))
        lines += [
            "",
            f"== Top {k} worst samples per output and metric (rank: sample, value) ==",
            wrap_table(["output", "metric", "rank", "sample", "value"],
                       [[o, m, r, i, fmt(v)] for o in result.outputs for m in metrics
                        for r, (i, v) in enumerate(result.topk[o][m], 1)]),
            "",
            f"== Top {k} worst samples per metric over all outputs ==",
            wrap_table(["metric", "rank", "sample", "output", "value"],
                       [[m, r, i, o, fmt(v)] for m in metrics for r, (i, o, v) in enumerate(result.overall_topk[m], 1)]),
        ]
    written = atomic_write_text(path, "\n".join(lines) + "\n")
    write_bad_case_html(result, Path(path).parent / BAD_CASE_HTML)
    return written


def write_statistic(trace: TraceReader, path: str | os.PathLike) -> Path:
    """``statistic.txt``: per op site its outputs (and QuantStub inputs, weights), NaN/Inf flagged."""
    rows, bad = [], []
    for site in trace.sites:
        keys = (["in0"] if site.boundary == "input" and "in0" in site.stats else []) + site.outputs()
        keys += ["weight"] if "weight" in site.stats else []
        for key in keys:
            st = site.stats[key]
            attr = {"in0": "input", "weight": "weight"}.get(key, f"output{key[3:]}" if len(site.outputs()) > 1 else "output")
            scale = site.weight_scale if key == "weight" else (site.scale if key.startswith("out") else None)
            dtype = site.quant_dtype if key.startswith("out") else st.dtype
            flag = f"NaN x{st.nan} Inf x{st.inf}" if st.nonfinite else ""
            rows.append([site.index, site.name, site.op_type, attr, dtype, fmt(scale), fmt(st.min), fmt(st.max),
                         fmt(st.mean), fmt(st.var), "x".join(map(str, st.shape)), st.dtype, flag])
            if flag:
                bad.append([site.index, site.name, attr, flag])
    headers = ["index", "op name", "op type", "attr", "quant dtype", "scale", "min", "max", "mean", "var", "shape",
               "tensor dtype", "NaN/Inf"]
    lines = [f"quantlens statistics: {trace.label} model", trace.description, "", wrap_table(headers, rows, keys=(0, 1, 3)), "",
             "== NaN / Inf =="]
    lines.append(wrap_table(["index", "op name", "attr", "count"], bad) if bad else "(none)")
    return atomic_write_text(path, "\n".join(lines) + "\n")


_TEXT_COLUMNS = (
    ("index", "index"), ("op_name", "op name"), ("base_op_type", "base op"), ("op_type", "analysis op"),
    ("shape", "shape"), ("quant_dtype", "quant dtype"), ("scale", "scale"), ("Cosine", "Cosine"), ("L1", "L1"),
    ("Atol", "Atol"), ("atol_in_scale", "Atol/scale"), ("same_input_sqnr", "same-in SQNR"),
    ("same_input_atol", "same-in Atol"), ("same_input_in_scale", "same-in Atol/scale"),
    ("worst_channel_sqnr", "worst-ch SQNR"), ("same_input_worst_channel_sqnr", "same-in worst-ch SQNR"),
    ("channels_below", f"ch < {SAME_INPUT_SQNR_LIMIT:g} dB"), ("error_kind", "error kind"), ("base_min", "base min"), ("base_max", "base max"), ("base_mean", "base mean"),
    ("analy_min", "analy min"), ("analy_max", "analy max"), ("analy_mean", "analy mean"), ("note", "note"),
)


def _label(row) -> str:
    return row.op_name + (" (host-side)" if row.host_side else "")


def _sensitivity_lines(comparison: LayerComparison, sensitivity, top: int) -> list[str]:
    """The summary's first ranking: each op's best sensitivity rank over the outputs (one quantizer at a time),
    the ops that reach no compared output left out; nothing before ``sensitivity()`` has run."""
    if not sensitivity:
        return []
    rows = {r.op_name: r for r in comparison}
    best: dict[str, tuple[int, str, float, str]] = {}
    for table in sensitivity:
        for rank, row in enumerate(table):
            if rows.get(row.op_name) is not None and rows[row.op_name].reaches_output is False:
                continue
            if row.op_name not in best or rank < best[row.op_name][0]:
                best[row.op_name] = (rank, row.sensitive_type, row.value, f"{table.output} ({table.metric})")
    ranked = sorted(best.items(), key=lambda kv: kv[1][0])[:top]
    label = {name: _label(rows[name]) if name in rows else name for name, _ in ranked}
    return [f"== Ops the outputs are most sensitive to (sensitivity, one quantizer at a time; top {len(ranked)}) ==",
            wrap_table(["op name", "quantizer", "value", "output (metric)"],
                       [[label[name], kind, fmt(value), out] for name, (_, kind, value, out) in ranked]), ""]


def write_compare_text(comparison: LayerComparison, path: str | os.PathLike, top: int = 20,
                       sensitivity=None) -> Path:
    """``compare_per_layer_out.txt``: the per-layer table, then the summary: the sensitivity ranking first (when
    ``sensitivity``, a :class:`~.sensitivity.SensitivityResult`, is given), the same-input ranking second, the
    per-channel one, the LSB verdicts, and the ops listed apart (one side only, reaching no compared output)."""
    rows = [[_label(r) if key == "op_name" else fmt(getattr(r, key)) for key, _ in _TEXT_COLUMNS] for r in comparison]
    ranked = [r for r in comparison.ranked("same_input_sqnr") if math.isfinite(r.same_input_sqnr)][:top]
    lines = [
        "quantlens per-layer comparison",
        f"baseline: {comparison.baseline}",
        f"analysis: {comparison.analysis}",
        *_consistency_lines(getattr(comparison, "consistency", None)),
        *textwrap.wrap("Accumulated error: analysis output vs baseline output. Same-input error: the analysis op "
                       "re-run on the baseline's input (what this op adds). Atol/scale: in output quantization steps.",
                       TEXT_WIDTH),
        "",
        wrap_table([h for _, h in _TEXT_COLUMNS], rows, keys=(0, 1)),
        "",
        *_sensitivity_lines(comparison, sensitivity, top),
        f"== Ops that lose the most precision themselves (same-input SQNR, worst {len(ranked)}) ==",
        wrap_table(["op name", "op type", "quant dtype", "same-in SQNR", "same-in Atol/scale", "error kind"],
                   [[_label(r), r.op_type, r.quant_dtype, fmt(r.same_input_sqnr), fmt(r.same_input_in_scale),
                     r.error_kind] for r in ranked]) if ranked else "(no same-input results)",
    ]
    lines += _channel_lines(comparison, top) + _lsb_lines(comparison) + _one_side_lines(comparison)
    if comparison.unreached:
        lines += ["", "== Ops whose output reaches no compared output (not ranked: they cannot explain it) ==",
                  ", ".join(f"{r.op_name} ({r.op_type})" for r in comparison.unreached)]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def _weights(per_channel: bool | None) -> str:
    return {True: "per channel", False: "per tensor"}.get(per_channel, "")


def _channel_lines(comparison: LayerComparison, top: int) -> list[str]:
    """The ranking by the worst channel (same input), for the ops with per-channel figures (none: no lines)."""
    ranked = comparison.ranked("same_input_worst_channel_sqnr")
    if not ranked:
        return []
    ranked = [r for r in ranked if math.isfinite(r.same_input_worst_channel_sqnr)][:top]
    headers = ["op name", "op type", "same-in SQNR", "same-in worst-ch SQNR", "before output rounding",
               f"ch < {SAME_INPUT_SQNR_LIMIT:g} dB", "weights"]
    rows = [[r.op_name, r.op_type, fmt(r.same_input_sqnr), fmt(r.same_input_worst_channel_sqnr),
             fmt(r.same_input_inner_worst_channel_sqnr), fmt(r.channels_below), _weights(r.weight_per_channel)]
            for r in ranked]
    return [
        "", f"== Ops with the worst single channel (same-input worst-channel SQNR, worst {len(ranked)}) ==",
        *textwrap.wrap("A whole-tensor SQNR is dominated by the strongest channels: an op can look healthy while some "
                       "of its channels are crushed (per-tensor weights on channels of very different ranges). "
                       f"'before output rounding': the worst channel of the op's own arithmetic; 'ch < "
                       f"{SAME_INPUT_SQNR_LIMIT:g} dB': the share of channels below that.", TEXT_WIDTH),
        wrap_table(headers, rows) if rows else "(no channel loses precision)",
    ]


def _consistency_lines(consistency) -> list[str]:
    """The header line naming the consistency level the models were built with (none without one)."""
    return [] if consistency is None else [consistency.line()]


def _lsb_lines(comparison: LayerComparison) -> list[str]:
    summary = comparison.lsb_summary()
    if summary is None:
        return []
    counts = lambda kind: ", ".join(f"{v}: {n}" for v, n in summary[kind].items())  # noqa: E731
    rows = [[r.op_name, r.op_type, r.quant_dtype, r.lsb_verdict, r.lsb_hist, r.same_input_lsb_verdict,
             r.same_input_lsb_hist] for r in comparison if r.lsb_verdict or r.same_input_lsb_verdict]
    return [
        "", "== Integer comparison: |analysis - baseline| in LSB of each op's output ==",
        f"accumulated: {counts('accumulated')}",
        f"same input (what each op's own kernel adds): {counts('same_input')}",
        f"first op that diverges (> 4 LSB): {summary['first_diverged'] or '(none)'}",
        f"first op whose own kernel is not bit-exact: {_first_inexact(summary)}",
        "histogram buckets: |diff| of 0, 1, 2, 3-4, 5-8 and more than 8 LSB (element counts)",
        wrap_table(["op name", "op type", "quant dtype", "verdict", "histogram", "same-in verdict",
                    "same-in histogram"], rows),
    ]


def _first_inexact(summary: dict) -> str:
    """The first inexact op; "(no same-input data)" when no row has a same-input verdict (an onnxruntime pair),
    so that no data never reads as "(none)"."""
    if not any(summary["same_input"].values()):
        return "(no same-input data)"
    return summary["first_inexact"] or "(none)"


def _one_side_lines(comparison: LayerComparison) -> list[str]:
    lines = []
    for title, sites in (("only in the baseline", comparison.only_in_baseline),
                         ("only in the analysis model", comparison.only_in_analysis)):
        if sites:
            lines += ["", f"== Op sites {title} ({len(sites)}) ==",
                      wrap_table(["op name", "op type"], [list(s) for s in sites])]
    return lines


def write_compare_csv(comparison: LayerComparison, path: str | os.PathLike) -> Path:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in comparison:
        writer.writerow([fmt(getattr(row, c)) for c in COLUMNS])
    return atomic_write_text(path, buf.getvalue())


def write_advisor(findings: list[Finding], path: str | os.PathLike, consistency=None) -> Path:
    lines = ["quantlens abnormal layer advisor", *_consistency_lines(consistency),
             "thresholds: " + ", ".join(f"{k} = {v:g}" for k, v in THRESHOLDS.items()), ""]
    if findings:
        lines.append(wrap_table(["rule", "op name", "op type", "abnormal info", "advice"],
                                [[f.rule if f.is_problem else f"{f.rule} ({f.severity})", f.op_name, f.op_type, f.info,
                                  f.advice] for f in findings], keys=(1,)))
    else:
        lines.append("(no abnormal layers found)")
    return atomic_write_text(path, "\n".join(lines) + "\n")


def write_sensitivity(table: SensitivityTable, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``output_<name>_<metric>_sensitive_ops.txt`` and ``.pt`` (a list of row dicts)."""
    stem = sensitivity_stem(safe_name(table.output), table.metric)  # names may contain ".": no with_suffix
    if any(r.sensitive_type == "lut" for r in table):  # pre_export: each table's own error on the bad case
        text = wrap_table(["op_name", "sensitive_type", "op_type", table.metric, "quant_dtype",
                           "table err max (steps)", "table err hist (steps)"],
                          [[r.op_name, r.sensitive_type, r.op_type, fmt(r.value), r.quant_dtype,
                            fmt(r.table_error_max_steps), r.table_error_hist or "-"] for r in table])
    else:
        text = wrap_table(["op_name", "sensitive_type", "op_type", table.metric, "quant_dtype"],
                          [[r.op_name, r.sensitive_type, r.op_type, fmt(r.value), r.quant_dtype] for r in table])
    header = f"quantlens sensitivity: output '{table.output}', metric {table.metric} (one quantizer on at a time)\n"
    txt = atomic_write_text(Path(out_dir) / f"{stem}.txt", header + text + "\n")
    pt = save_pt([r.to_dict() for r in table], Path(out_dir) / f"{stem}.pt")
    refresh_sensitivity(out_dir)  # profiler.html's sensitivity charts, when the page exists
    return txt, pt


def write_comparison(comparison: LayerComparison, findings: list[Finding], out_dir: Path, sensitivity=None,
                     traces: tuple[TraceReader, TraceReader] | None = None) -> None:
    """The per-layer reports: ``compare_per_layer_out.txt``/``.csv``, ``profiler.html`` and, given the two
    ``traces`` it was computed from (a whole comparison), ``compare_per_layer.json`` for ``quantlens report``."""
    write_compare_text(comparison, out_dir / COMPARE_TEXT, sensitivity=sensitivity)
    write_compare_csv(comparison, out_dir / COMPARE_CSV)
    write_html(comparison, findings, out_dir / PROFILER_HTML)
    if traces is not None:
        save_comparison(comparison, out_dir / COMPARISON_FILE, *traces)


@contextlib.contextmanager
def keeping(result: Any) -> Iterator[None]:
    """Report files written inside this block: a full disk raises its :class:`DiskFullError` holding ``result``
    (what was computed before), so nothing computed is lost."""
    try:
        yield
    except DiskFullError as exc:
        raise exc.keeping(result)


def save_pt(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` through a temporary file and a rename (never a half-written file).

    The archive is written through a file object: ``torch.save`` names the zip's records after the file name,
    and the temporary name is random, so a path would give different bytes for the same data each time."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)

    return atomic_write(path, write)  # (its size is known only once written)
