"""The HTML reports in a real browser: Debian's headless Chromium, driven by selenium, with networking off.

Each page (profiler.html with the sensitivity charts, profiler.html of a convert analysis with its LSB
histograms, badcase_report.html) must load without console errors or network requests, draw its charts (SVG
elements with the expected number of points and bars), name each point's op site, show its figures on hover,
jump to its table row on click, sort on a header click with empty rows last, and keep the page itself within
the window (the per-layer table scrolls sideways inside its box, its first column staying in view).

Needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (``./dev test`` installs them when run as root) and
selenium (the ``test`` extra). Without them the tests fail, saying how to install them.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest

from quantlens.profiler import QuantAnalysis
from quantlens.profiler.compare import LayerComparison, LayerRow
from quantlens.profiler.html import SENSITIVITY_TOP, write_html
from quantlens.quantization import calibrate as calibrate_model
from quantlens.quantization import prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches

INSTALL = ("install them with: apt-get install -y --no-install-recommends chromium chromium-driver "
           "(./dev test does this when run as root), or point QUANTLENS_CHROMIUM / QUANTLENS_CHROMEDRIVER at them")
SAMPLES = 6


def _binary(env: str, *names: str) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    for name in names:
        if os.path.isfile(f"/usr/bin/{name}") and os.access(f"/usr/bin/{name}", os.X_OK):
            return f"/usr/bin/{name}"
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: pip install -e '.[test]' (or ./dev test)")
    chromium = _binary("QUANTLENS_CHROMIUM", "chromium", "chromium-browser")
    driver_path = _binary("QUANTLENS_CHROMEDRIVER", "chromedriver")
    if chromium is None or driver_path is None:
        pytest.fail(f"headless Chromium is missing (chromium: {chromium}, chromedriver: {driver_path}): {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=Service(driver_path))
    except Exception as exc:  # noqa: BLE001 - say what to do, whatever selenium raised
        pytest.fail(f"could not start headless Chromium ({chromium}, {driver_path}): {exc}\n{INSTALL}")
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions",
                           {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
    # every uncaught error and console.error call, from the first line of each page on
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        "window.__errors = []; window.addEventListener('error', function (e) { window.__errors.push(String(e.message)); });"
        "var __ce = console.error; console.error = function () { window.__errors.push("
        "Array.prototype.join.call(arguments, ' ')); return __ce.apply(console, arguments); };")})
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One fake_quant analysis on the tiny ResNet: bad case search, run, per-layer comparison, sensitivity."""
    model = get_model("tiny_resnet")
    calib = prepare(model, example_inputs("tiny_resnet"), default_calibration_qconfig_setter, check_result_dir=None)
    calibrate_model(calib, sample_batches("tiny_resnet", 3, 8))
    out = tmp_path_factory.mktemp("browser")
    qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out, progress=False)
    found = qa.auto_find_bad_case(sample_batches("tiny_resnet", SAMPLES, 2))
    qa.run()
    table = qa.compare_per_layer()
    sens = qa.sensitivity()
    return out, found, table, sens


def _open(driver, path):
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(path.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    return driver


def _no_errors(driver):
    logged = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    caught = driver.execute_script("return window.__errors")
    assert logged == [] and caught == [], (logged, caught)
    # nothing but the page itself was fetched: no script, style sheet, font or image
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0


def _column(driver, table_id, col):
    return driver.execute_script(
        "var col = arguments[1]; return Array.prototype.map.call(document.getElementById(arguments[0]).tBodies[0].rows,"
        " function (r) { var c = r.cells[col]; return [c.getAttribute('data-sort'), c.textContent.trim()]; });",
        table_id, col)


def _click_header(driver, table_id, header):
    from selenium.webdriver.common.by import By

    th = next(th for th in driver.find_elements(By.CSS_SELECTOR, f"#{table_id} thead th") if th.text.strip() == header)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", th)
    th.click()
    return th


def _check_sort(driver, table_id, header, numeric=True):
    """Ascending, then descending: the values in order, the rows without a value last both times."""
    from selenium.webdriver.common.by import By

    headers = [th.text.strip() for th in driver.find_elements(By.CSS_SELECTOR, f"#{table_id} thead th")]
    col = headers.index(header)
    before = _column(driver, table_id, col)
    assert any(text == "" for _, text in before), f"{header}: the test needs empty cells"
    for direction in ("asc", "desc"):
        th = _click_header(driver, table_id, header)
        assert direction in th.get_attribute("class")
        cells = _column(driver, table_id, col)
        assert sorted(cells) == sorted(before)  # the same rows, reordered
        empty = [text == "" for _, text in cells]
        first_empty = empty.index(True)
        assert all(empty[first_empty:]), f"{header} {direction}: an empty row before a filled one"
        filled = [float(s) if numeric else t for s, t in cells[:first_empty]]
        assert filled == sorted(filled, reverse=direction == "desc"), f"{header} {direction}: {filled}"


def test_profiler_page(browser, reports):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    out, _, table, sens = reports
    driver = _open(browser, out / "profiler.html")
    _no_errors(driver)
    compared = [r for r in table if r.compared]
    charts = driver.find_elements(By.CSS_SELECTOR, "svg.chart:not(.bars)")
    assert len(charts) == 5
    expected_points = [
        [r.Cosine for r in compared] + [r.same_input_cosine for r in compared],
        [r.Atol for r in compared] + [r.same_input_atol for r in compared],
        [r.same_input_sqnr for r in compared] + [r.same_input_worst_channel_sqnr for r in compared],
        [r.same_input_in_scale for r in compared],
        [v for r in compared for v in (r.base_min, r.base_max, r.analy_min, r.analy_max)],
    ]
    for chart, values in zip(charts, expected_points):
        finite = sum(1 for v in values if v is not None and math.isfinite(v))
        assert len(chart.find_elements(By.CSS_SELECTOR, "circle.pt")) == finite > 0
        assert len(chart.find_elements(By.CSS_SELECTOR, "rect.hit")) == len(compared)
        assert chart.size["width"] > 400 and chart.size["height"] > 150  # drawn, not collapsed
        # the x axis names op sites (not row numbers)
        labels = [t.get_attribute("textContent") for t in chart.find_elements(By.CSS_SELECTOR, "text.xlabel")]
        assert labels and set(labels) <= {r.op_name if len(r.op_name) <= 22 else r.op_name[:21] + "\u2026"
                                          for r in compared}
        ticks = [t.get_attribute("textContent") for t in chart.find_elements(By.CSS_SELECTOR, "text.tick")
                 if "xlabel" not in t.get_attribute("class")]
        assert all(len(t) <= 8 for t in ticks), ticks  # round ticks

    # hover a point: its op site and figures; click it: its table row
    target = compared[len(compared) // 2]
    hit = charts[0].find_elements(By.CSS_SELECTOR, "rect.hit")[len(compared) // 2]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", charts[0])
    ActionChains(driver).move_to_element(hit).perform()
    tip = driver.find_element(By.ID, "tip")
    assert tip.is_displayed()
    text = tip.get_attribute("textContent")
    assert text.startswith(f"{target.op_name} (#{target.index})") and "accumulated: " in text and "same input: " in text
    ActionChains(driver).click(hit).perform()
    assert driver.execute_script("return location.hash") == f"#row-{target.index}"
    row = driver.find_element(By.ID, f"row-{target.index}")
    assert driver.execute_script(
        "var r = arguments[0].getBoundingClientRect(); return r.top >= 0 && r.bottom <= window.innerHeight", row)

    # the sensitivity ranking, one bar chart per output
    bars = driver.find_elements(By.CSS_SELECTOR, "svg.chart.bars")
    assert len(bars) == len(sens)
    for chart, t in zip(bars, sens):
        assert len(chart.find_elements(By.CSS_SELECTOR, "rect.bar")) == min(len(t), SENSITIVITY_TOP) > 0

    # the page keeps to the window; the per-layer table scrolls inside its box, its first column stays
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    box = driver.find_element(By.CSS_SELECTOR, "div.scroll:has(> #layers)")
    assert driver.execute_script("return arguments[0].scrollWidth > arguments[0].clientWidth", box)
    driver.execute_script("arguments[0].scrollIntoView(); arguments[0].scrollLeft = 600", box)
    first = driver.find_element(By.CSS_SELECTOR, "#layers tbody tr td:first-child")
    assert driver.execute_script("return Math.abs(arguments[0].getBoundingClientRect().left -"
                                 " arguments[1].getBoundingClientRect().left) < 3", first, box)
    assert first.is_displayed() and first.text == table[0].op_name

    # sorting: numbers, then text; the fused rows (no value) last in both directions
    _check_sort(driver, "layers", "Cosine")
    _check_sort(driver, "layers", "same-in SQNR")
    _check_sort(driver, "layers", "same-in worst-ch SQNR")
    _check_sort(driver, "layers", "error kind", numeric=False)
    _no_errors(driver)


def _lsb_row(index, name, hist, same_hist, verdict, same_verdict, **kw):
    return LayerRow(index=index, op_name=name, base_op_type="conv2d", analy_op_type="conv2d", module_type="Conv2d",
                    shape="1x8x4x4", quant_dtype="qint8", scale=0.05, lsb_hist=hist, same_input_lsb_hist=same_hist,
                    lsb_verdict=verdict, same_input_lsb_verdict=same_verdict, **kw)


def test_convert_page_lsb_histograms(browser, tmp_path):
    from selenium.webdriver.common.by import By

    rows = [
        _lsb_row(0, "quant", "0:128|1:0|2:0|3-4:0|5-8:0|>8:0", "0:128|1:0|2:0|3-4:0|5-8:0|>8:0", "bit-exact",
                 "bit-exact", Cosine=1.0, Atol=0.0, same_input_atol=0.0),
        _lsb_row(1, "conv1", "", "", "", "", note="fused into relu1"),
        _lsb_row(2, "relu1", "0:100|1:20|2:5|3-4:3|5-8:0|>8:0", "0:120|1:8|2:0|3-4:0|5-8:0|>8:0", "within 4 LSB",
                 "within 1 LSB", Cosine=0.999, Atol=0.2, same_input_atol=0.05, same_input_sqnr=40.0),
        _lsb_row(3, "fc", "0:10|1:10|2:10|3-4:10|5-8:10|>8:10", "0:60|1:0|2:0|3-4:0|5-8:0|>8:0", "diverged",
                 "bit-exact", Cosine=0.9, Atol=3.0, same_input_atol=0.0),
    ]
    comparison = LayerComparison(rows, "qat IR", "quantized IR")
    driver = _open(browser, write_html(comparison, [], tmp_path / "profiler.html"))
    _no_errors(driver)
    lsb = driver.find_element(By.ID, "lsb")
    hists = lsb.find_elements(By.CSS_SELECTOR, "svg.hist")
    assert len(hists) == 2 * 3  # accumulated and same-input, per op with a verdict
    for hist in hists:
        counts = [int(b.get_attribute("data-count")) for b in hist.find_elements(By.CSS_SELECTOR, "rect.bar")]
        assert len(counts) == 6 and sum(counts) in (128, 60)
        assert hist.size["width"] > 100
    # a click on a histogram jumps to its op's row of the per-layer table
    cell = lsb.find_elements(By.CSS_SELECTOR, "td[data-row]")[2]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", cell)
    cell.click()
    assert driver.execute_script("return location.hash") == "#row-2"
    _check_sort(driver, "layers", "Atol")
    _no_errors(driver)


def test_bad_case_page(browser, reports):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    out, found, _, _ = reports
    driver = _open(browser, out / "badcase_report.html")
    _no_errors(driver)
    charts = driver.find_elements(By.CSS_SELECTOR, "svg.hist-chart")
    assert len(charts) == len(found.outputs) * len(found.metrics)
    for chart in charts:
        bars = chart.find_elements(By.CSS_SELECTOR, "rect.bar")
        assert len(bars) == int(chart.get_attribute("data-bars")) >= 1
        assert sum(int(b.get_attribute("data-count")) for b in bars) == found.num_samples == SAMPLES
        assert chart.find_elements(By.CSS_SELECTOR, "line.mark")  # the bad case is marked
        assert chart.size["width"] > 200
    assert driver.find_element(By.ID, "bad-case").text == str(found.bad_case_index)
    bar = next(b for b in charts[0].find_elements(By.CSS_SELECTOR, "rect.bar") if b.get_attribute("data-count") != "0")
    ActionChains(driver).move_to_element(bar).perform()
    assert "sample" in driver.find_element(By.ID, "tip").get_attribute("textContent")
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    th = _click_header(driver, "overall", "sample")
    assert "asc" in th.get_attribute("class")
    samples = [int(s) for s, _ in _column(driver, "overall", 1)]
    assert samples == sorted(samples)
    _no_errors(driver)


#: JavaScript: the elements of selector A that overlap one of selector B in the same chart (bounding boxes)
_OVERLAP = """
var a = document.querySelectorAll(arguments[0]), b = document.querySelectorAll(arguments[1]), hits = [];
a.forEach(function (x) { var r = x.getBoundingClientRect(); b.forEach(function (y) { var s = y.getBoundingClientRect();
  if (x.closest('svg') === y.closest('svg') && r.width && s.width && r.left < s.right && s.left < r.right && r.top < s.bottom && s.top < r.bottom)
    hits.push((x.textContent || x.tagName) + ' / ' + (y.textContent || y.tagName)); }); });
return hits;"""

#: JavaScript: the tables wider than the window that no scrolling box holds (what the user cannot reach)
_CLIPPED = """
var out = [], width = document.documentElement.clientWidth;
document.querySelectorAll('table').forEach(function (t) {
  var box = t.parentElement, style = getComputedStyle(box);
  var scrolls = (style.overflowX === 'auto' || style.overflowX === 'scroll') && box.getBoundingClientRect().right <= width + 1;
  if (t.getBoundingClientRect().right > width + 1 && !scrolls) out.push(t.id || t.className); });
return out;"""


def test_charts_read_right_on_a_bit_exact_pair_and_wide_tables_scroll(browser, tmp_path):
    """A bit-exact pair's cosines (float64 noise around 1) draw one flat line on an axis whose ticks read apart,
    not "1, 1, 1, 1, 1" over a zig-zag; the legend sits above the plot, never on a line; a table wider than the
    window scrolls inside its box."""
    from selenium.webdriver.common.by import By

    noise = [1.0, 0.9999999999999998, 1.0000000000000016, 0.9999999999999999, 1.0, 1.0000000000000009] * 4
    rows = [LayerRow(index=i, op_name=f"block{i}.conv_with_a_long_name_" + "x" * 40, base_op_type="conv2d",
                     analy_op_type="conv2d", module_type="Conv2d", shape="1x8x4x4", quant_dtype="qint8", scale=0.05,
                     Cosine=c, same_input_cosine=c, SQNR=300.0, Atol=0.0, same_input_atol=0.0,
                     note="a long note " * 30)
            for i, c in enumerate(noise)]
    driver = _open(browser, write_html(LayerComparison(rows, "qat IR", "quantized IR"), [], tmp_path / "p.html"))
    _no_errors(driver)
    charts = [c for c in driver.find_elements(By.CSS_SELECTOR, "svg.chart") if c.get_attribute("data-points")]
    assert charts
    for chart in charts:
        ticks = [t.text for t in chart.find_elements(By.CSS_SELECTOR, "text.tick:not(.xlabel)")]
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), ticks
        points = chart.find_elements(By.CSS_SELECTOR, "circle.pt")
        if "osine" in chart.get_attribute("aria-label"):
            assert points and len({p.get_attribute("cy") for p in points}) == 1  # one flat line
    assert driver.execute_script(_OVERLAP, "svg.chart .legend, svg.chart .legend-box", "svg.chart circle.pt, "
                                 "svg.chart polyline") == []
    assert driver.execute_script(_CLIPPED) == []
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")


def test_bad_case_marks_are_labelled_above_the_bars(browser, reports):
    out, _, _, _ = reports
    driver = _open(browser, out / "badcase_report.html")
    assert driver.execute_script(_OVERLAP, "svg.hist-chart .mark-label", "svg.hist-chart rect.bar") == []
    assert driver.execute_script(_CLIPPED) == []
