"""onnxruntime's int8 session against its float session and torch, on the ResNet-18 shape and all-MiniLM-L6-v2, and
the simulator's time, under ``March.ORT_CPU`` (issue #45, ``docs/march_ort.md``).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ort_cpu.py [--nets resnet18 minilm] [--threads 1]

For each net (``bench_peers_nets.py``: the same nets, inputs and calibration data as the peer comparison), prepared
under ``set_march(March.ORT_CPU)`` with the int8 template and calibrated, then exported and converted (convert checks
its kernels against the runtime's); timed side by side in this one process, medians of ``--repeat`` runs at
``--threads`` intra-op threads for torch and onnxruntime alike:

* the **int8 session**: onnxruntime at default options on ``to_onnx``'s file (that march's QDQ form: the runtime
  fuses its int8 kernels);
* the **float session**: onnxruntime on the float net exported by ``torch.onnx.export``;
* torch on the float net, and the quantized IR's run (the **simulator** of the runtime's kernels).

Also the runtime's fused kernels, max |int8 session - quantized IR| over the outputs as a share of max |y|, the share
of output elements that are bit-equal, and the fused kernels' same-input check (``compare_fused_ops``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers_nets import build_net  # noqa: E402

from quantlens import March, set_march  # noqa: E402
from quantlens.compiler import convert, export, to_onnx  # noqa: E402
from quantlens.compiler.onnx.runtime_kernels import runtime_kernels  # noqa: E402
from quantlens.compiler.onnx.runtime_match import compare_fused_ops  # noqa: E402
from quantlens.quantization import calibrate, prepare  # noqa: E402
from quantlens.quantization.pre_export import pre_export  # noqa: E402
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter  # noqa: E402


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_net(name: str, repeat: int, threads: int, out: Path) -> dict:
    import numpy as np

    net = build_net(name)
    set_march(March.ORT_CPU)
    try:
        prepared = prepare(net.model, net.args, default_calibration_qconfig_setter, check_result_dir=None,
                           allow_no_stubs=True)  # (third-party module code: the inputs are quantized where read)
        calibrate(prepared, net.calib)
        qat_ir = export(pre_export(prepared), net.args)
        quantized = convert(qat_ir)
    finally:
        set_march(March.QL1)
    row = {"net": name, "batch": net.batch}
    feeds = {n: a.numpy() for n, a in zip(qat_ir.input_names, net.args)}
    path = to_onnx(qat_ir, out / f"{name}.int8.onnx")
    sess = _session(path, threads)
    row["ort_int8_ms"] = _median_ms(lambda: sess.run(None, feeds), repeat)
    y_ort = [torch.from_numpy(v) for v in sess.run(None, feeds)]
    row["fused"] = dict(sorted(collections.Counter(k.op_type for k in runtime_kernels(path) if k.integer).items()))
    float_path = out / f"{name}.float.onnx"
    torch.onnx.export(net.model, tuple(net.args), str(float_path), dynamo=True, input_names=list(net.input_names))
    float_sess = _session(float_path, threads)
    float_feeds = {i.name: a.numpy() for i, a in zip(float_sess.get_inputs(), net.args)}
    row["ort_float_ms"] = _median_ms(lambda: float_sess.run(None, float_feeds), repeat)
    with torch.no_grad():
        y_ir = quantized.run({k: torch.from_numpy(v) for k, v in feeds.items()})
        row["simulator_ms"] = _median_ms(lambda: quantized(*net.args), max(1, repeat // 2))
        row["torch_float_ms"] = _median_ms(lambda: net.model(*net.args), repeat)
    pairs = [(a, b) for a, b in zip(y_ort, y_ir) if a.shape == b.shape and a.numel()]
    row["max_share"] = max(float((a.double() - b.double()).abs().max()) / max(float(b.abs().max()), 1e-12)
                           for a, b in pairs)
    row["bit_equal"] = sum(int((a == b).sum()) for a, b in pairs) / sum(a.numel() for a, _ in pairs)
    checks = compare_fused_ops(quantized, path, {k: np.asarray(v) for k, v in feeds.items()})
    row["kernels_checked"] = len(checks)
    row["same_input_differ"] = sum(c.same_input_differ for c in checks)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["resnet18", "minilm"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from quantlens.march.ort_cpu import detect_variant

    print(f"# onnxruntime CPU kernel variant of this machine: {detect_variant().value}; {args.threads} thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.nets:
            row = run_net(name, args.repeat, args.threads, Path(tmp))
            print(f"{row['net']} (batch {row['batch']}): onnxruntime int8 {row['ort_int8_ms']:.1f} ms, onnxruntime float "
                  f"{row['ort_float_ms']:.1f} ms (int8 / float = {row['ort_int8_ms'] / row['ort_float_ms']:.2f}), "
                  f"torch float {row['torch_float_ms']:.1f} ms, simulator {row['simulator_ms']:.1f} ms; "
                  f"max |int8 session - quantized IR| = {row['max_share']:.2%} of max |y|, "
                  f"{row['bit_equal']:.2%} of the output elements bit-equal; {row['kernels_checked']} fused kernels, "
                  f"{row['same_input_differ']} elements differ on the same input; runtime kernels {row['fused']}")


if __name__ == "__main__":
    main()
