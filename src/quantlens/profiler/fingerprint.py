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

from quantlens.errors import QuantLensError

__all__ = ["model_digest", "callable_digest", "check_made_from"]


def _tensors(h, tensors, exact: bool = False) -> None:
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if exact:  # every byte (a resumed sensitivity must not replay values of a model one weight away)
            from quantlens.profiler.trace.stats import input_digest

            h.update(input_digest(t).encode())
            continue
        if not t.numel() or t.is_complex():
            continue
        t = t.detach()
        if t.is_floating_point():  # in the tensor's own dtype: no float64 copy of every weight on every run()
            h.update(f"{float(t.sum())!r}|{float(torch.linalg.vector_norm(t))!r}".encode())
        else:
            h.update(f"{int(t.to(torch.int64).sum())}".encode())


def model_digest(access: Any, exact: bool = False) -> str:
    """The fingerprint of the model behind a :class:`~.model_access.ModelAccess` ("" when it has none);
    ``exact``: every tensor's bytes rather than its sums (slower: for progress files, not for every trace)."""
    h = hashlib.sha256()
    model = getattr(access, "model", None)
    module = getattr(access, "module", None)
    proto = getattr(access, "proto", None)
    if isinstance(model, torch.nn.Module):
        h.update(type(model).__name__.encode())
        state = getattr(model, "_quantlens_state", None)
        h.update(str(getattr(state, "setter_name", "")).encode())
        _tensors(h, model.state_dict(keep_vars=False).items(), exact)
    elif module is not None and hasattr(module, "graph"):
        for node in module.graph.nodes:
            h.update(f"{node.op}|{node.site}|{sorted((k, repr(v)) for k, v in node.attrs.items())}".encode())
        _tensors(h, sorted(getattr(module.graph, "constants", {}).items()), exact)
    elif proto is not None:
        h.update(proto.SerializeToString(deterministic=True))
    else:
        return ""
    return h.hexdigest()


def callable_digest(func: Any) -> str:
    """A fingerprint of a callable (a ``post_process``): its qualified name and code (bytecode, constants, names,
    recursively into nested functions), and a module's state; "" for None. Another function, or the same one
    edited, gives another digest."""
    if func is None:
        return ""
    h = hashlib.sha256()
    target = getattr(func, "func", func)  # functools.partial
    h.update(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
             .encode())
    code = getattr(target, "__code__", None) or getattr(getattr(type(target), "forward", None), "__code__", None) \
        or getattr(getattr(type(target), "__call__", None), "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                stack.append(const)
            else:
                h.update(repr(const).encode())
    if isinstance(target, torch.nn.Module):
        _tensors(h, target.state_dict().items(), exact=True)
    for arg in getattr(func, "args", ()):  # a partial's bound arguments
        h.update(repr(arg).encode())
    return h.hexdigest()


def check_made_from(trace: Any, access: Any, folder: Any) -> None:
    """Refuse a trace (a :class:`~.trace.reader.TraceReader`) reused without running its model when it was made
    from another model than ``access``'s."""
    if trace.model_digest and trace.model_digest != model_digest(access):
        raise QuantLensError(
            f"The trace in {folder} was made from another model ({trace.description}) than this "
            f"QuantAnalysis' {access.label} model ({access.describe()}): its weights, buffers, qconfig or graph "
            "differ. Run that model again (qa.run()), or give the trace of this very model.")
