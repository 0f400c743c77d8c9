"""The qat IR vs the quantized IR (the seed article's 2.2.4): what the integer kernels change.

``convert(qat_ir)`` gives the quantized IR: integer-only, the march's requantize and rounding. It differs from
the qat IR (float ops + fake quants) by whole output steps: compare the two with analysis type ``"convert"`` and
read the LSB verdicts: which op is the first whose own integer kernel is not bit-exact, and whether any op
diverges (more than 4 LSB) from the qat IR.

Both IRs are saved with ``quantlens.compiler.save`` and passed to QuantAnalysis by path, as on a deployment
machine; the data is in the deployment format (the multi-task inputs without the task list).

    .venv/bin/python examples/06_qat_ir_vs_quantized_ir/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from quantlens.compiler import convert, export, save
from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate as calibrate_model, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches

BATCH = 16  # the IR is exported for this batch size (shapes are fixed, as on the NPU)


def build_irs(out_dir: Path) -> tuple[Path, Path]:
    """Calibrate the multi-task model, export and convert it; save both IRs into ``out_dir``."""
    float_model = get_model("multitask")
    example = example_inputs("multitask", batch_size=BATCH)  # ({"image": ..., "meta": ...}, ["cls", "reg"])
    calib = prepare(float_model, example, default_calibration_qconfig_setter,
                    extra_example_inputs=[(example[0], ["cls"])], check_result_dir=None)
    calibrate_model(calib, sample_batches("multitask", 8, 16))
    qat_ir = export(calib, example)  # applies pre_export's tables first; fixed to the task list and the batch size
    return save(qat_ir, out_dir / "qat_ir.qlir"), save(convert(qat_ir), out_dir / "quantized_ir.qlir")


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    qat_path, quantized_path = build_irs(out_dir)

    qa = QuantAnalysis(qat_path, quantized_path, "convert", out_dir=out_dir, progress=progress)
    # The deployment format: each sample is the call's arguments without the task list, ({"image", "meta"},).
    data = [(inputs,) for inputs, _ in sample_batches("multitask", 8, BATCH)]
    found = qa.auto_find_bad_case(data)
    qa.run()
    table = qa.compare_per_layer()
    sens = qa.sensitivity()

    diverged, inexact = table.first_diverged, table.first_inexact
    return {
        "out_dir": str(out_dir),
        "bad_case_sample": found.bad_case_index,
        "lsb_verdicts": dict(Counter(r.lsb_verdict for r in table if r.lsb_verdict)),
        "same_input_lsb_verdicts": dict(Counter(r.same_input_lsb_verdict for r in table if r.same_input_lsb_verdict)),
        "first_diverged": diverged.op_name if diverged else None,
        "first_inexact": (inexact.op_name, inexact.analy_op_type, inexact.same_input_lsb_hist) if inexact else None,
        "only_in_baseline": table.only_in_baseline,
        "sensitivity_top3": {t.output: [(r.op_name, r.op_type, round(r.value, 6)) for r in t[:3]] for t in sens},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    result = main(parser.parse_args().out)
    for key, value in result.items():
        print(f"{key}: {value}")
