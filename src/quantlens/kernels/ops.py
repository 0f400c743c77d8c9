"""Float-facing entry points of the table ops: ``torch.library`` custom ops (one ``torch.export`` node each).

Each op takes the fake-quantized float input(s), the scales of the fake quants that produced them and of the
output, and the site's tables and integer constants as tensors. It quantizes the input (exact: the input is
on its grid), runs the integer kernel of :mod:`quantlens.kernels.int_ops` and dequantizes the result. There
is no autograd formula: pre_export models are for evaluation, and ``backward`` through them raises.

==========================  ===========================================================================
op                          integer kernel
==========================  ===========================================================================
``quantlens::lut``          256-entry table on an int8 input (``Table256``, offset 128)
``quantlens::segment_lut``  segmented table on an int16 input (``SegmentedTable``)
``quantlens::int_reciprocal`` ``1 / x`` on an int16 input by the mantissa rule
``quantlens::int_div``      ``x / y`` by the mantissa reciprocal of ``y``
``quantlens::int_softmax``  softmax: exp table, sum, mantissa reciprocal, requantize
``quantlens::int_log_softmax`` log_softmax: exp table, sum, its ln by mantissa and exponent, one rounded shift
``quantlens::int_layer_norm`` layer norm: mean, variance, mantissa rsqrt, per-channel gain and bias
``quantlens::int_rms_norm``   RMS norm and L2 normalization: the layer norm without the mean
``quantlens::int_vector_norm`` L2 norm: exact sum of squares, mantissa square root, 31-bit requantize
==========================  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlens.kernels.int_ops import exp_table_from, int_div, int_layer_norm, int_reciprocal, int_softmax
from quantlens.kernels.log_softmax_ops import int_log_softmax
from quantlens.kernels.norm_ops import int_rms_norm, int_vector_norm
from quantlens.kernels.tables import lut256_lookup, segmented_lookup
from quantlens.march import QuantDType
from quantlens.march.numerics import dequantize, quantize

__all__ = ["dtype_from_range", "TableOpIO", "TABLE_OP_IO", "table_torch_op"]


@dataclass(frozen=True)
class TableOpIO:
    """How a graph carries one table op: its data inputs and the scale input of each (schema names), and the
    float op it emulates, which a runtime without the march's tables computes instead (``reference``: read from
    the node's ``attrs["reference"]``; otherwise a fixed op)."""

    data: tuple[str, ...]
    scales: tuple[str, ...]
    float_op: str = ""  #: fixed float op (softmax, div, reciprocal); "" when attrs["reference"] names it
    float_attrs: tuple[str, ...] = ()  #: the node attrs the fixed float op reads (softmax's dim)


#: every table op of :mod:`quantlens.kernels.ops`, by its ``torch.ops.quantlens`` name (= its IR op name).
TABLE_OP_IO: dict[str, TableOpIO] = {
    "lut": TableOpIO(("x",), ("scale_in",)),
    "segment_lut": TableOpIO(("x",), ("scale_in",)),
    "int_reciprocal": TableOpIO(("x",), ("scale_in",), "reciprocal"),
    "int_softmax": TableOpIO(("x",), ("scale_in",), "softmax", ("dim",)),
    "int_log_softmax": TableOpIO(("x",), ("scale_in",), "log_softmax", ("dim",)),
    "int_layer_norm": TableOpIO(("x",), ("scale_in",)),
    "int_div": TableOpIO(("x", "y"), ("scale_x", "scale_y"), "div"),
    "int_rms_norm": TableOpIO(("x",), ("scale_in",)),
    "int_vector_norm": TableOpIO(("x",), ("scale_in",)),
}


def table_torch_op(name: str):
    """The ``torch.ops.quantlens`` overload of table op ``name`` (registered when this module is imported, so
    a saved IR runs in a new process without lowering having run)."""
    return getattr(torch.ops.quantlens, name).default


def dtype_from_range(qmin: int, qmax: int) -> QuantDType:
    """The integer type with range ``[qmin, qmax]`` (int8, uint8, int16)."""
    return QuantDType.of_range(qmin, qmax)


def _q(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    return quantize(x, scale, dtype_from_range(qmin, qmax))


def _dq(y: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # a per-channel output scale (a norm writing channel exponents, docs/march.md §3.1) runs along the last dim
    return dequantize(y, scale, y.dim() - 1 if scale.numel() > 1 else None).to(like.dtype)


# --- 256-entry table ------------------------------------------------------------------------------------------


@torch.library.custom_op("quantlens::lut", mutates_args=())
def _lut(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, table: torch.Tensor,
         out_qmin: int, out_qmax: int) -> torch.Tensor:
    q = _q(x, scale_in, -128, 127)
    return _dq(lut256_lookup(q, table, 128).clamp(out_qmin, out_qmax), scale_out, x)


@_lut.register_fake
def _(x, scale_in, scale_out, table, out_qmin, out_qmax):
    return torch.empty_like(x)


# --- segmented table ------------------------------------------------------------------------------------------


@torch.library.custom_op("quantlens::segment_lut", mutates_args=())
def _segment_lut(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, bounds: torch.Tensor,
                 shifts: torch.Tensor, entries: torch.Tensor, tails: torch.Tensor, frac_bits: int, in_qmin: int,
                 in_qmax: int, out_qmin: int, out_qmax: int) -> torch.Tensor:
    q = _q(x, scale_in, in_qmin, in_qmax)
    return _dq(segmented_lookup(q, bounds, shifts, entries, frac_bits, out_qmin, out_qmax, tails), scale_out, x)


@_segment_lut.register_fake
def _(x, scale_in, scale_out, bounds, shifts, entries, tails, frac_bits, in_qmin, in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


# --- reciprocal and div ---------------------------------------------------------------------------------------


@torch.library.custom_op("quantlens::int_reciprocal", mutates_args=())
def _int_reciprocal(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, params: torch.Tensor,
                    in_qmin: int, in_qmax: int, out_qmin: int, out_qmax: int) -> torch.Tensor:
    multiplier, shift = (int(v) for v in params.tolist())  # params = [M, shift]
    q = _q(x, scale_in, in_qmin, in_qmax)
    return _dq(int_reciprocal(q, multiplier, shift, dtype_from_range(out_qmin, out_qmax)), scale_out, x)


@_int_reciprocal.register_fake
def _(x, scale_in, scale_out, params, in_qmin, in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


@torch.library.custom_op("quantlens::int_div", mutates_args=())
def _int_div(x: torch.Tensor, y: torch.Tensor, scale_x: torch.Tensor, scale_y: torch.Tensor,
             scale_out: torch.Tensor, params: torch.Tensor, x_qmin: int, x_qmax: int, y_qmin: int, y_qmax: int,
             out_qmin: int, out_qmax: int) -> torch.Tensor:
    multiplier, shift = (int(v) for v in params.tolist())
    qx = _q(x, scale_x, x_qmin, x_qmax)
    qy = _q(y, scale_y, y_qmin, y_qmax)
    out = int_div(qx, qy, multiplier, shift, dtype_from_range(out_qmin, out_qmax))
    return _dq(out, scale_out, x)


@_int_div.register_fake
def _(x, y, scale_x, scale_y, scale_out, params, x_qmin, x_qmax, y_qmin, y_qmax, out_qmin, out_qmax):
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape))


# --- softmax --------------------------------------------------------------------------------------------------


@torch.library.custom_op("quantlens::int_softmax", mutates_args=())
def _int_softmax(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, exp_bounds: torch.Tensor,
                 exp_shifts: torch.Tensor, exp_entries: torch.Tensor, exp_tails: torch.Tensor, params: torch.Tensor,
                 dim: int, exp_frac_bits: int, in_qmin: int, in_qmax: int, out_qmin: int,
                 out_qmax: int) -> torch.Tensor:
    """``exp_bounds`` empty: ``exp_entries`` is a 256-entry table indexed by ``d + 255`` (int8 input);
    ``params = [M, shift]``."""
    multiplier, shift = (int(v) for v in params.tolist())
    out_dtype = dtype_from_range(out_qmin, out_qmax)
    table = exp_table_from(exp_bounds, exp_shifts, exp_entries, exp_tails, exp_frac_bits, out_dtype)
    q = _q(x, scale_in, in_qmin, in_qmax)
    return _dq(int_softmax(q, dim, table, multiplier, shift, out_dtype), scale_out, x)


@_int_softmax.register_fake
def _(x, scale_in, scale_out, exp_bounds, exp_shifts, exp_entries, exp_tails, params, dim, exp_frac_bits, in_qmin,
      in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


@torch.library.custom_op("quantlens::int_log_softmax", mutates_args=())
def _int_log_softmax(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, exp_bounds: torch.Tensor,
                     exp_shifts: torch.Tensor, exp_entries: torch.Tensor, exp_tails: torch.Tensor,
                     params: torch.Tensor, dim: int, exp_frac_bits: int, in_qmin: int, in_qmax: int, out_qmin: int,
                     out_qmax: int) -> torch.Tensor:
    """The softmax's exp table (as ``int_softmax``); ``params = [M_x, M_l, T]`` (``march.rules.log_softmax``)."""
    multiplier, ln_multiplier, shift = (int(v) for v in params.tolist())
    out_dtype = dtype_from_range(out_qmin, out_qmax)
    table = exp_table_from(exp_bounds, exp_shifts, exp_entries, exp_tails, exp_frac_bits, out_dtype)
    q = _q(x, scale_in, in_qmin, in_qmax)
    return _dq(int_log_softmax(q, dim, table, multiplier, ln_multiplier, shift, out_dtype), scale_out, x)


@_int_log_softmax.register_fake
def _(x, scale_in, scale_out, exp_bounds, exp_shifts, exp_entries, exp_tails, params, dim, exp_frac_bits, in_qmin,
      in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


# --- layer norm -----------------------------------------------------------------------------------------------


@torch.library.custom_op("quantlens::int_layer_norm", mutates_args=())
def _int_layer_norm(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, gain: torch.Tensor,
                    bias: torch.Tensor, params: torch.Tensor, normalized_ndim: int, in_qmin: int, in_qmax: int,
                    out_qmin: int, out_qmax: int) -> torch.Tensor:
    """``params = [eps_term, shift, frac_bits]``; ``gain``/``bias`` per normalized element."""
    return _normalized(int_layer_norm, x, scale_in, scale_out, gain, bias, params, normalized_ndim, in_qmin,
                       in_qmax, out_qmin, out_qmax)


def _normalized(kernel, x, scale_in, scale_out, gain, bias, params, normalized_ndim, in_qmin, in_qmax, out_qmin,
                out_qmax) -> torch.Tensor:
    """The table ops of the layer-norm family: the input's codes through ``kernel``, dequantized."""
    eps_term, shift, frac_bits = (int(v) for v in params.tolist())
    q = _q(x, scale_in, in_qmin, in_qmax)
    out = kernel(q, normalized_ndim, gain, bias, eps_term, frac_bits, shift, dtype_from_range(out_qmin, out_qmax))
    return _dq(out, scale_out, x)


@_int_layer_norm.register_fake
def _(x, scale_in, scale_out, gain, bias, params, normalized_ndim, in_qmin, in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


# --- RMS norm, L2 normalization, L2 norm -----------------------------------------------------------------------


@torch.library.custom_op("quantlens::int_rms_norm", mutates_args=())
def _int_rms_norm(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, gain: torch.Tensor,
                  bias: torch.Tensor, params: torch.Tensor, normalized_ndim: int, in_qmin: int, in_qmax: int,
                  out_qmin: int, out_qmax: int) -> torch.Tensor:
    """As ``int_layer_norm`` without the mean: ``params = [eps_term, shift, frac_bits]``."""
    return _normalized(int_rms_norm, x, scale_in, scale_out, gain, bias, params, normalized_ndim, in_qmin, in_qmax,
                       out_qmin, out_qmax)


@_int_rms_norm.register_fake
def _(x, scale_in, scale_out, gain, bias, params, normalized_ndim, in_qmin, in_qmax, out_qmin, out_qmax):
    return torch.empty_like(x)


@torch.library.custom_op("quantlens::int_vector_norm", mutates_args=())
def _int_vector_norm(x: torch.Tensor, scale_in: torch.Tensor, scale_out: torch.Tensor, params: torch.Tensor,
                     dim: list[int], keepdim: bool, in_qmin: int, in_qmax: int, out_qmin: int,
                     out_qmax: int) -> torch.Tensor:
    """``||x||_2`` over ``dim`` (empty: every dim); ``params = [M, shift]``."""
    multiplier, shift = (int(v) for v in params.tolist())
    q = _q(x, scale_in, in_qmin, in_qmax)
    out = int_vector_norm(q, list(dim), keepdim, multiplier, shift, dtype_from_range(out_qmin, out_qmax))
    return _dq(out, scale_out, x)


@_int_vector_norm.register_fake
def _(x, scale_in, scale_out, params, dim, keepdim, in_qmin, in_qmax, out_qmin, out_qmax):
    return x.sum(dim=list(dim) or list(range(x.dim())), keepdim=keepdim)
