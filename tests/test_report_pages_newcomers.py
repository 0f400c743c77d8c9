"""The pages and the console summary of the two newcomer models (tests/newcomers: a tiny DeBERTa-v2 with 170 op
sites of long shared names, a CNN + GRU), read in a 1400 px wide headless Chromium: the charts fill the page, their
x labels tell the op sites apart and overlap neither each other nor the axis title, nothing is cut at a chart's
edge, the two models' output ranges read apart, the page says what each ranking measures; the answer names where
precision is first lost and where the most, separately; the console table keeps its short columns whole at 120
columns.

The pages come from ``quantlens analyze CONFIG --stage fake_quant`` (the cheapest pair with every chart and the
sensitivity ranking), run in this process. Set QUANTLENS_SCREENSHOTS to a folder to keep a PNG of each
page's charts and of each index page.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from quantlens.cli.pipeline import PairResult, print_losses, summarize, write_index, write_summary
from quantlens.profiler.compare import LayerComparison, LayerRow
from tests.test_cli import ql
from tests.test_report_browser import _OVERLAP, _no_errors, _open, browser  # noqa: F401 - the browser fixture

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("deberta", "cnn_gru")
WIDTH = 1400


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """``analyze --stage fake_quant`` on both newcomers, at the console width the tests use (120 columns)."""
    out = tmp_path_factory.mktemp("newcomers")
    logs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "120")
        for m in MODELS:
            run = ql("analyze", ROOT / "tests/newcomers" / f"{m}.py", "--stage", "fake_quant", "--out", out / m)
            assert run.returncode in (0, 1), run.stdout + run.stderr
            logs[m] = run.stdout
    return out, logs


def _shot(driver, element, name: str) -> None:
    folder = os.environ.get("QUANTLENS_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.execute_script("arguments[0].scrollIntoView()", element)
        element.screenshot(str(Path(folder) / f"{name}.png"))


#: JavaScript: per chart, the x labels' boxes in their own turned frame (what the eye sees); the pairs that overlap
_LABELS_OVERLAP = """
var hits = [];
document.querySelectorAll('svg.chart').forEach(function (svg) {
  var boxes = [];
  svg.querySelectorAll('text.xlabel').forEach(function (t) {
    var b = t.getBBox(), m = t.getScreenCTM(), a = Math.atan2(m.b, m.a), c = Math.cos(-a), s = Math.sin(-a);
    var xs = [], ys = [];
    [[b.x, b.y], [b.x + b.width, b.y], [b.x, b.y + b.height], [b.x + b.width, b.y + b.height]].forEach(function (p) {
      var q = svg.createSVGPoint(); q.x = p[0]; q.y = p[1]; q = q.matrixTransform(m);
      xs.push(q.x * c - q.y * s); ys.push(q.x * s + q.y * c); });
    boxes.push([Math.min.apply(null, xs), Math.max.apply(null, xs), Math.min.apply(null, ys), Math.max.apply(null, ys),
                t.textContent]); });
  for (var i = 0; i < boxes.length; i++) for (var j = i + 1; j < boxes.length; j++) {
    var p = boxes[i], q = boxes[j];
    if (p[0] < q[1] && q[0] < p[1] && p[2] < q[3] && q[2] < p[3]) hits.push(p[4] + ' / ' + q[4]); } });
return hits;"""

#: JavaScript: the texts of a chart that reach past its edges (cut off)
_CUT = """
var out = [];
document.querySelectorAll('svg.chart').forEach(function (svg) {
  var r = svg.getBoundingClientRect();
  svg.querySelectorAll('text').forEach(function (t) { var b = t.getBoundingClientRect();
    if (b.left < r.left - 1 || b.right > r.right + 1 || b.top < r.top - 1 || b.bottom > r.bottom + 1) out.push(t.textContent); }); });
return out;"""


def _rgb(color: str) -> tuple[int, ...]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


@pytest.mark.parametrize("model", MODELS)
def test_profiler_charts_read_at_1400_px(browser, pages, model):  # noqa: F811 - the imported fixture
    from selenium.webdriver.common.by import By

    out, _ = pages
    browser.set_window_size(WIDTH, 900)
    driver = _open(browser, out / model / "fake_quant" / "profiler.html")
    _no_errors(driver)
    content = driver.execute_script("var s = getComputedStyle(document.body); return document.body.clientWidth - "
                                    "parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)")
    assert content > 0.9 * (WIDTH - 20), content  # the page itself uses the window's width
    charts = driver.find_elements(By.CSS_SELECTOR, "svg.chart")
    lines = [c for c in charts if c.get_attribute("data-points")]
    assert len(lines) == 5 and len(charts) > 5  # the sensitivity bars too
    for k, chart in enumerate(charts):
        assert chart.size["width"] >= 0.9 * content, (chart.get_attribute("aria-label"), chart.size, content)
        _shot(driver, chart, f"{model}_profiler_{k}")
    for chart in lines:
        labels = chart.find_elements(By.CSS_SELECTOR, "text.xlabel")
        texts = [t.get_attribute("textContent") for t in labels]
        fulls = [t.get_attribute("data-tip").rsplit(" (#", 1)[0] for t in labels]
        assert len(texts) >= min(30, int(chart.get_attribute("data-points"))), texts
        assert len(set(texts)) == len(texts), texts  # distinct ...
        assert len(os.path.commonprefix(texts)) < 8, texts  # ... not one elided prefix ...
        for text, full in zip(texts, fulls):  # ... each ends with its op site's own tail
            tail = text.split(".")[-1].lstrip("\u2026")
            assert full.endswith(tail) and len(tail) >= min(len(full), 4), (text, full)
    assert driver.execute_script(_LABELS_OVERLAP) == []
    assert driver.execute_script(_OVERLAP, "svg.chart text.xlabel", "svg.chart text.axis, svg.chart .title, "
                                 "svg.chart .legend, svg.chart text.tick:not(.xlabel)") == []
    assert driver.execute_script(_CUT) == []
    # the two models' output ranges: every baseline colour far from every analysis colour
    ranges = next(c for c in lines if c.get_attribute("aria-label") == "Output ranges")
    legend = {t.get_attribute("textContent"): b.get_attribute("fill") for t, b in
              zip(ranges.find_elements(By.CSS_SELECTOR, "text.legend"),
                  ranges.find_elements(By.CSS_SELECTOR, "rect.legend-box"))}
    base = [_rgb(c) for n, c in legend.items() if n.startswith("baseline")]
    analy = [_rgb(c) for n, c in legend.items() if n.startswith("analysis")]
    assert len(base) == len(analy) == 2
    assert min(sum((x - y) ** 2 for x, y in zip(b, a)) ** 0.5 for b in base for a in analy) > 150, legend
    # the page says what each ranking measures
    note = driver.find_element(By.ID, "rankings").text
    assert "only that one quantizer" in note and "same-input SQNR" in note


@pytest.mark.parametrize("model", MODELS)
def test_index_page_and_console_answer(browser, pages, model):  # noqa: F811 - the imported fixture
    from selenium.webdriver.common.by import By

    out, logs = pages
    summary = json.loads((out / model / "summary.json").read_text())
    first, most = summary["first_loss"], summary["most_loss"]
    assert first["analysis_type"] == "fake_quant" and first["op"] and most["op"] == summary["culprit"]["op"]
    browser.set_window_size(WIDTH, 900)
    driver = _open(browser, out / model / "index.html")
    _no_errors(driver)
    answer = [li.text for li in driver.find_elements(By.CSS_SELECTOR, "ul.culprit li")]
    assert answer[0].startswith(f"precision is first lost in fake_quant (float vs calibration), at {first['op']} ")
    assert answer[1].startswith(f"precision is lost most at {most['op']} (fake_quant")
    assert "only that one quantizer" in driver.find_element(By.TAG_NAME, "body").text
    _shot(driver, driver.find_element(By.TAG_NAME, "body"), f"{model}_index")
    # the console at 120 columns: the same two answers, every header and short cell whole
    log = " ".join(logs[model].split())
    assert f"precision is first lost in fake_quant (float vs calibration), at {first['op']}" in log
    assert f"precision is lost most at {most['op']}" in log
    header = next(ln for ln in logs[model].splitlines() if "┃" in ln and "stage pair" in ln)
    for col in ("stage pair", "verdict", "worst op", "SQNR dB", "kind", "findings"):
        assert col in header, header
    assert "\u2026" not in logs[model]


def _row(index, name, same_sqnr):
    return LayerRow(index=index, op_name=name, base_op_type="add", analy_op_type="add", module_type="", shape="[2]",
                    quant_dtype="qint8", scale=0.1, Cosine=0.99, Atol=0.1, SQNR=30.0, same_input_sqnr=same_sqnr)


def _pairs():
    long = "deberta.encoder.layer.1.attention.self.pos_key_proj"
    fq = summarize(PairResult("fake_quant", "float", "calibration", "fake_quant"),
                   LayerComparison([_row(0, "embeddings.add_0", 45.0), _row(1, long, 30.0)], "b", "a"))
    cv = summarize(PairResult("convert", "qat_ir", "quantized_ir", "convert"),
                   LayerComparison([_row(0, "embeddings.add_0", 200.0), _row(1, long + "_2", 20.0)], "b", "a"))
    return fq, cv, long


def test_first_and_most_loss_are_two_statements(tmp_path):
    """fake_quant already loses precision at embeddings.add_0; convert loses the most: both are said, each true."""
    fq, cv, long = _pairs()
    console = Console(record=True, width=120)
    print_losses(console, [fq, cv])
    text = " ".join(console.export_text().split())
    assert ("precision is first lost in fake_quant (float vs calibration), at embeddings.add_0 (the first op there "
            "that loses precision itself, same-input SQNR 45.0 dB)") in text
    assert f"precision is lost most at {long}_2 (convert: qat_ir vs quantized_ir, same-input SQNR 20.0 dB" in text
    summary = json.loads(write_summary([fq, cv], tmp_path).read_text())
    assert summary["first_loss"] == {"op": "embeddings.add_0", "analysis_type": "fake_quant", "verdict": "lossy",
                                     "same_input_sqnr": 45.0, "diff": ""}
    assert summary["most_loss"]["op"] == summary["culprit"]["op"] == long + "_2"
    page = write_index([fq, cv], tmp_path).read_text()
    assert "precision is first lost in fake_quant" in page and f"precision is lost most at {long}_2" in page


def test_console_table_keeps_short_columns_at_120_columns():
    fq, cv, long = _pairs()
    fq.findings = [{"severity": "problem"}] * 4
    console = Console(record=True, width=120)
    print_losses(console, [fq, cv])
    text = console.export_text()
    assert "\u2026" not in text, text  # nothing cut: long cells fold
    header = next(ln for ln in text.splitlines() if "┃" in ln and "stage pair" in ln)
    for col in ("stage pair", "verdict", "worst op", "SQNR dB", "kind", "findings"):
        assert col in header, header
    cells = "".join(ln.split("│")[3].strip() for ln in text.splitlines() if ln.count("│") == 7)
    assert long + "_2" in cells  # the long op name is whole, folded over lines


def test_index_gives_the_stage_metrics_as_a_table(tmp_path):
    from html.parser import HTMLParser

    fq, cv, _ = _pairs()
    page = write_index([fq, cv], tmp_path, metrics=[{"stage": "float", "value": 0.91, "error": ""},
                                                    {"stage": "quantized IR", "value": 0.88, "error": ""},
                                                    {"stage": "qat IR", "value": None, "error": "ValueError: x"}])

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.inside = [], False

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.inside = dict(attrs).get("id") == "metrics"
            elif tag == "tr" and self.inside:
                self.rows.append([])

        def handle_endtag(self, tag):
            if tag == "table":
                self.inside = False

        def handle_data(self, data):
            if self.inside and self.rows and data.strip():
                self.rows[-1].append(data.strip())

    parser = Cells()
    parser.feed(page.read_text())
    assert parser.rows == [["stage", "metric", "vs first stage"], ["float", "0.91", "+0"],
                           ["quantized IR", "0.88", "-0.03"], ["qat IR", "-", "failed: ValueError: x"]]


def test_short_names_keep_the_tail():
    from quantlens.profiler.short_names import short_names

    names = [f"deberta.encoder.layer.{i}.attention.self.{op}" for i in (0, 1) for op in ("query_proj", "pos_key_proj")]
    texts, prefix = short_names(names + ["deberta.embeddings.add_0"], 30)
    assert prefix == "deberta." and len(set(texts)) == len(texts)
    # one module's op sites abbreviated alike; the op itself and the layer number kept
    assert texts[:3] == ["e.l.0.a.self.query_proj", "e.l.0.a.self.pos_key_proj", "e.l.1.a.self.query_proj"]
    assert texts[-1] == "embeddings.add_0"
