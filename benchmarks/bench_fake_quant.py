"""The fake quant's direct eager path against its ``torch.library`` op, side by side in one process: one call on
tensors of several sizes, a calibrated model's forward and its qat IR's run.

``quantlens.march.fake_quant`` calls its arithmetic directly in plain eager calls that record no gradient, and the
custom op ``quantlens::fake_quant`` elsewhere (graphs, autograd). Here the op path is forced by making the path test
say no. Both give the same bits (``tests/test_fake_quant_paths.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_fake_quant.py [--models digits_cnn,tiny_resnet,...] [--rounds 5]

Prints the best time of each path (µs for one call, ms for a forward), alternating the paths ``--rounds`` times;
no thresholds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import quantlens.march.fake_quant as fq
from quantlens.compiler import export
from quantlens.march import QuantDType
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ir import _time  # noqa: E402  (warm-up once, then the best of n calls; benchmarks/ is not a package)


def _side_by_side(fn, rounds: int, calls: int) -> tuple[float, float]:
    direct_test = fq._plain_eager
    op, direct = float("inf"), float("inf")
    try:
        for _ in range(rounds):
            fq._plain_eager = lambda *a: False
            op = min(op, _time(fn, calls))
            fq._plain_eager = direct_test
            direct = min(direct, _time(fn, calls))
    finally:
        fq._plain_eager = direct_test
    return op, direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(list_models()))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = torch.tensor(0.05)
    print("1 thread; best of each path, the paths alternating")
    with torch.no_grad():
        for n in (16, 4096, 65536, 1 << 20):
            x = torch.randn(n)
            op, direct = _side_by_side(lambda: fq.fake_quant(x, scale, QuantDType.qint8), args.rounds, 50)
            print(f"fake_quant of {n:>8d} float32: op {op * 1e6:9.1f} µs, direct {direct * 1e6:9.1f} µs")
        print(f"{'model (batch 32)':22s} {'float ms':>9s} {'fq model: op':>13s} {'direct':>8s} "
              f"{'qat IR: op':>11s} {'direct':>8s}")
        for name in args.models.split(","):
            model = get_model(name).eval()
            batch = sample_batches(name, 1, 32)[0]
            prepared = calibrate(prepare(model, example_inputs(name), default_calibration_qconfig_setter,
                                         check_result_dir=None), sample_batches(name, 3, 8))
            qat_ir = export(prepared, batch)
            float_ms = min(_time(lambda: model(*batch), 10) for _ in range(args.rounds)) * 1e3
            fq_op, fq_direct = _side_by_side(lambda: prepared(*batch), args.rounds, 10)
            ir_op, ir_direct = _side_by_side(lambda: qat_ir(*batch), args.rounds, 10)
            print(f"{name:22s} {float_ms:9.3f} {fq_op * 1e3:13.3f} {fq_direct * 1e3:8.3f} "
                  f"{ir_op * 1e3:11.3f} {ir_direct * 1e3:8.3f}")


if __name__ == "__main__":
    main()
