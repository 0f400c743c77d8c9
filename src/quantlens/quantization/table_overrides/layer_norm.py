"""The layer_norm table override: integer constants per normalized element and the mantissa rsqrt."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantlens.errors import QuantLensError
from quantlens.kernels import int_layer_norm, layer_norm_constants
from quantlens.quantization.table_calls import float_leaves, layer_norm_call
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_overrides.report import PROBE_ROWS, probe_rows
from quantlens.quantization.table_registry import TableKind
from quantlens.sites.tracing_state import export_tracing


class LayerNormOverride(TableOverride):
    """Integer layer_norm. Buffers: ``gain``/``bias`` (int64 per normalized element), ``params_q`` =
    [eps_term, shift, frac_bits], and ``weight_ref``/``bias_ref`` (the float gamma/beta the constants were
    built from, to detect later changes)."""

    override_kind = TableKind.LAYER_NORM

    kind = "layer_norm"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        n = int(math.prod(params["normalized_shape"]))
        c = layer_norm_constants(float(input_fqs[0].scale), float(output_fq.scale), input_fqs[0].dtype, n,
                                 weight, bias, float(params["eps"]))
        self.normalized_ndim = len(params["normalized_shape"])
        self.register_buffer("gain", c.gain)
        self.register_buffer("bias", c.bias)
        self.register_buffer("params_q", torch.tensor([c.eps_term, c.shift, c.frac_bits], dtype=torch.int64))
        ref = lambda t: torch.empty(0) if t is None else t.detach().to(torch.float32).clone()  # noqa: E731
        self.register_buffer("weight_ref", ref(weight))
        self.register_buffer("bias_ref", ref(bias))

    def _call_params(self, call):
        shape, w, b, eps = layer_norm_call(call)
        return {"normalized_shape": shape, "eps": eps}, w, b

    def _same_affine(self, weight, bias):
        return all((now is None and ref.numel() == 0) or (
            now is not None and now.shape == ref.shape and torch.equal(now.detach().to(ref), ref))
            for now, ref in ((weight, self.weight_ref), (bias, self.bias_ref)))

    def int_op(self, call, fqs, out_fq):
        shape, w, b, eps = layer_norm_call(call)
        if shape != tuple(self.params["normalized_shape"]):
            raise self._param_mismatch("normalized_shape", tuple(self.params["normalized_shape"]), shape)
        if eps != self.params["eps"]:
            raise self._param_mismatch("eps", self.params["eps"], eps)
        if not export_tracing():
            for name, now, ref in (("weight", w, self.weight_ref), ("bias", b, self.bias_ref)):
                same = (now is None and ref.numel() == 0) or (
                    now is not None and now.shape == ref.shape and torch.equal(now.detach().to(ref), ref))
                if not same:
                    raise QuantLensError(
                        f"The layer_norm {name} of op site '{self.site}' changed after pre_export (its integer "
                        "constants were built from the old values). Run pre_export again on the updated model."
                    )
        x = float_leaves(call)[0]
        if tuple(x.shape[x.dim() - len(shape):]) != shape:
            raise QuantLensError(
                f"Op site '{self.site}' (layer_norm) normalizes the trailing dims {shape}, but its input has shape "
                f"{tuple(x.shape)}: the integer layer_norm normalizes the last {len(shape)} dim(s) of its input. "
                "Fix: call layer_norm on a tensor whose last dims are normalized_shape (permute the normalized "
                "axis last first), or give the module a forward of its own that does (it is then traced op by op)."
            )
        di, do = fqs[0].dtype, out_fq.dtype
        return torch.ops.quantlens.int_layer_norm(
            x, fqs[0].scale, out_fq.scale, self.gain, self.bias, self.params_q, self.normalized_ndim,
            di.qmin, di.qmax, do.qmin, do.qmax,
        )

    def integer(self, q: torch.Tensor) -> torch.Tensor:
        eps_term, shift, frac = (int(v) for v in self.params_q.tolist())
        return int_layer_norm(q, self.normalized_ndim, self.gain, self.bias, eps_term, frac, shift,
                              self.output_dtype)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        shape = tuple(self.params["normalized_shape"])
        n = int(math.prod(shape))
        q = probe_rows(self.input_dtypes[0], n).reshape(PROBE_ROWS, *shape).to(self.table_scales.device)
        y = self.integer(q).to(torch.float64)
        w = self.weight_ref.to(torch.float64) if self.weight_ref.numel() else None
        b = self.bias_ref.to(torch.float64) if self.bias_ref.numel() else None
        exact = F.layer_norm(q.to(torch.float64) * s_in, shape, w, b, float(self.params["eps"])) / s_out
        do = self.output_dtype
        return float((y - exact.clamp(do.qmin, do.qmax)).abs().max()), "probe"

    def entry_count(self):
        return int(self.gain.numel() + self.bias.numel())

    def describe(self):
        eps_term, shift, frac = self.params_q.tolist()
        return f"N={self.gain.numel()}, P={frac}, eps_term={eps_term}, shift={shift}, mantissa rsqrt"
