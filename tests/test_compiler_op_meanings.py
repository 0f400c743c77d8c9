"""The compiler's op meanings are one static table (``quantlens.compiler.op_meanings``) that the lowering, the
interpreter and the loader read; lowering a graph adds nothing to it, so a process that only loads a saved IR knows
what an exporting one knows."""

import pytest
import torch
from torch import nn

from quantlens.compiler import export
from quantlens.compiler.lowering import TORCH_OPS
from quantlens.kernels import TABLE_OP_IO
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter


def test_lowering_a_table_op_leaves_the_op_meanings_as_declared():
    before = dict(TORCH_OPS)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    example = (torch.linspace(-2, 2, 8).reshape(2, 4),)
    prepared = prepare(model, example, default_calibration_qconfig_setter, check_result_dir=None,
                       allow_no_stubs=True)
    ir = export(calibrate(prepared, [example]), example)  # pre_export: the sigmoid becomes a lookup table
    assert {n.op for n in ir.graph.nodes} & set(TABLE_OP_IO), [n.op for n in ir.graph.nodes]
    from quantlens.compiler.lowering import TORCH_OPS as after

    assert dict(after) == before
    with pytest.raises(TypeError):  # read-only: a new meaning is declared in op_meanings, never added at run time
        after["lut"] = torch.ops.quantlens.lut.default
