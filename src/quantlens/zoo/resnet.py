"""A tiny ResNet: residual adds, a strided downsample shortcut and a channel concat, on 16x16 images."""

from __future__ import annotations

import torch
from torch import nn

from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = ["BasicBlock", "TinyResNet"]


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut, then ReLU.

    With ``stride != 1`` or a channel change the shortcut is a strided 1x1 conv-BN, so the add joins two
    computed branches (two independently quantized inputs) rather than a tensor and itself.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu2 = nn.ReLU()
        if stride != 1 or in_ch != out_ch:
            self.downsample: nn.Module | None = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.downsample = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu2(out)


class TinyResNet(nn.Module):
    """Input ``[B, 3, 16, 16]`` float, output ``[B, num_classes]`` logits.

    Layout: stem conv-BN-ReLU (16 ch, 16x16) -> identity block (16 ch) -> strided block with downsample
    shortcut (32 ch, 8x8). A side branch average-pools the identity block's output and projects it with a
    1x1 conv-ReLU (16 ch, 8x8); ``torch.cat`` joins it with the strided block's output (48 ch), so the concat
    merges two tensors with different value ranges. Then global average pool, flatten and a linear classifier.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.stem_conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(16)
        self.stem_relu = nn.ReLU()
        self.layer1 = BasicBlock(16, 16, stride=1)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.side_pool = nn.AvgPool2d(2)
        self.side_conv = nn.Conv2d(16, 16, 1)
        self.side_relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(48, num_classes)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.stem_relu(self.stem_bn(self.stem_conv(x)))
        x1 = self.layer1(x)
        x2 = self.layer2(x1)
        side = self.side_relu(self.side_conv(self.side_pool(x1)))
        x = torch.cat([x2, side], dim=1)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return self.dequant(x)
