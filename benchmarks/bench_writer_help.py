"""``run()`` with the forward's thread helping the trace writer, against the forward's thread waiting for it, side by
side in one process (issue #25).

Storing a traced site has a part that depends on that site alone (its statistics, integer codes, file and output
quantization split) and a part recorded in queue order (held values, the statistics references read, the row).
Where the forward would wait for the writer thread (its copies' pool full, or ``finish()``), it now computes the
first part of the newest queued sites itself. "waiting" rebuilds the former behaviour by making the helper say no.
Both give the same trace bytes and rows (``tests/test_trace_helping.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_writer_help.py [--nets tiny_resnet,big64,minilm] [--rounds 4]

Nets: ``bench_peers``' (``digits_cnn``, ``tiny_resnet``, ``resnet18``, ``minilm``) with their calibrated models and
inputs, and ``big64`` / ``big128``: ``bench_profiler``'s conv-BN-ReLU nets (64x64, 6 blocks, batch 8; 128x128,
8 blocks, batch 4). For each net, ``--rounds`` times: each mode's best of ``--per`` calls, the modes alternating.
Prints each mode's times (run(), and run() + compare_per_layer()), their best and median, and how many sites the
forward's thread computed per run. No thresholds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _net(name: str):
    """(float model, calibrated model, bad case) of ``name``."""
    if name.startswith("big"):
        import bench_profiler

        size = int(name[3:])
        args = argparse.Namespace(layers=6 if size <= 64 else 8, channels=32, size=size, batch=8 if size <= 64 else 4)
        model, calib, x = bench_profiler._models(args)
        return model, calib, (x,)
    from bench_peers_nets import build_net
    from bench_peers_tools import calibrated

    net = build_net(name)
    return net.model, calibrated(net), net.args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", default="digits_cnn,tiny_resnet,big64,minilm")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per", type=int, default=2, help="calls per mode and round; the best counts")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from quantlens.profiler import QuantAnalysis
    from quantlens.profiler.trace.writer import TraceWriter

    helper = TraceWriter._help
    helped = [0]

    def counting(self):
        done = helper(self)
        helped[0] += done and threading.current_thread() is threading.main_thread()
        return done

    print(f"torch threads: {torch.get_num_threads()}; ms; best of {args.per} per round, {args.rounds} rounds")
    for name in args.nets.split(","):
        model, calib, case = _net(name)

        def once() -> tuple[float, float]:
            with tempfile.TemporaryDirectory() as out:
                qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out, progress=False)
                qa.set_bad_case(case)
                t0 = time.perf_counter()
                qa.run()
                t1 = time.perf_counter()
                qa.compare_per_layer()
                return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3

        once()
        times = {"waiting": [], "helping": []}
        per_run = []
        try:
            for _ in range(args.rounds):
                for mode in times:
                    TraceWriter._help = counting if mode == "helping" else (lambda self: False)
                    helped[0] = 0
                    times[mode].append(min(once() for _ in range(args.per)))
                    if mode == "helping":
                        per_run.append(helped[0] / args.per)
        finally:
            TraceWriter._help = helper
        for mode, ts in times.items():
            runs, both = [t[0] for t in ts], [t[1] for t in ts]
            print(f"{name:12s} {mode:8s} run() {[round(t) for t in runs]} best {min(runs):.0f} median "
                  f"{statistics.median(runs):.0f} | + compare best {min(both):.0f} median {statistics.median(both):.0f}"
                  + (f" | sites computed by the forward's thread per run: {statistics.mean(per_run):.0f}"
                     if mode == "helping" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
