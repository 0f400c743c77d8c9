"""QAT vs pre_export (the seed article's 2.2.2): the error the integer lookup tables add.

``pre_export(qat)`` computes every nonlinear op (layer_norm, softmax, gelu ...) through the march's integer
tables. When the QAT model is fine and the pre_export model is not, the tables are at fault: compare the two.
With int16 activations the tables are segmented and interpolate, so each one adds up to about one output step.

    python examples/02_qat_vs_pre_export/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path


from quantlens.profiler import QuantAnalysis
from quantlens.quantization import calibrate as calibrate_model, prepare
from quantlens.quantization.pre_export import pre_export, pre_export_report
from quantlens.quantization.qconfig_template import calibration_8bit_weight_16bit_act_qconfig_setter
from quantlens.zoo import example_inputs, get_model, sample_batches


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    float_model = get_model("tiny_transformer")
    # The calibrated model stands in for qat_pt: pre_export takes either (QAT training only moves weights).
    qat = prepare(float_model, example_inputs("tiny_transformer"), calibration_8bit_weight_16bit_act_qconfig_setter,
                  check_result_dir=None)
    calibrate_model(qat, sample_batches("tiny_transformer", 8, 16))
    table_model = pre_export(qat)  # qat.export.pt in the article

    qa = QuantAnalysis(qat, table_model, "pre_export", out_dir=out_dir, progress=progress)
    qa.auto_find_bad_case(sample_batches("tiny_transformer", 6, 4))
    qa.run()
    table = qa.compare_per_layer()
    sens = qa.sensitivity()  # one lookup table switched on at a time
    return {
        "out_dir": str(out_dir),
        "table_sites": [info.site for info in pre_export_report(table_model)],
        "worst_same_input_ops": [(r.op_name, round(r.same_input_sqnr, 1)) for r in table.ranked("same_input_sqnr")[:4]],
        "sensitivity": [(r.op_name, r.value) for r in sens[0]],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    result = main(parser.parse_args().out)
    for key, value in result.items():
        print(f"{key}: {value}")
