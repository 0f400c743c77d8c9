"""Time of ``QuantAnalysis.sensitivity()`` against N forwards (N = the number of quantizers), side by side.

For each model it prints ``time(sensitivity) / (N x time(one forward))`` for the cached path (the default: each
ablation recomputes only from the op site of its quantizer on, the rest comes from one reference forward) and
for the old path (one full forward per quantizer), measured in one run. "One forward" is a plain forward of the
analysis model (``TorchModelAccess.run``: eval, no grad), the best of the forwards timed before and between the
sensitivity() calls (each path's time is its best call too). Models, all ``fake_quant`` (float vs
calibration): a ResNet-like net (residual blocks of conv-BN-ReLU, conv-BN, add, ReLU), the zoo's
``tiny_transformer``, and a 4-head net (two of those blocks, then four heads with one output each: there the
quantizers of different heads share ablation forwards, see ``profiler/sensitivity.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_sensitivity.py [--blocks 6] [--channels 32] [--size 64] [--batch 2]

The thread count printed is torch's intra-op thread count. Prints numbers only; there are no thresholds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + x)


class ResNetLike(nn.Module):
    def __init__(self, blocks: int, channels: int):
        super().__init__()
        from quantlens.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub(scale=1 / 128)
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Conv2d(channels, 4, 1)
        self.dequant = DeQuantStub()

    def forward(self, x):
        return self.dequant(self.head(self.blocks(self.stem(self.quant(x)))))


class MultiHead(nn.Module):
    """A detector-like net: a trunk of residual blocks and four heads (conv-BN-ReLU twice, a 1x1 conv), one
    output each."""

    def __init__(self, blocks: int, channels: int, heads: int = 4):
        super().__init__()
        from quantlens.quantization import DeQuantStub, QuantStub

        self.quant = QuantStub(scale=1 / 128)
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.heads = nn.ModuleList([nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 4, 1)) for _ in range(heads)])
        self.dequant = nn.ModuleList([DeQuantStub() for _ in range(heads)])

    def forward(self, x):
        y = self.blocks(self.stem(self.quant(x)))
        return tuple(dq(head(y)) for head, dq in zip(self.heads, self.dequant))


def _prepared_conv_net(model, args):
    from quantlens.quantization import FakeQuantState, prepare, set_fake_quantize
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    x = torch.rand(args.batch, 3, args.size, args.size) * 2 - 1
    calib = prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None)
    calib.eval()
    set_fake_quantize(calib, FakeQuantState.CALIBRATION)
    with torch.no_grad():
        calib(x)
    set_fake_quantize(calib, FakeQuantState.VALIDATION)
    return model, calib, (x,)


def _multihead(args):
    torch.manual_seed(0)
    return _prepared_conv_net(MultiHead(2, args.channels).eval(), args)


def _resnet(args):
    torch.manual_seed(0)
    return _prepared_conv_net(ResNetLike(args.blocks, args.channels).eval(), args)


def _transformer(args):
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
    from quantlens.zoo import example_inputs, get_model, sample_batches

    model = get_model("tiny_transformer")
    calib = prepare(model, example_inputs("tiny_transformer"), default_calibration_qconfig_setter,
                    check_result_dir=None)
    calibrate(calib, sample_batches("tiny_transformer", 3, 8))
    return model, calib, example_inputs("tiny_transformer", args.batch * 4)


#: the compute of these nets: what the "GEMM share" column counts
_GEMMS = {"conv1d", "conv2d", "conv3d", "linear", "matmul", "bmm", "scaled_dot_product_attention"}


class _GemmCount(torch.overrides.TorchFunctionMode):
    """Counts GEMM calls (convs, linears, matmuls, attention) made while it is on, whatever runs them."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _GEMMS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _gemm_calls(fn) -> int:
    with _GemmCount() as count:
        fn()
    return count.calls


def measure(name: str, model, calib, example, repeat: int) -> list:
    from quantlens.profiler import QuantAnalysis
    from quantlens.profiler import sensitivity as sensitivity_module
    from quantlens.profiler.model_access import AnalysisType
    from quantlens.profiler.torch_access import TorchModelAccess

    access = TorchModelAccess(calib, "analysis")
    n = len(access.quantizers(AnalysisType.FAKE_QUANT))
    for _ in range(3):
        access.run(example)  # warm-up
    times = []

    def forwards():
        # timed again between the sensitivity calls: on a shared machine the load drifts, and a ratio of two
        # bests measured side by side is what stays put
        for _ in range(5):
            t0 = time.perf_counter()
            access.run(example)
            times.append(time.perf_counter() - t0)

    forwards()
    results = {}
    with tempfile.TemporaryDirectory() as out:
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=out, progress=False)
        qa.set_bad_case(example)
        for label, cached in (("cached", True), ("full", False)):
            sensitivity_module._USE_CACHE = cached
            try:
                best = None
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    tables = qa.sensitivity(shard=False)
                    seconds = time.perf_counter() - t0
                    best = seconds if best is None else min(best, seconds)
                    forwards()
                gemms = _gemm_calls(lambda: qa.sensitivity(shard=False))
                results[label] = ([(r.op_name, r.sensitive_type, r.value) for t in tables for r in t], best, gemms)
            finally:
                sensitivity_module._USE_CACHE = True
    fwd = min(times)
    row = [name, n, f"{fwd * 1e3:.2f}"]
    for label in ("cached", "full"):
        seconds = results[label][1]
        row += [f"{seconds:.3f}", f"{seconds / (n * fwd):.3f}"]
    row.append("yes" if results["cached"][0] == results["full"][0] else "NO")
    # the GEMMs the cached path runs against N forwards' worth (the reference forward included): on a net whose
    # time is its GEMMs, the ratio no exact per-quantizer ablation can go below
    per_forward = _gemm_calls(lambda: access.run(example))
    row.append(f"{results['cached'][2]}/{n * per_forward} = {results['cached'][2] / (n * per_forward):.3f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="sensitivity() calls per path (the best counts)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
          f"ResNet-like: {args.blocks} residual blocks, {args.channels} ch at {args.size}x{args.size}, batch "
          f"{args.batch}; tiny_transformer: batch {args.batch * 4}")
    header = ["model", "N", "fwd ms", "cached s", "cached ratio", "full s", "full ratio", "same tables",
              "GEMM share (cached)"]
    widths = [18, 5, 8, 9, 13, 8, 11, 12, 22]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for name, build in (("ResNet-like", _resnet), ("tiny_transformer", _transformer), ("4-head net", _multihead)):
        row = measure(name, *build(args), repeat=args.repeat)
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))),
              flush=True)
    print("ratio: time(sensitivity) / (N x time(one forward)); cached: the default path; full: one full forward "
          "per quantizer (the old path). GEMM share: conv/linear/matmul/attention calls of one cached "
          "sensitivity() over N x those of one forward.")


if __name__ == "__main__":
    main()
