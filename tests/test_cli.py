"""The `quantlens` command line: each command on the bundled digits model, exit codes, errors without tracebacks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantlens.cli.pipeline import PAIRS, onnxruntime_available

ROOT = Path(__file__).resolve().parents[1]


def ql_process(*args, cwd=None):
    """``python -m quantlens ...`` in a fresh process (the entry point itself)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    return subprocess.run([sys.executable, "-m", "quantlens", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def ql(*args, cwd=None):
    """``quantlens ...`` run in this process (``quantlens.cli.main``, what the console script calls): the same exit
    code and output as a subprocess, without starting torch again for every command."""
    import contextlib
    import io

    from quantlens.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse: usage errors and --help
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(old)
    return subprocess.CompletedProcess(["quantlens", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    """`analyze --gen` then `analyze` on the template, as written: every stage pair."""
    root = tmp_path_factory.mktemp("cli")
    config = root / "config.py"
    gen = ql("analyze", "--gen", config)
    assert gen.returncode == 0, gen.stderr
    out = root / "out"
    run = ql("analyze", config, "--stage", "all", "--out", out, "--no-sensitivity")
    return config, out, run


def test_help_on_every_command():
    top = ql_process("--help")
    assert top.returncode == 0 and "analyze" in top.stdout and "Exit codes" in top.stdout
    for cmd in ("analyze", "report", "inspect", "sensitivity", "compare"):
        res = ql(cmd, "--help")
        assert res.returncode == 0, (cmd, res.stderr)
        assert "usage: quantlens " + cmd in res.stdout


def test_gen_template_runs_through_analyze(analyzed):
    config, out, run = analyzed
    # out of the box the template exits 0: its only advisor finding (the convert GEMMs within 1 LSB at
    # consistency off) is advice, not a problem
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "Traceback" not in run.stderr
    # the check file prepare points to is written where the analysis writes
    check = (out / "model_check_result.txt").read_text()
    assert check.startswith("quantlens model check") and "conv1+bn1+relu1" in check
    # the CONFIG's evaluate(model) per stage: printed and in summary.json, the IR stages included
    assert "evaluate(model) per stage" in run.stdout
    metrics = {m["stage"]: m for m in json.loads((out / "summary.json").read_text())["stage_metrics"]}
    assert {"float", "calibration", "qat", "pre_export", "qat IR", "quantized IR"} <= set(metrics)
    assert all(not m["error"] and 0.9 < m["value"] <= 1 for m in metrics.values()), metrics
    assert (f"<tr><td>quantized IR</td><td class=num>{metrics['quantized IR']['value']:.6g}</td>"
            in (out / "index.html").read_text())  # the index's table of the metric per stage
    summary = json.loads((out / "summary.json").read_text())
    kinds = [p["analysis_type"] for p in summary["pairs"]]
    assert kinds == list(PAIRS)
    expected = [k for k in PAIRS if k != "onnxruntime" or onnxruntime_available()]
    index = (out / "index.html").read_text()
    for kind in expected:
        assert (out / kind / "profiler.html").is_file()
        assert (out / kind / "compare_per_layer_out.csv").is_file()
        assert f'href="{kind}/profiler.html"' in index
    assert (out / "qat_ir.qlir").is_file() and (out / "quantized_ir.qlir").is_file()
    assert summary["culprit"]["op"]
    assert "precision is first lost in" in run.stdout and "precision is lost most at" in run.stdout
    problems = any([f for f in p["findings"] if f["severity"] == "problem"] or (p["lsb"] or {}).get("first_diverged")
                   for p in summary["pairs"])
    assert run.returncode == (1 if problems else 0)
    advice = [f for p in summary["pairs"] for f in p["findings"] if f["severity"] == "advice"]
    assert all(f["rule"] == "consistency_level" for f in advice)


def test_gen_refuses_to_overwrite(analyzed):
    config, _, _ = analyzed
    res = ql("analyze", "--gen", config)
    assert res.returncode == 2 and "--force" in res.stderr and "Traceback" not in res.stderr


def test_report_rerenders_from_traces(analyzed):
    _, out, run = analyzed
    html = out / "fake_quant" / "profiler.html"
    before = html.read_text()
    html.unlink()
    (out / "index.html").unlink()
    res = ql("report", out)
    assert res.returncode == run.returncode, res.stderr
    assert html.read_text() == before  # same traces, same page
    assert (out / "index.html").is_file()
    assert '<table id="metrics">' in (out / "index.html").read_text()  # the metric per stage kept from summary.json
    # one QuantAnalysis folder works as well
    single = ql("report", out / "convert")
    assert single.returncode in (0, 1), single.stderr


def test_inspect_quantized_ir(analyzed):
    _, out, _ = analyzed
    res = ql("inspect", out / "quantized_ir.qlir")
    assert res.returncode == 0, res.stderr
    for text in ("quantized IR", "input contract", "module(", "conv2d[qint8]", "relu2", "latency estimate",
                 "estimated_cycles"):
        assert text in res.stdout, text
    # a conv written straight to its fused ReLU's grid is named with that site, as the reports name its value
    assert "fused into" in res.stdout and "relu1" in res.stdout
    qat = ql("inspect", out / "qat_ir.qlir", "--no-graph")
    assert qat.returncode == 0 and "qat IR" in qat.stdout


def test_compare_and_sensitivity_on_saved_irs(analyzed, tmp_path):
    _, out, _ = analyzed
    res = ql("compare", out / "qat_ir.qlir", out / "quantized_ir.qlir", "--out", tmp_path / "cmp", "--samples", "2")
    assert res.returncode in (0, 1), res.stderr
    assert "bit-exact" in res.stdout and "first diverged" in res.stdout
    # the digits CNN's convs are written straight to their fused ReLU's grid: named with the site holding them
    assert "only in A: conv1 (conv2d (fused into relu1))" in res.stdout.replace("\n", " "), res.stdout
    assert (tmp_path / "cmp" / "profiler.html").is_file()
    sens = ql("sensitivity", out / "qat_ir.qlir", out / "quantized_ir.qlir", "--out", tmp_path / "sens",
              "--samples", "2", "--top", "3")
    assert sens.returncode == 0, sens.stderr
    assert (tmp_path / "sens" / "output_0_L1_sensitive_ops.txt").is_file()
    if onnxruntime_available():
        ort = ql("compare", out / "qat_ir.qlir", out / "qat_ir.onnx", "--out", tmp_path / "ort", "--samples", "1")
        assert ort.returncode in (0, 1), ort.stderr


@pytest.mark.parametrize("args, needle", [
    (("analyze", "missing_config.py"), "does not exist"),
    (("analyze", "x.py", "--stage", "bogus"), "invalid choice"),
    (("inspect", "missing.qlir"), "does not exist"),
    (("report", "."), "holds no traces"),
    (("sensitivity", "x.py", "--stage", "onnxruntime"), "no sensitivity"),
    ((), "usage"),
])
def test_errors_exit_2_without_traceback(args, needle, tmp_path):
    res = ql(*args, cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_files_exit_2_and_debug_shows_traceback(tmp_path, analyzed):
    bad_ir = tmp_path / "bad.qlir"
    bad_ir.write_text("not an IR")
    res = ql("inspect", bad_ir)
    assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def float_model():\n    return None\nraise RuntimeError('boom in config')\n")
    res = ql("analyze", broken)
    assert res.returncode == 2 and "boom in config" in res.stderr and "line 3" in res.stderr
    assert "Traceback" not in res.stderr
    dbg = ql("--debug", "analyze", broken)
    assert dbg.returncode == 2 and "Traceback" in dbg.stderr
    incomplete = tmp_path / "incomplete.py"
    incomplete.write_text("x = 1\n")
    res = ql("analyze", incomplete)
    assert res.returncode == 2 and "does not define float_model" in res.stderr
    _, out, _ = analyzed
    wrong = ql("compare", out / "quantized_ir.qlir", out / "qat_ir.qlir")
    assert wrong.returncode == 2 and "must be a qat IR" in wrong.stderr


def test_piped_errors_are_not_rewrapped(tmp_path):
    """Errors written to a pipe keep their lines whole: the path and the suggested command can be copied (a
    terminal of 80 columns, as COLUMNS says, must not fold them)."""
    deep = tmp_path / ("a_rather_long_folder_name_for_a_config_" * 3) / "incomplete_config_file.py"
    deep.parent.mkdir(parents=True)
    deep.write_text("x = 1\n")
    env_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        res = ql("analyze", deep)
    finally:
        if env_columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = env_columns
    assert res.returncode == 2
    line = next(ln for ln in res.stderr.splitlines() if "does not define" in ln)
    assert str(deep) in line and len(line) > 80
    assert "quantlens analyze --gen" in res.stderr
    # the real entry point, its stderr a pipe
    proc = subprocess.run([sys.executable, "-m", "quantlens", "analyze", str(deep)], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 2
    assert str(deep) in proc.stderr and "quantlens analyze --gen" in proc.stderr


def test_pair_verdicts_and_report_agree(analyzed):
    """Every analysed pair gets its verdict from compared rows ("exact" only with no differing row, never "no
    data" here); the onnxruntime pair runs at onnxruntime's default level over every op site; ``quantlens report``
    re-renders the same verdicts and worst ops from the traces."""
    _, out, _ = analyzed
    keys = ("analysis_type", "verdict", "worst_op", "worst_diff", "compared", "differing", "note")
    before = [{k: p[k] for k in keys} | {"skipped": p["skipped"]}
              for p in json.loads((out / "summary.json").read_text())["pairs"]]
    res = ql("report", out)
    assert res.returncode in (0, 1), res.stderr
    after = [{k: p[k] for k in keys} | {"skipped": p["skipped"]}
             for p in json.loads((out / "summary.json").read_text())["pairs"]]
    assert after == before
    for p in before:
        if p["skipped"]:
            assert p["verdict"] == "skipped", p
            continue
        assert p["verdict"] in ("exact", "lossy", "differs") and p["compared"] > 0, p
        assert (p["verdict"] == "exact") == (p["differing"] == 0) == (p["worst_op"] is None), p
    index = (out / "index.html").read_text()
    assert index.count("none (exact)") == sum(p["verdict"] == "exact" for p in before)
    if onnxruntime_available():
        ort = next(p for p in before if p["analysis_type"] == "onnxruntime")
        meta = json.loads((out / "onnxruntime" / "quantlens_pair.json").read_text())["onnxruntime"]
        assert meta["optimization"] == "all" and not meta["outputs_only"] and meta["output_check"]["equal"]
        csv_rows = (out / "onnxruntime" / "compare_per_layer_out.csv").read_text().strip().splitlines()[1:]
        assert ort["compared"] == len(csv_rows) > 1
        assert ort["note"].startswith("ORT_ENABLE_ALL (onnxruntime's default level): every op site traced")
        assert "(no same-input data)" in (out / "onnxruntime" / "compare_per_layer_out.txt").read_text()


def test_a_warning_is_one_line_in_words(monkeypatch, tmp_path):
    """A warning during a command reaches the user as one line, not Python's 'file:line: UserWarning' with a
    source line (--debug keeps Python's own format): quantlens' own as 'warning:', another library's named as
    that library's, with its file and line."""
    import warnings

    import torch

    import quantlens.cli.analyze as analyze
    from quantlens.errors import QuantLensWarning

    def warns(args):
        warnings.warn("prepare: 2 op site(s) run on the host in float ('x')", QuantLensWarning, stacklevel=2)
        warnings.warn_explicit("a tensor attribute was assigned during export", UserWarning,
                               torch.__file__.replace("__init__.py", "export/_trace.py"), 7)
        return 0

    monkeypatch.setattr(analyze, "run", warns)
    res = ql("analyze", tmp_path / "c.py")
    assert res.returncode == 0
    assert "warning: prepare: 2 op site(s)" in res.stderr and "UserWarning" not in res.stderr, res.stderr
    assert "warning from torch (_trace.py:7): a tensor attribute" in res.stderr, res.stderr


def test_report_reads_the_saved_rows_back_without_recomputing(analyzed, monkeypatch, tmp_path):
    """`quantlens report` re-renders from compare_per_layer.json (no traced tensor read again) while the traces
    are the ones it was computed from; another trace.json is recomputed, and gives the same page."""
    import shutil

    import quantlens.profiler.compare as compare

    _, out, _ = analyzed
    folder = tmp_path / "convert"
    shutil.copytree(out / "convert", folder)
    assert (folder / "compare_per_layer.json").is_file()
    before = (folder / "profiler.html").read_text()

    def no_recompute(*args, **kwargs):
        raise AssertionError("compare_traces ran: the saved rows were not used")

    with monkeypatch.context() as m:
        m.setattr(compare, "compare_traces", no_recompute)
        res = ql("report", folder)
        assert res.returncode in (0, 1), res.stderr
    assert (folder / "profiler.html").read_text() == before
    # a trace.json that is not the one the rows came from: recomputed from the traces (one more space changes
    # its digest, not its content), and the page is the same
    trace = folder / "analysis_model" / "trace.json"
    trace.write_text(trace.read_text() + " ")
    calls = []
    real = compare.compare_traces
    with monkeypatch.context() as m:
        m.setattr(compare, "compare_traces", lambda *a, **k: calls.append(1) or real(*a, **k))
        res = ql("report", folder)
    assert calls and res.returncode in (0, 1), res.stderr
    assert (folder / "profiler.html").read_text() == before


def test_a_config_without_stubs_is_refused_then_accepted_with_allow_no_stubs(tmp_path):
    """A CONFIG whose float model has no QuantStub: `analyze` exits 2 with the fix in words; the CONFIG's
    `allow_no_stubs = True` lets it through (the template documents the name)."""
    from quantlens.cli.config import OPTIONAL, TEMPLATE

    assert "allow_no_stubs = False" in TEMPLATE and "allow_no_stubs" in OPTIONAL
    body = ("import torch\n"
            "def float_model():\n"
            "    torch.manual_seed(0)\n"
            "    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()\n"
            "def example_inputs():\n    return torch.randn(4, 6)\n"
            "def calibration_data():\n    return [torch.randn(4, 6) for _ in range(2)]\n")
    config = tmp_path / "nostubs.py"
    config.write_text(body)
    res = ql("analyze", config, "--stage", "fake_quant", "--out", tmp_path / "out", "--no-sensitivity")
    assert res.returncode == 2 and "no QuantStub" in res.stderr and "allow_no_stubs" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    allowed = tmp_path / "allowed.py"
    allowed.write_text(body + "allow_no_stubs = True\n")
    res = ql("analyze", allowed, "--stage", "fake_quant", "--out", tmp_path / "out2", "--no-sensitivity")
    assert res.returncode in (0, 1) and "no QuantStub" not in res.stderr, res.stderr
    assert (tmp_path / "out2" / "model_check_result.txt").is_file()
