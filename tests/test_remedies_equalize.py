"""Issue #24, remedies: the equalization transforms are exact in float, are taken only where exact, and do what
they are for (per-tensor int8 weights lose less after cross-layer equalization; smoothing shrinks the norm's
activation outliers)."""

import pytest
import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.search.remedies import (
    activation_absmax,
    cross_layer_equalization,
    find_cle_pairs,
    find_smoothing_pairs,
    smooth_activations,
)


class ConvChain(nn.Module):
    """conv1 -> relu -> conv2 -> leaky_relu -> conv3, and a residual branch that blocks its pair."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), \
            nn.Conv2d(8, 8, 1)
        self.conv4 = nn.Conv2d(8, 8, 1)
        self.relu, self.leaky = nn.ReLU(), nn.LeakyReLU(0.1)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            self.conv1.weight[:4] *= 50.0  # wide channels: per-tensor int8 wastes levels on the others
            self.conv1.bias[:4] *= 50.0

    def forward(self, x):
        h = self.conv3(self.leaky(self.conv2(self.relu(self.conv1(x)))))
        return self.conv4(h) + h  # conv3's output is read twice: no pair for it


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_cle_is_exact_and_only_where_exact():
    model, x = ConvChain().eval(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    pairs = find_cle_pairs(model, (x,))
    assert [(p.producer, p.activation, p.consumers) for p in pairs] == [
        ("conv1", "relu", ("conv2",)), ("conv2", "leaky.leaky_relu_0", ("conv3",))]
    equalized, done = cross_layer_equalization(model, (x,))
    with torch.no_grad():
        assert _max_rel(equalized(x), model(x)) < 1e-5
    assert model.conv1.weight.abs().max() > 5  # the user's model is untouched
    one, _ = cross_layer_equalization(model, (x,), pairs[:1])
    r1 = one.conv1.weight.detach().abs().reshape(8, -1).amax(1)
    r2 = one.conv2.weight.detach().abs().transpose(0, 1).reshape(8, -1).amax(1)
    assert torch.allclose(r1, r2, rtol=1e-5)  # both sides of every channel get the same range
    assert max(done[0].scales) > 5 * min(done[0].scales)


def _per_tensor_int8(w):
    s = w.abs().max() / 127
    return torch.round(w / s).clamp(-128, 127) * s


def test_cle_lowers_the_per_tensor_weight_error():
    model, x = ConvChain().eval(), torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))

    def error(m):
        q = type(m)()
        q.load_state_dict(m.state_dict())
        with torch.no_grad():
            for conv in (q.conv1, q.conv2, q.conv3):
                conv.weight.copy_(_per_tensor_int8(conv.weight))
            return float((q(x) - model(x)).pow(2).mean())

    equalized, _ = cross_layer_equalization(model, (x,))
    assert error(equalized) < 0.5 * error(model)


class PreLN(nn.Module):
    """A pre-LN block (the residual taken before the norm) next to a post-LN one (the norm's output also feeds the
    residual add): only the first norm can be smoothed exactly."""

    def __init__(self, d=16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc = nn.Linear(d, d)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            self.ln1.weight[:2] = 20.0  # two outlier channels after the norm

    def forward(self, x):
        h = self.ln1(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h)
        x = x + self.o(a)
        y = self.ln2(x)
        return y + self.fc(y)


def test_smoothing_is_exact_and_only_where_exact():
    gen = torch.Generator().manual_seed(3)
    model, x = PreLN().eval(), torch.randn(2, 5, 16, generator=gen)
    batches = [(torch.randn(2, 5, 16, generator=gen),) for _ in range(3)]
    pairs = find_smoothing_pairs(model, (x,))
    assert [(p.producer, set(p.consumers)) for p in pairs] == [("ln1", {"q", "k", "v"})]
    before = activation_absmax(model, ["ln1"], batches)["ln1"]
    smoothed, done = smooth_activations(model, (x,), batches, alpha=0.5)
    with torch.no_grad():
        assert _max_rel(smoothed(x), model(x)) < 1e-5
    after = activation_absmax(smoothed, ["ln1"], batches)["ln1"]
    spread_before, spread_after = float(before.max() / before.median()), float(after.max() / after.median())
    assert spread_before > 20 and spread_after < spread_before / 3, (spread_before, spread_after)
    with pytest.raises(QuantLensError, match="alpha"):
        smooth_activations(model, (x,), batches, alpha=1.5)
