"""``run()`` + ``compare_per_layer()`` on the ResNet-18 shape of issue #25, against two plain float forwards.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_analysis_resnet18.py [--repeat 3] [--profile]

transformers' ``ResNetModel`` (basic blocks [2, 2, 2, 2], widths 64-512, random weights), 224x224, batch 4, int8
calibration on two batches, 1 torch thread. Prints the best of ``--repeat`` runs of each part and the ratios;
``--profile`` adds a cProfile of one ``compare_per_layer()`` and one ``run()`` (tottime). To compare two source
trees side by side, run it alternately with ``PYTHONPATH=<other checkout>/src``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
import warnings

import torch


def main() -> None:
    import transformers

    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       embedding_size=64)
    model = transformers.ResNetModel(config).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 224, 224, generator=g)
    calib = [(torch.randn(4, 3, 224, 224, generator=g),) for _ in range(2)]
    prepared = calibrate(prepare(model, (x,), check_result_dir=None, allow_no_stubs=True), calib)  # no QuantStub

    def forwards() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model(x)
            model(x)
        return time.perf_counter() - t

    two = min(forwards() for _ in range(args.repeat + 1))
    runs, compares, rows = [], [], 0
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeat + 1):  # the first is a warm-up
            qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out, progress=False)
            qa.set_bad_case((x,))
            t0 = time.perf_counter()
            qa.run()
            t1 = time.perf_counter()
            rows = len(qa.compare_per_layer())
            runs.append(t1 - t0)
            compares.append(time.perf_counter() - t1)
        run, compare = min(runs[1:]), min(compares[1:])
        print(f"threads {torch.get_num_threads()}; two forwards {two:.3f} s; run() {run:.3f} s ({run / two:.2f}x); "
              f"compare_per_layer() {compare:.3f} s ({compare / two:.2f}x); together {(run + compare) / two:.2f}x; "
              f"{rows} rows")
        if args.profile:
            for name, call in (("compare_per_layer", qa.compare_per_layer), ("run", qa.run)):
                profile = cProfile.Profile()
                profile.runcall(call)
                print(f"--- {name}()")
                pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
