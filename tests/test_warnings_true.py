"""A warning must be true (issue #42, point 3): the ops the op set once said "a later stage will refuse" (no lowering
yet, no integer rule yet) run on the host and go through every stage, so prepare warns of no refusal; a host op
with two outputs (``min`` along a dim: values and indices) is saved and loaded like any other."""

import warnings

import pytest
import torch
from torch import nn

from quantlens.march.opset import OPS
from quantlens.quantization import DeQuantStub, QuantStub
from quantlens.zoo.coverage import run_stages

HOST_OPS = {
    "amin": lambda h: h - torch.amin(h, -1, keepdim=True),
    "argmin": lambda h: h + torch.argmin(h, -1, keepdim=True).float(),
    "min": lambda h: h - torch.min(h, -1, keepdim=True)[0],
    "roll": lambda h: torch.roll(h, 1, -1),
    "square": torch.square,
    "max_pool1d_with_indices": lambda h: torch.nn.functional.max_pool1d(h[:, None], 2, return_indices=True)[0]
    .repeat(1, 1, 2)[:, 0],
}


class _Between(nn.Module):
    """``op`` between two integer linears."""

    def __init__(self, op):
        super().__init__()
        self.q, self.dq, self.fc1, self.fc2, self.op = QuantStub(), DeQuantStub(), nn.Linear(8, 8), nn.Linear(8, 8), op

    def forward(self, x):
        return self.dq(self.fc2(self.op(self.fc1(self.q(x)))))


@pytest.mark.parametrize("name", sorted(HOST_OPS))
def test_an_op_without_an_integer_rule_goes_through_every_stage_with_no_refusal_warned(name):
    assert OPS[name].refused_by() == [] and not OPS[name].on_npu
    torch.manual_seed(0)

    def data():
        return torch.randn(2, 8)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_stages(name, _Between(HOST_OPS[name]).eval(), data(), [data() for _ in range(2)], data())
    assert result.failed_stage is None, result.error
    assert result.passed, result.agreements
    assert not [w for w in caught if "refuse" in str(w.message)]
