"""The layer_norm table override: integer constants per normalized element and the mantissa rsqrt."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.kernels import int_layer_norm, layer_norm_constants
from quantlens.quantization.table_calls import float_leaves, layer_norm_call
from quantlens.quantization.table_overrides.base import input_grid
from quantlens.quantization.table_overrides.gain_table import GainTable
from quantlens.quantization.table_registry import TableKind
from quantlens.sites.tracing_state import export_tracing


class LayerNormOverride(GainTable):
    """Integer layer_norm. Buffers: ``gain``/``bias`` (int64 per normalized element), ``params_q`` =
    [eps_term, shift, frac_bits], and ``weight_ref``/``bias_ref`` (the float gamma/beta the constants were
    built from, to detect later changes)."""

    override_kind = TableKind.LAYER_NORM

    kind = "layer_norm"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        n = int(math.prod(params["normalized_shape"]))
        s_in, in_dtype = input_grid(input_fqs[0])  # channel-exponent codes: their common int16 grid (§3.1)
        if output_fq.scale.numel() not in (1, n) or (output_fq.scale.numel() > 1 and len(params["normalized_shape"]) > 1):
            raise QuantLensError(
                f"pre_export: op site '{site}' (layer_norm over {tuple(params['normalized_shape'])}) asks for a "
                f"per-channel output scale of {output_fq.scale.numel()} channels; the integer layer_norm writes one "
                "per element of a single normalized (last) dim (docs/march.md §3.1). Quantize its output per tensor.")
        c = layer_norm_constants(s_in, output_fq.scale, in_dtype, n, weight, bias, float(params["eps"]))
        self.normalized_ndim = len(params["normalized_shape"])
        self._store(c, weight=weight, bias=bias)

    def _call_params(self, call):
        shape, w, b, eps = layer_norm_call(call)
        return {"normalized_shape": shape, "eps": eps}, w, b

    def int_op(self, call, fqs, out_fq):
        shape, w, b, eps = layer_norm_call(call)
        if shape != tuple(self.params["normalized_shape"]):
            raise self._param_mismatch("normalized_shape", tuple(self.params["normalized_shape"]), shape)
        if eps != self.params["eps"]:
            raise self._param_mismatch("eps", self.params["eps"], eps)
        if not export_tracing():
            self._check_affine(w, b)
        x = float_leaves(call)[0]
        if tuple(x.shape[x.dim() - len(shape):]) != shape:
            raise QuantLensError(
                f"Op site '{self.site}' (layer_norm) normalizes the trailing dims {shape}, but its input has shape "
                f"{tuple(x.shape)}: the integer layer_norm normalizes the last {len(shape)} dim(s) of its input. "
                "Fix: call layer_norm on a tensor whose last dims are normalized_shape (permute the normalized "
                "axis last first), or give the module a forward of its own that does (it is then traced op by op)."
            )
        (s_in, di), do = fqs[0].read_grid(), out_fq.dtype  # channel-exponent codes: their common grid (§3.1)
        return torch.ops.quantlens.int_layer_norm(
            x, s_in, out_fq.scale, self.gain, self.bias, self.params_q, self.normalized_ndim,
            di.qmin, di.qmax, do.qmin, do.qmax,
        )

    def integer(self, q: torch.Tensor, normalized_ndim: int) -> torch.Tensor:
        eps_term, shift, frac = (int(v) for v in self.params_q.tolist())
        return int_layer_norm(q, normalized_ndim, self.gain, self.bias, eps_term, frac, shift, self.output_dtype)

    def error_steps(self):
        shape = tuple(self.params["normalized_shape"])
        w, b = self._affine_refs()
        return self._probe_error(shape, lambda x: F.layer_norm(x, shape, w, b, float(self.params["eps"])))
