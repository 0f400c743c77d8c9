"""Running the float model over data with hooks on some of its modules, the hooks removed afterwards whatever
happens (what bias correction reads of a layer's input and equalization of a layer's output)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from quantlens.sites.record import call_model

__all__ = ["watch_modules"]


def watch_modules(model: nn.Module, batches: Iterable[Any], *, inputs: dict[str, Callable] | None = None,
                  outputs: dict[str, Callable] | None = None) -> None:
    """Run ``model`` (no gradients) on each batch with ``inputs[name](module, args)`` called before module ``name``
    runs and ``outputs[name](module, args, output)`` after it; every hook is removed afterwards."""
    handles = [model.get_submodule(n).register_forward_pre_hook(f) for n, f in (inputs or {}).items()]
    handles += [model.get_submodule(n).register_forward_hook(f) for n, f in (outputs or {}).items()]
    try:
        with torch.no_grad():
            for batch in batches:
                call_model(model, batch)
    finally:
        for h in handles:
            h.remove()
