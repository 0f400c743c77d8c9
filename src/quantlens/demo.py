"""End-to-end demo on the bundled digits CNN: every stage, then every stage-pair analysis.

Run it with ``./dev demo`` (or ``python -m quantlens.demo --out DIR``). It runs float -> int8 calibration -> QAT ->
pre_export -> qat IR (export) -> quantized IR (convert), prints the accuracy of every stage, then compares each
pair of neighbouring stages with the profiler (``QuantAnalysis``), each pair in its own subfolder of the output
folder, and prints where precision is lost: the verdict and worst op per stage pair, the worst overall first (a
pair is "exact" only when every compared op is bit-exact; the onnxruntime pair runs onnxruntime's default level).
``index.html`` links every pair's ``profiler.html``.

``--fault`` plants a fault: op site ``relu2`` (the output of the fused conv2-bn2-relu2) gets a fixed int8 scale
far too coarse for its range, so a newcomer sees the profiler find it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantlens._io import atomic_write_text
from quantlens.quantization import FakeQuantState, check_qat_model, set_fake_quantize
from quantlens.quantization.qconfig_template import (
    calibration_8bit_weight_16bit_act_qconfig_setter,
    default_calibration_qconfig_setter,
    default_qat_qconfig_setter,
)

__all__ = ["StageResult", "DemoResult", "run_demo", "main", "FAULT_SITE", "fault_setters"]

#: the op site ``--fault`` breaks
FAULT_SITE = "relu2"
#: its planted fixed output scale: int8 steps of 1.0 where the calibrated scale is about 0.035 (relu2's outputs
#: span 0..4), so its values round to 0, 1, 2, 3 or 4
FAULT_SCALE = 1.0


@dataclass(frozen=True)
class StageResult:
    stage: str
    accuracy: float  # percent on the 360 held-out digits


@dataclass
class DemoResult:
    stages: list[StageResult] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    pairs: list = field(default_factory=list)  # quantlens.cli.pipeline.PairResult, in pipeline order
    #: the worst op of the first pair of ``ranked_losses``: the lowest same-input SQNR over the lossy pairs,
    #: else the worst differing op of the first pair that differs
    culprit: str | None = None
    fault: str | None = None  # the planted op site (--fault)

    def accuracy(self, stage: str) -> float:
        return next(s.accuracy for s in self.stages if s.stage == stage)


def fault_setters(calibration: bool = True):
    """The demo's qconfig setters with the planted fault: ``FAULT_SITE`` gets a fixed, far too coarse int8
    output scale; every other op site keeps the default template."""
    from quantlens.march import QuantDType
    from quantlens.quantization import FixedScaleObserver, MinMaxObserver, QConfig, QuantSpec
    from quantlens.quantization.qconfig_template import ModuleNameQconfigSetter

    planted = QConfig(
        weight=QuantSpec(QuantDType.qint8, MinMaxObserver, ch_axis=0),
        output=QuantSpec(QuantDType.qint8, FixedScaleObserver.with_args(scale=FAULT_SCALE)),
    )
    base = default_calibration_qconfig_setter if calibration else default_qat_qconfig_setter
    return (ModuleNameQconfigSetter({FAULT_SITE: planted}), base)


def _calibrate(model, x: torch.Tensor, batch_size: int = 128) -> None:
    from quantlens.quantization import calibrate

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


def _accuracy_ir(module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((module(x[i : i + batch_size]).argmax(dim=1) == y[i : i + batch_size]).sum())
    return 100.0 * correct / len(x)


def run_demo(out_dir: str = "quantlens_demo", qat_epochs: int = 2, seed: int = 0, *, fault: bool = False,
             analysis_batches: int = 3, batch_size: int = 32, sensitivity: bool = True, int16: bool = True,
             progress: bool = False, step=None) -> DemoResult:
    """Run the whole flow and every stage-pair analysis; files go to ``out_dir``.

    ``analysis_batches`` x ``batch_size`` held-out images are searched for each pair's bad case; ``int16``
    also reports an int16-activation calibration's accuracy; ``fault`` plants :data:`FAULT_SITE`'s fault."""
    from quantlens.cli.pipeline import (
        PAIRS,
        analyze_pairs,
        build_stages,
        ranked_losses,
        write_index,
        write_summary,
    )
    from quantlens.quantization import prepare
    from quantlens.zoo import digits_cnn, evaluate_accuracy, load_digits_data

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    data = load_digits_data()
    example = data.x_train[:8]
    float_model = digits_cnn(pretrained=True).eval()
    result = DemoResult(fault=FAULT_SITE if fault else None)
    calib_setter = fault_setters(True) if fault else default_calibration_qconfig_setter
    qat_setter = fault_setters(False) if fault else default_qat_qconfig_setter

    def record(stage, model):
        result.stages.append(StageResult(stage, evaluate_accuracy(model, data.x_test, data.y_test)))

    stages = build_stages(
        float_model, example, lambda: (data.x_train[i : i + 128] for i in range(0, len(data.x_train), 128)),
        calib_setter, qat_qconfig_setter=qat_setter,
        train_qat=(lambda m: _qat(m, data.x_train, data.y_train, qat_epochs, seed)) if qat_epochs > 0 else None,
        out_dir=out, step=step)
    record("float", stages.float)
    record("int8 calibration", stages.calibration)
    if int16 and not fault:
        calib16 = prepare(float_model, example, calibration_8bit_weight_16bit_act_qconfig_setter,
                          check_result_dir=None)
        _calibrate(calib16, data.x_train)
        record("int16-activation calibration", calib16)
    if stages.qat is not stages.calibration:
        record("int8 QAT", stages.qat)
    record("pre_export (lookup tables)", stages.pre_export)
    result.stages.append(StageResult("qat IR", _accuracy_ir(stages.qat_ir, data.x_test, data.y_test)))
    result.stages.append(StageResult("quantized IR (integer)",
                                     _accuracy_ir(stages.quantized_ir, data.x_test, data.y_test)))
    check = check_qat_model(stages.qat, example, out_dir)

    def batches():
        return [data.x_test[i * batch_size : (i + 1) * batch_size] for i in range(analysis_batches)]

    result.pairs = analyze_pairs(stages, list(PAIRS), out, batches, example, sensitivity=sensitivity,
                                 progress=progress, step=step)
    ranked = ranked_losses(result.pairs)
    result.culprit = ranked[0].worst_op if ranked else None
    intro = "digits CNN, " + (f"planted fault at op site '{FAULT_SITE}' (fixed int8 scale {FAULT_SCALE})"
                              if fault else "no planted fault") + "."
    index = write_index(result.pairs, out, "quantlens demo: where the digits CNN loses precision", intro,
                        metrics=[(s.stage, s.accuracy) for s in result.stages], metric_label="accuracy (%)")
    summary = write_summary(result.pairs, out, {"fault": result.fault,
                                                "stages": [asdict(s) for s in result.stages]})
    legacy = out / "demo_summary.json"  # accuracies only, as before
    atomic_write_text(legacy, json.dumps([asdict(s) for s in result.stages], indent=2) + "\n")
    result.files = [check.path, *stages.files, str(index), str(summary), str(legacy)]
    return result


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from quantlens.cli import quiet_torch
    from quantlens.cli.pipeline import print_losses

    quiet_torch()
    parser = argparse.ArgumentParser(prog="quantlens-demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", default="quantlens_demo", help="output folder (default: ./quantlens_demo)")
    parser.add_argument("--qat-epochs", type=int, default=2, help="QAT epochs (default 2; 0 skips training)")
    parser.add_argument("--fault", action="store_true",
                        help=f"plant a fault: op site '{FAULT_SITE}' gets a far too coarse fixed int8 scale")
    parser.add_argument("--batches", type=int, default=3,
                        help="held-out batches of 32 searched for each pair's bad case (default 3)")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the per-quantizer sensitivity tables")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 120)
    with console.status("quantlens demo") as status:
        result = run_demo(args.out, args.qat_epochs, fault=args.fault, analysis_batches=args.batches,
                          sensitivity=not args.no_sensitivity, step=lambda s: status.update(f"[bold]{s}"))

    table = Table(title="digits CNN: accuracy by stage (360 held-out images)")
    table.add_column("stage")
    table.add_column("accuracy %", justify="right")
    table.add_column("vs float", justify="right")
    base = result.accuracy("float")
    for stage in result.stages:
        table.add_row(stage.stage, f"{stage.accuracy:.2f}", f"{stage.accuracy - base:+.2f}")
    console.print(table)
    print_losses(console, result.pairs)
    console.print(f"reports: {os.path.join(args.out, 'index.html')} links each pair's <pair>/profiler.html")
    if result.fault:
        found = "found it" if result.culprit == result.fault else f"but the worst op is {result.culprit}"
        console.print(f"planted fault: {result.fault} ({found})")
    for path in result.files:
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
