"""On the zoo models' own QDQ files, every fused int8 kernel onnxruntime runs (default options) is recomputed bit for
bit by quantlens' kernels of the runtime on the inputs the runtime gave it (``compiler/onnx/runtime_check.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from quantlens.compiler import export, to_onnx  # noqa: E402
from quantlens.compiler.onnx.runtime_check import check_runtime_kernels  # noqa: E402
from quantlens.quantization import calibrate, prepare  # noqa: E402
from quantlens.quantization.pre_export import pre_export  # noqa: E402
from quantlens.zoo import example_inputs, get_model, sample_batches  # noqa: E402

#: the fused kernels each model's file runs today (QL1's template), at least
EXPECTED = {
    "tiny_resnet": {"QLinearConv", "QLinearConcat", "QLinearGlobalAveragePool", "QGemm"},
    "tiny_transformer": {"QGemm", "QLinearMatMul"},
    "multitask": {"QLinearGlobalAveragePool", "QGemm"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fused_kernel_of_a_zoo_model_is_recomputed_bit_for_bit(tmp_path, name):
    torch.manual_seed(0)
    calib = prepare(get_model(name), example_inputs(name), check_result_dir=None)
    calibrate(calib, sample_batches(name, 2, 4))
    qat_ir = export(pre_export(calib), example_inputs(name))
    path = to_onnx(qat_ir, tmp_path / f"{name}.onnx", standard_qdq=True)
    example = example_inputs(name)
    feeds = {k: v.numpy() for k, v in qat_ir.feeds(*(example if isinstance(example, tuple) else (example,))).items()}
    checks = check_runtime_kernels(path, feeds)
    assert EXPECTED[name] <= {c.op_type for c in checks}
    assert [c for c in checks if c.differ != 0] == []
    assert sum(c.elements for c in checks) > 0
