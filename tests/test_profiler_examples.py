"""Every example under examples/ runs and writes its reports (into tmp_path)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / name / "example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_folder_has_a_readme_and_a_script():
    folders = sorted(p for p in EXAMPLES.iterdir() if p.is_dir() and p.name[:2].isdigit())
    assert [p.name for p in folders] == [
        "01_float_vs_calib", "02_qat_vs_pre_export", "03_multitask_task_strings", "04_post_process",
        "05_pre_export_vs_qat_ir", "06_qat_ir_vs_quantized_ir"]
    for folder in folders:
        assert (folder / "README.md").is_file() and (folder / "example.py").is_file()


def test_01_float_vs_calib(tmp_path):
    summary = _load("01_float_vs_calib").main(tmp_path, progress=False)
    acc = summary["accuracy"]
    assert acc["int8 calibration"] < acc["float"] - 20
    assert acc["int8 + top-1 sensitive op int16"] >= acc["float"] - 1
    assert summary["most_sensitive"] == ("relu2", "activation")
    for name in ("badcase.txt", "profiler.html", "compare_per_layer_out.csv", "abnormal_layer_advisor.txt",
                 "output_0_L1_sensitive_ops.txt"):
        assert (tmp_path / name).is_file()


def test_02_qat_vs_pre_export(tmp_path):
    summary = _load("02_qat_vs_pre_export").main(tmp_path, progress=False)
    tables = set(summary["table_sites"])
    assert {name for name, _ in summary["worst_same_input_ops"]} == tables
    assert {name for name, _ in summary["sensitivity"]} == tables
    assert "lut" in (tmp_path / "output_0_L1_sensitive_ops.txt").read_text()


def test_03_multitask_task_strings(tmp_path):
    summary = _load("03_multitask_task_strings").main(tmp_path, progress=False)
    assert summary["cls_reg"]["sensitivity_tables"] == ["cls_L1", "reg_L1"]
    assert summary["cls"]["outputs"] == ["cls"] and summary["cls"]["op_sites"] < summary["cls_reg"]["op_sites"]
    assert (tmp_path / "cls_reg" / "output_reg_L1_sensitive_ops.txt").is_file()


def test_04_post_process(tmp_path):
    summary = _load("04_post_process").main(tmp_path, progress=False)
    assert "topk_0" in summary["in_model"]["rows"] and summary["in_model"]["tables"] == ["scores_L1", "boxes_L1"]
    assert summary["as_argument"]["rows"][-1] == "post_process"
    assert "post_process.scores_L1" in summary["as_argument"]["tables"]
    assert summary["as_argument"]["post_process_cosine"] > 0.9


def test_05_pre_export_vs_qat_ir(tmp_path):
    summary = _load("05_pre_export_vs_qat_ir").main(tmp_path, progress=False)
    assert summary["summary"] == "all bit-exact"
    assert summary["lsb_verdicts"] == {"bit-exact": 7} and summary["float_rows_identical"]
    assert summary["only_in_analysis"] == []
    assert {name for name, _ in summary["only_in_baseline"]} == {"bn1", "bn2", "dequant_cls", "dequant_reg"}
    assert summary["sensitivity_tables"] == ["cls_L1", "reg_L1"] and summary["largest_sensitivity"] == 0
    header = (tmp_path / "compare_per_layer_out.csv").read_text().splitlines()[0].split(",")
    assert {"lsb_verdict", "lsb_hist", "same_input_lsb_verdict", "same_input_lsb_hist"} <= set(header)
    assert "qat IR" in (tmp_path / "analysis_model" / "statistic.txt").read_text()


def test_06_qat_ir_vs_quantized_ir(tmp_path):
    summary = _load("06_qat_ir_vs_quantized_ir").main(tmp_path, progress=False)
    assert summary["first_diverged"] is None
    # spec v5's default qpp: the conv fused with relu1 requantizes with a 16-bit multiplier (a rare 1-LSB flip)
    assert summary["first_inexact"][:2] == ("relu1", "conv2d")
    assert set(summary["same_input_lsb_verdicts"]) <= {"bit-exact", "within 1 LSB"}
    assert summary["lsb_verdicts"].get("bit-exact", 0) >= 3 and "diverged" not in summary["lsb_verdicts"]
    assert {name for name, _ in summary["only_in_baseline"]} == {"conv1", "conv2", "meta_fc"}
    for head in ("cls", "reg"):
        assert summary["sensitivity_top3"][head][0][0] == "add_0"
    assert (tmp_path / "quantized_ir.qlir").is_file() and (tmp_path / "badcase.txt").is_file()
    assert "quantized IR from" in (tmp_path / "compare_per_layer_out.txt").read_text()


def test_example_command_line_writes_into_out(tmp_path):
    result = subprocess.run([sys.executable, str(EXAMPLES / "04_post_process" / "example.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, check=True)
    assert "as_argument" in result.stdout
    assert (tmp_path / "as_argument" / "profiler.html").is_file()


def test_readme_command_of_the_deployed_examples_runs_from_the_repo_root(tmp_path):
    root = EXAMPLES.parent
    for name in ("05_pre_export_vs_qat_ir", "06_qat_ir_vs_quantized_ir"):
        readme = (EXAMPLES / name / "README.md").read_text()
        assert f".venv/bin/python examples/{name}/example.py --out DIR" in readme
        result = subprocess.run([sys.executable, f"examples/{name}/example.py", "--out", str(tmp_path / name)],
                                cwd=root, capture_output=True, text=True, check=True)
        assert "first_" in result.stdout or "summary: all bit-exact" in result.stdout
        assert (tmp_path / name / "profiler.html").is_file()
