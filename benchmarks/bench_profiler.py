"""Peak memory and time of ``QuantAnalysis.run()`` against two plain forward passes, side by side.

The model has large activations (by default 8 conv-BN-ReLU blocks of 32 channels at 128x128, batch 4: about
8 MB per activation, ~200 MB for the whole network's op outputs). ``run()`` traces both models, streams every
op site's tensors to disk and computes the same-input output of every analysis op; its extra memory should be
about one layer's tensors, not the network's. Each measurement runs in a fresh subprocess, and peak memory is
the largest resident set size sampled during the measured call, minus the size just before it.

    python benchmarks/bench_profiler.py [--layers 8] [--channels 32] [--size 128] [--batch 4] [--glibc-default]

It measures two depths: run()'s peak should stay the same when the network doubles. Prints numbers only;
there are no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch import nn


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size every millisecond while the block runs."""

    def __enter__(self):
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.start


class LargeActivationNet(nn.Module):
    def __init__(self, layers: int, channels: int):
        super().__init__()
        from quantlens.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub(scale=1 / 128)
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
            for _ in range(layers)
        ])
        self.head = nn.Conv2d(channels, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(self.head(self.blocks(self.stem(self.quant(x)))))


def _models(args):
    from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    torch.manual_seed(0)
    model = LargeActivationNet(args.layers, args.channels).eval()
    small = torch.rand(1, 3, 32, 32) * 2 - 1  # calibration on small images keeps the setup's peak low
    calib = prepare(model, (small,), default_calibration_qconfig_setter, check_result_dir=None)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        calib(small)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    x = torch.rand(args.batch, 3, args.size, args.size) * 2 - 1
    return model, calib, x


def measure(mode: str, args) -> dict:
    """One measurement (runs inside a fresh subprocess)."""
    from quantlens.profiler import QuantAnalysis

    model, calib, x = _models(args)
    with torch.no_grad():  # warm-up: first-call kernel setup is not what we measure
        model(x[:1])
        calib(x[:1])
    with tempfile.TemporaryDirectory() as out:
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out, progress=False)
        qa.set_bad_case((x,))
        t0 = time.perf_counter()
        with PeakRSS() as mem:
            if mode == "forward":
                with torch.no_grad():
                    model(x)
                    calib(x)
            else:
                qa.run()
        seconds = time.perf_counter() - t0
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        sites = qa.compare_per_layer() if mode == "run" else []
    activation = args.batch * args.channels * args.size * args.size * 4
    return {"mode": mode, "seconds": seconds, "extra_peak": mem.extra, "disk": disk, "activation": activation,
            "sites": len(sites)}


def _measure_in_subprocess(mode: str, layers: int, args) -> dict:
    flags = [f"--layers={layers}"] + [f"--{k}={getattr(args, k)}" for k in ("channels", "size", "batch")]
    env = dict(os.environ)
    if not args.glibc_default:
        # glibc raises its mmap threshold after the first large free and then keeps freed activations in its
        # heap: RSS would show the allocator's cache instead of live tensors. A fixed threshold returns them.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    out = subprocess.run([sys.executable, __file__, f"--measure={mode}", *flags], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's malloc tuning alone")
    parser.add_argument("--measure", choices=["forward", "run"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    mb = 1024 * 1024
    act = args.batch * args.channels * args.size * args.size * 4
    print(f"model: conv-BN-ReLU blocks of {args.channels} ch at {args.size}x{args.size}, batch {args.batch}; "
          f"one activation = {act / mb:.1f} MB")
    print(f"{'':34s}{'two plain forwards':>20s}{'QuantAnalysis.run()':>22s}")
    for layers in (args.layers, 2 * args.layers):
        fwd = _measure_in_subprocess("forward", layers, args)
        run = _measure_in_subprocess("run", layers, args)
        print(f"-- {layers} blocks, {run['sites']} op sites: all op outputs of one model = "
              f"{run['sites'] * act / mb:.0f} MB; run() wrote {run['disk'] / mb:.0f} MB to disk")
        print(f"{'   time (s)':34s}{fwd['seconds']:>20.2f}{run['seconds']:>22.2f}")
        print(f"{'   extra peak memory (MB)':34s}{fwd['extra_peak'] / mb:>20.1f}{run['extra_peak'] / mb:>22.1f}")
        print(f"{'   extra peak memory (activations)':34s}{fwd['extra_peak'] / act:>20.1f}{run['extra_peak'] / act:>22.1f}")


if __name__ == "__main__":
    main()
