"""A newcomer's small CNN + GRU net (issue #42): GroupNorm (a functional layer_norm), a GRU, and pixel_shuffle after
the last conv, outside the integer region (after the DeQuantStub)."""

import torch
from torch import nn

from quantlens.quantization import DeQuantStub, QuantStub


class ConvGroupNormGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.dq = QuantStub(), DeQuantStub()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.relu1 = nn.ReLU()
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.conv2 = nn.Conv2d(8, 12, 3, padding=1)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        h = self.relu1(self.norm(self.conv1(self.q(x))))  # (n, 8, 6, 6)
        n, c, hh, ww = h.shape
        seq, _ = self.gru(h.flatten(2).transpose(1, 2))  # (n, 36, 8)
        h = seq.transpose(1, 2).reshape(n, c, hh, ww)
        return torch.pixel_shuffle(self.dq(self.relu2(self.conv2(h))), 2)


def float_model():
    torch.manual_seed(0)
    return ConvGroupNormGRU().eval()


def example_inputs():
    torch.manual_seed(1)
    return torch.randn(2, 3, 6, 6)


def calibration_data():
    torch.manual_seed(2)
    return [torch.randn(2, 3, 6, 6) for _ in range(3)]


def evaluation_data():
    torch.manual_seed(3)
    return [torch.randn(2, 3, 6, 6) for _ in range(2)]
