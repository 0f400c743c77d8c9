"""Every fused int8 kernel onnxruntime runs for the peer nets' QDQ files (QL1's int8 calibration template),
recomputed on its own inputs by quantlens' kernels of the runtime (``compiler/onnx/runtime_check.py``).

Run: OMP_NUM_THREADS=2 .venv/bin/python -W ignore benchmarks/check_ort_kernels.py minilm resnet18
Prints, per net, ``{(kernel, elements that differ): count}`` and the elements checked.
"""
import collections
import sys
import tempfile

sys.path.insert(0, "benchmarks")
from bench_peers_nets import build_net

from quantlens.compiler import export, to_onnx
from quantlens.compiler.onnx.runtime_check import check_runtime_kernels
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.pre_export import pre_export
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

for name in sys.argv[1:]:
    net = build_net(name)
    p = prepare(net.model, net.args, default_calibration_qconfig_setter, check_result_dir=None, allow_no_stubs=True)
    calibrate(p, net.calib)
    q = export(pre_export(p), net.args)
    path = to_onnx(q, tempfile.mktemp(suffix=".onnx"), standard_qdq=True)
    feeds = {k: v.numpy() for k, v in q.feeds(*net.args).items()}
    checks = check_runtime_kernels(path, feeds)
    by = collections.Counter((c.op_type, c.differ) for c in checks)
    print(name, dict(by), "elements", sum(c.elements for c in checks))
