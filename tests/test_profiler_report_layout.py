"""The reports' layout without a browser: round axis ticks, sort keys (empty rows last), 120-column text
tables, the bad-case page, the sensitivity charts and byte-for-byte determinism (tests/test_report_browser.py
checks the same pages in Chromium)."""

from __future__ import annotations

import math
import re

import pytest

from quantlens._io import format_table
from quantlens.profiler import QuantAnalysis
from quantlens.profiler.charts import histogram_chart, line_chart, nice_ticks, tick_text
from quantlens.profiler.html import SENSITIVITY_BEGIN, TABLE_COLUMNS
from quantlens.profiler.report import TEXT_WIDTH, wrap_table
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization import prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


@pytest.mark.parametrize("lo,hi", [(0.3, 0.97), (0, 1), (-3.2, 41.7), (0.99991, 0.99999), (1e-7, 3e-6), (5, 5),
                                   (0, 0), (-1e6, 2e7), (0.1 + 0.2, 0.7), (-0.0123, 0.0456), (37.123, 37.9)])
def test_nice_ticks_are_round_and_cover_the_range(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 3 <= len(ticks) <= 7
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6  # 1, 2 or 5 times a power of ten
    assert all(abs((b - a) - step) <= 1e-9 * max(1.0, abs(step)) for a, b in zip(ticks, ticks[1:]))
    assert all(len(tick_text(t)) <= 8 for t in ticks), [tick_text(t) for t in ticks]  # no 0.30000000000000004
    counts = nice_ticks(0, hi * 7 + 3, n=4, integer=True)
    assert all(float(t).is_integer() for t in counts)


def test_chart_ticks_and_labels():
    svg = str(line_chart("t", ["quant", "layer1.conv", "a_really_long_op_site_name.inside.a.block"],
                         [("s", "#000", [0.1 + 0.2, 0.71, None])]))
    ticks = re.findall(r'class="tick" text-anchor="end">([^<]*)</text>', svg)
    assert ticks == ["0.3", "0.4", "0.5", "0.6", "0.7", "0.8"]
    labels = re.findall(r'class="tick xlabel"[^>]*>([^<]*)</text>', svg)
    # a long name keeps its distinguishing tail: leading parts abbreviated, not its end cut
    assert labels == ["quant", "layer1.conv", "a.inside.a.block"]
    assert svg.count('<circle class="pt"') == 2 and svg.count('class="hit"') == 3
    hist = str(histogram_chart("h", [1.0, 2.0, 2.5, float("nan"), 3.0], [("bad case", 1)]))
    counts = [int(c) for c in re.findall(r'data-count="(\d+)"', hist)]
    assert sum(counts) == 5 and counts[-1] == 1  # the NaN in a bar of its own


def test_wrap_table_keeps_to_120_columns():
    narrow = [["a", 1], ["b", 2]]
    assert wrap_table(["x", "y"], narrow) == format_table(["x", "y"], narrow)  # a table that fits is unchanged
    headers = ["index", "op name"] + [f"metric {i}" for i in range(20)]
    rows = [[i, f"layer{i}.conv"] + [f"{1 / (i + j + 1):.7g}" for j in range(20)] for i in range(4)]
    text = wrap_table(headers, rows, keys=(0, 1))
    assert max(map(len, text.splitlines())) <= TEXT_WIDTH
    assert all(h in text for h in headers)
    groups = text.split("\n\n")
    assert len(groups) > 1 and all("| index | op name " in g and "| 3     | layer3.conv " in g for g in groups)
    long = wrap_table(["rule", "op name", "advice"], [["r", "conv", "word " * 80]], keys=(1,))
    assert max(map(len, long.splitlines())) <= TEXT_WIDTH and long.count("word") == 80


@pytest.fixture(scope="module")
def models():
    model = get_model("tiny_resnet")
    calib = prepare(model, example_inputs("tiny_resnet"), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches("tiny_resnet", 3, 8))
    return model, calib


def _analyse(models, out, sensitivity_first=False):
    qa = QuantAnalysis(*models, "fake_quant", out_dir=out, progress=False)
    found = qa.auto_find_bad_case(sample_batches("tiny_resnet", 4, 2))
    qa.run()
    if sensitivity_first:
        sens = qa.sensitivity()
        table = qa.compare_per_layer()
    else:
        table = qa.compare_per_layer()
        sens = qa.sensitivity()
    return found, table, sens


def test_reports_layout_and_determinism(models, tmp_path):
    found, table, sens = _analyse(models, tmp_path / "a")
    _analyse(models, tmp_path / "b", sensitivity_first=True)
    for name in ("profiler.html", "badcase_report.html", "compare_per_layer_out.txt", "badcase.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    for name in ("compare_per_layer_out.txt", "abnormal_layer_advisor.txt", "baseline_model/statistic.txt",
                 "output_0_L1_sensitive_ops.txt", "badcase.txt"):
        lines = [x for x in (tmp_path / "a" / name).read_text().splitlines() if x[:1] in ("|", "+")]
        assert all(len(x) <= TEXT_WIDTH for x in lines), name

    page = (tmp_path / "a" / "profiler.html").read_text()
    assert "http://" not in page and "https://" not in page and "<link" not in page and "<img" not in page
    assert page.count(SENSITIVITY_BEGIN) == 1 and page.count('<svg class="chart bars"') == len(sens)
    # sort keys: a numeric cell carries its value; a row without a value has neither key nor text (sorts last)
    body = page.split('<table id="layers"', 1)[1]
    rows = re.findall(r'<tr id="row-(\d+)">(.*?)</tr>', body)
    assert [int(i) for i, _ in rows] == [r.index for r in table]
    cosine = [h for _, h in TABLE_COLUMNS].index("Cosine")
    for (_, cells), row in zip(rows, table):
        sort, text = re.findall(r'<td[^>]*data-sort="([^"]*)"[^>]*>([^<]*)</td>', cells)[cosine]
        if row.Cosine is None:
            assert (sort, text) == ("", "")
        else:
            assert float(sort) == row.Cosine
    assert any(r.Cosine is None for r in table) and "rows without a value stay last" in page

    bad = (tmp_path / "a" / "badcase_report.html").read_text()
    assert bad.count('class="chart hist-chart"') == len(found.outputs) * len(found.metrics)
    assert sum(map(int, re.findall(r'data-count="(\d+)"', bad))) == found.num_samples * len(found.metrics)
    assert "http://" not in bad and "https://" not in bad
    assert len(found.values["0"]["L1"]) == found.num_samples
    assert max(found.values["0"]["L1"]) == found.worst_value["0"]["L1"]


def test_a_histogram_of_values_apart_by_float_rounding_only():
    """Cosines of 1 +- 2e-16 (identical stages, summed in another order) are one value to the axis: round ticks
    around it, every sample in a bar (the edges used to collapse and the bad-case report raised IndexError)."""
    ticks = nice_ticks(0.9999999999999998, 1.0000000000000002, n=5)
    assert len(set(ticks)) == len(ticks) >= 3 and ticks[0] < 1.0 < ticks[-1]
    svg = str(histogram_chart("Cosine", [1.0, 1.0000000000000002, 0.9999999999999998]))
    assert sum(int(c) for c in re.findall(r'data-count="(\d+)"', svg)) == 3
