"""The table overrides of ``rms_norm`` and ``F.normalize`` (``int_rms_norm``, ``docs/march.md`` §13.7.1) and of the
L2 vector norm (``int_vector_norm``, §13.7.2), their call readers and float ops are in :mod:`..table_calls`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quantlens.kernels.norm_ops import int_rms_norm, int_vector_norm, normalize_constants, rms_norm_constants
from quantlens.march import rules
from quantlens.quantization.table_calls import arg, float_leaves, normalize_params, rms_norm_call, vector_norm_params
from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_overrides.gain_table import GainTable
from quantlens.quantization.table_overrides.report import probe_rows
from quantlens.quantization.table_registry import TableKind
from quantlens.sites.tracing_state import export_tracing

__all__ = ["RmsNormOverride", "NormalizeOverride", "VectorNormOverride"]

# -- the overrides ----------------------------------------------------------------------------------------------
class _NormTable(GainTable):
    """The RMS norm kernel's overrides (no mean)."""

    describe_suffix = ", no mean"

    def integer(self, q: torch.Tensor, normalized_ndim: int = 1) -> torch.Tensor:
        eps_term, shift, frac = (int(v) for v in self.params_q.tolist())
        return int_rms_norm(q, normalized_ndim, self.gain, self.bias, eps_term, frac, shift, self.output_dtype)

    def _run(self, x: torch.Tensor, fqs, out_fq, normalized_ndim: int) -> torch.Tensor:
        di, do = fqs[0].dtype, out_fq.dtype
        return torch.ops.quantlens.int_rms_norm(x, fqs[0].scale, out_fq.scale, self.gain, self.bias, self.params_q,
                                                normalized_ndim, di.qmin, di.qmax, do.qmin, do.qmax)


class RmsNormOverride(_NormTable):
    """Integer ``rms_norm`` (§13.7.1); ``weight_ref`` keeps the float gamma the constants were built from."""

    override_kind = TableKind.RMS_NORM

    kind = "rms_norm"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        n = int(math.prod(params["normalized_shape"]))
        self._store(rms_norm_constants(float(input_fqs[0].scale), float(output_fq.scale), input_fqs[0].dtype, n,
                                       weight, float(params["eps"])), weight=weight)
        self.normalized_ndim = len(params["normalized_shape"])

    def _call_params(self, call):
        shape, w, eps = rms_norm_call(call)
        return {"normalized_shape": shape, "eps": eps}, w, None

    def int_op(self, call, fqs, out_fq):
        shape, w, eps = rms_norm_call(call)
        if shape != tuple(self.params["normalized_shape"]):
            raise self._param_mismatch("normalized_shape", tuple(self.params["normalized_shape"]), shape)
        if eps != self.params["eps"]:
            raise self._param_mismatch("eps", self.params["eps"], eps)
        if not export_tracing():
            self._check_affine(w, None)
        return self._run(float_leaves(call)[0], fqs, out_fq, self.normalized_ndim)

    def error_steps(self):
        shape = tuple(self.params["normalized_shape"])
        w, _ = self._affine_refs()
        return self._probe_error(shape, lambda x: F.rms_norm(x, shape, w, float(self.params["eps"])))


class NormalizeOverride(_NormTable):
    """Integer ``F.normalize`` with p = 2 (§13.7.1): the RMS norm kernel over ``dim`` (moved last and back)."""

    override_kind = TableKind.NORMALIZE

    kind = "normalize"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        self._store(normalize_constants(float(input_fqs[0].scale), float(output_fq.scale), input_fqs[0].dtype,
                                        int(params["length"]), float(params["eps"])))

    def _call_params(self, call):
        params = normalize_params(call)
        if params is None:
            raise self._param_mismatch("p", 2, arg(call, 1, "p", 2.0))
        x = float_leaves(call)[0]
        return {**params, "length": int(x.shape[params["dim"]])}, None, None

    def int_op(self, call, fqs, out_fq):
        params, _, _ = self._call_params(call)
        for key in ("dim", "eps", "length"):
            if params[key] != self.params[key]:
                raise self._param_mismatch(key, self.params[key], params[key])
        x = float_leaves(call)[0]
        dim = params["dim"] % x.dim()
        last = dim == x.dim() - 1
        y = self._run(x if last else x.movedim(dim, -1), fqs, out_fq, 1)
        return y if last else y.movedim(-1, dim)

    def error_steps(self):
        eps = float(self.params["eps"])
        return self._probe_error((int(self.params["length"]),), lambda x: F.normalize(x, 2.0, -1, eps))


class VectorNormOverride(TableOverride):
    """Integer ``||x||_2`` (§13.7.2). Buffer ``params_q = [M, shift]``."""

    override_kind = TableKind.VECTOR_NORM

    kind = "vector_norm"

    def __init__(self, site, op_type, input_fqs, output_fq, params, weight=None, bias=None):
        super().__init__(site, op_type, input_fqs, output_fq, params)
        attrs = rules.vector_norm(input_fqs[0].scale, output_fq.scale, output_fq.dtype)
        self.register_buffer("params_q", torch.tensor([attrs["multiplier"], attrs["shift"]], dtype=torch.int64))

    def _call_params(self, call):
        params = vector_norm_params(call)
        if params is None:
            raise self._param_mismatch("ord", 2, arg(call, 1, "ord", None))
        return params, None, None

    def int_op(self, call, fqs, out_fq):
        params, _, _ = self._call_params(call)
        for key in ("dim", "keepdim"):
            if params[key] != self.params[key]:
                raise self._param_mismatch(key, self.params[key], params[key])
        di, do = fqs[0].dtype, out_fq.dtype
        return torch.ops.quantlens.int_vector_norm(float_leaves(call)[0], fqs[0].scale, out_fq.scale, self.params_q,
                                                   list(params["dim"]), bool(params["keepdim"]), di.qmin, di.qmax,
                                                   do.qmin, do.qmax)

    def error_steps(self):
        s_in, s_out = self.table_scales.tolist()
        q = probe_rows(self.input_dtypes[0], 64)
        m, shift = (int(v) for v in self.params_q.tolist())
        y = int_vector_norm(q, [-1], False, m, shift, self.output_dtype).to(torch.float64)
        exact = torch.linalg.vector_norm(q.to(torch.float64) * s_in, dim=-1) / s_out
        do = self.output_dtype
        return float((y - exact.clamp(do.qmin, do.qmax)).abs().max()), "probe"

    def describe(self):
        m, shift = self.params_q.tolist()
        return f"M={m}, shift={shift}, exact sum of squares, mantissa square root"
