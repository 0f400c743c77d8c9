"""A model's fingerprint, stored in every trace (``trace.json``'s ``model_digest``), so that a trace reused
without running the model (``run(run_baseline_model=False)``, ``set_model_profiler_dir``) is refused when it was
made from another model.

Cheap by design (it runs on every ``run()``): per tensor of the state dict (weights and buffers) its name,
dtype, shape, sum and norm, plus the qconfig setter's name for a prepared model; an IR's
graph (its ops, op sites and attributes) and constants alike. Another model, other weights,
another qconfig or graph give another digest with overwhelming probability. An ONNX model: its serialized bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["model_digest"]


def _tensors(h, tensors) -> None:
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if not t.numel() or t.is_complex():
            continue
        t = t.detach()
        if t.is_floating_point():  # in the tensor's own dtype: no float64 copy of every weight on every run()
            h.update(f"{float(t.sum())!r}|{float(torch.linalg.vector_norm(t))!r}".encode())
        else:
            h.update(f"{int(t.to(torch.int64).sum())}".encode())


def model_digest(access: Any) -> str:
    """The fingerprint of the model behind a :class:`~.model_access.ModelAccess` ("" when it has none)."""
    h = hashlib.sha256()
    model = getattr(access, "model", None)
    module = getattr(access, "module", None)
    proto = getattr(access, "proto", None)
    if isinstance(model, torch.nn.Module):
        h.update(type(model).__name__.encode())
        state = getattr(model, "_quantlens_state", None)
        h.update(str(getattr(state, "setter_name", "")).encode())
        _tensors(h, model.state_dict(keep_vars=False).items())
    elif module is not None and hasattr(module, "graph"):
        for node in module.graph.nodes:
            h.update(f"{node.op}|{node.site}|{sorted((k, repr(v)) for k, v in node.attrs.items())}".encode())
        _tensors(h, sorted(getattr(module.graph, "constants", {}).items()))
    elif proto is not None:
        h.update(proto.SerializeToString(deterministic=True))
    else:
        return ""
    return h.hexdigest()
