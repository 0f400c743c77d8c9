"""pre_export vs the qat IR (the seed article's 2.2.3): does ``export`` change what the model computes?

``export(pre_export_model, example)`` traces the model with ``torch.export`` into the qat IR (float ops plus fake
quants). It should compute exactly what the pre_export model computes: compare the two with analysis type
``"export"``. Every row gets an LSB verdict (``bit-exact`` / ``within 1 LSB`` / ``within 4 LSB`` / ``diverged``).

The multi-task model takes ``({"image": ..., "meta": ...}, ["cls", "reg"])``; the IR is fixed to the exported task
list and is deployed without it. Each side is traced with its own input format, in two ``run`` calls: the torch
model with the task list, the IR with the deployment format (the same structure without the task list).

    .venv/bin/python examples/05_pre_export_vs_qat_ir/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from quantlens.compiler import export
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate as calibrate_model, prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


def first_not_bit_exact(table) -> str:
    """The first op (execution order) whose value is not bit-exact, or ``"all bit-exact"``."""
    row = next((r for r in table if r.lsb_verdict not in ("", "bit-exact")), None)
    return f"{row.op_name} ({row.lsb_verdict})" if row else "all bit-exact"


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    float_model = get_model("multitask")
    torch_example = example_inputs("multitask")  # ({"image": ..., "meta": ...}, ["cls", "reg"])
    calib = prepare(float_model, torch_example, default_calibration_qconfig_setter,
                    extra_example_inputs=[(torch_example[0], ["cls"])], check_result_dir=None)
    calibrate_model(calib, sample_batches("multitask", 8, 16))
    pre_export_model = pre_export(calib)  # qat.export.pt in the article (the calibrated model stands in for QAT)
    qat_ir = export(pre_export_model, torch_example)  # fixed to the task list ["cls", "reg"]
    deploy_example = (torch_example[0],)  # the deployment format: the same structure without the task list

    qa = QuantAnalysis(pre_export_model, qat_ir, "export", out_dir=out_dir, progress=progress)
    qa.set_bad_case(torch_example)  # the torch model needs the task list to choose its heads
    qa.run(run_baseline_model=True, run_analysis_model=False)
    qa.set_bad_case(deploy_example)  # the IR is called as it is deployed
    qa.run(run_baseline_model=False, run_analysis_model=True)  # same tensors: the baseline trace still fits
    table = qa.compare_per_layer()
    # sensitivity() re-runs both models: it uses the format the baseline was traced in (the same tensors)
    sens = qa.sensitivity()

    verdicts = Counter(r.lsb_verdict for r in table if r.lsb_verdict)
    exact_float = all(r.Atol == 0 for r in table if r.compared and not r.lsb_verdict)
    return {
        "out_dir": str(out_dir),
        "summary": first_not_bit_exact(table),
        "lsb_verdicts": dict(verdicts),
        "float_rows_identical": exact_float,  # rows without a grid (float conv outputs): Atol == 0
        "only_in_baseline": table.only_in_baseline,
        "only_in_analysis": table.only_in_analysis,
        "sensitivity_tables": sens.keys(),
        "largest_sensitivity": max(r.value for t in sens for r in t),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    result = main(parser.parse_args().out)
    for key, value in result.items():
        print(f"{key}: {value}")
