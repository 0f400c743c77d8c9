"""Speed of the integer simulator: quantized IR time over float torch time, per zoo model, side by side.

Run: .venv/bin/python benchmarks/bench_ir.py [--batch 32] [--repeat 20]
The goal is a ratio <= 2 (no threshold is enforced; this prints measurements).
"""

from __future__ import annotations

import argparse
import time

import torch

from quantlens.compiler import convert, export
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo import example_inputs, get_model, list_models, sample_batches


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: multithreading on a loaded 2-core machine is erratic)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, best of {args.repeat}, {torch.get_num_threads()} thread(s)")
    print(f"{'model':22s} {'float ms':>10s} {'qat IR ms':>10s} {'int IR ms':>10s} {'int/float':>10s}")
    ratios = {}
    for name in list_models():
        model = get_model(name)
        batch = sample_batches(name, 1, args.batch)[0]
        prepared = prepare(model, example_inputs(name), default_calibration_qconfig_setter, check_result_dir=None)
        calibrate(prepared, sample_batches(name, 3, 8))
        qat_ir = export(prepared, batch)
        int_ir = convert(qat_ir)
        with torch.no_grad():
            t_float = _time(lambda: model(*batch), args.repeat)
        t_qat = _time(lambda: qat_ir(*batch), args.repeat)
        t_int = _time(lambda: int_ir(*batch), args.repeat)
        ratios[name] = t_int / t_float
        print(f"{name:22s} {t_float * 1e3:10.3f} {t_qat * 1e3:10.3f} {t_int * 1e3:10.3f} {t_int / t_float:10.2f}")
    print(f"max int/float ratio: {max(ratios.values()):.2f} ({max(ratios, key=ratios.get)}); "
          f"{torch.get_num_threads()} thread(s), batch {args.batch}")


if __name__ == "__main__":
    main()
