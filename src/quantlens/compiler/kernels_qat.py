"""The qat IR's kernel table: what each qat IR node computes, in float.

A node whose op has a kernel here (:data:`QAT_KERNELS`: data movement with attrs, the march's tie order of
``topk``/``sort``, ``fake_quant``, host ops ...) runs it; any other calls the torch op that gives its op its meaning
(:mod:`quantlens.compiler.op_meanings`), so the qat IR computes exactly what the exported model computed. The
quantized IR's data-movement and host nodes run these kernels too (``kernels_int``).
"""

from __future__ import annotations

from typing import Any

import torch

from quantlens._registry import make_registry
from quantlens.compiler.graph import Node
from quantlens.compiler.host_ops import call_host_aten
from quantlens.compiler.op_meanings import torch_op_of
from quantlens.errors import QuantLensError
from quantlens.kernels.integer import call_op
from quantlens.march.numerics import fake_quant_range
from quantlens.march.semantics import select_by_attrs

__all__ = ["QAT_KERNELS", "qat_kernel", "qat_dispatch", "call_torch_op"]

#: qat IR op -> its kernel (``Node, inputs -> outputs``)
QAT_KERNELS, qat_kernel = make_registry("qat IR kernel for op")


def call_torch_op(torch_op, node: Node, inputs: list) -> Any:
    """Call an aten/custom op with the node's inputs (tensor schema args, in order) and attrs (the rest)."""
    return call_op(torch_op, node.attrs, inputs)


@qat_kernel("topk", "sort")
def _ordered(node: Node, inputs: list):
    return list(select_by_attrs(node.op, inputs[0], node.attrs))  # the march's tie order (docs/march.md §11.1)


@qat_kernel("host_aten")
def _host_aten(node: Node, inputs: list):
    return call_host_aten(node.attrs, inputs, node.site)


@qat_kernel("fake_quant")
def _fake_quant(node: Node, inputs: list):
    # numerics' function rather than the custom op: the same bits, without the op's dispatch in eager runs
    a = node.attrs
    return fake_quant_range(inputs[0], inputs[1], a["qmin"], a["qmax"], a.get("axis", -1))


@qat_kernel("split")
def _split(node: Node, inputs: list):
    return list(torch.split(inputs[0], node.attrs["sizes"], dim=node.attrs["dim"]))


@qat_kernel("slice")
def _slice(node: Node, inputs: list):
    a = node.attrs
    index = [slice(None)] * inputs[0].dim()
    index[a["dim"]] = slice(a["start"], a["end"], a["step"])
    return inputs[0][tuple(index)]


@qat_kernel("select")
def _select(node: Node, inputs: list):
    return inputs[0].select(node.attrs["dim"], node.attrs["index"])


@qat_kernel("index")
def _index(node: Node, inputs: list):
    return torch.ops.aten.index.Tensor(inputs[0], list(inputs[1:]))


@qat_kernel("embedding")
def _embedding(node: Node, inputs: list):
    """A table lookup; ids outside the table are refused by name (torch's own error is an IndexError that names
    neither the op site nor the input)."""
    table, ids = inputs[0], inputs[1]
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= table.shape[0]:
            bad = high if high >= table.shape[0] else low
            raise QuantLensError(
                f"op site '{node.site}' (embedding): id {bad} is outside the table of {table.shape[0]} rows; its "
                f"ids must lie in [0, {table.shape[0]}). Check the model input that feeds it (token ids from "
                "another tokenizer or vocabulary, or a mask passed in its place).")
    return torch.nn.functional.embedding(ids, table)


@qat_kernel("cast")
def _cast(node: Node, inputs: list):
    return inputs[0].to(getattr(torch, node.attrs["dtype"]))


def qat_dispatch(node: Node, inputs: list) -> Any:
    """Run one qat IR node: its own kernel (:data:`QAT_KERNELS`), else the torch op that gives it its meaning
    (:mod:`quantlens.compiler.op_meanings`)."""
    kernel = QAT_KERNELS.get(node.op)
    if kernel is not None:
        return kernel(node, inputs)
    torch_op = torch_op_of(node.op)
    if torch_op is None:
        raise QuantLensError(f"qat IR: no kernel for op '{node.op}' (op site '{node.site}').")
    return call_torch_op(torch_op, node, inputs)


@qat_kernel("pad")
def _pad(node: Node, inputs: list):
    a = node.attrs
    return torch.nn.functional.pad(inputs[0], a["pad"], mode=a["mode"],
                                   value=a["value"] if a["mode"] == "constant" else None)


@qat_kernel("batch_norm")
def _batch_norm(node: Node, inputs: list):
    x, weight, bias, mean, var = inputs
    return torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, node.attrs["eps"])
