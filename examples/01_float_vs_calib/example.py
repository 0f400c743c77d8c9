"""Float vs calibration (the seed article's 2.2.1): find why int8 calibration loses accuracy, and fix it.

The bundled digits CNN is given an outlier channel: channel 5 of ``bn2`` is scaled by 100 and ``conv3``'s
weights for that channel by 1/100. The float model computes exactly the same function (ReLU commutes with a
positive scale), but ``relu2``'s int8 per-tensor scale now has to cover a 100x larger range, and every other
channel of that tensor rounds to a few levels. The profiler finds ``relu2``; promoting it to int16 with the
sensitivity table restores the accuracy.

    python examples/01_float_vs_calib/example.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from quantlens.profiler import QuantAnalysis
from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import (
    default_calibration_qconfig_setter,
    sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter,
)
from quantlens.zoo import digits_cnn, evaluate_accuracy, load_digits_data

OUTLIER_CHANNEL, OUTLIER_FACTOR = 5, 100.0


def float_model_with_outlier() -> torch.nn.Module:
    model = digits_cnn(pretrained=True)
    with torch.no_grad():
        model.bn2.weight[OUTLIER_CHANNEL] *= OUTLIER_FACTOR
        model.bn2.bias[OUTLIER_CHANNEL] *= OUTLIER_FACTOR
        model.conv3.weight[:, OUTLIER_CHANNEL] /= OUTLIER_FACTOR
    return model


def calibrate(model, x_calib, setter):
    calib = prepare(model, x_calib[:8], setter, check_result_dir=None)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for i in range(0, len(x_calib), 128):
            calib(x_calib[i : i + 128])
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    return calib


def main(out_dir: str | Path | None = None, progress: bool = True) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).parent / "out"
    data = load_digits_data()
    x_calib = data.x_train[:512]
    float_model = float_model_with_outlier()
    calib = calibrate(float_model, x_calib, default_calibration_qconfig_setter)
    acc = {"float": evaluate_accuracy(float_model, data.x_test, data.y_test),
           "int8 calibration": evaluate_accuracy(calib, data.x_test, data.y_test)}

    qa = QuantAnalysis(float_model, calib, "fake_quant", out_dir=out_dir, progress=progress)
    # Bad case: the test batch on which the two models disagree most (badcase.txt).
    qa.auto_find_bad_case([(data.x_test[i : i + 32],) for i in range(0, 320, 32)])
    qa.run()
    table = qa.compare_per_layer()  # compare_per_layer_out.txt/.csv, profiler.html, abnormal_layer_advisor.txt
    sens = qa.sensitivity()  # output_0_L1_sensitive_ops.txt/.pt

    # Close the loop: int16 for the most sensitive op, int8 elsewhere.
    fixed = calibrate(float_model, x_calib, sensitive_op_calibration_8bit_weight_16bit_act_qconfig_setter(sens, topk=1))
    acc["int8 + top-1 sensitive op int16"] = evaluate_accuracy(fixed, data.x_test, data.y_test)
    return {
        "accuracy": acc,
        "worst_same_input_op": table.ranked("same_input_sqnr")[0].op_name,
        "most_sensitive": (sens[0][0].op_name, sens[0][0].sensitive_type),
        "out_dir": str(out_dir),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default: out/ next to this file)")
    summary = main(parser.parse_args().out)
    for stage, value in summary["accuracy"].items():
        print(f"{stage:35s} {value:6.2f}%")
    print(f"op that loses the most precision itself: {summary['worst_same_input_op']}")
    print(f"most sensitive quantizer: {summary['most_sensitive']}")
    print(f"reports in {summary['out_dir']}")
