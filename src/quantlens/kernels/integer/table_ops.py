"""Table ops (``docs/march.md`` §13) on their codes: the integer kernels ``pre_export``'s custom ops run
(:mod:`quantlens.kernels.ops`), without their quantize/dequantize round trips (exact: the values lie on the
grids).

Every table op has a reference kernel (:data:`REFERENCE_TABLE_KERNELS`: the custom op itself, on the
dequantized inputs, its result quantized again) and, for the ops of :data:`_DIRECT_TABLE`, a direct kernel on the
codes (the one registered in :data:`~.core.INT_KERNELS`).
"""

from __future__ import annotations

from typing import Callable

import torch

from quantlens.kernels.int_ops import exp_table_from, int_div, int_layer_norm, int_reciprocal, int_softmax
from quantlens.kernels.integer.aten_call import call_op
from quantlens.kernels.integer.core import int_kernel, storage_dtype
from quantlens.kernels.integer.param_cache import prepared
from quantlens.kernels.log_softmax_ops import int_log_softmax
from quantlens.kernels.norm_ops import int_rms_norm
from quantlens.kernels.ops import TABLE_OP_IO, dtype_from_range, table_torch_op
from quantlens.kernels.tables import lut256_lookup, segmented_lookup
from quantlens.march import QuantDType
from quantlens.march.numerics import dequantize, quantize

__all__ = ["REFERENCE_TABLE_KERNELS", "reference_table_kernel", "direct_table_kernel"]


def _qdtype_from_range(qmin: int) -> QuantDType:
    return {-128: QuantDType.qint8, -32768: QuantDType.qint16}[qmin]


def reference_table_kernel(op: str) -> Callable:
    """Table op ``op`` as pre_export runs it: integers in, dequantized at the input scales (exact), the op's
    custom op, and the result re-quantized at the output scale (exact: it lies on that grid)."""

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        torch_op = table_torch_op(op)
        io = TABLE_OP_IO[op]
        n_data = len(attrs["table_inputs"])
        schema_tensors = [a.name for a in torch_op._schema.arguments if str(a.type).startswith("Tensor")]
        data, rest = inputs[:n_data], inputs[n_data:]
        by_name = dict(zip([n for n in schema_tensors if n not in attrs["table_inputs"]], rest))
        scale_of = dict(zip(io.data, io.scales))
        for name, q in zip(attrs["table_inputs"], data):
            by_name[name] = dequantize(q, by_name[scale_of[name]])
        call_attrs = {k: v for k, v in attrs.items() if k != "table_inputs"}
        out = call_op(torch_op, call_attrs, [by_name[n] for n in schema_tensors])
        out_dtype = _qdtype_from_range(attrs["out_qmin"])
        return quantize(out, by_name["scale_out"], out_dtype, storage=storage_dtype(out_dtype.value))

    return kernel


#: the integer kernel of each table op on its codes, as its custom op (``quantlens.kernels.ops``) calls it, minus
#: the custom op's quantize/dequantize: ``(codes, constants by schema name, attrs, derived) -> output codes``;
#: ``derived`` is a per-call-site dict for values made from the constants (kept while they are unchanged).
def _direct_lut(q, c, a, derived):
    entries = derived.get("entries")
    if entries is None:
        # the output range applied to the 256 entries once instead of to every output (same values), stored in
        # the output's storage type: the gather is the whole kernel
        out = _qdtype_from_range(a["out_qmin"])
        entries = derived["entries"] = c["table"].to(torch.int64).clamp(a["out_qmin"], a["out_qmax"]).clamp(
            out.qmin, out.qmax).to(storage_dtype(out.value))
    if q.dtype != torch.int8:
        return lut256_lookup(q, entries.to(torch.int64), 128)
    return torch.take(entries, q.to(torch.int64).add_(128))


def _direct_segment_lut(q, c, a, derived):
    return segmented_lookup(q[0], c["bounds"], c["shifts"], c["entries"], a["frac_bits"], a["out_qmin"],
                            a["out_qmax"], c["tails"])


def _params(c, name="params"):
    return [int(v) for v in c[name].tolist()]


def _direct_reciprocal(q, c, a, derived):
    multiplier, shift = _params(c)
    return int_reciprocal(q[0], multiplier, shift, dtype_from_range(a["out_qmin"], a["out_qmax"]))


def _direct_div(q, c, a, derived):
    multiplier, shift = _params(c)
    return int_div(q[0], q[1], multiplier, shift, dtype_from_range(a["out_qmin"], a["out_qmax"]))


def _exp_table_site(c, a, derived):
    """(exp table, params, out_dtype) of a softmax / log_softmax call, made once per constants."""
    prepared_site = derived.get("exp")
    if prepared_site is None:
        out_dtype = dtype_from_range(a["out_qmin"], a["out_qmax"])
        table = exp_table_from(c["exp_bounds"], c["exp_shifts"], c["exp_entries"], c["exp_tails"],
                               a["exp_frac_bits"], out_dtype)
        prepared_site = derived["exp"] = (table, _params(c), out_dtype)
    return prepared_site


def _direct_softmax(q, c, a, derived):
    table, (multiplier, shift), out_dtype = _exp_table_site(c, a, derived)
    return int_softmax(q[0], a["dim"], table, multiplier, shift, out_dtype)


def _direct_log_softmax(q, c, a, derived):
    table, (multiplier, ln_multiplier, shift), out_dtype = _exp_table_site(c, a, derived)
    return int_log_softmax(q[0], a["dim"], table, multiplier, ln_multiplier, shift, out_dtype)


def _direct_layer_norm(q, c, a, derived):
    params = derived.get("params")
    if params is None:
        params = derived["params"] = _params(c)
    eps_term, shift, frac_bits = params
    return int_layer_norm(q[0], a["normalized_ndim"], c["gain"], c["bias"], eps_term, frac_bits, shift,
                          dtype_from_range(a["out_qmin"], a["out_qmax"]))


def _direct_rms_norm(q, c, a, derived):
    eps_term, shift, frac_bits = _params(c)
    return int_rms_norm(q[0], a["normalized_ndim"], c["gain"], c["bias"], eps_term, frac_bits, shift,
                        dtype_from_range(a["out_qmin"], a["out_qmax"]))


_DIRECT_TABLE = {"lut": lambda q, c, a, d: _direct_lut(q[0], c, a, d), "segment_lut": _direct_segment_lut,
                 "int_reciprocal": _direct_reciprocal, "int_div": _direct_div, "int_softmax": _direct_softmax,
                 "int_log_softmax": _direct_log_softmax,
                 "int_layer_norm": _direct_layer_norm, "int_rms_norm": _direct_rms_norm}


class _TableSite:
    """A table call's schema split, prepared from its attrs: data inputs (with their quantize range), the
    constant inputs by schema name, and the output type; and the constants of its last call with what the
    direct kernel made from them."""

    def __init__(self, op: str, attrs: dict):
        torch_op = table_torch_op(op)
        io = TABLE_OP_IO[op]
        self.n_data = len(attrs["table_inputs"])
        schema_tensors = [a.name for a in torch_op._schema.arguments if str(a.type).startswith("Tensor")]
        self.const_names = [n for n in schema_tensors if n not in attrs["table_inputs"]]
        self.attrs = {k: v for k, v in attrs.items() if k != "table_inputs"}
        self.out = _qdtype_from_range(attrs["out_qmin"])
        self.storage = storage_dtype(self.out.value)
        ranges = {"x": ("in_qmin", "in_qmax")} if len(io.data) == 1 else {"x": ("x_qmin", "x_qmax"),
                                                                            "y": ("y_qmin", "y_qmax")}
        self.ranges = [(attrs.get(ranges.get(n, ("", ""))[0], -128), attrs.get(ranges.get(n, ("", ""))[1], 127))
                       for n in attrs["table_inputs"]]
        self.ok = list(attrs["table_inputs"]) == list(io.data)
        self.consts: tuple | None = None  # (inputs, versions, by name)
        self.derived: dict = {}  # what a kernel made from the constants (reset when they change)

    def constants(self, rest: list) -> dict:
        cached = self.consts
        if cached is not None and len(cached[0]) == len(rest) and all(
                a is b and a._version == v for a, b, v in zip(cached[0], rest, cached[1])):
            return cached[2]
        by_name = dict(zip(self.const_names, rest))
        self.consts = (list(rest), [t._version for t in rest], by_name)
        self.derived = {}
        return by_name


_STORAGE_RANGE = {torch.int8: (-128, 127), torch.int16: (-32768, 32767)}


def direct_table_kernel(op: str, reference: Callable) -> Callable:
    """Table op ``op`` on its codes: the very integer kernel pre_export's custom op runs, on the codes it would
    quantize (its dequantize-quantize round trips are exact: the values lie on the grids). ``reference``: the
    kernel of the calls it does not take (an unexpected schema split, a non-tensor input)."""
    direct = _DIRECT_TABLE[op]
    saturated_entries = op == "lut"  # (its entries carry the output range already)

    def build(attrs: dict) -> _TableSite:
        return _TableSite(op, attrs)

    def kernel(inputs: list, attrs: dict, site: str = "") -> torch.Tensor:
        s = prepared(attrs, build)
        if not s.ok or any(not isinstance(t, torch.Tensor) for t in inputs):
            return reference(inputs, attrs, site)
        data = []
        for q, (lo, hi) in zip(inputs[:s.n_data], s.ranges):
            if _STORAGE_RANGE.get(q.dtype) != (lo, hi):  # the custom op's quantize saturates to the input range
                q = torch.clamp(q.to(torch.int64), lo, hi)
            data.append(q)
        consts = s.constants(inputs[s.n_data:])
        out = direct(data, consts, s.attrs, s.derived)
        if out.dtype == s.storage and saturated_entries:
            return out
        return torch.clamp(out, s.out.qmin, s.out.qmax).to(s.storage)

    return kernel


#: table IR op -> its reference kernel (the custom op on dequantized inputs)
REFERENCE_TABLE_KERNELS: dict[str, Callable] = {op: reference_table_kernel(op) for op in TABLE_OP_IO}

for _op in TABLE_OP_IO:
    int_kernel(_op)(direct_table_kernel(_op, REFERENCE_TABLE_KERNELS[_op]) if _op in _DIRECT_TABLE
                    else REFERENCE_TABLE_KERNELS[_op])
