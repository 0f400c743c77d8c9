"""What a measured value depends on, beyond the tensors a search is given: the caller's ``evaluate`` (its code,
the file it is written in, the tensors and modules it reads), the float model's code, the base setter's
assignments, and the float model's fingerprint that ``remedies.json`` carries.

A resumed search replays a measurement only when all of these are what they were: another ``evaluate``, the same
one edited, or one that reads other evaluation data must measure again, not replay the first run's values.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["hash_tree", "evaluate_identity", "model_code_identity", "setter_identity", "float_model_digest",
           "data_digest"]

#: how deep the identity of ``evaluate`` follows what it reads (closures, defaults, globals, attributes)
_DEPTH = 6


def _hash_tensor(h, t: torch.Tensor) -> None:
    h.update(f"T{t.dtype}{tuple(t.shape)}{t.layout}".encode())
    try:
        t = t.detach().cpu().contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    except (RuntimeError, TypeError, NotImplementedError):  # sparse, quantized, meta: their values have no bytes
        h.update(repr(t).encode())


def hash_tree(h, obj: Any) -> None:
    """Feed ``obj`` (tensors, dicts, lists, tuples, plain values) into the hash ``h``: every tensor's bytes."""
    if isinstance(obj, torch.Tensor):
        _hash_tensor(h, obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"K{k!s}".encode())
            hash_tree(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for item in obj:
            hash_tree(h, item)
    else:
        h.update(repr(obj).encode())


def data_digest(data: Any) -> str:
    """A digest of ``data`` (batches: tensors in lists, tuples, dicts) by every tensor's bytes."""
    h = hashlib.sha256()
    hash_tree(h, data)
    return h.hexdigest()


class _Identity:
    """Hashes a callable and what it reads; each object once (cycles, shared data)."""

    def __init__(self):
        self.h = hashlib.sha256()
        self.seen: set[int] = set()
        self.files: set[str] = set()

    def code(self, code: types.CodeType) -> None:
        stack = [code]
        while stack:
            c = stack.pop()
            self.h.update(c.co_code)
            self.h.update(repr(c.co_names).encode())
            for const in c.co_consts:
                if isinstance(const, types.CodeType):
                    stack.append(const)
                else:
                    self.h.update(repr(const).encode())
            self.source_file(c.co_filename)

    def source_file(self, filename: str) -> None:
        """The bytes of the file a function is written in: an edit anywhere in it (the data it builds, a helper
        it calls) may change what the function computes."""
        if filename in self.files:
            return
        self.files.add(filename)
        try:
            self.h.update(Path(filename).read_bytes())
        except OSError:  # "<stdin>", "<string>", a file since removed: its code above still counts
            self.h.update(filename.encode())

    def value(self, obj: Any, depth: int) -> None:
        """What ``obj`` contributes: tensors by their bytes, modules by their state and code, callables by their
        code; plain Python values (counters, flags) by nothing, so that an ``evaluate`` that counts its calls
        still resumes."""
        if depth > _DEPTH or isinstance(obj, (str, bytes, int, float, bool, type(None), type, types.ModuleType)):
            return
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _hash_tensor(self.h, obj)
        elif isinstance(obj, nn.Module):
            self.h.update(model_code_identity(obj).encode())
            hash_tree(self.h, dict(obj.state_dict()))
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                self.h.update(f"K{k!s}".encode())
                self.value(obj[k], depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj if not isinstance(obj, (set, frozenset)) else sorted(obj, key=repr):
                self.value(item, depth + 1)
        elif callable(obj):
            self.callable(obj, depth + 1)
        elif hasattr(obj, "__array__") and hasattr(obj, "tobytes"):  # a numpy array
            self.h.update(f"A{getattr(obj, 'dtype', '')}{getattr(obj, 'shape', '')}".encode() + obj.tobytes())
        elif hasattr(obj, "__dict__"):
            self.value(dict(vars(obj)), depth + 1)

    def callable(self, fn: Any, depth: int) -> None:
        if isinstance(fn, functools.partial):
            self.value(fn.args, depth)
            self.value(fn.keywords, depth)
            fn = fn.func
        if isinstance(fn, types.MethodType):
            self.value(fn.__self__, depth)
            fn = fn.__func__
        if isinstance(fn, types.FunctionType):
            self.h.update(f"F{fn.__module__}.{fn.__qualname__}".encode())
            self.code(fn.__code__)
            for cell in fn.__closure__ or ():
                try:
                    self.value(cell.cell_contents, depth)
                except ValueError:  # an empty cell (a name assigned after the function was made)
                    continue
            self.value(fn.__defaults__, depth)
            self.value(fn.__kwdefaults__, depth)
            for name in _global_names(fn.__code__):
                if name in fn.__globals__:
                    self.value(fn.__globals__[name], depth)
            return
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self.h.update(f"B{getattr(fn, '__qualname__', repr(fn))}".encode())
            return
        # a callable object: its class's __call__ and its attributes
        call = getattr(type(fn), "__call__", None)
        self.h.update(f"O{type(fn).__module__}.{type(fn).__qualname__}".encode())
        if isinstance(call, types.FunctionType):
            self.callable(call, depth)
        if hasattr(fn, "__dict__"):
            self.value(dict(vars(fn)), depth + 1)


def _global_names(code: types.CodeType) -> list[str]:
    names, stack = [], [code]
    while stack:
        c = stack.pop()
        names += c.co_names
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return sorted(set(names))


def evaluate_identity(evaluate: Any) -> str:
    """A digest of what decides ``evaluate``'s value besides the model it is given: its qualified name and code
    (recursively into nested functions), the bytes of the files that code is written in, and the tensors,
    modules and functions it reads (closure, defaults, globals, a partial's arguments, a method's object).
    Plain Python values it reads (a call counter, a flag) are not part of it; data read from other files is not
    either (a search's ``evaluation_key`` names that)."""
    ident = _Identity()
    ident.callable(evaluate, 0)
    return ident.h.hexdigest()


def model_code_identity(model: nn.Module) -> str:
    """A digest of the code of every module class in ``model`` (their ``forward``): another forward computes
    other values from the same weights."""
    h = hashlib.sha256()
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        if code is not None:
            h.update(code.co_code + repr(code.co_names).encode() + repr(code.co_consts).encode())
        else:
            try:
                h.update(inspect.getsource(cls).encode())
            except (OSError, TypeError):
                continue
    return h.hexdigest()


def setter_identity(setter: Any, prepared: nn.Module) -> str:
    """The base setter in a progress file's fingerprint: its name and what it gave every op site (dtype,
    observer and its options, axis), so another mapping under the same name does not replay old measurements."""
    plans = getattr(getattr(prepared, "_quantlens_state", None), "plans", {})
    given = []
    for name, plan in plans.items():
        qc = plan.qconfig
        specs = [] if qc is None else [getattr(qc, part, None) for part in ("input", "weight", "output")]
        given.append(f"{name}:" + "|".join("-" if spec is None else spec.describe() for spec in specs))
    return getattr(setter, "name", repr(setter)) + "#" + "\n".join(given)


def float_model_digest(model: nn.Module) -> str:
    """The float model's fingerprint (the profiler's :func:`~quantlens.profiler.fingerprint.model_digest`, every
    weight's and buffer's bytes): ``remedies.json`` carries it so that ``load_remedies`` refuses another model."""
    from quantlens.profiler.fingerprint import model_digest

    return model_digest(types.SimpleNamespace(model=model), exact=True)
