"""The factory of the profiler's model accesses: the :class:`~.model_access.ModelAccess` for any model an
analysis takes. It lives apart from the interface so that the backends import the interface and this module
imports the backends, never the other way round."""

from __future__ import annotations

import os
from typing import Any

import torch

from quantlens.errors import QuantLensError
from quantlens.profiler.model_access import ModelAccess

__all__ = ["make_access"]


def make_access(model: Any, label: str) -> ModelAccess:
    """The :class:`ModelAccess` for ``model``: a torch module, an IR module, the path of a saved IR, or an ONNX
    model (``onnx.ModelProto`` or a path ending in ``.onnx``; run by onnxruntime at its default level,
    ``ORT_ENABLE_ALL``)."""
    # each backend is imported when a model of its kind comes: a torch-only analysis loads no IR or ONNX code
    if isinstance(model, torch.nn.Module):
        from quantlens.profiler.torch_access import TorchModelAccess

        return TorchModelAccess(model, label)
    if isinstance(model, ModelAccess):
        return model
    from quantlens.profiler.onnx_access import is_onnx_model

    if is_onnx_model(model):
        from quantlens.profiler.onnx_access import OnnxModelAccess

        return OnnxModelAccess(model, label)
    from quantlens.compiler.ir import Module

    if isinstance(model, Module) or (isinstance(model, (str, os.PathLike)) and os.path.isfile(model)):
        from quantlens.profiler.ir_access import IRModelAccess

        return IRModelAccess(model, label)
    if isinstance(model, (str, os.PathLike)):
        raise QuantLensError(f"QuantAnalysis: the {label} model file {str(model)!r} does not exist.")
    raise QuantLensError(
        f"QuantAnalysis: the {label} model must be a torch.nn.Module (float, calibration, QAT or pre_export "
        f"model), a quantlens IR module (export / convert), the path of one written by save(), or an ONNX model "
        f"(onnx.ModelProto or a .onnx path: onnxruntime); got "
        f"{type(model).__name__}."
    )
