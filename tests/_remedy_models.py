"""The planted-outlier MLP the remedy tests share (tests/test_remedies_search.py, tests/test_remedies_catalog.py)."""

import torch
from torch import nn

from quantlens.quantization import DeQuantStub, QuantStub


class Outliers(nn.Module):
    """fc1 -> relu -> fc2 -> relu -> fc3; fc1's output has rare large outliers in the calibration data, so a min/max
    range leaves the ordinary values a few int8 steps."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = QuantStub(), DeQuantStub()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)

    def forward(self, x):
        return self.dequant(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(self.quant(x)))))))


def _data():
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        x = torch.randn(64, 8, generator=gen)
        x[0] *= 60.0  # one rare outlier row per batch
        batches.append((x,))
    held_out = torch.randn(128, 8, generator=gen)
    return batches, held_out


def _cosine(model, held_out):
    with torch.no_grad():
        ref = model(held_out)

    def evaluate(prepared):
        out = prepared(held_out)
        return float(nn.functional.cosine_similarity(out.double(), ref.double(), dim=1).mean())
    return evaluate
