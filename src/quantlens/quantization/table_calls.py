"""Reading a table op call: its arguments (module attributes or function-call arguments), the parameters its
tables are built for, and the float op the prepared model computes. The table-op registry
(:mod:`.table_registry`) and the overrides (:mod:`.table_overrides`) both read calls through these."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.quantization.overrides import OverrideCall
from quantlens.sites.tracer import is_float_tensor

__all__ = ["float_leaves", "arg", "softmax_call", "layer_norm_call", "rms_norm_call", "normalize_params",
           "vector_norm_params", "rms_norm_site", "normalize_site", "rms_norm_float", "normalize_float",
           "vector_norm_float"]


def float_leaves(call: OverrideCall) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves((call.args, call.kwargs)) if is_float_tensor(x)]


def arg(call: OverrideCall, position: int, name: str, default: Any) -> Any:
    if name in call.kwargs:
        return call.kwargs[name]
    if len(call.args) > position:
        return call.args[position]
    return default


def softmax_call(call: OverrideCall, site: str) -> tuple[int, torch.dtype | None]:
    if call.module is not None:
        dim, dtype = call.module.dim, None
    else:
        dim = arg(call, 1, "dim", None)
        dtype = call.kwargs.get("dtype")
        if dtype is None and len(call.args) > 2 and isinstance(call.args[2], torch.dtype):
            dtype = call.args[2]
    if dim is None:
        raise QuantLensError(
            f"Op site '{site}': softmax without an explicit dim cannot be computed by table. Pass dim= "
            "(e.g. torch.softmax(x, dim=-1))."
        )
    return int(dim), dtype


def layer_norm_call(call: OverrideCall):
    """(normalized_shape, weight, bias, eps) of a layer_norm call (module or function)."""
    m = call.module
    if m is not None:
        return tuple(m.normalized_shape), m.weight, m.bias, float(m.eps)
    shape = arg(call, 1, "normalized_shape", None)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return shape, arg(call, 2, "weight", None), arg(call, 3, "bias", None), float(arg(call, 4, "eps", 1e-5))


#: ``F.rms_norm``'s ``eps=None`` is ``torch.finfo(x.dtype).eps``; the tables are built for float32 inputs
_DEFAULT_RMS_EPS = float(torch.finfo(torch.float32).eps)


# -- reading the calls -------------------------------------------------------------------------------------------
def rms_norm_call(call) -> tuple[tuple[int, ...], Any, float]:
    """(normalized_shape, weight, eps) of an rms_norm call (``nn.RMSNorm`` or ``F.rms_norm``)."""
    m = call.module
    if m is not None:
        return tuple(m.normalized_shape), m.weight, _DEFAULT_RMS_EPS if m.eps is None else float(m.eps)
    shape = arg(call, 1, "normalized_shape", None)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape or ())
    eps = arg(call, 3, "eps", None)
    return shape, arg(call, 2, "weight", None), _DEFAULT_RMS_EPS if eps is None else float(eps)


def normalize_params(call) -> dict | None:
    """``F.normalize(x, p, dim, eps)``: ``{"dim", "eps"}``, or None (not a table op) for ``p != 2``."""
    p = arg(call, 1, "p", 2.0)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or float(p) != 2.0:
        return None
    return {"dim": int(arg(call, 2, "dim", 1)), "eps": float(arg(call, 3, "eps", 1e-12))}


def vector_norm_params(call) -> dict | None:
    """``torch.linalg.vector_norm(x, ord, dim, keepdim)`` / ``torch.norm(x, p, dim, keepdim)``: ``{"dim",
    "keepdim"}`` (``dim`` a list, empty for every dim), or None (not a table op) for another order or a dtype."""
    order = arg(call, 1, "ord" if "ord" in call.kwargs else "p", 2 if call.op_type == "linalg_vector_norm" else "fro")
    if call.kwargs.get("dtype") is not None or len(call.args) > 4:
        return None
    if order != "fro" and (isinstance(order, bool) or not isinstance(order, (int, float)) or float(order) != 2.0):
        return None
    dim = arg(call, 2, "dim", None)
    dims = [] if dim is None else [int(dim)] if isinstance(dim, int) else [int(d) for d in dim]
    return {"dim": dims, "keepdim": bool(arg(call, 3, "keepdim", False))}


def rms_norm_site(rec, module, call):
    if module is not None:
        shape, weight, eps = rms_norm_call(_ModuleCall(module))
        return {"normalized_shape": shape, "eps": eps}, weight, None
    if call is None:
        raise QuantLensError(
            f"pre_export: op site '{rec.name}' calls rms_norm as a function (at {rec.source}); its normalized shape, "
            "weight and eps are only known when it runs. Pass example inputs: pre_export(model, example_inputs=...), "
            "or use an nn.RMSNorm module.")
    shape, weight, eps = rms_norm_call(call)
    return {"normalized_shape": shape, "eps": eps}, weight, None


def normalize_site(rec, module, call):
    params = normalize_params(call) if call is not None else {"dim": 1, "eps": 1e-12}
    if params is None:
        return None, None, None
    shape = rec.inputs[0].shape
    if not shape:
        raise QuantLensError(f"pre_export: op site '{rec.name}' (normalize, at {rec.source}) has a 0-d input.")
    return {**params, "length": int(shape[params["dim"]])}, None, None


class _ModuleCall:
    def __init__(self, module):
        self.module, self.args, self.kwargs = module, (), {}


def rms_norm_float(call, site: str) -> Any:
    shape, weight, eps = rms_norm_call(call)
    return F.rms_norm(float_leaves(call)[0], shape, weight, eps)


def normalize_float(call, site: str) -> Any:
    return F.normalize(*call.args, **call.kwargs)


def vector_norm_float(call, site: str) -> Any:
    return call.func(*call.args, **call.kwargs)
