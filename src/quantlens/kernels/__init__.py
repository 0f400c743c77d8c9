"""Integer kernels of the march: the table ops (``docs/march.md`` §13) and every op of the quantized IR.

One implementation of every integer step, used by ``pre_export`` (through the custom ops of
:mod:`quantlens.kernels.ops`), by the integer simulator (the quantized IR) and by the integer emulator of the
prepared model:

* :mod:`.tables`: the table formats (:class:`Table256`, :class:`SegmentedTable`), their construction and
  evaluation, and the two constant mantissa tables (reciprocal, rsqrt);
* :mod:`.int_ops`: the integer kernels (softmax, layer_norm, div, reciprocal) and the constants they need;
* :mod:`.log_softmax_ops`: the integer log_softmax (the softmax's exp sum, its ln by the ln mantissa table);
* :mod:`.functions`: the real functions the elementwise tables sample;
* :mod:`.ops`: ``torch.ops.quantlens.{lut, segment_lut, int_reciprocal, int_div, int_softmax, int_log_softmax,
  int_layer_norm, int_rms_norm, int_vector_norm}``;
* :mod:`.integer`: the integer kernel of every quantized IR op on tensors and attrs (:data:`INT_KERNELS`).

This package imports nothing above it: only :mod:`quantlens.march`, the base modules (errors, registries) and torch.
"""

from quantlens.kernels import ops as _ops  # noqa: F401  (registers the custom ops)
from quantlens.kernels.int_ops import (
    LayerNormConstants,
    div_multiplier,
    elementwise_table,
    exp_bits,
    exp_table_from,
    int_div,
    int_layer_norm,
    int_reciprocal,
    int_softmax,
    layer_norm_constants,
    layer_norm_frac_bits,
    recip_mantissa,
    reciprocal_multiplier,
    softmax_exp_table,
    softmax_multiplier,
)
from quantlens.kernels.int_rounding import bit_length, div_round_half_even, rshift_rhe_var
from quantlens.kernels.integer import INT_KERNELS, storage_dtype
from quantlens.kernels.log_softmax_ops import int_log_softmax
from quantlens.kernels.ops import TABLE_OP_IO, TableOpIO, dtype_from_range, table_torch_op
from quantlens.kernels.tables import (
    SegmentedTable,
    Table256,
    build_segmented_table,
    build_table256,
    ln_mantissa_table,
    lut256_lookup,
    minimax_segments,
    recip_mantissa_table,
    rsqrt_mantissa_table,
    segmented_lookup,
)
from quantlens.march.functions import ELEMENTWISE_OPS, TABLE_FUNCTIONS, TableFunction, real_function

__all__ = [
    "Table256",
    "SegmentedTable",
    "build_table256",
    "build_segmented_table",
    "minimax_segments",
    "lut256_lookup",
    "segmented_lookup",
    "recip_mantissa_table",
    "rsqrt_mantissa_table",
    "ln_mantissa_table",
    "ELEMENTWISE_OPS",
    "TABLE_FUNCTIONS",
    "TableFunction",
    "real_function",
    "elementwise_table",
    "exp_bits",
    "softmax_exp_table",
    "softmax_multiplier",
    "exp_table_from",
    "int_softmax",
    "int_log_softmax",
    "LayerNormConstants",
    "layer_norm_frac_bits",
    "layer_norm_constants",
    "int_layer_norm",
    "div_multiplier",
    "reciprocal_multiplier",
    "recip_mantissa",
    "int_div",
    "int_reciprocal",
    "rshift_rhe_var",
    "div_round_half_even",
    "bit_length",
    "dtype_from_range",
    "TABLE_OP_IO",
    "TableOpIO",
    "table_torch_op",
    "INT_KERNELS",
    "storage_dtype",
]
