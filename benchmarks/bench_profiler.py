"""Peak memory and time of ``QuantAnalysis.run()`` against two plain forward passes, side by side.

The model has large activations (by default 8 conv-BN-ReLU blocks of 32 channels at 128x128, batch 4: about
8 MB per activation, ~200 MB for the whole network's op outputs). ``run()`` traces both models, streams every
op site's tensors to disk and computes the same-input output of every analysis op; its extra memory should be
about one layer's tensors, not the network's. Each measurement runs in a fresh subprocess, and peak memory is
the largest resident set size sampled during the measured call, minus the size just before it.

Three pairs of models of the same net, side by side: the torch models (``fake_quant``: float vs calibration),
``export`` (the pre_export model vs the qat IR) and ``convert`` (the qat IR vs the quantized IR, both IR models).
The IRs are exported for the measured input's shape (setup, not measured).

    python benchmarks/bench_profiler.py [--layers 8] [--channels 32] [--size 128] [--batch 4] [--glibc-default]
                                        [--pairs fake_quant,export,convert,digits] [--threads 1] [--repeat 3]

It measures two depths: run()'s peak should stay the same when the network doubles. ``digits`` is the small
trained digits CNN of the zoo (float vs calibration on 64 test images), where fixed costs dominate: there the
measured call is ``run()`` + ``compare_per_layer()``. ``--threads`` (a comma-separated list) sets both torch's
intra-op threads and quantlens' (``quantlens._threads.set_num_threads``) in the measuring subprocess, so the
forwards and run() use the same count; each subprocess times ``--repeat`` calls and keeps the fastest (the
peak memory is the first call's). Columns: ``x fwd`` is time(run) / time(two plain forwards); ``RSS x`` the
ratio of the peak resident set sizes of the whole process (run()'s over the forwards'); ``extra x`` the ratio
of the peaks above the size before the call. Prints numbers only; there are no thresholds.
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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size every millisecond while the block runs."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

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


#: the model pairs measured, side by side: analysis type -> what is compared
PAIRS = {"fake_quant": "float vs calibration (torch)", "export": "pre_export vs qat IR",
         "convert": "qat IR vs quantized IR", "digits": "digits CNN, 64 img (+compare)"}


def _pair(kind: str, model, calib, x):
    """The (baseline, analysis) models of analysis type ``kind``: torch models or IR modules of one net."""
    if kind == "fake_quant":
        return model, calib
    from quantlens.compiler import convert, export
    from quantlens.quantization.pre_export import pre_export

    qat_ir = export(calib, (x,))  # shapes fixed at the measured input's, as on the NPU
    return (pre_export(calib), qat_ir) if kind == "export" else (qat_ir, convert(qat_ir))


def _digits_models():
    """The trained digits CNN, its calibration model and 64 test images (setup, not measured)."""
    from quantlens import zoo
    from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    model = zoo.get_model("digits_cnn").eval()
    x = zoo.example_inputs("digits_cnn", 64)[0]
    calib = prepare(model, (x[:8],), default_calibration_qconfig_setter, check_result_dir=None)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for batch in zoo.sample_batches("digits_cnn", 4, 64):
            calib(*batch)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    return model, calib, x


def measure(mode: str, args) -> dict:
    """One measurement (runs inside a fresh subprocess)."""
    from quantlens._threads import set_num_threads
    from quantlens.profiler import QuantAnalysis

    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    if args.pair == "digits":
        baseline, analysis, x = _digits_models()
        kind = "fake_quant"
    else:
        model, calib, x = _models(args)
        baseline, analysis = _pair(args.pair, model, calib, x)
        kind = args.pair
    with torch.no_grad():  # warm-up: first-call kernel setup is not what we measure (IRs: fixed shapes)
        baseline(x if args.pair == "convert" else x[:1])
        analysis(x if args.pair != "fake_quant" else x[:1])
    with tempfile.TemporaryDirectory() as out:
        qa = QuantAnalysis(baseline, analysis, kind, out_dir=out, progress=False)
        qa.set_bad_case((x,))
        times, mems, sites = [], [], []
        for _ in range(max(args.repeat, 1)):
            t0 = time.perf_counter()
            with PeakRSS() as mem:
                if mode == "forward":
                    with torch.no_grad():
                        baseline(x)
                        analysis(x)
                else:
                    qa.run()
                    if args.pair == "digits":
                        sites = qa.compare_per_layer()
            times.append(time.perf_counter() - t0)
            mems.append(mem)
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        if mode == "run" and not sites:
            sites = qa.compare_per_layer()
    activation = args.batch * args.channels * args.size * args.size * 4
    return {"mode": mode, "seconds": min(times), "extra_peak": mems[0].extra, "peak": mems[0].peak,
            "disk": disk, "activation": activation, "sites": len(sites), "threads": torch.get_num_threads()}


def measure_in_subprocess(script: str, mode: str, flags: list[str], glibc_default: bool) -> dict:
    """Run ``script --measure=mode *flags`` in a fresh process (its RSS its own) and return the JSON dict its last
    line prints."""
    env = dict(os.environ)
    if not glibc_default:
        # glibc raises its mmap threshold after the first large free and then keeps freed activations in its
        # heap: RSS would show the allocator's cache instead of live tensors. A fixed threshold returns them.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    out = subprocess.run([sys.executable, script, f"--measure={mode}", *flags], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_in_subprocess(mode: str, layers: int, args, pair: str = "fake_quant", threads: int = 1) -> dict:
    flags = [f"--layers={layers}", f"--pair={pair}", f"--threads={threads}"] + [
        f"--{k}={getattr(args, k)}" for k in ("channels", "size", "batch", "repeat")]
    return measure_in_subprocess(__file__, mode, flags, args.glibc_default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's malloc tuning alone")
    parser.add_argument("--pairs", default=",".join(PAIRS),
                        help=f"comma-separated analysis types to measure (default: {','.join(PAIRS)})")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts to measure (default: 1)")
    parser.add_argument("--repeat", type=int, default=3, help="calls timed per measurement; the fastest counts")
    parser.add_argument("--measure", choices=["forward", "run"], help=argparse.SUPPRESS)
    parser.add_argument("--pair", choices=list(PAIRS), default="fake_quant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        args.threads = int(args.threads)
        print(json.dumps(measure(args.measure, args)))
        return
    thread_counts = [int(t) for t in str(args.threads).split(",") if t.strip()]
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        parser.error(f"unknown pair(s) {unknown}; choose from {list(PAIRS)}")
    mb = 1024 * 1024
    act = args.batch * args.channels * args.size * args.size * 4
    print(f"model: conv-BN-ReLU blocks of {args.channels} ch at {args.size}x{args.size}, batch {args.batch}; "
          f"one activation = {act / mb:.1f} MB; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    header = ["pair", "blocks", "sites", "threads", "fwd s", "run() s", "x fwd", "fwd RSS", "run RSS", "RSS x",
              "fwd +MB", "run +MB", "extra x", "disk MB"]
    widths = [30, 6, 5, 7, 7, 8, 6, 8, 8, 6, 8, 8, 7, 8]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for pair in pairs:
        for threads in thread_counts:
            for layers in ((args.layers,) if pair == "digits" else (args.layers, 2 * args.layers)):
                fwd = _measure_in_subprocess("forward", layers, args, pair, threads)
                run = _measure_in_subprocess("run", layers, args, pair, threads)
                cells = [PAIRS[pair], "-" if pair == "digits" else layers, run["sites"], run["threads"],
                         f"{fwd['seconds']:.3f}", f"{run['seconds']:.3f}", f"{run['seconds'] / fwd['seconds']:.2f}",
                         f"{fwd['peak'] / mb:.0f}", f"{run['peak'] / mb:.0f}", f"{run['peak'] / fwd['peak']:.2f}",
                         f"{fwd['extra_peak'] / mb:.1f}", f"{run['extra_peak'] / mb:.1f}",
                         f"{run['extra_peak'] / max(fwd['extra_peak'], 1):.2f}", f"{run['disk'] / mb:.0f}"]
                print("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))), flush=True)
    try:
        load = "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "load average unknown"
    print(f"fwd: both models' plain forwards; run(): QuantAnalysis.run() (both traces, same-input outputs; digits: "
          f"+ compare_per_layer()); x fwd: time(run) / time(fwd); RSS: peak resident set size of the process, MB; "
          f"+MB: the peak above the size before the call; sites: compared rows. {os.cpu_count()} cores, {load}.")


if __name__ == "__main__":
    main()
