"""Export time of a 3-layer nn.LSTM over long sequences (recurrent export folds the time steps).

Run: .venv/bin/python benchmarks/bench_recurrent_export.py [--lengths 40 160] [--threads 1] [--unrolled]

Prints, per sequence length, the seconds of prepare, calibration, export (the qat IR) and convert, the IR's node
count and the cosine of the quantized IR against the qat IR. ``--unrolled`` also times the export that traces
every time step (``quantlens.sites.rnn_fold.unrolled_export``; minutes per length, the former behaviour).
The goal is an export of <= 60 s at 160 steps on a 2-core machine with one torch thread (no threshold is
enforced; this prints measurements).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from quantlens.compiler import convert, export
from quantlens.quantization import DeQuantStub, QuantStub, calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.sites.rnn_fold import unrolled_export


class Recurrent(nn.Module):
    """QuantStub -> nn.LSTM(16, 32, num_layers=3, batch_first=True) -> the output sequence and h_n dequantized."""

    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.rnn = nn.LSTM(16, 32, num_layers=3, batch_first=True)
        self.dq_out, self.dq_h = DeQuantStub(), DeQuantStub()

    def forward(self, x):
        out, (h, _) = self.rnn(self.quant(x))
        return self.dq_out(out), self.dq_h(h)


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def run(length: int, batches: int, unrolled: bool) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Recurrent().eval()
    example = torch.randn(1, length, 16, generator=gen)
    prepared, t_prepare = _timed(lambda: prepare(model, (example,), default_calibration_qconfig_setter,
                                                 check_result_dir=None))
    data = [torch.randn(1, length, 16, generator=gen) for _ in range(batches)]
    _, t_calib = _timed(lambda: calibrate(prepared, data))
    qat_ir, t_export = _timed(lambda: export(prepared, (example,)))
    int_ir, t_convert = _timed(lambda: convert(qat_ir))
    held_out = torch.randn(1, length, 16, generator=gen)
    cosine = min(_cosine(a, b) for a, b in zip(qat_ir(held_out), int_ir(held_out)))
    line = (f"{length:6d} {t_prepare:9.1f} {t_calib:9.1f} {t_export:9.1f} {t_convert:9.1f} "
            f"{len(qat_ir.graph.nodes):8d} {cosine:9.5f}")
    if unrolled:
        with unrolled_export():
            _, t_unrolled = _timed(lambda: export(prepared, (example,)))
        line += f" {t_unrolled:12.1f}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 160])
    parser.add_argument("--batches", type=int, default=4, help="calibration batches (batch 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: multithreading on a loaded 2-core machine is erratic)")
    parser.add_argument("--unrolled", action="store_true", help="also time the export that traces every step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"3-layer LSTM(16, 32), batch 1, {args.batches} calibration batches, {torch.get_num_threads()} thread(s); "
          "seconds (the first export of the process includes torch.export's warm-up)")
    header = f"{'steps':>6s} {'prepare':>9s} {'calib':>9s} {'export':>9s} {'convert':>9s} {'IR nodes':>8s} {'cos q/qat':>9s}"
    print(header + (f" {'unrolled exp':>12s}" if args.unrolled else ""))
    for length in args.lengths:
        run(length, args.batches, args.unrolled)


if __name__ == "__main__":
    main()
