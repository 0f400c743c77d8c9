"""What each IR op means: the torch op whose float semantics a qat IR node of that op has.

One static table, declared here and read by everyone who needs an op's meaning: the lowering (a rule may only emit
an op whose meaning is declared), the qat kernels (a node without a kernel of its own calls its torch op with its
inputs and attrs), the integer kernels of data movement, and the loader's arity and shape checks (the op's schema).
Nothing adds to it while a graph is lowered or run, so a process that only loads and runs a saved IR knows exactly
what one that exported it knows.

pre_export's table ops (``quantlens::lut``, ``int_softmax`` ...) are not listed: their meaning is their custom op
in :mod:`quantlens.kernels.ops`, found by name (:func:`torch_op_of` covers both).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

import quantlens.march.numerics  # noqa: F401  (registers torch.ops.quantlens.fake_quant, read below)
from quantlens.kernels import TABLE_OP_IO, table_torch_op

__all__ = ["TORCH_OPS", "torch_op_of"]

aten = torch.ops.aten

#: IR op name -> the torch op whose float semantics it has (read-only: a new op is declared here, in this order:
#: GEMMs, elementwise, normalisation and reductions, pools and resizes, data movement, masks, quantizer, the rest)
TORCH_OPS: Mapping[str, torch._ops.OpOverload] = MappingProxyType({
    "conv2d": aten.conv2d.default,
    "conv1d": aten.conv1d.default,
    "conv_transpose1d": aten.conv_transpose1d.default,
    "conv_transpose2d": aten.conv_transpose2d.input,
    "linear": aten.linear.default,
    "matmul": aten.matmul.default,
    "sdpa": aten.scaled_dot_product_attention.default,
    "embedding": aten.embedding.default,
    "add": aten.add.Tensor,
    "sub": aten.sub.Tensor,
    "mul": aten.mul.Tensor,
    "div": aten.div.Tensor,
    "relu": aten.relu.default,
    "sigmoid": aten.sigmoid.default,
    "tanh": aten.tanh.default,
    "silu": aten.silu.default,
    "exp": aten.exp.default,
    "reciprocal": aten.reciprocal.default,
    "rsqrt": aten.rsqrt.default,
    "sqrt": aten.sqrt.default,
    "neg": aten.neg.default,
    "abs": aten.abs.default,
    "erf": aten.erf.default,
    "log": aten.log.default,
    "gelu": aten.gelu.default,
    "softplus": aten.softplus.default,
    "clamp": aten.clamp.default,
    "hardtanh": aten.hardtanh.default,
    "pow": aten.pow.Tensor_Scalar,
    "hardswish": aten.hardswish.default,
    "hardsigmoid": aten.hardsigmoid.default,
    "elu": aten.elu.default,
    "where": aten.where.self,
    "masked_fill": aten.masked_fill.Scalar,
    "layer_norm": aten.layer_norm.default,
    "softmax": aten.softmax.int,
    "log_softmax": aten.log_softmax.int,
    "mean": aten.mean.dim,
    "sum": aten.sum.dim_IntList,
    "cumsum": aten.cumsum.default,
    "amax": aten.amax.default,
    "max_dim": aten.max.dim,
    "argmax": aten.argmax.default,
    "topk": aten.topk.default,
    "sort": aten.sort.default,
    "max_pool2d": aten.max_pool2d.default,
    "avg_pool2d": aten.avg_pool2d.default,
    "adaptive_avg_pool2d": aten.adaptive_avg_pool2d.default,
    "adaptive_avg_pool1d": aten.adaptive_avg_pool1d.default,
    "upsample_nearest2d": aten.upsample_nearest2d.vec,
    "upsample_bilinear2d": aten.upsample_bilinear2d.vec,
    "max_pool1d": aten.max_pool1d.default,
    "avg_pool1d": aten.avg_pool1d.default,
    "upsample_nearest1d": aten.upsample_nearest1d.vec,
    "gather": aten.gather.default,
    "index_select": aten.index_select.default,
    "pixel_shuffle": aten.pixel_shuffle.default,
    "pixel_unshuffle": aten.pixel_unshuffle.default,
    "flip": aten.flip.default,
    "reshape": aten.reshape.default,
    "permute": aten.permute.default,
    "cat": aten.cat.default,
    "expand": aten.expand.default,
    "eq": aten.eq.Tensor,
    "ne": aten.ne.Tensor,
    "lt": aten.lt.Tensor,
    "le": aten.le.Tensor,
    "gt": aten.gt.Tensor,
    "ge": aten.ge.Tensor,
    "logical_not": aten.logical_not.default,
    "logical_and": aten.logical_and.default,
    "logical_or": aten.logical_or.default,
    "fake_quant": torch.ops.quantlens.fake_quant.default,
    "prelu": aten.prelu.default,
    "leaky_relu": aten.leaky_relu.default,
    "fill": aten.fill.Scalar,
    "select_scatter": aten.select_scatter.default,
    "slice_scatter": aten.slice_scatter.default,
})


def torch_op_of(op: str) -> torch._ops.OpOverload | None:
    """The torch op that gives IR op ``op`` its meaning: its :data:`TORCH_OPS` entry, or a table op's custom op;
    ``None`` for an op whose meaning is a kernel of its own (``split``, ``slice``, ``host_aten`` ...)."""
    torch_op = TORCH_OPS.get(op)
    if torch_op is None and op in TABLE_OP_IO:  # (their custom ops register when quantlens.kernels is imported)
        torch_op = table_torch_op(op)
    return torch_op
