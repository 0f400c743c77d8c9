"""Deployment boundaries of a model: where float data enters and leaves the integer NPU."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["QuantStub", "DeQuantStub"]


class QuantStub(nn.Module):
    """Marks a float model input that the NPU receives quantized.

    In the float model it is the identity. After ``prepare`` its op site quantizes the tensor with the site's
    output qconfig. ``scale`` fixes the input scale (e.g. ``1/128`` for images normalised to [-1, 1)); leave it
    ``None`` to let calibration observe it.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return "" if self.scale is None else f"scale={self.scale}"


class DeQuantStub(nn.Module):
    """Marks a model output that leaves the NPU as float. The identity in every stage before ``convert``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
