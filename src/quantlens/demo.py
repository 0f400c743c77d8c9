"""End-to-end demo on the bundled digits CNN: float -> calibration -> QAT -> validation -> integer IR.

Run it with ``./dev demo`` (or ``python -m quantlens.demo --out DIR``). It prints the accuracy of every stage and
writes ``model_check_result.txt``, the quantized IR (``quantized.qlir``) and ``demo_summary.json`` into the
output folder.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

import torch

from quantlens._io import atomic_write_text
from quantlens.compiler import convert, export, save
from quantlens.quantization import FakeQuantState, calibrate, check_qat_model, prepare, set_fake_quantize
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
)

__all__ = ["StageResult", "DemoResult", "run_demo", "main"]


@dataclass(frozen=True)
class StageResult:
    stage: str
    accuracy: float  # percent on the 360 held-out digits


@dataclass
class DemoResult:
    stages: list[StageResult] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def accuracy(self, stage: str) -> float:
        return next(s.accuracy for s in self.stages if s.stage == stage)


def _calibrate(model, x: torch.Tensor, batch_size: int = 128) -> None:
    calibrate(model, (x[i : i + batch_size] for i in range(0, len(x), batch_size)))


def _qat(model, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model.train()
    set_fake_quantize(model, FakeQuantState.QAT)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), 64):
            idx = order[i : i + 64]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
    model.eval()
    set_fake_quantize(model, FakeQuantState.VALIDATION)


def run_demo(out_dir: str = "quantlens_demo", qat_epochs: int = 2, seed: int = 0) -> DemoResult:
    """Run the whole flow and return the accuracies; files go to ``out_dir``."""
    from quantlens.zoo import digits_cnn, evaluate_accuracy, load_digits_data

    torch.manual_seed(seed)
    data = load_digits_data()
    example = data.x_train[:8]
    float_model = digits_cnn(pretrained=True).eval()
    result = DemoResult()

    def record(stage, model):
        result.stages.append(StageResult(stage, evaluate_accuracy(model, data.x_test, data.y_test)))

    record("float", float_model)

    calib = prepare(float_model, example, default_calibration_qconfig_setter, check_result_dir=None)
    _calibrate(calib, data.x_train)
    record("int8 calibration", calib)

    calib16 = prepare(float_model, example, calibration_8bit_weight_16bit_act_qconfig_setter, check_result_dir=None)
    _calibrate(calib16, data.x_train)
    record("int16-activation calibration", calib16)

    # QAT starts from the calibrated scales, as recommended: same structure, QAT observers (moving average).
    qat = prepare(float_model, example, default_qat_qconfig_setter, check_result_dir=None)
    qat.load_state_dict(calib.state_dict())
    _qat(qat, data.x_train, data.y_train, qat_epochs, seed)
    record("int8 QAT", qat)

    check = check_qat_model(qat, example, out_dir)

    # Deployment: the qat IR (float + fake quant) and the integer-only IR, a bit-exact simulator of the march.
    qat_ir = export(qat, example, dynamic_batch=True)
    quantized_ir = convert(qat_ir)
    result.stages.append(StageResult("quantized IR (integer)", _accuracy_ir(quantized_ir, data.x_test, data.y_test)))
    ir_path = os.path.join(out_dir, "quantized.qlir")
    save(quantized_ir, ir_path)

    summary = os.path.join(out_dir, "demo_summary.json")
    atomic_write_text(summary, json.dumps([asdict(s) for s in result.stages], indent=2) + "\n")
    result.files = [check.path, ir_path, summary]
    return result


def _accuracy_ir(module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((module(x[i : i + batch_size]).argmax(dim=1) == y[i : i + batch_size]).sum())
    return 100.0 * correct / len(x)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="quantlens_demo", help="output folder (default: ./quantlens_demo)")
    parser.add_argument("--qat-epochs", type=int, default=2)
    args = parser.parse_args(argv)
    result = run_demo(args.out, args.qat_epochs)
    table = Table(title="digits CNN: accuracy by stage (360 held-out images)")
    table.add_column("stage")
    table.add_column("accuracy %", justify="right")
    table.add_column("vs float", justify="right")
    base = result.accuracy("float")
    for stage in result.stages:
        table.add_row(stage.stage, f"{stage.accuracy:.2f}", f"{stage.accuracy - base:+.2f}")
    console = Console()
    console.print(table)
    for path in result.files:
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
