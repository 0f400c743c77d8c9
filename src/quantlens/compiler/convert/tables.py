"""pre_export's table ops: their integer tables become constants of the quantized IR."""

from __future__ import annotations

from quantlens.compiler.convert.state import (
    converter,
    fq_dtype,
)
from quantlens.errors import QuantLensError
from quantlens.kernels import TABLE_OP_IO, table_torch_op
from quantlens.march import rules

#: table ops of pre_export (``torch.ops.quantlens.*``): their data inputs and scale inputs (one declaration,
#: ``quantlens.kernels.TABLE_OP_IO``)
TABLE_OPS = {name: (io.data, io.scales) for name, io in TABLE_OP_IO.items()}


@converter(*TABLE_OPS)
def _table_op(c, node):
    """A table op takes integers at its input scales and yields integers at ``scale_out``; its integer kernel
    is the same function pre_export runs (``quantlens.kernels``), so both are bit-identical."""
    import torch as _torch

    schema = table_torch_op(node.op)._schema
    tensor_args = [a.name for a in schema.arguments if str(a.type).startswith("Tensor")]
    by_name = dict(zip(tensor_args, node.inputs))
    data_args, scale_args = TABLE_OPS[node.op]
    inputs = []
    for arg, scale_arg in zip(data_args, scale_args):
        info = c.int_input(node, by_name[arg])
        expected = c.src.constants[by_name[scale_arg]].to(_torch.float32)
        if not info.same_grid(info.qdtype, expected):
            raise QuantLensError(
                f"convert: table op '{node.op}' at op site '{node.site}' was built for input scale "
                f"{float(expected.reshape(-1)[0]):.6g} but its input has scale {float(info.scale.reshape(-1)[0]):.6g}; "
                "re-run pre_export after calibration."
            )
        inputs.append(info.name)
    others = [
        c.const(c.src.constants[by_name[a]], f"{node.outputs[0]}_{a}") if by_name[a] else ""
        for a in tensor_args if a not in data_args
    ]
    qdtype = fq_dtype(node.attrs, "out_")
    out_scale = c.src.constants[by_name["scale_out"]].to(_torch.float32)
    axis = None
    if out_scale.numel() > 1:  # a norm writing channel exponents along its last dim (§3.1; its gain per element)
        rules.channel_exponents(out_scale)  # refused unless in exponent form
        axis = len(c.src.values[node.outputs[0]].shape) - 1
    c.emit(node, node.op, inputs + others, {**node.attrs, "table_inputs": list(data_args)}, qdtype, out_scale, axis)
    c.q[node.outputs[0]].exponents = axis is not None
