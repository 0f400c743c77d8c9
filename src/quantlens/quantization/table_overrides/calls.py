"""Reading a table op call's arguments (module attributes or function-call arguments); shared with
:mod:`quantlens.quantization.table_registry`."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from quantlens.errors import QuantLensError
from quantlens.quantization.overrides import OverrideCall
from quantlens.quantization.tracer import is_float_tensor


def _float_leaves(call: OverrideCall) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves((call.args, call.kwargs)) if is_float_tensor(x)]


def _arg(call: OverrideCall, position: int, name: str, default: Any) -> Any:
    if name in call.kwargs:
        return call.kwargs[name]
    if len(call.args) > position:
        return call.args[position]
    return default


def _softmax_call(call: OverrideCall, site: str) -> tuple[int, torch.dtype | None]:
    if call.module is not None:
        dim, dtype = call.module.dim, None
    else:
        dim = _arg(call, 1, "dim", None)
        dtype = call.kwargs.get("dtype")
        if dtype is None and len(call.args) > 2 and isinstance(call.args[2], torch.dtype):
            dtype = call.args[2]
    if dim is None:
        raise QuantLensError(
            f"Op site '{site}': softmax without an explicit dim cannot be computed by table. Pass dim= "
            "(e.g. torch.softmax(x, dim=-1))."
        )
    return int(dim), dtype


def _layer_norm_call(call: OverrideCall):
    """(normalized_shape, weight, bias, eps) of a layer_norm call (module or function)."""
    m = call.module
    if m is not None:
        return tuple(m.normalized_shape), m.weight, m.bias, float(m.eps)
    shape = _arg(call, 1, "normalized_shape", None)
    shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return shape, _arg(call, 2, "weight", None), _arg(call, 3, "bias", None), float(_arg(call, 4, "eps", 1e-5))
