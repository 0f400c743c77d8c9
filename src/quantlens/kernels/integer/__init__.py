"""Integer kernels of the quantized IR: the bit-exact simulator of ``docs/march.md``, on tensors and plain
parameters.

Every kernel is ``kernel(inputs, attrs, site="") -> Tensor`` (a list for ops with several outputs): ``inputs``
the integer tensors (int8/int16/int32 storage; int64 for indices) and constants, ``attrs`` the op's parameters
(a quantized IR node's attrs; the emulator builds the same dicts with :mod:`quantlens.march.rules`), ``site`` the
op site, for messages only. :data:`INT_KERNELS` maps each IR op to its kernel; the quantized IR's interpreter
calls them through a thin adapter (``quantlens.compiler.kernels_int``), and the integer emulator of
``quantlens.quantization`` calls them directly.

GEMMs and pooling sums are computed in float32/float64 on integer operands, exactly (every partial sum stays
below 2**24 / 2**53), so independent of summation order and thread count; results are then rounded/saturated
with the functions of :mod:`quantlens.march.numerics`, which implement the spec's rules once. Requantize
parameters live in attrs: ``multiplier``/``shift`` (lists: one entry per tensor, or per channel along ``axis``)
and the output type's ``out_dtype``.

Modules, by family: :mod:`.requantize` (quantize, dequantize, requantize), :mod:`.gemm` (conv, conv_transpose,
linear, matmul), :mod:`.elementwise` (add, sub, add_const, cat, mul, scale, clamp, abs, neg, masked_fill,
channel_affine, prelu), :mod:`.reduce` (sum, average pools), :mod:`.resize` (bilinear, nearest),
:mod:`.movement` (relu, max pools, pad, fill, scatters, topk/sort/max_dim), :mod:`.table_ops` (the table ops of
§13); :mod:`.param_cache` holds the caches of prepared parameters. :mod:`.ort_cpu` holds the kernels of the nodes
``convert`` lowers under ``March.ORT_CPU`` (attrs ``runtime: "ort_cpu"``, :data:`RUNTIME_KERNELS`).
"""

from quantlens.kernels.integer import elementwise, gemm, movement, reduce, requantize, resize, table_ops  # noqa: F401
from quantlens.kernels.integer.aten_call import MOVEMENT_OPS, call_op
from quantlens.kernels.integer.core import INT_KERNELS, int_kernel, storage_dtype
from quantlens.kernels.integer.ort_cpu import ORT_CPU_KERNELS
from quantlens.kernels.integer.table_ops import REFERENCE_TABLE_KERNELS

#: a node's ``runtime`` attr -> the kernels of that runtime march (``March.ORT_CPU``: :mod:`.ort_cpu`)
RUNTIME_KERNELS = {"ort_cpu": ORT_CPU_KERNELS}

__all__ = ["INT_KERNELS", "int_kernel", "storage_dtype", "REFERENCE_TABLE_KERNELS", "call_op", "MOVEMENT_OPS",
           "RUNTIME_KERNELS"]
