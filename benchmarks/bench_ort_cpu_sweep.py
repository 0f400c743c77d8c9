"""March.ORT_CPU over every zoo architecture (transformers' module code, tiny random configs): prepare, calibrate,
export, convert (which checks its assumed kernels against onnxruntime's optimized graph), then onnxruntime at its
default options on ``to_onnx``'s file against the quantized IR, at the outputs and at every fused kernel
(``compare_fused_ops``: from the two runs, and with the IR's node re-run on the runtime's own inputs).

Run: OMP_NUM_THREADS=1 .venv/bin/python -W ignore benchmarks/bench_ort_cpu_sweep.py [architecture ...]

One line per architecture: ``ok`` with the IR's runtime nodes, the share of output elements bit-equal, the fused
kernels compared and the elements that differ (same input / two runs), or ``FAIL`` with the error in one line.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from quantlens import March, set_march
from quantlens.compiler import convert, export, to_onnx
from quantlens.compiler.onnx.runtime_match import compare_fused_ops
from quantlens.errors import QuantLensError
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.architectures import build, list_architectures


def sweep_one(name: str, folder: Path) -> str:
    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, example, batches, _ = build(name)
        example = example if isinstance(example, tuple) else (example,)
        prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                           allow_no_stubs=True)
        calibrate(prepared, batches)
        qat_ir = export(pre_export(prepared), example)
        quantized = convert(qat_ir)
        path = to_onnx(qat_ir, folder / f"{name}.onnx")
    feeds = {k: v.numpy() for k, v in qat_ir.feeds(*example).items()}
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = quantized.run({k: torch.from_numpy(v) for k, v in feeds.items()})
    equal = [float((t == o.detach().numpy()).mean()) for t, o in zip(theirs, ours) if t.dtype.kind == "f"]
    checks = compare_fused_ops(quantized, path, {k: np.asarray(v) for k, v in feeds.items()})
    nodes = sum(1 for n in quantized.graph.nodes if n.attrs.get("runtime"))
    return (f"ok: {nodes} runtime nodes, {min(equal) if equal else 1.0:.2%} of the output elements bit-equal, "
            f"{len(checks)} fused kernels, {sum(c.same_input_differ for c in checks)} / "
            f"{sum(c.differ for c in checks)} elements differ (same input / two runs)")


def main() -> None:
    names = sys.argv[1:] or list_architectures()
    passed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            began = time.perf_counter()
            set_march(March.ORT_CPU)
            try:
                line = sweep_one(name, Path(tmp))
                passed += line.startswith("ok") and " 0 / 0 " in line and "100.00%" in line
            except (QuantLensError, RuntimeError, ValueError) as exc:
                line = f"FAIL: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            finally:
                set_march(March.QL1)
            print(f"{name:16s} {time.perf_counter() - began:5.1f} s  {line}", flush=True)
    print(f"# {passed} of {len(names)} architectures bit for bit at every output and fused kernel")


if __name__ == "__main__":
    main()
