"""A two-input, two-head model: dict inputs, dict outputs and Python control flow choosing the heads."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = ["MultiTaskNet"]


class MultiTaskNet(nn.Module):
    """Image + metadata in, a subset of {"cls", "reg"} heads out.

    ``forward(inputs, task)``: ``inputs["image"]`` is ``[B, 3, 16, 16]`` float, ``inputs["meta"]`` is ``[B, 8]``
    float; each enters through its own QuantStub (two independently quantized inputs). A conv backbone turns
    the image into ``[B, 32]`` features; the meta vector goes through Linear-ReLU to ``[B, 32]`` and is added
    to them. Head ``"cls"`` gives ``[B, 5]`` logits, head ``"reg"`` ``[B, 2]`` values, each behind its own
    DeQuantStub. Only heads named in ``task`` run (plain ``if`` statements), so a traced graph depends on the
    task list -- a deliberate test of tools that must follow Python control flow.
    """

    TASKS = ("cls", "reg")

    def __init__(self, meta_dim: int = 8, num_classes: int = 5, reg_dim: int = 2) -> None:
        super().__init__()
        self.quant_image = QuantStub()
        self.quant_meta = QuantStub()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.meta_fc = nn.Linear(meta_dim, 32)
        self.meta_relu = nn.ReLU()
        self.cls_head = nn.Linear(32, num_classes)
        self.reg_head = nn.Linear(32, reg_dim)
        self.dequant_cls = DeQuantStub()
        self.dequant_reg = DeQuantStub()

    def forward(self, inputs: dict[str, torch.Tensor], task: list[str]) -> dict[str, torch.Tensor]:
        unknown = [name for name in task if name not in self.TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; valid tasks are {list(self.TASKS)}")
        missing = [key for key in ("image", "meta") if key not in inputs]
        if missing:
            raise ValueError(f"inputs is missing {missing}; expected keys ['image', 'meta']")

        image = self.quant_image(inputs["image"])
        meta = self.quant_meta(inputs["meta"])
        x = self.relu1(self.bn1(self.conv1(image)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = torch.flatten(self.avgpool(x), 1)
        features = x + self.meta_relu(self.meta_fc(meta))

        outputs: dict[str, torch.Tensor] = {}
        if "cls" in task:
            outputs["cls"] = self.dequant_cls(self.cls_head(features))
        if "reg" in task:
            outputs["reg"] = self.dequant_reg(self.reg_head(features))
        return outputs
