"""Task metrics of the real third-party models (quantlens.zoo.third_party) at each stage, int8 and 8-bit weights
with 16-bit activations: float, calibration (fake quant), pre_export (tables) and the quantized IR.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/third_party_models.py [--models crepe_tiny ...]
Prints one table; the figures in docs/zoo.md come from it.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from rich.console import Console
from rich.table import Table

from quantlens.compiler import convert, export
from quantlens.quantization import calibrate, pre_export, prepare
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
)
from quantlens.zoo.third_party import THIRD_PARTY_MODELS, load_third_party

SETTERS = {"int8": default_calibration_qconfig_setter, "w8a16": calibration_8bit_weight_16bit_act_qconfig_setter}


def measure(name: str, setter_name: str) -> dict[str, dict[str, float]]:
    """{stage: metrics} for one model and qconfig setter (metrics are against the float model)."""
    torch.manual_seed(0)
    entry = load_third_party(name)
    model = entry.build()
    example, batches, evaluation, labels = entry.data()
    reference = entry.evaluate(model, evaluation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrated = calibrate(prepare(model, example, SETTERS[setter_name], check_result_dir=None), batches)
    table_model = pre_export(calibrated, example_inputs=example)
    quantized = convert(export(table_model, example, dynamic_batch=not entry.per_call))
    return {stage: entry.metric(reference, entry.evaluate(m, evaluation), labels)
            for stage, m in (("float", model), ("calibration", calibrated), ("pre_export", table_model),
                             ("quantized IR", quantized))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=sorted(THIRD_PARTY_MODELS))
    args = parser.parse_args()
    table = Table(title=f"third-party models, torch threads = {torch.get_num_threads()}")
    for col in ("model", "qconfig", "stage", "metrics"):
        table.add_column(col)
    for name in args.models:
        for setter_name in SETTERS:
            for stage, metrics in measure(name, setter_name).items():
                table.add_row(name, setter_name, stage, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
