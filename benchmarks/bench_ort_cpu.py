"""onnxruntime's int8 session against its float session and torch, on the ResNet-18 shape and all-MiniLM-L6-v2, and
the simulator's time (issue #45, ``docs/march_ort.md``).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ort_cpu.py [--nets resnet18 minilm] [--threads 1]

For each net (``bench_peers_nets.py``: the same nets, inputs and calibration data as the peer comparison), QL1
int8 template, calibrated: the quantized IR's run (the simulator), and onnxruntime at default options on

* the default ONNX form (``to_onnx``: QuantizeLinear, then Cast + Mul; the runtime computes in float),
* the standard QDQ form (``standard_qdq=True``: the runtime fuses its int8 kernels where it can),

and torch on the float net; medians of ``--repeat`` runs, each timed side by side in this one process, at
``--threads`` intra-op threads for torch and onnxruntime alike. Also the runtime's fused kernels (op types of its
optimized graph) and max |standard QDQ - quantized IR| over the outputs, as a share of max |y|.
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

from quantlens.compiler import convert, export, to_onnx  # noqa: E402
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


def _session(path: Path, threads: int, optimized: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _flat(y) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(y) if isinstance(t, torch.Tensor)]


def run_net(name: str, repeat: int, threads: int, out: Path) -> dict:
    import onnx

    net = build_net(name)
    prepared = prepare(net.model, net.args, default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)  # (third-party module code: the inputs are quantized where they are read)
    calibrate(prepared, net.calib)
    qat_ir = export(pre_export(prepared), net.args)
    quantized = convert(qat_ir)
    row = {"net": name, "batch": net.batch}
    feeds = {n: a.numpy() for n, a in zip(net.input_names, net.args)}
    for form, qdq in (("default", False), ("qdq", True)):
        path = to_onnx(qat_ir, out / f"{name}.{form}.onnx", standard_qdq=qdq)
        optimized = out / f"{name}.{form}.opt.onnx"
        sess = _session(path, threads, optimized)
        names = [i.name for i in sess.get_inputs()]
        inputs = dict(zip(names, feeds.values()))
        row[f"ort_{form}_ms"] = _median_ms(lambda: sess.run(None, inputs), repeat)
        if qdq:
            ops = collections.Counter(n.op_type for n in onnx.load(str(optimized)).graph.node)
            row["fused"] = {k: v for k, v in sorted(ops.items()) if k.startswith("QLinear") or k in (
                "QGemm", "MatMulIntegerToFloat", "FusedConv", "Conv", "MatMul", "Gemm")}
            y_ort = [torch.from_numpy(v) for v in sess.run(None, inputs)]
    with torch.no_grad():
        y_ir = _flat(quantized(*net.args))
        row["simulator_ms"] = _median_ms(lambda: quantized(*net.args), max(1, repeat // 2))
        row["torch_float_ms"] = _median_ms(lambda: net.model(*net.args), repeat)
    diffs = [float((a.float() - b.float()).abs().max()) / max(float(b.abs().max()), 1e-12)
             for a, b in zip(y_ort, y_ir) if a.shape == b.shape and a.numel()]
    row["qdq_vs_ir_max_share"] = max(diffs) if diffs else None
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
            print(f"{row['net']} (batch {row['batch']}): onnxruntime int8 QDQ {row['ort_qdq_ms']:.1f} ms, default form "
                  f"{row['ort_default_ms']:.1f} ms, torch float {row['torch_float_ms']:.1f} ms, simulator "
                  f"{row['simulator_ms']:.1f} ms; QDQ session / float-form session = "
                  f"{row['ort_qdq_ms'] / row['ort_default_ms']:.2f}; max |QDQ - quantized IR| = "
                  f"{row['qdq_vs_ir_max_share']:.2%} of max |y|; runtime kernels {row['fused']}")


if __name__ == "__main__":
    main()
