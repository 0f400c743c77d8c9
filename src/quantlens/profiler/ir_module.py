"""An IR module as the profiler takes it (a :class:`Module` or the path of a saved one) and its named input
tensors for one call's inputs. Shared by the IR's model access, the IR ablation cache and the ONNX access."""

from __future__ import annotations

import os
from typing import Any

import torch

from quantlens.compiler.ir import Module
from quantlens.errors import QuantLensError
from quantlens.sites.record import inputs_to

__all__ = ["as_ir_module", "call_ir"]


def as_ir_module(model: Any) -> Module:
    """An IR :class:`Module`, or the one in a file written by ``save``."""
    if isinstance(model, Module):
        return model
    if isinstance(model, (str, os.PathLike)):
        from quantlens.compiler.serialize import load

        return load(model)
    raise QuantLensError(f"Expected a quantlens IR module or a path to a saved one, got {type(model).__name__}.")


def call_ir(module: Module, example: Any) -> dict[str, torch.Tensor]:
    """The IR's named input tensors for one call's inputs in any accepted format: the torch input pytree (a tuple
    is positional arguments), the deployment format (the same without its non-tensor leaves), or a dict of the
    tensors by input name. They are moved to the IR's device (:meth:`Module.to`): the profiler runs an IR where
    its constants are, whatever device the bad case was given on."""
    if isinstance(example, dict) and example and set(example) <= set(module.input_names) and \
            all(isinstance(v, torch.Tensor) for v in example.values()):
        feeds = module.feeds(**example)
    else:
        args = example if isinstance(example, tuple) else (example,)
        feeds = module.feeds(*args)
    return inputs_to(feeds, module.device)
