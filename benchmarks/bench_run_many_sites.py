"""What ``QuantAnalysis.run()`` holds beyond the forward on a model of many op sites, side by side.

``benchmarks/bench_profiler.py`` measures a few large layers; this one a deep MLP of many small ones (by default
68 residual blocks ``x + relu(linear(x))``: 204 op sites, 0.5 MB per activation, ~100 MB of activations), where
what ``run()`` keeps *per op site* (held copies for the same-input run and the row stream, queued copies, per-site
records) adds up. Each measurement runs in a fresh subprocess; peak memory is the largest resident set size
sampled every millisecond during the call, minus the size just before it. ``kept`` is the memory still held
once the call has returned (resident set size after, minus before).

    python benchmarks/bench_run_many_sites.py [--blocks 68] [--width 512] [--batch 256] [--glibc-default]

Columns: the plain forwards of both models (``fwd``) and ``run()``, their peaks above the start (MB), run()'s
peak minus the forwards' (``over fwd``), and the memory each keeps afterwards. Prints numbers only; there are no
thresholds.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import torch
from bench_profiler import PeakRSS as _Sampler  # (the same folder: run as a script)
from bench_profiler import measure_in_subprocess, rss_bytes
from torch import nn

MB = 1024 * 1024


class PeakRSS(_Sampler):
    """bench_profiler's sampler, with what the block kept once it ended (``kept``: RSS after minus before)."""

    def __enter__(self):
        gc.collect()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        gc.collect()
        self.kept = rss_bytes() - self.start


class DeepMLP(nn.Module):
    """``blocks`` residual blocks: three op sites each (linear, relu, add)."""

    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def _pair(args):
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    model = DeepMLP(args.blocks, args.width).eval()
    for layer in model.layers:  # small weights: the residual stream stays of order 1 through every block
        nn.init.normal_(layer.weight, std=0.2 / args.width ** 0.5)
    x = torch.randn(args.batch, args.width)
    small = x[:8]  # calibration on a small batch keeps the setup's memory low
    prepared = prepare(model, (small,), default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)
    calibrate(prepared, [(small,)])
    return model, prepared, x


def measure(mode: str, args) -> dict:
    """One measurement (inside a fresh subprocess)."""
    from quantlens.profiler import QuantAnalysis

    torch.set_num_threads(1)
    model, prepared, x = _pair(args)
    with torch.no_grad():  # warm-up: first-call kernel setup is not what is measured
        model(x[:1])
        prepared(x[:1])
    with tempfile.TemporaryDirectory() as out:
        qa = QuantAnalysis(model, prepared, "fake_quant", out_dir=out, progress=False)
        qa.set_bad_case((x,))
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            if mode == "forward":
                with torch.no_grad():
                    model(x)
                    prepared(x)
            else:
                result = qa.run()
        seconds = time.perf_counter() - t0
        sites = result.analysis_sites if mode == "run" else None
    return {"mode": mode, "seconds": seconds, "extra_peak": mem.peak - mem.start, "kept": mem.kept, "sites": sites,
            "activation": x.numel() * 4}


def _in_subprocess(mode: str, args) -> dict:
    flags = [f"--{k}={getattr(args, k)}" for k in ("blocks", "width", "batch")]
    return measure_in_subprocess(__file__, mode, flags, args.glibc_default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=68)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--glibc-default", action="store_true")
    parser.add_argument("--measure", choices=["forward", "run"], default=None)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    fwd, run = _in_subprocess("forward", args), _in_subprocess("run", args)
    acts = fwd["activation"] * 3 * args.blocks
    print(f"{run['sites']} op sites, {fwd['activation'] / MB:.2f} MB per activation, {acts / MB:.0f} MB of "
          "activations per forward")
    print(f"{'':10}{'peak +MB':>10}{'kept MB':>10}{'seconds':>10}")
    for name, m in (("fwd x2", fwd), ("run()", run)):
        print(f"{name:10}{m['extra_peak'] / MB:10.1f}{m['kept'] / MB:10.1f}{m['seconds']:10.2f}")
    print(f"run() over the forwards: {(run['extra_peak'] - fwd['extra_peak']) / MB:.1f} MB at its peak, "
          f"{(run['kept'] - fwd['kept']) / MB:.1f} MB kept afterwards")


if __name__ == "__main__":
    main()
